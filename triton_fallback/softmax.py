"""Softmax over the last dim in hand-written Triton: the twin of ``hkernels/ops/softmax.py``, whose docstring gives
the math and the bytes moved. Rows that fit a block of registers are read once; longer rows are split into chunks
(``triton_fallback/_split.py``): read once from memory, the second read of a chunk from L2. Launch settings:
``_common.row_settings``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from hkernels.runtime.device import cdiv, next_pow2
from hkernels.runtime.interpret import interpreting
from hkernels.runtime.launch import Bound
from triton_fallback import _split
from triton_fallback._common import RowSettings, row_settings

Tensor = torch.Tensor

# Long rows (triton_fallback/_split.py), phase 2 one step behind phase 1 (more where a row has more chunks than
# the grid has programs). Forward: chunks of 4096 elements, 4
# warps, 8 programs per SM; backward (two inputs): chunks of 8192, 8 warps, 2 programs per SM. The fastest of
# python -m bench sweep-llm's candidates (see bench/results/h200/README.md).
SPLIT = RowSettings(False, 1, 4096, 4, programs_per_sm=8)
SPLIT_BWD = RowSettings(False, 1, 8192, 8, programs_per_sm=2)
SPLIT_LAG = 1

# The custom ops whose launches these host functions record at a symbolic length (see triton_fallback/rms_norm.py),
# for rows kept in registers (symbolic_ok): the split kernels' persistent grid must not outnumber its items.
SYMBOLIC = frozenset({"softmax_fwd", "softmax_bwd"})


def symbolic_ok(name: str, tensors: tuple[Tensor, ...]) -> bool:
    """Whether the call of custom op ``name`` on ``tensors`` traces at a symbolic length: its rows are resident."""
    t = tensors[0]
    backward = name == "softmax_bwd"
    return row_settings(int(t.shape[-1]), 0, backward=backward, op=None if backward else "softmax",
                        device=t.device).resident


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
def _softmax_fwd_split_kernel(
    x_ptr, y_ptr,  # [M, N] rows with unit column stride
    slot_ptr,  # [M, C, 1] int64 slots, empty on entry: per chunk (max, Σ exp(x − max))
    M, N, C, stride_x, stride_y, LAG,
    BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
):
    # Long rows split into chunks (triton_fallback/_split.py): x read once from memory, y written once.
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    n_mine = tl.cdiv(M * C - pid, P)
    row, chunk, cols = _split.place(pid, C, BLOCK_N)
    x_next = tl.load(x_ptr + row * stride_x + cols, mask=cols < N, other=-float("inf"), eviction_policy="evict_last")
    for step in range(0, n_mine + LAG):
        x = x_next
        # The next step's chunk (past the last item: the last again, from L2).
        row, chunk, cols = _split.place(pid + tl.minimum(step + 1, n_mine - 1) * P, C, BLOCK_N)
        x_next = tl.load(x_ptr + row * stride_x + cols, mask=cols < N, other=-float("inf"),
                         eviction_policy="evict_last")
        if step < n_mine:  # phase 1: the chunk's max and Σ exp
            row, chunk, cols = _split.place(pid + step * P, C, BLOCK_N)
            xf = x.to(tl.float32)
            m = tl.max(xf, axis=0)
            # A chunk of -inf only shifts by 0: no inf − inf = NaN in its sum.
            _split.publish(slot_ptr + row * C + chunk, m,
                           tl.sum(tl.exp(xf - tl.where(m == -float("inf"), 0.0, m)), axis=0))
        if step >= LAG:  # phase 2: the chunk again (from L2), the row's max and sum from its slots, y out
            row, chunk, cols = _split.place(pid + (step - LAG) * P, C, BLOCK_N)
            x = tl.load(x_ptr + row * stride_x + cols, mask=cols < N, other=-float("inf"),
                        eviction_policy="evict_first")
            m_k, s_k = _split.collect(slot_ptr + row * C, C, 1, BLOCK_C)
            m_k = tl.where(tl.arange(0, BLOCK_C) < C, m_k, -float("inf"))
            row_max = tl.max(m_k, axis=0)
            shift = tl.where(row_max == -float("inf"), 0.0, row_max)
            inv_sum = 1.0 / tl.sum(s_k * tl.exp(m_k - shift), axis=0)
            y = tl.exp(x.to(tl.float32) - row_max) * inv_sum
            tl.store(y_ptr + row * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=cols < N,
                     eviction_policy="evict_first")


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
def _softmax_bwd_split_kernel(
    dy_ptr, y_ptr, dx_ptr,  # [M, N] rows with unit column stride
    slot_ptr,  # [M, C, 1] int64 slots, empty on entry: per chunk (Σ dy·y, 0)
    M, N, C, stride_dy, stride_y, stride_dx, LAG,
    BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
):
    # Long rows split into chunks (triton_fallback/_split.py): dy and y read once from memory, dx written once.
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    n_mine = tl.cdiv(M * C - pid, P)
    row, chunk, cols = _split.place(pid, C, BLOCK_N)
    dy_next = tl.load(dy_ptr + row * stride_dy + cols, mask=cols < N, other=0.0, eviction_policy="evict_last")
    y_next = tl.load(y_ptr + row * stride_y + cols, mask=cols < N, other=0.0, eviction_policy="evict_last")
    for step in range(0, n_mine + LAG):
        dy = dy_next
        y = y_next
        # The next step's chunks (past the last item: the last again, from L2).
        row, chunk, cols = _split.place(pid + tl.minimum(step + 1, n_mine - 1) * P, C, BLOCK_N)
        dy_next = tl.load(dy_ptr + row * stride_dy + cols, mask=cols < N, other=0.0, eviction_policy="evict_last")
        y_next = tl.load(y_ptr + row * stride_y + cols, mask=cols < N, other=0.0, eviction_policy="evict_last")
        if step < n_mine:  # phase 1: the chunk's Σ dy·y
            row, chunk, cols = _split.place(pid + step * P, C, BLOCK_N)
            _split.publish(slot_ptr + row * C + chunk, tl.sum(dy.to(tl.float32) * y.to(tl.float32), axis=0),
                           tl.zeros([], dtype=tl.float32))
        if step >= LAG:  # phase 2: both chunks again (from L2), the row's Σ dy·y from its slots, dx out
            row, chunk, cols = _split.place(pid + (step - LAG) * P, C, BLOCK_N)
            dy = tl.load(dy_ptr + row * stride_dy + cols, mask=cols < N, other=0.0, eviction_policy="evict_first")
            y = tl.load(y_ptr + row * stride_y + cols, mask=cols < N, other=0.0, eviction_policy="evict_first")
            dot_k, _ = _split.collect(slot_ptr + row * C, C, 1, BLOCK_C)
            dot = tl.sum(tl.where(tl.arange(0, BLOCK_C) < C, dot_k, 0.0), axis=0)
            dx = y.to(tl.float32) * (dy.to(tl.float32) - dot)
            tl.store(dx_ptr + row * stride_dx + cols, dx.to(dx_ptr.dtype.element_ty), mask=cols < N,
                     eviction_policy="evict_first")


def softmax_fwd(x: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """x: [M, N] (unit column stride) -> softmax over N, [M, N] in ``dtype`` (default x.dtype)."""
    return _bind_fwd(x, dtype)(x, dtype)


def softmax_bwd(dy: Tensor, y: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """dy, y: [M, N] -> dx [M, N] in ``dtype`` (default y.dtype)."""
    return _bind_bwd(dy, y, dtype)(dy, y, dtype)


def _bind_fwd(x: Tensor, out: torch.dtype | None = None) -> Callable[..., Tensor]:
    M, N = x.shape[0], int(x.shape[1])  # (N specialised where a graph made it symbolic)
    dtype, device, sx = out or x.dtype, x.device, x.stride(0)
    s = row_settings(N, M, op="softmax", device=device)
    if s.resident:
        k = Bound(_softmax_fwd_kernel, (cdiv(M, s.block_m),), BLOCK_M=s.block_m, BLOCK_N=s.block_n,
                  num_warps=s.num_warps)

        def run(x: Tensor, out: torch.dtype | None = None) -> Tensor:
            y = torch.empty((M, N), dtype=dtype, device=device)
            k.go(x, y, M, N, sx, N)
            return y
        return run
    s = s if interpreting() or s != row_settings(N, M) else SPLIT  # a tuned long-row setting stays
    grid = _split.split_grid(device, M, N, s.block_n, s.programs_per_sm, SPLIT_LAG)
    k = Bound(_softmax_fwd_split_kernel, (grid.programs,), BLOCK_N=s.block_n, BLOCK_C=next_pow2(grid.chunks),
              num_warps=s.num_warps, **_split.cooperative(s.num_warps, s.programs_per_sm))

    def run_split(x: Tensor, out: torch.dtype | None = None) -> Tensor:
        y = torch.empty((M, N), dtype=dtype, device=device)
        k.go(x, y, _split.scratch(M, grid, 1, device), M, N, grid.chunks, sx, N, grid.lag)
        return y
    return run_split


def _bind_bwd(dy: Tensor, y: Tensor, out: torch.dtype | None = None) -> Callable[..., Tensor]:
    M, N = y.shape[0], int(y.shape[1])
    dtype, device, sdy, sy = out or y.dtype, y.device, dy.stride(0), y.stride(0)
    s = row_settings(N, M, backward=True)
    if s.resident:
        k = Bound(_softmax_bwd_kernel, (cdiv(M, s.block_m),), BLOCK_M=s.block_m, BLOCK_N=s.block_n,
                  num_warps=s.num_warps)

        def run(dy: Tensor, y: Tensor, out: torch.dtype | None = None) -> Tensor:
            dx = torch.empty((M, N), dtype=dtype, device=device)
            k.go(dy, y, dx, M, N, sdy, sy, N)
            return dx
        return run
    s = s if interpreting() else SPLIT_BWD
    grid = _split.split_grid(device, M, N, s.block_n, s.programs_per_sm, SPLIT_LAG)
    k = Bound(_softmax_bwd_split_kernel, (grid.programs,), BLOCK_N=s.block_n, BLOCK_C=next_pow2(grid.chunks),
              num_warps=s.num_warps, **_split.cooperative(s.num_warps, s.programs_per_sm))

    def run_split(dy: Tensor, y: Tensor, out: torch.dtype | None = None) -> Tensor:
        dx = torch.empty((M, N), dtype=dtype, device=device)
        k.go(dy, y, dx, _split.scratch(M, grid, 1, device), M, N, grid.chunks, sdy, sy, N, grid.lag)
        return dx
    return run_split


# Binders (see hkernels/runtime/plan.py): the same function for every call of one signature, set up once.
softmax_fwd.bind = _bind_fwd  # type: ignore[attr-defined]
softmax_bwd.bind = _bind_bwd  # type: ignore[attr-defined]
