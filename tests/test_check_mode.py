"""Checking mode (``HKERNELS_CHECK=1``): every value the kernels take on trust is checked with a host sync and a
``ValueError`` naming the op, on every backend and every call (the first of a signature and the replayed ones);
with it off the same calls run as documented (clamped, NaN, zeros), without a sync."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import hkernels
from tests.test_bad_inputs import GOOD

BACKENDS = ["helion", "triton", "torch"]


def _cu(d: torch.device, *values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=d)


# (op, how the good call's arguments change, what the error says after "hkernels.<op>: ")
CASES: list[tuple[str, Callable[[dict[str, Any], torch.device], dict[str, Any]], str]] = [
    ("cross_entropy", lambda a, d: {"target": torch.tensor([1, 8, 2], device=d)},
     r"target\[1\] = 8 is outside \[0, 8\) and is not ignore_index \(-100\)"),
    ("cross_entropy", lambda a, d: {"target": torch.tensor([1, -1, 2], device=d)},
     r"target\[1\] = -1 is outside \[0, 8\)"),
    ("fused_linear_cross_entropy", lambda a, d: {"target": torch.tensor([-100, 3, 10], device=d)},
     r"target\[2\] = 10 is outside \[0, 10\) and is not ignore_index"),
    ("moe", lambda a, d: {"topk_ids": torch.tensor([[0, 1], [1, 2], [0, 0]], device=d)},
     r"topk_ids\[1, 1\] = 2 is outside \[0, 2\) \(the experts"),
    ("moe", lambda a, d: {"topk_ids": torch.tensor([[0, 1], [1, 1], [-1, 0]], device=d)},
     r"topk_ids\[2, 0\] = -1 is outside \[0, 2\)"),
    ("grouped_matmul", lambda a, d: {"group_sizes": torch.tensor([-1, 3], device=d)},
     r"group_sizes\[0\] = -1 is outside \[0, 6\)"),
    ("grouped_matmul", lambda a, d: {"group_sizes": torch.tensor([4, 3], device=d)},
     r"group_sizes sum to 7, past the T = 5 rows of x"),
    ("attention_varlen", lambda a, d: {"cu_seqlens_q": _cu(d, 1, 2, 5)}, r"cu_seqlens_q must start at 0, got "
     r"cu_seqlens_q\[0\] = 1"),
    ("attention_varlen", lambda a, d: {"cu_seqlens_q": _cu(d, 0, 3, 2)}, r"cu_seqlens_q's lengths .*\[1\] = -1 "
     r"is outside \[0, 6\): it must not decrease"),
    ("attention_varlen", lambda a, d: {"cu_seqlens_q": _cu(d, 0, 2, 6)}, r"cu_seqlens_q ends at 6, past the 5 "
     r"rows of q"),
    ("attention_varlen", lambda a, d: {"cu_seqlens_k": _cu(d, 0, 4, 7)}, r"cu_seqlens_k ends at 7, past the 5 "
     r"rows of k"),
    ("attention_varlen", lambda a, d: {"max_seqlen_q": 2}, r"max_seqlen_q = 2 is below the longest sequence of "
     r"cu_seqlens_q \(3 rows\)"),
    ("attention_varlen", lambda a, d: {"cu_seqlens_k": _cu(d, 0, 1, 5), "max_seqlen_q": 3, "max_seqlen_k": 3},
     r"max_seqlen_k = 3 is below the longest sequence of cu_seqlens_k \(4 rows\)"),
    ("decode_attention", lambda a, d: {"cache_seqlens": _cu(d, 6, 2)}, r"cache_seqlens\[0\] = 6 is outside "
     r"\[0, 6\) \(S_max, k_cache's third dim, is 5\)"),
    ("decode_attention", lambda a, d: {"cache_seqlens": _cu(d, 5, -1)}, r"cache_seqlens\[1\] = -1 is outside"),
    ("rope", lambda a, d: {"cos": torch.randn(6, 4, device=d), "sin": torch.randn(6, 4, device=d),
                           "position_ids": torch.tensor([0, 6, 1], device=d)},
     r"position_ids\[1\] = 6 is outside \[0, 6\) \(the tables have P = 6 rows\)"),
    ("rope", lambda a, d: {"cos": torch.randn(6, 4, device=d), "sin": torch.randn(6, 4, device=d),
                           "position_ids": torch.tensor([[0, 1, -2]], device=d)},
     r"position_ids\[0, 2\] = -2 is outside \[0, 6\)"),
]
IDS = ["ce_high", "ce_negative", "linear_ce", "moe_high", "moe_negative", "gmm_negative", "gmm_sum", "cu_start",
       "cu_decreasing", "cu_end_q", "cu_end_k", "max_q", "max_k", "cache_high", "cache_negative", "positions",
       "positions_2d"]


def _call(op: str, change: Callable[..., dict[str, Any]], device: torch.device) -> Any:
    args = GOOD[op][0](device)
    args.update(change(args, device))
    with torch.no_grad():
        return getattr(hkernels, op)(**args)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("op", "change", "pattern"), CASES, ids=IDS)
def test_checking_mode_raises_on_every_backend(op, change, pattern, backend, device, monkeypatch):
    """In checking mode the call raises, naming the op and the first value outside its range, before any kernel
    runs; again on the next call (values differ from call to call, so they are checked every call)."""
    monkeypatch.setenv("HKERNELS_CHECK", "1")
    with hkernels.use_backend(backend):
        for _ in range(2):
            with pytest.raises(ValueError, match=rf"^hkernels\.{op}: " + pattern):
                _call(op, change, device)


@pytest.mark.parametrize(("op", "change", "pattern"), CASES, ids=IDS)
def test_without_checking_mode_the_values_are_taken_on_trust(op, change, pattern, device, monkeypatch):
    """Off (unset, or 0): the same calls run, with the documented results for such values (no sync to check them)."""
    for value in (None, "0", "False"):
        if value is None:
            monkeypatch.delenv("HKERNELS_CHECK", raising=False)
        else:
            monkeypatch.setenv("HKERNELS_CHECK", value)
        with hkernels.use_backend("triton"):
            _call(op, change, device)


def test_checking_mode_is_read_at_call_time_and_passes_good_values(device, monkeypatch):
    """Turned on after a signature was planned, the next call is checked; good values pass in checking mode."""
    args = GOOD["cross_entropy"][0](device)
    with hkernels.use_backend("triton"):
        good = hkernels.cross_entropy(**args)
        args["target"] = torch.tensor([1, 9, 2], device=device)
        hkernels.cross_entropy(**args)  # planned, not checked
        monkeypatch.setenv("HKERNELS_CHECK", "1")
        with pytest.raises(ValueError, match=r"hkernels\.cross_entropy: target\[1\] = 9"):
            hkernels.cross_entropy(**args)
        args["target"] = GOOD["cross_entropy"][0](device)["target"]
        assert torch.isfinite(hkernels.cross_entropy(**args)) and torch.isfinite(good)
        for op in ("moe", "grouped_matmul", "attention_varlen", "decode_attention"):
            with torch.no_grad():
                getattr(hkernels, op)(**GOOD[op][0](device))

