"""Softmax over the last dim in Helion (the twin of ``triton_fallback/softmax.py``).

Math, per row:  y = exp(x − max x) / Σ exp(x − max x).  Backward:  dx = y·(dy − Σ dy·y).

Bytes for x: [M, N] of b-byte elements: forward reads and writes M·N·b; backward reads dy and y, writes dx.
Rows longer than a block of registers are read twice: pass 1 keeps an online (max, sum) per row, rescaling the
sum when the max grows (one exp per element), pass 2 writes.
"""

from __future__ import annotations

from collections.abc import Callable

import helion
import helion.language as hl
import torch

from hkernels.ops import _helion

Tensor = torch.Tensor
MAX_RESIDENT_FWD = 32768


@helion.kernel(static_shapes=False)
def _softmax_fwd(x: Tensor) -> Tensor:
    # Resident rows: x: [M, N] -> y [M, N]; reads x once.
    m, n = x.size()
    n = hl.specialize(n)
    y = torch.empty([m, n], dtype=x.dtype, device=x.device)
    for tile_m in hl.tile(m):
        xf = x[tile_m, :].to(torch.float32)
        e = torch.exp(xf - torch.amax(xf, dim=-1)[:, None])
        y[tile_m, :] = (e / torch.sum(e, dim=-1)[:, None]).to(y.dtype)
    return y


@helion.kernel(static_shapes=False)
def _softmax_fwd_looped(x: Tensor) -> Tensor:
    # Long rows: pass 1, online max and sum over chunks; pass 2, read again and write y.
    m, n = x.size()
    n = hl.specialize(n)
    y = torch.empty([m, n], dtype=x.dtype, device=x.device)
    for tile_m in hl.tile(m):
        row_max = hl.full([tile_m], float("-inf"), dtype=torch.float32)
        row_sum = hl.zeros([tile_m], dtype=torch.float32)
        for tile_n in hl.tile(n):
            xf = x[tile_m, tile_n].to(torch.float32)
            xf = torch.where((tile_n.index < n)[None, :], xf, float("-inf"))
            new_max = torch.maximum(row_max, torch.amax(xf, dim=-1))
            # While every value seen is -inf, shift by 0 instead of -inf so no inf - inf = NaN enters the sum.
            shift = torch.where(new_max == float("-inf"), 0.0, new_max)
            row_sum = row_sum * torch.exp(row_max - shift) + torch.sum(torch.exp(xf - shift[:, None]), dim=-1)
            row_max = new_max
        inv_sum = 1.0 / row_sum
        for tile_n in hl.tile(n):
            xf = x[tile_m, tile_n].to(torch.float32)
            y[tile_m, tile_n] = (torch.exp(xf - row_max[:, None]) * inv_sum[:, None]).to(y.dtype)
    return y


@helion.kernel(static_shapes=False)
def _softmax_bwd(dy: Tensor, y: Tensor) -> Tensor:
    # dy, y: [M, N] -> dx [M, N]. A config with reduction_loops=[None] keeps rows in registers (one read of dy
    # and y); reduction_loops=[chunk] loops twice, for long rows.
    m, n = y.size()
    n = hl.specialize(n)
    dx = torch.empty([m, n], dtype=y.dtype, device=y.device)
    for tile_m in hl.tile(m):
        yf = y[tile_m, :].to(torch.float32)
        dyf = dy[tile_m, :].to(torch.float32)
        dx[tile_m, :] = (yf * (dyf - torch.sum(dyf * yf, dim=-1)[:, None])).to(dx.dtype)
    return dx


def softmax_fwd(x: Tensor) -> Tensor:
    """x: [M, N] (unit column stride) -> softmax over N, [M, N] in x.dtype."""
    return _bind_fwd(x)(x)


def softmax_bwd(dy: Tensor, y: Tensor) -> Tensor:
    """dy, y: [M, N] -> dx [M, N] in y.dtype."""
    return _bind_bwd(dy, y)(dy, y)


def _bind_fwd(x: Tensor) -> Callable[[Tensor], Tensor]:
    N = x.shape[1]
    kernel = _softmax_fwd if N <= MAX_RESIDENT_FWD else _softmax_fwd_looped
    fn, launcher = _helion.bind(kernel, (x,), N, x.device)
    return lambda x: fn(x, _launcher=launcher)


def _bind_bwd(dy: Tensor, y: Tensor) -> Callable[[Tensor, Tensor], Tensor]:
    fn, launcher = _helion.bind(_softmax_bwd, (dy, y), y.shape[1], y.device)
    return lambda dy, y: fn(dy, y, _launcher=launcher)


# Binders (see triton_fallback/_plan.py): the same function for every call of one signature, set up once.
softmax_fwd.bind = _bind_fwd  # type: ignore[attr-defined]
softmax_bwd.bind = _bind_bwd  # type: ignore[attr-defined]
