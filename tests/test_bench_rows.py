"""The benchmark's derived backward rows (fwd_bwd - fwd): a difference lost in timing noise is no failure."""

from __future__ import annotations

from bench.__main__ import _backward_rows
from bench.harness import Row
from bench.ops import OPS


def _row(mode: str, ms: float | None, error: str = "") -> Row:
    row = Row("rms_norm", 4, 64, "float32", mode, "triton", 0)
    row.ms, row.error = ms, error
    return row


def test_backward_row_within_noise_is_not_a_failure():
    op = OPS["rms_norm"]
    rows = _backward_rows({"fwd": [_row("fwd", 2.0)], "fwd_bwd": [_row("fwd_bwd", 1.5)]}, op, 1.0, 4)
    assert rows[0].ms is None and not rows[0].error and "not measurable" in rows[0].timing
    rows = _backward_rows({"fwd": [_row("fwd", 1.0)], "fwd_bwd": [_row("fwd_bwd", 3.0)]}, op, 1.0, 4)
    assert abs(rows[0].ms - 2.0) < 1e-12 and not rows[0].error
    rows = _backward_rows({"fwd": [_row("fwd", 1.0)], "fwd_bwd": [_row("fwd_bwd", None, "boom")]}, op, 1.0, 4)
    assert rows[0].error == "boom"  # a real failure still fails the run
