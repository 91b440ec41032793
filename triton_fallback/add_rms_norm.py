"""Residual add + RMS norm in hand-written Triton: the twin of ``hkernels/ops/add_rms_norm.py``, whose docstring
gives the math and the bytes moved.

The kernels are rms_norm's (``triton_fallback/rms_norm.py``), run with their optional residual and ds. Long rows
(past the resident limits) loop as rms_norm's do: the forward's second pass reads s back, the backward reads dy
and s twice.
"""

from __future__ import annotations

import torch

from triton_fallback import rms_norm

Tensor = torch.Tensor

SYMBOLIC = frozenset({"add_rms_norm_fwd", "add_rms_norm_bwd"})  # (see triton_fallback/rms_norm.py)


def add_rms_norm_fwd(
    x: Tensor, residual: Tensor, weight: Tensor | None, eps: float, offset: float = 0.0
) -> tuple[Tensor, Tensor, Tensor]:
    """x, residual: [M, N] (one dtype, unit column stride), weight: [N] or None
    -> (y [M, N], s = x + residual [M, N], both in x.dtype; rstd [M] float32); the scale is ``offset + weight``."""
    return rms_norm.bind_fwd(x, residual, weight)(x, residual, weight, eps, offset)


def add_rms_norm_bwd(
    dy: Tensor, ds: Tensor | None, s: Tensor, weight: Tensor | None, rstd: Tensor, dx: Tensor | None = None,
    offset: float = 0.0,
) -> tuple[Tensor, Tensor | None]:
    """dy, ds (or None): [M, N], s: [M, N] from the forward, weight: [N] or None, rstd: [M]
    -> (dsum [M, N] in s.dtype, dw [N] in weight.dtype or None); dsum written into ``dx`` where given (it may be
    dy); the scale is ``offset + weight``."""
    return rms_norm.bind_bwd(dy, ds, s, weight, rstd)(dy, ds, s, weight, rstd, dx, offset)


# Binders (see hkernels/runtime/plan.py): the same function for every call of one signature, set up once.
add_rms_norm_fwd.bind = (  # type: ignore[attr-defined]
    lambda x, residual, weight, eps, offset=0.0, stats=True: rms_norm.bind_fwd(x, residual, weight, stats))
add_rms_norm_bwd.bind = rms_norm.bind_bwd  # type: ignore[attr-defined]
