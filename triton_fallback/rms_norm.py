"""RMS norm in hand-written Triton: the twin of ``hkernels/ops/rms_norm.py``, whose docstring gives the math, the
bytes moved and the optional residual and ds that serve ``add_rms_norm``.

The backward writes a [programs, N] float32 partial of dw, which one more kernel (``_partials.sum_partials``) sums
and casts to the weight's dtype. Launch settings: ``_common.row_settings`` and ``persistent_bwd_settings``.
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

# The custom ops whose launches these host functions record with a symbolic row count (a compiled graph whose
# length varies): their settings depend on N alone, grids and loop bounds on M through sym-safe arithmetic.
SYMBOLIC = frozenset({"rms_norm_fwd", "rms_norm_bwd"})


@triton.jit
def _rms_norm_fwd_kernel(
    x_ptr, w_ptr, y_ptr, rstd_ptr,  # x, y: [M, N] rows with unit column stride; w: [N]; rstd: [M] float32
    M, N, stride_x, stride_y, eps, offset,  # the scale is offset + w (Gemma's 1 + w: offset 1)
    r_ptr, s_ptr, stride_r, stride_s,  # add_rms_norm only: the residual r and s = x + r, [M, N]
    HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    STORE_RSTD: tl.constexpr,  # False for a forward no backward will follow: rstd_ptr is then not written
):
    eps = tl.cast(eps, tl.float32)  # float32 scalars (a compiled graph's launch types floats as float64)
    offset = tl.cast(offset, tl.float32)
    # Resident rows: each program reads BLOCK_M rows of x once and writes BLOCK_M rows of y. With a residual r
    # (add_rms_norm) it also reads r, and the row normalised is s = x + r rounded to x's dtype, written to s.
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_ok = rows < M
    mask = row_ok[:, None] & (cols < N)[None, :]
    rows64 = rows.to(tl.int64)
    x = tl.load(x_ptr + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + rows64[:, None] * stride_r + cols[None, :], mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(s_ptr.dtype.element_ty)
        tl.store(s_ptr + rows64[:, None] * stride_s + cols[None, :], x, mask=mask)
    x = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / N + eps)
    y = x * rstd[:, None]
    if HAS_WEIGHT:
        y = y * (tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32) + offset)[None, :]
    tl.store(y_ptr + rows64[:, None] * stride_y + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
    if STORE_RSTD:
        tl.store(rstd_ptr + rows, rstd, mask=row_ok)


@triton.jit
def _rms_norm_fwd_looped_kernel(
    x_ptr, w_ptr, y_ptr, rstd_ptr,
    N, stride_x, stride_y, eps, offset,
    r_ptr, s_ptr, stride_r, stride_s,  # add_rms_norm only
    HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr, BLOCK_N: tl.constexpr, STORE_RSTD: tl.constexpr,
):
    eps = tl.cast(eps, tl.float32)  # float32 scalars (a compiled graph's launch types floats as float64)
    offset = tl.cast(offset, tl.float32)
    # Long rows, one per program: pass 1 reads the row for Σx², pass 2 reads it again and writes y. With a
    # residual, pass 1 reads x and r and writes s = x + r; pass 2 reads s back (one tensor instead of two).
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    y_row = y_ptr + row * stride_y
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        x = tl.load(x_row + cols, mask=cols < N, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(r_ptr + row * stride_r + cols, mask=cols < N, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(s_ptr.dtype.element_ty)
            tl.store(s_ptr + row * stride_s + cols, x, mask=cols < N)
        x = x.to(tl.float32)
        acc += x * x
    rstd = tl.rsqrt(tl.sum(acc, axis=0) / N + eps)
    if HAS_RESIDUAL:
        # Pass 2 reads what other threads of this program wrote in pass 1: the barrier makes it visible.
        tl.debug_barrier()
        x_row = s_ptr + row * stride_s
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        x = tl.load(x_row + cols, mask=cols < N, other=0.0).to(tl.float32)
        y = x * rstd
        if HAS_WEIGHT:
            y = y * (tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32) + offset)
        tl.store(y_row + cols, y.to(y_ptr.dtype.element_ty), mask=cols < N)
    if STORE_RSTD:
        tl.store(rstd_ptr + row, rstd)


@triton.jit
def _rms_norm_bwd_kernel(
    dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, dw_part_ptr,  # dw_part: [programs, N] float32
    M, N, rows_per_program, stride_dy, stride_x, stride_dx, offset,
    ds_ptr, stride_ds,  # add_rms_norm only: ds [M, N], a gradient added to dx
    HAS_DS: tl.constexpr, HAS_WEIGHT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    # Resident rows, persistent: each program walks its own run of rows, reads dy and x once, writes dx, and
    # keeps its share of dw in registers until the end (one [N] float32 row written per program). With ds
    # (add_rms_norm: the gradient that reaches x directly) it also reads ds and adds it to dx before rounding.
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < N
    if HAS_WEIGHT:
        w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32) + tl.cast(offset, tl.float32)
    dw_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    first = pid * rows_per_program
    last = tl.minimum(first + rows_per_program, M)
    for start in tl.range(first, last, BLOCK_M, num_stages=NUM_STAGES):
        rows = start + tl.arange(0, BLOCK_M)
        row_ok = rows < last
        mask = row_ok[:, None] & col_ok[None, :]
        rows64 = rows.to(tl.int64)
        dy = tl.load(dy_ptr + rows64[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=row_ok, other=0.0)
        wdy = dy
        if HAS_WEIGHT:
            wdy = dy * w[None, :]
        c = tl.sum(wdy * x, axis=1) / N
        dx = (wdy - x * (rstd * rstd * c)[:, None]) * rstd[:, None]
        if HAS_DS:
            dx += tl.load(ds_ptr + rows64[:, None] * stride_ds + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(dx_ptr + rows64[:, None] * stride_dx + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
        if HAS_WEIGHT:
            dw_acc += tl.sum(dy * x * rstd[:, None], axis=0)
    if HAS_WEIGHT:
        tl.store(dw_part_ptr + pid.to(tl.int64) * N + cols, dw_acc, mask=col_ok)


@triton.jit
def _rms_norm_bwd_dot_kernel(
    dy_ptr, x_ptr, w_ptr, c_ptr,  # c: [M] float32, receives mean(w·dy·x) per row
    N, stride_dy, stride_x, offset,
    HAS_WEIGHT: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # Long rows, step 1 of 2: reads dy and x once for the row's dot product.
    row = tl.program_id(0).to(tl.int64)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        m = cols < N
        dy = tl.load(dy_ptr + row * stride_dy + cols, mask=m, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + row * stride_x + cols, mask=m, other=0.0).to(tl.float32)
        if HAS_WEIGHT:
            dy = dy * (tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32) + tl.cast(offset, tl.float32))
        acc += dy * x
    tl.store(c_ptr + row, tl.sum(acc, axis=0) / N)


@triton.jit
def _rms_norm_bwd_looped_kernel(
    dy_ptr, x_ptr, w_ptr, rstd_ptr, c_ptr, dx_ptr, dw_part_ptr,  # dw_part: [row groups, N] float32
    M, N, rows_per_program, stride_dy, stride_x, stride_dx, offset,
    ds_ptr, stride_ds,  # add_rms_norm only
    HAS_DS: tl.constexpr, HAS_WEIGHT: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # Long rows, step 2 of 2: program (column block, row group) reads dy and x again (and ds, once), writes dx,
    # and sums its rows' share of dw for its columns.
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    group = tl.program_id(1)
    col_ok = cols < N
    if HAS_WEIGHT:
        w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32) + tl.cast(offset, tl.float32)
    dw_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    first = group * rows_per_program
    last = tl.minimum(first + rows_per_program, M)
    for row in range(first, last):
        row64 = tl.cast(row, tl.int64)
        dy = tl.load(dy_ptr + row64 * stride_dy + cols, mask=col_ok, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + row64 * stride_x + cols, mask=col_ok, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + row)
        c = tl.load(c_ptr + row)
        wdy = dy
        if HAS_WEIGHT:
            wdy = dy * w
        dx = (wdy - x * (rstd * rstd * c)) * rstd
        if HAS_DS:
            dx += tl.load(ds_ptr + row64 * stride_ds + cols, mask=col_ok, other=0.0).to(tl.float32)
        tl.store(dx_ptr + row64 * stride_dx + cols, dx.to(dx_ptr.dtype.element_ty), mask=col_ok)
        if HAS_WEIGHT:
            dw_acc += dy * x * rstd
    if HAS_WEIGHT:
        tl.store(dw_part_ptr + group.to(tl.int64) * N + cols, dw_acc, mask=col_ok)


def rms_norm_fwd(x: Tensor, weight: Tensor | None, eps: float, offset: float = 0.0) -> tuple[Tensor, Tensor]:
    """x: [M, N] (unit column stride), weight: [N] or None -> (y [M, N] in x.dtype, rstd [M] float32); the scale
    is ``offset + weight``."""
    return bind_fwd(x, None, weight)(x, weight, eps, offset)


def rms_norm_bwd(dy: Tensor, x: Tensor, weight: Tensor | None, rstd: Tensor, dx: Tensor | None = None,
                 offset: float = 0.0) -> tuple[Tensor, Tensor | None]:
    """dy, x: [M, N], weight: [N] or None, rstd: [M] -> (dx [M, N] in x.dtype, dw [N] in weight.dtype or None);
    dx written into the given buffer (contiguous; it may be dy: each element of dy is read before its dx is
    written) where there is one; the scale is ``offset + weight``."""
    return bind_bwd(dy, None, x, weight, rstd)(dy, None, x, weight, rstd, dx, offset)


def _bind_rms_norm_bwd(dy: Tensor, x: Tensor, weight: Tensor | None, rstd: Tensor, dx: Tensor | None = None,
                       offset: float = 0.0) -> Callable[..., Any]:
    run = bind_bwd(dy, None, x, weight, rstd)
    return lambda dy, x, weight, rstd, dx=None, offset=0.0: run(dy, None, x, weight, rstd, dx, offset)


# Binders (see hkernels/runtime/plan.py): the same function for every call of one signature, set up once.
rms_norm_fwd.bind = (  # type: ignore[attr-defined]
    lambda x, weight, eps, offset=0.0, stats=True: bind_fwd(x, None, weight, stats))
rms_norm_bwd.bind = _bind_rms_norm_bwd  # type: ignore[attr-defined]


def bind_fwd(x: Tensor, residual: Tensor | None, weight: Tensor | None, stats: bool = True) -> Callable[..., Any]:
    """The forward for arguments of this signature, shared with add_rms_norm. Without a residual: ``run(x, weight,
    eps, offset=0.0) -> (y [M, N] in x.dtype, rstd [M] float32)``, the scale ``offset + weight``. With one:
    ``run(x, residual, weight, eps, offset=0.0) -> (y, s, rstd)``,
    the row normalised being s = x + residual rounded to x's dtype, written out. ``stats=False`` (a forward no
    backward follows): rstd is neither allocated nor written, and not returned (``y``, or ``(y, s)``)."""
    M, N = x.shape[0], int(x.shape[1])  # (N specialised where a graph made it symbolic: the settings follow it)
    dtype, device = x.dtype, x.device
    has_w, has_r = weight is not None, residual is not None
    sx = x.stride(0)
    sr = residual.stride(0) if residual is not None else sx
    s = row_settings(N, M, op="add_rms_norm" if has_r else "rms_norm", device=device)
    meta = {"HAS_RESIDUAL": has_r, "HAS_WEIGHT": has_w, "BLOCK_N": s.block_n, "STORE_RSTD": stats,
            "num_warps": s.num_warps}
    resident = s.resident
    if resident:
        k = Bound(_rms_norm_fwd_kernel, (cdiv(M, s.block_m),), BLOCK_M=s.block_m, **meta)
    else:
        k = Bound(_rms_norm_fwd_looped_kernel, (M,), **meta)

    if not has_r and not stats:
        def run_y(x: Tensor, weight: Tensor | None, eps: float, offset: float = 0.0) -> Tensor:
            y = torch.empty((M, N), dtype=dtype, device=device)
            w = weight if has_w else x
            if resident:
                k.go(x, w, y, y, M, N, sx, N, eps, offset, x, x, sx, sx)
            else:
                k.go(x, w, y, y, N, sx, N, eps, offset, x, x, sx, sx)
            return y
        return run_y
    if not has_r:
        def run(x: Tensor, weight: Tensor | None, eps: float, offset: float = 0.0) -> tuple[Tensor, Tensor]:
            y = torch.empty((M, N), dtype=dtype, device=device)
            rstd = torch.empty(M, dtype=torch.float32, device=device)
            w = weight if has_w else x
            if resident:
                k.go(x, w, y, rstd, M, N, sx, N, eps, offset, x, x, sx, sx)
            else:
                k.go(x, w, y, rstd, N, sx, N, eps, offset, x, x, sx, sx)
            return y, rstd
        return run

    def run_residual(x: Tensor, residual: Tensor, weight: Tensor | None, eps: float, offset: float = 0.0
                     ) -> tuple[Tensor, ...]:
        summed = torch.empty((M, N), dtype=dtype, device=device)
        y = torch.empty((M, N), dtype=dtype, device=device)
        rstd = torch.empty(M, dtype=torch.float32, device=device) if stats else y
        w = weight if has_w else x
        if resident:
            k.go(x, w, y, rstd, M, N, sx, N, eps, offset, residual, summed, sr, N)
        else:
            k.go(x, w, y, rstd, N, sx, N, eps, offset, residual, summed, sr, N)
        return (y, summed, rstd) if stats else (y, summed)
    return run_residual


def bind_bwd(dy: Tensor, ds: Tensor | None, x: Tensor, weight: Tensor | None, rstd: Tensor, dx: Tensor | None = None,
             offset: float = 0.0) -> Callable[..., Any]:
    """The backward for arguments of this signature, shared with add_rms_norm: ``run(dy, ds, x, weight, rstd, dx=None,
    offset=0.0) -> (dx [M, N] in x.dtype, dw [N] in weight.dtype or None)``, the scale ``offset + weight`` (dw is
    the same for any offset); ``ds`` [M, N] or None is added to dx in float32
    before the one rounding; dx written into the buffer given (contiguous; it may be dy) where there is one."""
    M, N = x.shape[0], int(x.shape[1])  # (N specialised where a graph made it symbolic: the settings follow it)
    dtype, device = x.dtype, x.device
    has_w, has_ds = weight is not None, ds is not None
    sdy, sx = dy.stride(0), x.stride(0)
    sg = ds.stride(0) if ds is not None else sdy
    if N <= MAX_RESIDENT_BWD:
        s = persistent_bwd_settings(N, M)
        programs = persistent_programs(device, cdiv(M, s.block_m), per_sm=s.programs_per_sm)
        rows_per_program = cdiv(M, programs)
        k = Bound(_rms_norm_bwd_kernel, (programs,), HAS_DS=has_ds, HAS_WEIGHT=has_w, BLOCK_M=s.block_m,
                  BLOCK_N=s.block_n, NUM_STAGES=s.num_stages, num_warps=s.num_warps, num_stages=s.num_stages)
        sum_dw = bind_sum_partials(programs, N, weight) if weight is not None else None

        def run(dy: Tensor, ds: Tensor | None, x: Tensor, weight: Tensor | None, rstd: Tensor,
                dx: Tensor | None = None, offset: float = 0.0) -> tuple[Tensor, Tensor | None]:
            if dx is None:
                dx = torch.empty((M, N), dtype=dtype, device=device)
            dw_part = torch.empty((programs, N), dtype=torch.float32, device=device)
            k.go(dy, x, weight if has_w else x, rstd, dx, dw_part, M, N, rows_per_program, sdy, sx, N, offset,
                 ds if has_ds else dy, sg)
            return dx, (sum_dw(dw_part, weight) if sum_dw is not None else None)
        return run
    s = row_settings(N, M, backward=True)
    dot = Bound(_rms_norm_bwd_dot_kernel, (M,), HAS_WEIGHT=has_w, BLOCK_N=s.block_n, num_warps=s.num_warps)
    col_blocks = cdiv(N, s.block_n)
    groups = max(1, persistent_programs(device, M * col_blocks, per_sm=4) // col_blocks)
    groups = min(M, groups) if type(M) is int else groups
    rows_per_group = cdiv(M, groups)
    k = Bound(_rms_norm_bwd_looped_kernel, (col_blocks, groups), HAS_DS=has_ds, HAS_WEIGHT=has_w,
              BLOCK_N=s.block_n, num_warps=s.num_warps)
    sum_dw = bind_sum_partials(groups, N, weight) if weight is not None else None

    def run_looped(dy: Tensor, ds: Tensor | None, x: Tensor, weight: Tensor | None, rstd: Tensor,
                   dx: Tensor | None = None, offset: float = 0.0) -> tuple[Tensor, Tensor | None]:
        if dx is None:
            dx = torch.empty((M, N), dtype=dtype, device=device)
        c = torch.empty(M, dtype=torch.float32, device=device)
        w = weight if has_w else x
        dot.go(dy, x, w, c, N, sdy, sx, offset)
        dw_part = torch.empty((groups, N), dtype=torch.float32, device=device)
        k.go(dy, x, w, rstd, c, dx, dw_part, M, N, rows_per_group, sdy, sx, N, offset, ds if has_ds else dy, sg)
        return dx, (sum_dw(dw_part, weight) if sum_dw is not None else None)
    return run_looped
