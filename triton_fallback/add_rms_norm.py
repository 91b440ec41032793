"""Residual add + RMS norm in hand-written Triton (the twin of ``hkernels/ops/add_rms_norm.py``).

Math, per row of N elements:  s = x + residual (rounded to x's dtype, as the unfused ``s = x + residual;
rms_norm(s)`` of a Llama layer),  rstd = 1 / sqrt(mean(s²) + eps) from the rounded s,  y = s · rstd · w.
Backward, with dy the gradient of y and ds that of s (the residual stream's, or None):
dsum = rstd·(w·dy) − s·rstd³·mean(w·dy·s) + ds  (the gradient of both x and residual),  dw = Σ_rows dy·s·rstd.

The kernels are rms_norm's (``triton_fallback/rms_norm.py``), run with their optional residual and ds: the
forward reads x and residual once and writes y and s once; the backward reads dy, ds and s once and writes dsum
once. Bytes for [M, N] of b-byte elements: forward 4·M·N·b (+ 4M for rstd), backward 4·M·N·b plus a
[programs, N] float32 partial of dw. Long rows (past the resident limits) loop as rms_norm's do: the forward's
second pass reads s back, the backward reads dy and s twice.
"""

from __future__ import annotations

import torch

from triton_fallback import rms_norm

Tensor = torch.Tensor


def add_rms_norm_fwd(
    x: Tensor, residual: Tensor, weight: Tensor | None, eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    """x, residual: [M, N] (one dtype, unit column stride), weight: [N] or None
    -> (y [M, N], s = x + residual [M, N], both in x.dtype; rstd [M] float32)."""
    return rms_norm.bind_fwd(x, residual, weight)(x, residual, weight, eps)


def add_rms_norm_bwd(
    dy: Tensor, ds: Tensor | None, s: Tensor, weight: Tensor | None, rstd: Tensor
) -> tuple[Tensor, Tensor | None]:
    """dy, ds (or None): [M, N], s: [M, N] from the forward, weight: [N] or None, rstd: [M]
    -> (dsum [M, N] in s.dtype, dw [N] in weight.dtype or None)."""
    return rms_norm.bind_bwd(dy, ds, s, weight, rstd)(dy, ds, s, weight, rstd)


# Binders (see triton_fallback/_plan.py): the same function for every call of one signature, set up once.
add_rms_norm_fwd.bind = (  # type: ignore[attr-defined]
    lambda x, residual, weight, eps, stats=True: rms_norm.bind_fwd(x, residual, weight, stats))
add_rms_norm_bwd.bind = rms_norm.bind_bwd  # type: ignore[attr-defined]
