"""python -m bench first-call end to end (interpret mode on a CPU: a check of the command, times meaning nothing)."""

from __future__ import annotations

import json

import pytest
import torch

from bench import first_call


def test_first_call_with_warm_caches_runs_each_case_twice(tmp_path, monkeypatch):
    """--warm: a second fresh process per case on the caches the first filled, as its own row."""
    if torch.cuda.is_available():
        pytest.skip("on a GPU this compiles for real (minutes): the bench's own run, not a test")
    monkeypatch.setenv("HKERNELS_INTERPRET", "1")
    code = first_call.main(["--quick", "--ops", "rms_norm", "--dtypes", "float32", "--backends", "triton", "--warm",
                            "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert code == 0, rows
    assert [r["caches"] for r in rows] == ["empty", "warm"]
    assert all(r["fwd_s"] is not None and r["bwd_s"] is not None and not r["error"] for r in rows)
    assert "warm" in (tmp_path / "table.txt").read_text()
