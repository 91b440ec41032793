"""hkernels.warmup: each op once per shape, forward and backward, on the backend the call chooses."""

from __future__ import annotations

import importlib
import logging

import pytest
import torch

import hkernels
from hkernels import registry


def _count(monkeypatch, op: str, fn: str) -> list[str]:
    """Which backend's ``fn`` of ``op`` ran, one entry per call."""
    ran: list[str] = []
    for backend in registry.BACKENDS:
        module = importlib.import_module(registry.OPS[op].module_name(backend))
        real = getattr(module, fn)
        monkeypatch.setattr(module, fn, lambda *a, real=real, b=backend: (ran.append(b), real(*a))[1])
    return ran


def test_warmup_runs_each_op_forward_and_backward_at_each_shape(device, monkeypatch):
    fwd, bwd = _count(monkeypatch, "rms_norm", "rms_norm_fwd"), _count(monkeypatch, "rms_norm", "rms_norm_bwd")
    sw = _count(monkeypatch, "swiglu", "swiglu_fwd")
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logger = logging.getLogger("hkernels")
    logger.addHandler(handler)
    monkeypatch.setattr(logger, "level", logging.INFO)
    try:
        times = hkernels.warmup(["rms_norm", "swiglu"], [(1, 64), (5, 96)], dtype=torch.float32, device=device)
    finally:
        logger.removeHandler(handler)
    assert list(times) == ["rms_norm 1x64 float32", "rms_norm 5x96 float32", "swiglu 1x64 float32",
                           "swiglu 5x96 float32"]
    assert all(t > 0 for t in times.values())
    x = torch.randn(5, 96, device=device)
    chosen = hkernels.selected_backend("rms_norm", x, torch.ones(96, device=device))
    # twice per shape: the forward alone, then forward+backward; on the backend a plain call chooses
    assert fwd == [chosen] * 4 and bwd == [chosen] * 2 and len(sw) == 4
    assert said[-1].startswith("hkernels.warmup 4/4: swiglu 5x96 float32 in ") and len(said) == 4


def test_warmup_takes_shapes_per_op_and_forward_only(device, monkeypatch):
    bwd = _count(monkeypatch, "rms_norm", "rms_norm_bwd")
    times = hkernels.warmup({"rms_norm": [(2, 32)], "attention_causal": [(16, 256, 2)]}, dtype=torch.float32,
                            device=device, backward=False)
    assert list(times) == ["rms_norm 2x32 float32", "attention_causal 16x256x2 float32"] and bwd == []


def test_warmup_names_what_it_cannot_run(device, monkeypatch):
    with pytest.raises(ValueError, match=r"unknown op 'rmsnorm'.*rms_norm"):
        hkernels.warmup(["rmsnorm"], [(1, 64)])
    with pytest.raises(ValueError, match=r"rms_norm: a shape is \(M, N\) or \(M, N, K\)"):
        hkernels.warmup(["rms_norm"], [(64,)])
    with pytest.raises(ValueError, match=r"attention at 16x256 has empty inputs.*\(S, Hq·D, batch\)"):
        hkernels.warmup(["attention"], [(16, 256)], device=device)  # no batch: nothing would be launched
    with pytest.raises(TypeError, match="give shapes"):
        hkernels.warmup(["rms_norm"])
    with pytest.raises(ValueError, match="attention at 16x100x1 has empty inputs"):  # (no head of 128 in 100)
        hkernels.warmup({"attention": [(16, 100, 1)]}, dtype=torch.float32, device=device)
    from hkernels.tune import cases

    def fails(self):
        raise RuntimeError("out of resources: shared memory")

    monkeypatch.setattr(cases.Case, "forward", fails)
    with pytest.raises(RuntimeError, match=r"hkernels.warmup: rms_norm at 2x32 failed: out of resources"):
        hkernels.warmup({"rms_norm": [(2, 32)]}, dtype=torch.float32, device=device)
