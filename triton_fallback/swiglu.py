"""SwiGLU in hand-written Triton: the twin of ``hkernels/ops/swiglu.py``, whose docstring gives the math, the shapes
and the bytes moved.

Each program owns a [BLOCK_M, BLOCK_N] tile of a flat grid, column blocks fastest: consecutive programs stream
consecutive memory of a row, row offsets are 64-bit (M·N and a view's span may pass 2^31 elements), and a tile of
2048 elements over 4 warps gives each thread two 16-byte vectors of each bf16 tensor. ``launch_settings`` is shared
with ``geglu.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from hkernels.runtime.device import cdiv, next_pow2, num_sms
from hkernels.runtime.interpret import interpreting
from hkernels.runtime.launch import Bound

Tensor = torch.Tensor

SYMBOLIC = frozenset({"swiglu_fwd", "swiglu_bwd"})  # traced at a symbolic row count (see triton_fallback/rms_norm.py)


@triton.jit
def _tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # The program's rows (int64, for row offsets past 2^31), columns and mask; column blocks vary fastest.
    pid = tl.program_id(0)
    col_blocks = tl.cdiv(N, BLOCK_N)
    rows = (pid // col_blocks) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = (pid % col_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    return rows.to(tl.int64), cols, mask


@triton.jit
def _swiglu_fwd_kernel(
    g_ptr, u_ptr, y_ptr,  # gate, up: [M, N] rows of unit column stride; y: [M, N] contiguous
    M, N, stride_g, stride_u,
    alpha, beta,  # the gate's and the result's multipliers (1.0: plain SwiGLU, the products exact)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # Reads a tile of gate and up once, writes the tile of y.
    alpha = tl.cast(alpha, tl.float32)  # float32 scalars (a compiled graph's launch types floats as float64)
    beta = tl.cast(beta, tl.float32)
    rows, cols, mask = _tile(M, N, BLOCK_M, BLOCK_N)
    g = tl.load(g_ptr + rows[:, None] * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32) * alpha
    u = tl.load(u_ptr + rows[:, None] * stride_u + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    # σ(g) = 1 / (1 + e^-g): e^-g = inf for g < -88 gives σ = 0 and y = -0, never NaN.
    y = g * tl.sigmoid(g) * u * beta
    tl.store(y_ptr + rows[:, None] * N + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


# Backward, with a = α·g and s = σ(a):  d silu/da = s + a·s·(1 − s) = s·(1 + a·(1 − s)),
#   dg = α·β·dy·u·s·(1 + a·(1 − s)),  du = β·dy·a·s.
# At a → -∞, s = 0 and the product is 0 (a·(1 − s) stays finite); at a → +∞, 1 − s = 0 and dg = α·β·dy·u.
@triton.jit
def _swiglu_bwd_kernel(
    dy_ptr, g_ptr, u_ptr, dg_ptr, du_ptr,  # dy, gate, up: [M, N], unit column stride; dg, du: [M, N] contiguous
    M, N, stride_dy, stride_g, stride_u,
    alpha, beta,  # the forward's multipliers
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # Reads a tile of dy, gate and up once, writes the tiles of dgate and dup.
    alpha = tl.cast(alpha, tl.float32)
    beta = tl.cast(beta, tl.float32)
    rows, cols, mask = _tile(M, N, BLOCK_M, BLOCK_N)
    dy = tl.load(dy_ptr + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32) * beta
    g = tl.load(g_ptr + rows[:, None] * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32) * alpha
    u = tl.load(u_ptr + rows[:, None] * stride_u + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(g)
    dg = dy * u * s * (1.0 + g * (1.0 - s)) * alpha
    du = dy * g * s
    out = rows[:, None] * N + cols[None, :]
    tl.store(dg_ptr + out, dg.to(dg_ptr.dtype.element_ty), mask=mask)
    tl.store(du_ptr + out, du.to(du_ptr.dtype.element_ty), mask=mask)


@dataclass(frozen=True)
class LaunchSettings:
    block_m: int
    block_n: int
    num_warps: int
    programs: int  # size of the flat grid


def launch_settings(M: int, N: int, device: torch.device, elements: int = 2048) -> LaunchSettings:
    """Tile shape, warps and grid for an element-wise kernel over [M, N] with about ``elements`` per program.

    2048 elements with 4 warps: the best, or within 1% of it, for every kernel of swiglu and geglu among tile shapes
    of 1024-8192 elements and 4-16 warps, at the copy rate of the GPU (see bench/results/h200/README.md). Column
    blocks are powers of two that divide N where one does (no half-empty last block); short rows stack several rows
    per tile. Small inputs take smaller tiles, so that
    even one row (a decoding step) spreads over a few programs per multiprocessor instead of a handful. A symbolic
    M (a compiled graph whose length varies) takes the full tiles: only the grid depends on it.
    """
    concrete = type(M) is int
    if interpreting():
        elements = 65536  # the interpreter runs programs one after another: few, large programs run fastest
    elif concrete:
        # at least ~2 programs per multiprocessor when the input allows, tiles of at least 512 elements
        per_program = next_pow2(max(1, (M * N) // (2 * num_sms(device))))
        elements = max(512, min(elements, per_program))
    block_n = min(next_pow2(N), elements)
    while block_n > 512 and block_n < N and N % block_n != 0 and N % (block_n // 2) == 0:
        block_n //= 2
    block_m = max(1, elements // block_n)
    block_m = min(next_pow2(M), block_m) if concrete else block_m
    num_warps = 4 if block_m * block_n <= 2048 else 8
    programs = cdiv(M, block_m) * cdiv(N, block_n)
    return LaunchSettings(block_m, block_n, num_warps, programs)


def swiglu_fwd(gate: Tensor, up: Tensor, alpha: float = 1.0, beta: float = 1.0) -> Tensor:
    """gate, up: [M, N] (unit column stride, any row stride) -> y = β·silu(α·gate)·up, [M, N] contiguous."""
    return bind_gated(_swiglu_fwd_kernel, gate, up, scalars=(alpha, beta))(gate, up)


def swiglu_bwd(dy: Tensor, gate: Tensor, up: Tensor, alpha: float = 1.0, beta: float = 1.0
               ) -> tuple[Tensor, Tensor]:
    """dy, gate, up: [M, N] (unit column stride) -> (dgate, dup), each [M, N] contiguous in gate's dtype."""
    return bind_gated_bwd(_swiglu_bwd_kernel, dy, gate, up, scalars=(alpha, beta))(dy, gate, up)


