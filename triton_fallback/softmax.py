"""Softmax over the last dim in hand-written Triton: the twin of ``hkernels/ops/softmax.py``, whose docstring gives
the math, the bytes moved and the two passes over long rows. Launch settings: ``_common.row_settings``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from triton_fallback._common import cdiv, row_settings
from triton_fallback._launch import Bound

Tensor = torch.Tensor


@triton.jit
def _softmax_fwd_kernel(
    x_ptr, y_ptr,  # [M, N] rows with unit column stride
    M, N, stride_x, stride_y,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # Resident rows: read BLOCK_M rows once, write them once.
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_ok = rows < M
    mask = row_ok[:, None] & (cols < N)[None, :]
    rows64 = rows.to(tl.int64)
    x = tl.load(x_ptr + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=-float("inf"))
    x = x.to(tl.float32)
    # Rows past M are all -inf: shift them by 0 and divide by 1, so they make no NaN (they are never stored).
    e = tl.exp(x - tl.where(row_ok, tl.max(x, axis=1), 0.0)[:, None])
    y = e / tl.where(row_ok, tl.sum(e, axis=1), 1.0)[:, None]
    tl.store(y_ptr + rows64[:, None] * stride_y + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _softmax_fwd_looped_kernel(
    x_ptr, y_ptr,
    N, stride_x, stride_y,
    BLOCK_N: tl.constexpr,
):
    # Long rows, one per program. Pass 1: online max and sum over chunks; pass 2: read again, write y.
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    y_row = y_ptr + row * stride_y
    row_max = tl.full([], -float("inf"), dtype=tl.float32)
    row_sum = tl.full([], 0.0, dtype=tl.float32)
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        x = tl.load(x_row + cols, mask=cols < N, other=-float("inf")).to(tl.float32)
        new_max = tl.maximum(row_max, tl.max(x, axis=0))
        # While every value seen is -inf, shift by 0 instead of -inf so no inf - inf = NaN enters the sum.
        shift = tl.where(new_max == -float("inf"), 0.0, new_max)
        row_sum = row_sum * tl.exp(row_max - shift) + tl.sum(tl.exp(x - shift), axis=0)
        row_max = new_max
    inv_sum = 1.0 / row_sum
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        x = tl.load(x_row + cols, mask=cols < N, other=-float("inf")).to(tl.float32)
        tl.store(y_row + cols, (tl.exp(x - row_max) * inv_sum).to(y_ptr.dtype.element_ty), mask=cols < N)


@triton.jit
def _softmax_bwd_kernel(
    dy_ptr, y_ptr, dx_ptr,
    M, N, stride_dy, stride_y, stride_dx,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # Resident rows: read dy and y once, write dx.
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    rows64 = rows.to(tl.int64)
    dy = tl.load(dy_ptr + rows64[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + rows64[:, None] * stride_y + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    dx = y * (dy - tl.sum(dy * y, axis=1)[:, None])
    tl.store(dx_ptr + rows64[:, None] * stride_dx + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _softmax_bwd_looped_kernel(
    dy_ptr, y_ptr, dx_ptr,
    N, stride_dy, stride_y, stride_dx,
    BLOCK_N: tl.constexpr,
):
    # Long rows, one per program. Pass 1: Σ dy·y; pass 2: read both again, write dx.
    row = tl.program_id(0).to(tl.int64)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        dy = tl.load(dy_ptr + row * stride_dy + cols, mask=cols < N, other=0.0).to(tl.float32)
        y = tl.load(y_ptr + row * stride_y + cols, mask=cols < N, other=0.0).to(tl.float32)
        acc += dy * y
    dot = tl.sum(acc, axis=0)
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        dy = tl.load(dy_ptr + row * stride_dy + cols, mask=cols < N, other=0.0).to(tl.float32)
        y = tl.load(y_ptr + row * stride_y + cols, mask=cols < N, other=0.0).to(tl.float32)
        tl.store(dx_ptr + row * stride_dx + cols, (y * (dy - dot)).to(dx_ptr.dtype.element_ty), mask=cols < N)


def softmax_fwd(x: Tensor) -> Tensor:
    """x: [M, N] (unit column stride) -> softmax over N, [M, N] in x.dtype."""
    return _bind_fwd(x)(x)


def softmax_bwd(dy: Tensor, y: Tensor) -> Tensor:
    """dy, y: [M, N] -> dx [M, N] in y.dtype."""
    return _bind_bwd(dy, y)(dy, y)


def _bind_fwd(x: Tensor) -> Callable[[Tensor], Tensor]:
    M, N = x.shape
    dtype, device, sx = x.dtype, x.device, x.stride(0)
    s = row_settings(N, M, op="softmax", device=device)
    resident = s.resident
    if resident:
        k = Bound(_softmax_fwd_kernel, (cdiv(M, s.block_m),), BLOCK_M=s.block_m, BLOCK_N=s.block_n,
                  num_warps=s.num_warps)
    else:
        k = Bound(_softmax_fwd_looped_kernel, (M,), BLOCK_N=s.block_n, num_warps=s.num_warps)

    def run(x: Tensor) -> Tensor:
        y = torch.empty((M, N), dtype=dtype, device=device)
        if resident:
            k.go(x, y, M, N, sx, N)
        else:
            k.go(x, y, N, sx, N)
        return y
    return run


def _bind_bwd(dy: Tensor, y: Tensor) -> Callable[[Tensor, Tensor], Tensor]:
    M, N = y.shape
    dtype, device, sdy, sy = y.dtype, y.device, dy.stride(0), y.stride(0)
    s = row_settings(N, M, backward=True)
    resident = s.resident
    if resident:
        k = Bound(_softmax_bwd_kernel, (cdiv(M, s.block_m),), BLOCK_M=s.block_m, BLOCK_N=s.block_n,
                  num_warps=s.num_warps)
    else:
        k = Bound(_softmax_bwd_looped_kernel, (M,), BLOCK_N=s.block_n, num_warps=s.num_warps)

    def run(dy: Tensor, y: Tensor) -> Tensor:
        dx = torch.empty((M, N), dtype=dtype, device=device)
        if resident:
            k.go(dy, y, dx, M, N, sdy, sy, N)
        else:
            k.go(dy, y, dx, N, sdy, sy, N)
        return dx
    return run


# Binders (see triton_fallback/_plan.py): the same function for every call of one signature, set up once.
softmax_fwd.bind = _bind_fwd  # type: ignore[attr-defined]
softmax_bwd.bind = _bind_bwd  # type: ignore[attr-defined]
