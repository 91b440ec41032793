"""Layer norm in hand-written Triton: the twin of ``hkernels/ops/layer_norm.py``, whose docstring gives the math,
how the variance is taken and the bytes moved.

The variance is always taken around the mean, never as E[x²] − mean², which cancels catastrophically when
|mean| ≫ std. The backward writes [programs, N] float32 partials of dw and db, each summed and cast by one more
kernel (``_partials.sum_partials``). Launch settings: ``_common.row_settings`` and ``persistent_bwd_settings``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl

from hkernels.runtime.device import cdiv
from hkernels.runtime.launch import Bound
from triton_fallback._common import MAX_RESIDENT_BWD, persistent_bwd_settings, persistent_programs, row_settings
from triton_fallback._partials import bind_sum_partials

Tensor = torch.Tensor

SYMBOLIC = frozenset({"layer_norm_fwd", "layer_norm_bwd"})  # (see triton_fallback/rms_norm.py)


@triton.jit
def _layer_norm_fwd_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr,  # x, y: [M, N]; w, b: [N]; mean, rstd: [M] float32
    M, N, stride_x, stride_y, eps,
    HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    STORE_STATS: tl.constexpr,  # False for a forward no backward will follow: mean and rstd are not written
):
    eps = tl.cast(eps, tl.float32)  # float32 scalars (a compiled graph's launch types floats as float64)
    # Resident rows: read BLOCK_M rows of x once, write y.
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    mask = row_ok[:, None] & col_ok[None, :]
    rows64 = rows.to(tl.int64)
    x = tl.load(x_ptr + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=1) / N
    xc = tl.where(mask, x - mean[:, None], 0.0)
    rstd = tl.rsqrt(tl.sum(xc * xc, axis=1) / N + eps)
    y = xc * rstd[:, None]
    if HAS_WEIGHT:
        y = y * tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        y = y + tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows64[:, None] * stride_y + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
    if STORE_STATS:
        tl.store(mean_ptr + rows, mean, mask=row_ok)
        tl.store(rstd_ptr + rows, rstd, mask=row_ok)


@triton.jit
def _layer_norm_fwd_looped_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr,
    N, stride_x, stride_y, eps,
    HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, STORE_STATS: tl.constexpr,
):
    eps = tl.cast(eps, tl.float32)  # float32 scalars (a compiled graph's launch types floats as float64)
    # Long rows, one per program. Pass 1 reads the row chunk by chunk and merges each chunk's (count, mean, M2)
    # into the running ones (Chan et al.); pass 2 reads it again and writes y.
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    y_row = y_ptr + row * stride_y
    count = 0.0
    mean = 0.0
    m2 = 0.0
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        m = cols < N
        x = tl.load(x_row + cols, mask=m, other=0.0).to(tl.float32)
        n_c = tl.minimum(N - start, BLOCK_N).to(tl.float32)
        mean_c = tl.sum(x, axis=0) / n_c
        d = tl.where(m, x - mean_c, 0.0)
        m2_c = tl.sum(d * d, axis=0)
        total = count + n_c
        delta = mean_c - mean
        mean = mean + delta * (n_c / total)
        m2 = m2 + m2_c + delta * delta * (count * n_c / total)
        count = total
    rstd = tl.rsqrt(m2 / N + eps)
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        m = cols < N
        x = tl.load(x_row + cols, mask=m, other=0.0).to(tl.float32)
        y = (x - mean) * rstd
        if HAS_WEIGHT:
            y = y * tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
        if HAS_BIAS:
            y = y + tl.load(b_ptr + cols, mask=m, other=0.0).to(tl.float32)
        tl.store(y_row + cols, y.to(y_ptr.dtype.element_ty), mask=m)
    if STORE_STATS:
        tl.store(mean_ptr + row, mean)
        tl.store(rstd_ptr + row, rstd)


@triton.jit
def _layer_norm_bwd_kernel(
    dy_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, dx_ptr, dw_part_ptr, db_part_ptr,  # partials: [programs, N] fp32
    M, N, rows_per_program, stride_dy, stride_x, stride_dx,
    HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    # Resident rows, persistent: each program walks its run of rows, reads dy and x once, writes dx, and keeps
    # its share of dw and db in registers until the end.
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < N
    if HAS_WEIGHT:
        w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    dw_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    db_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    first = pid * rows_per_program
    last = tl.minimum(first + rows_per_program, M)
    for start in tl.range(first, last, BLOCK_M, num_stages=NUM_STAGES):
        rows = start + tl.arange(0, BLOCK_M)
        row_ok = rows < last
        mask = row_ok[:, None] & col_ok[None, :]
        rows64 = rows.to(tl.int64)
        dy = tl.load(dy_ptr + rows64[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        mean = tl.load(mean_ptr + rows, mask=row_ok, other=0.0)
        rstd = tl.load(rstd_ptr + rows, mask=row_ok, other=0.0)
        xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
        wdy = dy
        if HAS_WEIGHT:
            wdy = dy * w[None, :]
        c1 = tl.sum(xhat * wdy, axis=1) / N
        c2 = tl.sum(wdy, axis=1) / N
        dx = (wdy - (xhat * c1[:, None] + c2[:, None])) * rstd[:, None]
        tl.store(dx_ptr + rows64[:, None] * stride_dx + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
        if HAS_WEIGHT:
            dw_acc += tl.sum(dy * xhat, axis=0)
        if HAS_BIAS:
            db_acc += tl.sum(dy, axis=0)
    if HAS_WEIGHT:
        tl.store(dw_part_ptr + pid.to(tl.int64) * N + cols, dw_acc, mask=col_ok)
    if HAS_BIAS:
        tl.store(db_part_ptr + pid.to(tl.int64) * N + cols, db_acc, mask=col_ok)


@triton.jit
def _layer_norm_bwd_dot_kernel(
    dy_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, c1_ptr, c2_ptr,  # c1 = mean(w·dy·x̂), c2 = mean(w·dy): [M] fp32
    N, stride_dy, stride_x,
    HAS_WEIGHT: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # Long rows, step 1 of 2: reads dy and x once for the row's two sums.
    row = tl.program_id(0).to(tl.int64)
    mean = tl.load(mean_ptr + row)
    rstd = tl.load(rstd_ptr + row)
    acc1 = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_N], dtype=tl.float32)
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        m = cols < N
        wdy = tl.load(dy_ptr + row * stride_dy + cols, mask=m, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + row * stride_x + cols, mask=m, other=0.0).to(tl.float32)
        if HAS_WEIGHT:
            wdy = wdy * tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
        acc1 += tl.where(m, (x - mean) * rstd, 0.0) * wdy
        acc2 += wdy
    tl.store(c1_ptr + row, tl.sum(acc1, axis=0) / N)
    tl.store(c2_ptr + row, tl.sum(acc2, axis=0) / N)


@triton.jit
def _layer_norm_bwd_looped_kernel(
    dy_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, c1_ptr, c2_ptr, dx_ptr, dw_part_ptr, db_part_ptr,
    M, N, rows_per_program, stride_dy, stride_x, stride_dx,
    HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # Long rows, step 2 of 2: program (column block, row group) reads dy and x again, writes dx, and sums its
    # rows' share of dw and db for its columns.
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    group = tl.program_id(1)
    col_ok = cols < N
    if HAS_WEIGHT:
        w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    dw_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    db_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    first = group * rows_per_program
    last = tl.minimum(first + rows_per_program, M)
    for row in range(first, last):
        row64 = tl.cast(row, tl.int64)
        dy = tl.load(dy_ptr + row64 * stride_dy + cols, mask=col_ok, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + row64 * stride_x + cols, mask=col_ok, other=0.0).to(tl.float32)
        xhat = (x - tl.load(mean_ptr + row)) * tl.load(rstd_ptr + row)
        wdy = dy
        if HAS_WEIGHT:
            wdy = dy * w
        dx = (wdy - (xhat * tl.load(c1_ptr + row) + tl.load(c2_ptr + row))) * tl.load(rstd_ptr + row)
        tl.store(dx_ptr + row64 * stride_dx + cols, dx.to(dx_ptr.dtype.element_ty), mask=col_ok)
        if HAS_WEIGHT:
            dw_acc += dy * xhat
        if HAS_BIAS:
            db_acc += dy
    if HAS_WEIGHT:
        tl.store(dw_part_ptr + group.to(tl.int64) * N + cols, dw_acc, mask=col_ok)
    if HAS_BIAS:
        tl.store(db_part_ptr + group.to(tl.int64) * N + cols, db_acc, mask=col_ok)


def layer_norm_fwd(
    x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float, dtype: torch.dtype | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """x: [M, N], weight/bias: [N] or None -> (y [M, N] in ``dtype`` (default x.dtype), mean [M] float32, rstd [M]
    float32)."""
    return _bind_fwd(x, weight, bias, eps, dtype)(x, weight, bias, eps, dtype)


def layer_norm_bwd(
    dy: Tensor, x: Tensor, weight: Tensor | None, bias: Tensor | None, mean: Tensor, rstd: Tensor
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """dy, x: [M, N]; weight/bias: [N] or None; mean, rstd: [M] -> (dx, dw or None, db or None)."""
    return _bind_bwd(dy, x, weight, bias, mean, rstd)(dy, x, weight, bias, mean, rstd)


def _bind_fwd(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float, out: torch.dtype | None = None,
              stats: bool = True) -> Callable[..., Any]:
    """``run(x, weight, bias, eps, out) -> (y, mean, rstd)``, y in ``out`` (default x.dtype); with ``stats=False``
    (a forward no backward follows) the statistics are neither allocated nor written, and ``run`` returns y."""
    M, N = x.shape[0], int(x.shape[1])  # (N specialised where a graph made it symbolic)
    dtype, device = out or x.dtype, x.device
    has_w, has_b = weight is not None, bias is not None
    sx = x.stride(0)
    flags = {"HAS_WEIGHT": has_w, "HAS_BIAS": has_b, "STORE_STATS": stats}
    s = row_settings(N, M, op="layer_norm", device=device)
    resident = s.resident
    if resident:
        k = Bound(_layer_norm_fwd_kernel, (cdiv(M, s.block_m),), **flags, BLOCK_M=s.block_m, BLOCK_N=s.block_n,
                  num_warps=s.num_warps)
    else:
        k = Bound(_layer_norm_fwd_looped_kernel, (M,), **flags, BLOCK_N=s.block_n, num_warps=s.num_warps)

    if not stats:
        def run_y(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float, out: Any = None) -> Tensor:
            y = torch.empty((M, N), dtype=dtype, device=device)
            w = weight if has_w else x
            b = bias if has_b else x
            if resident:
                k.go(x, w, b, y, y, y, M, N, sx, N, eps)
            else:
                k.go(x, w, b, y, y, y, N, sx, N, eps)
            return y
        return run_y

    def run(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float, out: Any = None
            ) -> tuple[Tensor, Tensor, Tensor]:
        y = torch.empty((M, N), dtype=dtype, device=device)
        mean = torch.empty(M, dtype=torch.float32, device=device)
        rstd = torch.empty(M, dtype=torch.float32, device=device)
        w = weight if has_w else x
        b = bias if has_b else x
        if resident:
            k.go(x, w, b, y, mean, rstd, M, N, sx, N, eps)
        else:
            k.go(x, w, b, y, mean, rstd, N, sx, N, eps)
        return y, mean, rstd
    return run


def _bind_bwd(dy: Tensor, x: Tensor, weight: Tensor | None, bias: Tensor | None, mean: Tensor, rstd: Tensor
              ) -> Callable[..., Any]:
    M, N = x.shape[0], int(x.shape[1])  # (N specialised where a graph made it symbolic)
    dtype, device = x.dtype, x.device
    has_w, has_b = weight is not None, bias is not None
    sdy, sx = dy.stride(0), x.stride(0)
    flags = {"HAS_WEIGHT": has_w, "HAS_BIAS": has_b}
    if N <= MAX_RESIDENT_BWD:
        s = persistent_bwd_settings(N, M)
        parts = persistent_programs(device, cdiv(M, s.block_m), per_sm=s.programs_per_sm)
        k = Bound(_layer_norm_bwd_kernel, (parts,), **flags, BLOCK_M=s.block_m, BLOCK_N=s.block_n,
                  NUM_STAGES=s.num_stages, num_warps=s.num_warps, num_stages=s.num_stages)
        dot = None
    else:
        s = row_settings(N, M, backward=True)
        dot = Bound(_layer_norm_bwd_dot_kernel, (M,), HAS_WEIGHT=has_w, BLOCK_N=s.block_n, num_warps=s.num_warps)
        col_blocks = cdiv(N, s.block_n)
        parts = max(1, persistent_programs(device, M * col_blocks, per_sm=4) // col_blocks)
        parts = min(M, parts) if type(M) is int else parts
        k = Bound(_layer_norm_bwd_looped_kernel, (col_blocks, parts), **flags, BLOCK_N=s.block_n,
                  num_warps=s.num_warps)
    rows = cdiv(M, parts)
    sum_dw = bind_sum_partials(parts, N, weight) if weight is not None else None
    sum_db = bind_sum_partials(parts, N, bias) if bias is not None else None

    def run(dy: Tensor, x: Tensor, weight: Tensor | None, bias: Tensor | None, mean: Tensor, rstd: Tensor
            ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        dx = torch.empty((M, N), dtype=dtype, device=device)
        w = weight if has_w else x
        dw_part = torch.empty((parts, N), dtype=torch.float32, device=device)
        db_part = torch.empty((parts, N), dtype=torch.float32, device=device)
        if dot is None:
            k.go(dy, x, w, mean, rstd, dx, dw_part, db_part, M, N, rows, sdy, sx, N)
        else:
            c1 = torch.empty(M, dtype=torch.float32, device=device)
            c2 = torch.empty(M, dtype=torch.float32, device=device)
            dot.go(dy, x, w, mean, rstd, c1, c2, N, sdy, sx)
            k.go(dy, x, w, mean, rstd, c1, c2, dx, dw_part, db_part, M, N, rows, sdy, sx, N)
        dw = sum_dw(dw_part, weight) if sum_dw is not None else None
        db = sum_db(db_part, bias) if sum_db is not None else None
        return dx, dw, db
    return run


# Binders (see hkernels/runtime/plan.py): the same function for every call of one signature, set up once.
layer_norm_fwd.bind = _bind_fwd  # type: ignore[attr-defined]
layer_norm_bwd.bind = _bind_bwd  # type: ignore[attr-defined]