def bind_gated(kernel: Any, gate: Tensor, up: Tensor, scalars: tuple[float, ...] = (), **meta: Any
               ) -> Callable[..., Tensor]:
    """A gated forward (swiglu's with its multipliers ``scalars``, geglu's with its ``meta``) for arguments of this
    signature: ``run(gate, up, *_) -> y [M, N]``."""
    M, N = gate.shape[0], int(gate.shape[1])  # (N specialised where a graph made it symbolic)
    dtype, device, sg, su = gate.dtype, gate.device, gate.stride(0), up.stride(0)
    s = launch_settings(M, N, device)
    k = Bound(kernel, (s.programs,), **meta, BLOCK_M=s.block_m, BLOCK_N=s.block_n, num_warps=s.num_warps)

    def run(gate: Tensor, up: Tensor, *_: Any) -> Tensor:
        y = torch.empty((M, N), dtype=dtype, device=device)
        k.go(gate, up, y, M, N, sg, su, *scalars)
        return y
    return run


def bind_gated_bwd(kernel: Any, dy: Tensor, gate: Tensor, up: Tensor, scalars: tuple[float, ...] = (), **meta: Any
                   ) -> Callable[..., Any]:
    """A gated backward for arguments of this signature: ``run(dy, gate, up, *_) -> (dgate, dup)``."""
    M, N = gate.shape[0], int(gate.shape[1])
    dtype, device = gate.dtype, gate.device
    strides = (dy.stride(0), gate.stride(0), up.stride(0))
    s = launch_settings(M, N, device)
    k = Bound(kernel, (s.programs,), **meta, BLOCK_M=s.block_m, BLOCK_N=s.block_n, num_warps=s.num_warps)

    def run(dy: Tensor, gate: Tensor, up: Tensor, *_: Any) -> tuple[Tensor, Tensor]:
        dgate = torch.empty((M, N), dtype=dtype, device=device)
        dup = torch.empty((M, N), dtype=dtype, device=device)
        k.go(dy, gate, up, dgate, dup, M, N, *strides, *scalars)
        return dgate, dup
    return run


# Binders (see hkernels/runtime/plan.py): the same function for every call of one signature, set up once.
swiglu_fwd.bind = lambda gate, up, alpha=1.0, beta=1.0: bind_gated(  # type: ignore[attr-defined]
    _swiglu_fwd_kernel, gate, up, scalars=(alpha, beta))
swiglu_bwd.bind = lambda dy, gate, up, alpha=1.0, beta=1.0: bind_gated_bwd(  # type: ignore[attr-defined]
    _swiglu_bwd_kernel, dy, gate, up, scalars=(alpha, beta))
