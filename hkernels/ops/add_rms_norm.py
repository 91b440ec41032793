"""Residual add + RMS norm in Helion (the twin of ``triton_fallback/add_rms_norm.py``).

Math, per row of N elements:  s = x + residual (rounded to x's dtype, as the unfused ``s = x + residual;
rms_norm(s)`` of a Llama layer),  rstd = 1 / sqrt(mean(s²) + eps) from the rounded s,  y = s · rstd · w.
Backward, with dy the gradient of y and ds that of s (the residual stream's, or None):
dsum = rstd·(w·dy) − s·rstd³·mean(w·dy·s) + ds  (the gradient of both x and residual),  dw = Σ_rows dy·s·rstd.

The kernels are rms_norm's (``hkernels/ops/rms_norm.py``) with their optional residual and ds in use, compiled
under this op's own names so that they carry their own shipped configs (they move more bytes per row than
rms_norm's: three [M, N] tensors live in a backward step instead of two). Bytes for [M, N] of b-byte elements:
forward reads x and residual and writes y and s (4·M·N·b, + 4M for rstd); backward reads dy, ds and s and
writes dsum (4·M·N·b), plus a [programs, N] float32 partial of dw. Long rows loop as rms_norm's do.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import helion
import torch
from helion.runtime.kernel import BoundKernel

from hkernels.functional._base import stats as row_stats
from hkernels.ops import _helion, rms_norm

Tensor = torch.Tensor
# traced at a symbolic row count (see hkernels/ops/rms_norm.py)
SYMBOLIC = frozenset({"add_rms_norm_fwd", "add_rms_norm_bwd"})


class _Renamed:
    """One of rms_norm's kernels under this op's name. ``_helion.run`` binds ``kernel`` as usual but looks its
    config up by ``name``, so this op ships its own configs for the same kernel code."""

    def __init__(self, kernel: helion.Kernel, name: str) -> None:
        self.kernel = kernel
        self.name = name

    def bind(self, args: tuple[Any, ...]) -> BoundKernel:
        return self.kernel.bind(args)

    def _bind_isolated(self, args: tuple[Any, ...]) -> BoundKernel:  # (Helion's binding outside its cache)
        return self.kernel._bind_isolated(args)

    @property
    def fn(self) -> Any:  # (what the on-disk code cache keys by, with the name and settings)
        return self.kernel.fn

    @property
    def _bound_kernels(self) -> Any:
        return self.kernel._bound_kernels

    @property
    def settings(self) -> Any:
        """The kernel's Helion settings: the tune command seeds and bounds its search through them, as for every
        Helion kernel."""
        return self.kernel.settings


_add_rms_norm_fwd = _Renamed(rms_norm._rms_norm_fwd, "_add_rms_norm_fwd")
_add_rms_norm_bwd = _Renamed(rms_norm._rms_norm_bwd, "_add_rms_norm_bwd")
_add_rms_norm_bwd_looped = _Renamed(rms_norm._rms_norm_bwd_looped, "_add_rms_norm_bwd_looped")


def add_rms_norm_fwd(
    x: Tensor, residual: Tensor, weight: Tensor | None, eps: float, offset: float = 0.0
) -> tuple[Tensor, Tensor, Tensor]:
    """x, residual: [M, N] (one dtype, unit column stride), weight: [N] or None
    -> (y [M, N], s = x + residual [M, N], both in x.dtype; rstd [M] float32); the scale is ``offset + weight``."""
    return _bind_fwd(x, residual, weight, eps, offset)(x, residual, weight, eps, offset)


def add_rms_norm_bwd(
    dy: Tensor, ds: Tensor | None, s: Tensor, weight: Tensor | None, rstd: Tensor, dx: Tensor | None = None,
    offset: float = 0.0,
) -> tuple[Tensor, Tensor | None]:
    """dy, ds (or None): [M, N], s: [M, N] from the forward, weight: [N] or None, rstd: [M]
    -> (dsum [M, N] in s.dtype, dw [N] in weight.dtype or None); dsum written into ``dx`` where given (it may be
    dy); the scale is ``offset + weight``."""
    return _bind_bwd(dy, ds, s, weight, rstd, None, offset)(dy, ds, s, weight, rstd, dx, offset)


def _bind_fwd(x: Tensor, residual: Tensor, weight: Tensor | None, eps: float, offset: float = 0.0,
              stats: bool = True) -> Callable[..., Any]:
    """``run(x, residual, weight, eps, offset) -> (y, s, rstd)`` for this eps and offset, or (y, s) with
    ``stats=False`` (no rstd allocated or written)."""
    M, N = x.shape
    dtype, device = x.dtype, x.device
    s = torch.empty((M, N), dtype=dtype, device=device)  # examples of the sum's and rstd's buffers, for binding
    rstd = row_stats(x) if stats else None
    fn, launcher = _helion.bind(_add_rms_norm_fwd, (x, residual, weight, eps, offset, s, rstd), N, device,
                                rows=(0, 1, 5, 6))
    if not stats:
        def run_no_stats(x: Tensor, residual: Tensor, weight: Tensor | None, eps: float, offset: float = 0.0
                         ) -> tuple[Tensor, Tensor]:
            s = torch.empty((M, N), dtype=dtype, device=device)
            return fn(x, residual, weight, eps, offset, s, None, _launcher=launcher), s
        return run_no_stats

    def run(x: Tensor, residual: Tensor, weight: Tensor | None, eps: float, offset: float = 0.0
            ) -> tuple[Tensor, Tensor, Tensor]:
        s = torch.empty((M, N), dtype=dtype, device=device)
        rstd = row_stats(x)
        return fn(x, residual, weight, eps, offset, s, rstd, _launcher=launcher), s, rstd
    return run


def _bind_bwd(dy: Tensor, ds: Tensor | None, s: Tensor, weight: Tensor | None, rstd: Tensor,
              dx: Tensor | None = None, offset: float = 0.0) -> Callable[..., Any]:
    if ds is None:  # rms_norm's backward at s, launched as rms_norm launches it
        return rms_norm.bind_bwd(rms_norm._rms_norm_bwd, rms_norm._rms_norm_bwd_looped, dy, None, s, weight, rstd,
                                 offset)
    return rms_norm.bind_bwd(_add_rms_norm_bwd, _add_rms_norm_bwd_looped, dy, ds, s, weight, rstd, offset)


# Binders (see hkernels/runtime/plan.py): the same function for every call of one signature, set up once.
add_rms_norm_fwd.bind = _bind_fwd  # type: ignore[attr-defined]
add_rms_norm_bwd.bind = _bind_bwd  # type: ignore[attr-defined]
