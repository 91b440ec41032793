"""Matmul with a fused epilogue in hand-written Triton: the twin of ``hkernels/ops/matmul.py``, whose docstring
gives the math (the activations and their derivatives), the shapes, the layouts read in place and the bytes moved.
Here tiles run in L2-swizzled groups of GROUP_M row tiles; the backward kernel reads dy and z and writes dz once.

Two kernels:
- ``_matmul_tma_kernel`` (16-bit operands whose layouts suit TMA: 16-byte aligned base and strides, N a multiple
  of 8): a persistent grid of ``programs_per_sm`` programs per multiprocessor walks the B·⌈M/BM⌉·⌈N/BN⌉ tiles in
  grouped order. a, b, y (and z) are read and written through host-built rank-3 TMA descriptors ([B, rows, cols]
  with a unit last stride; a transposed view gets a descriptor of its storage order and its tile is transposed,
  which wgmma reads from shared memory either way). TMA zero-fills reads past M, N, K and clips writes, so there
  are no masks; wide tiles finish their epilogue in ``subtile`` column slices.
- ``_matmul_kernel`` (float32, unaligned strides, K = 0): one program per tile, pointer loads with 64-bit offsets
  (M·K or M·N may pass 2^31 elements), masks only where K ends inside a step.

Launch settings (``matmul_config``) are chosen by tile class, as the Helion configs' keys are: 0 for decode rows
(M ≤ 16), else the largest of 64×64, 64×128, 128×128, 128×256 tiles that still fills the GPU for one wave.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from hkernels.runtime.device import cdiv, next_pow2, num_sms
from hkernels.runtime.interpret import interpreting
from hkernels.runtime.launch import Bound, aligned, descriptors_ok, launch
from triton_fallback._common import tile_class
from triton_fallback.geglu import _normal_cdf_fast
from triton_fallback.swiglu import _tile, launch_settings

Tensor = torch.Tensor
ACTIVATIONS = (None, "relu", "gelu", "gelu_tanh", "silu")
_TMA_DTYPES = (torch.bfloat16, torch.float16)
# traced at a symbolic length (see triton_fallback/rms_norm.py): the tile class of many rows at a symbolic M, the
# masked K loop at a symbolic K
SYMBOLIC = frozenset({"matmul_fwd", "matmul_act_bwd"})
# Constants are literals in the kernels, as in geglu.py: 0.7071067811865475 = 1/√2, 1.5957691216057308 = 2·√(2/π)
# (σ's argument is 2u), 0.21406444881780076 = 2·√(2/π)·3·0.044715 (in d(2u)/dz), 0.3989422804014327 = 1/√(2π).


@triton.jit
def _activation(z, ACTIVATION: tl.constexpr):
    # act(z) on a float32 tile; ACTIVATION is a compile-time string ("" for none).
    if ACTIVATION == "relu":
        return tl.where(z < 0.0, 0.0, z)  # NaN stays NaN, as torch.relu
    elif ACTIVATION == "gelu":
        # z·Φ(z), Φ(z) = ½·erfc(−z/√2), with erfc(x) = t·exp(−x² + P(t)), t = 1/(1 + x/2), x = |z|/√2 ≥ 0 (the
        # Chebyshev fit of Numerical Recipes' erfcc, relative error < 1.2e-7 for all x ≥ 0); for z ≥ 0, Φ = 1 − ½·erfc.
        # Straight-line FMAs and one exp: libdevice's erf made the 128×256 epilogue spill registers, and
        # ½·(1 + erf(z/√2)) cancels for z < −3, where this form keeps its relative accuracy.
        x = tl.abs(z) * 0.7071067811865475
        t = 1.0 / (1.0 + 0.5 * x)
        p = -0.82215223 + t * 0.17087277
        p = 0.27886807 + t * (-1.13520398 + t * (1.48851587 + t * p))
        p = -1.26551223 + t * (1.00002368 + t * (0.37409196 + t * (0.09678418 + t * (-0.18628806 + t * p))))
        half_tail = 0.5 * t * tl.exp(p - x * x)
        return z * tl.where(z >= 0.0, 1.0 - half_tail, half_tail)
    elif ACTIVATION == "gelu_tanh":
        return z * tl.sigmoid(1.5957691216057308 * (z + 0.044715 * z * z * z))
    elif ACTIVATION == "silu":
        return z * tl.sigmoid(z)
    else:
        return z


@triton.jit
def _tile_of(tile, tiles_m, tiles_n, GROUP_M: tl.constexpr):
    # Grouped (L2-swizzled) order within a batch: GROUP_M row tiles share each column panel of b while it is hot.
    per_batch = tiles_m * tiles_n
    batch = tile // per_batch
    t = tile % per_batch
    per_group = GROUP_M * tiles_n
    first_m = (t // per_group) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (t % per_group) % group_rows
    pid_n = (t % per_group) // group_rows
    return batch, pid_m, pid_n


@triton.jit
def _epilogue(acc, bias_ptr, y_desc, z_desc, batch, off_m, off_n, N, ACTIVATION: tl.constexpr, KEEP_PRE: tl.constexpr):
    # z = acc + bias, y = act(z) for a [rows, cols] slice of a tile at (off_m, off_n); stores y (and z) by TMA.
    rows: tl.constexpr = acc.shape[0]
    cols: tl.constexpr = acc.shape[1]
    if bias_ptr is not None:
        offs = off_n + tl.arange(0, cols)
        acc += tl.load(bias_ptr + offs, mask=offs < N, other=0.0).to(tl.float32)[None, :]
    if KEEP_PRE:
        z_desc.store([batch, off_m, off_n], tl.reshape(acc.to(z_desc.dtype), (1, rows, cols)))
    y_desc.store([batch, off_m, off_n], tl.reshape(_activation(acc, ACTIVATION).to(y_desc.dtype), (1, rows, cols)))


@triton.jit
def _matmul_tma_kernel(
    a_desc, b_desc, y_desc, z_desc,  # rank-3 TMA descriptors: a, b in storage order (see A_T, B_T); y, z [B, M, N]
    bias_ptr,  # [N] or None
    M, N, K, BATCH,
    A_T: tl.constexpr, B_T: tl.constexpr,  # a (b) is a transposed view: its descriptor is over [B, K, M] ([B, N, K])
    ACTIVATION: tl.constexpr, KEEP_PRE: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    SUBTILE: tl.constexpr, FLATTEN: tl.constexpr, NUM_PROGRAMS: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
):
    # Per tile: reads a [BLOCK_M, K] panel of a and a [K, BLOCK_N] panel of b, writes the tile of y (and z) once.
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    tiles = tiles_m * tiles_n * BATCH
    k_steps = tl.cdiv(K, BLOCK_K)
    # The epilogue finds its tile from a counter of its own, not from the loads' offsets: with FLATTEN the next
    # tile's loads are software-pipelined into this tile's iterations, and a value used both by the loads of one
    # tile and the epilogue of another is what Triton's persistent-matmul tutorial keeps apart for its pipeliner.
    tile_c = tl.program_id(0) - NUM_PROGRAMS
    for tile in tl.range(tl.program_id(0), tiles, NUM_PROGRAMS, flatten=FLATTEN, warp_specialize=WARP_SPECIALIZE):
        batch, pid_m, pid_n = _tile_of(tile, tiles_m, tiles_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for step in range(k_steps):
            off_k = step * BLOCK_K
            if A_T:
                lhs = tl.trans(tl.reshape(a_desc.load([batch, off_k, off_m]), (BLOCK_K, BLOCK_M)))
            else:
                lhs = tl.reshape(a_desc.load([batch, off_m, off_k]), (BLOCK_M, BLOCK_K))
            if B_T:
                rhs = tl.trans(tl.reshape(b_desc.load([batch, off_n, off_k]), (BLOCK_N, BLOCK_K)))
            else:
                rhs = tl.reshape(b_desc.load([batch, off_k, off_n]), (BLOCK_K, BLOCK_N))
            if UPCAST:  # interpret mode: the interpreter multiplies bf16 tiles' raw bits
                lhs = lhs.to(tl.float32)
                rhs = rhs.to(tl.float32)
            acc = tl.dot(lhs, rhs, acc, input_precision="ieee")
        tile_c += NUM_PROGRAMS
        batch, pid_m, pid_n = _tile_of(tile_c, tiles_m, tiles_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        if SUBTILE == 1:
            _epilogue(acc, bias_ptr, y_desc, z_desc, batch, off_m, off_n, N, ACTIVATION, KEEP_PRE)
        else:
            # Column slices, each finished (bias, activation, stores) before the next: a quarter or half of the
            # epilogue's registers and of the TMA store staging buffer; gelu with z spills at 128×256 otherwise.
            HALF: tl.constexpr = BLOCK_N // 2
            acc0, acc1 = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, HALF)), (0, 2, 1)))
            if SUBTILE == 2:
                _epilogue(acc0, bias_ptr, y_desc, z_desc, batch, off_m, off_n, N, ACTIVATION, KEEP_PRE)
                _epilogue(acc1, bias_ptr, y_desc, z_desc, batch, off_m, off_n + HALF, N, ACTIVATION, KEEP_PRE)
            else:
                QUARTER: tl.constexpr = BLOCK_N // 4
                acc00, acc01 = tl.split(tl.permute(tl.reshape(acc0, (BLOCK_M, 2, QUARTER)), (0, 2, 1)))
                _epilogue(acc00, bias_ptr, y_desc, z_desc, batch, off_m, off_n, N, ACTIVATION, KEEP_PRE)
                _epilogue(acc01, bias_ptr, y_desc, z_desc, batch, off_m, off_n + QUARTER, N, ACTIVATION, KEEP_PRE)
                acc10, acc11 = tl.split(tl.permute(tl.reshape(acc1, (BLOCK_M, 2, QUARTER)), (0, 2, 1)))
                _epilogue(acc10, bias_ptr, y_desc, z_desc, batch, off_m, off_n + HALF, N, ACTIVATION, KEEP_PRE)
                _epilogue(acc11, bias_ptr, y_desc, z_desc, batch, off_m, off_n + HALF + QUARTER, N, ACTIVATION,
                          KEEP_PRE)


@triton.jit
def _matmul_kernel(
    a_ptr, b_ptr, y_ptr, z_ptr,  # a: [B, M, K], b: [B, K, N], any strides; y, z: [B, M, N] contiguous
    bias_ptr,  # [N] or None
    M, N, K,
    stride_ab, stride_am, stride_ak, stride_bb, stride_bk, stride_bn,
    ACTIVATION: tl.constexpr, KEEP_PRE: tl.constexpr, UPCAST: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    # Reads a [BLOCK_M, K] panel of a and a [K, BLOCK_N] panel of b, writes the tile of y (and z) once.
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    batch, pid_m, pid_n = _tile_of(tl.program_id(0), tiles_m, tiles_n, GROUP_M)
    batch = batch.to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    # Rows and columns past the edge read row (column) 0 instead of being masked: the loads stay unmasked in M and
    # N, and the stores below drop those rows and columns. Row offsets are 64-bit.
    rows_in = tl.where(rows < M, rows, 0).to(tl.int64)
    cols_in = tl.where(cols < N, cols, 0).to(tl.int64)
    ks_in = ks.to(tl.int64)  # a transposed view's K stride is M: BLOCK_K·M may pass 2^31 too
    a_ptrs = a_ptr + batch * stride_ab + rows_in[:, None] * stride_am + ks_in[None, :] * stride_ak
    b_ptrs = b_ptr + batch * stride_bb + ks_in[:, None] * stride_bk + cols_in[None, :] * stride_bn
    a_step = tl.full([], BLOCK_K, tl.int64) * stride_ak
    b_step = tl.full([], BLOCK_K, tl.int64) * stride_bk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            lhs = tl.load(a_ptrs)
            rhs = tl.load(b_ptrs)
        else:
            lhs = tl.load(a_ptrs, mask=(k0 + ks)[None, :] < K, other=0.0)
            rhs = tl.load(b_ptrs, mask=(k0 + ks)[:, None] < K, other=0.0)
        if UPCAST:  # interpret mode: the interpreter multiplies bf16 tiles' raw bits
            lhs = lhs.to(tl.float32)
            rhs = rhs.to(tl.float32)
        acc = tl.dot(lhs, rhs, acc, input_precision="ieee")
        a_ptrs += a_step
        b_ptrs += b_step
    if bias_ptr is not None:
        acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    out = batch * M * N + rows.to(tl.int64)[:, None] * N + cols[None, :]
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    tl.store(y_ptr + out, _activation(acc, ACTIVATION).to(y_ptr.dtype.element_ty), mask=mask)
    if KEEP_PRE:
        tl.store(z_ptr + out, acc.to(z_ptr.dtype.element_ty), mask=mask)


# Backward of the epilogue, per element (the math of each derivative in the module docstring):
#   tanh form: 1 − s is taken as e·s with e = e^(−2u) (no cancellation where s ≈ 1); where e overflows, s = 0 and
#   1 − s = 1, so the product stays 0 instead of inf·0. erf form, 16-bit inputs: Φ from the cheap erfc form of
#   geglu.py (error ≤ 3e-7, far below a 16-bit ulp), which keeps this memory-bound kernel off the issue limit.
@triton.jit
def _matmul_act_bwd_kernel(
    dy_ptr, z_ptr, dz_ptr,  # dy, z: [R, N] rows of unit column stride; dz: [R, N] contiguous
    R, N, stride_dy, stride_z,
    ACTIVATION: tl.constexpr, FAST_CDF: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # Reads a tile of dy and z once, writes the tile of dz.
    rows, cols, mask = _tile(R, N, BLOCK_M, BLOCK_N)
    d = tl.load(dy_ptr + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    x = tl.load(z_ptr + rows[:, None] * stride_z + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if ACTIVATION == "relu":
        g = tl.where(x <= 0.0, 0.0, d)  # a NaN z passes the gradient, as torch.relu's backward does
    elif ACTIVATION == "gelu":
        if FAST_CDF:
            cdf, e = _normal_cdf_fast(x)  # e = e^(−x²/2): φ(x) from the same exponential
        else:
            cdf = 0.5 * (1.0 + tl.math.erf(x * 0.7071067811865475))
            e = tl.exp(-0.5 * x * x)
        g = d * (cdf + x * 0.3989422804014327 * e)
    elif ACTIVATION == "gelu_tanh":
        x2 = x * x
        e = tl.exp(-1.5957691216057308 * (x + 0.044715 * x2 * x))
        s = 1.0 / (1.0 + e)
        one_minus_s = tl.where(s == 0.0, 1.0, e * s)
        g = d * (s + x * s * one_minus_s * (1.5957691216057308 + 0.21406444881780076 * x2))
    else:  # silu
        s = tl.sigmoid(x)
        g = d * s * (1.0 + x * (1.0 - s))
    tl.store(dz_ptr + rows[:, None] * N + cols[None, :], g.to(dz_ptr.dtype.element_ty), mask=mask)


@dataclass(frozen=True)
class MatmulConfig:
    block_m: int
    block_n: int
    block_k: int
    group_m: int  # row tiles per L2 group
    num_warps: int
    num_stages: int
    programs_per_sm: int = 1  # persistent TMA kernel: programs per multiprocessor
    subtile: int = 1  # TMA kernel: the epilogue stores 1, 2 or 4 column slices of the tile
    flatten: bool = False  # TMA kernel: flatten tile and K loops into one pipelined loop
    warp_specialize: bool = False  # TMA kernel: Triton's automatic warp specialization of the tile loop


# 16-bit inputs, per tile class; the pointer kernel takes at most class 3 (128×256 spills there: address tensors)
_CONFIGS = {
    0: MatmulConfig(16, 32, 256, 1, 4, 4),
    1: MatmulConfig(64, 64, 64, 8, 4, 4, programs_per_sm=2, flatten=True),
    2: MatmulConfig(64, 128, 64, 8, 4, 4, flatten=True),
    3: MatmulConfig(128, 128, 64, 8, 8, 4, flatten=True),
    4: MatmulConfig(128, 256, 64, 8, 8, 4, subtile=4, flatten=True),
}


def matmul_config(m: int, n: int, k: int, batch: int, dtype: torch.dtype, sms: int, tma: bool) -> MatmulConfig:
    """Tile shape, warps and pipelining for B × [M, K] @ [K, N] of ``dtype`` on sm_90 (``sms``: 132 on an H200).

    Chosen from what Hopper rewards and checked to compile without spills (cuobjdump), not by a sweep:
    - class 4 (large M and N): 128×256×64 wgmma tiles, 8 warps (two warpgroups), 4 stages of 48 KB, the epilogue
      in four 128×64 column slices (16 KB of TMA staging: 208 KB of the 227 KB of shared memory; a whole-tile
      epilogue of gelu with z needs more than 255 registers a thread), tile and K loops flattened so that the
      next tile's loads overlap this one's epilogue. 162-170 registers.
    - classes 3-1 (fewer rows or columns): 128×128, 64×128, 64×64 tiles, whichever still fills the GPU.
    - class 0 (M ≤ 16, decode rows, bound by reading b): 16×32 tiles with 256-wide K steps, so that even N = 4096
      spreads over 128 programs.
    - float32 (IEEE products on FMA units, not tensor cores): 64×64×32.
    """
    cls = tile_class(m, n, batch, sms)
    if interpreting():
        # the interpreter runs programs one after another: few, large programs; 16 rows is tl.dot's minimum
        bm = min(128, max(16, next_pow2(m)))
        bn = min(128, max(16, next_pow2(n)))
        bk = min(128, max(16, next_pow2(k)))
        return MatmulConfig(bm, bn, bk, 8, 4, 1, subtile=4 if bn >= 64 else 2 if bn >= 32 else 1)
    if dtype == torch.float32:
        return MatmulConfig(16, 64, 64, 1, 4, 3) if cls == 0 else MatmulConfig(64, 64, 32, 8, 4, 3)
    if not tma:
        cls = min(cls, 3)
    return _CONFIGS[cls]


def _check(a: Tensor, b: Tensor, activation: str | None) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"matmul: activation must be one of {ACTIVATIONS}, got {activation!r}")
    if a.dim() != b.dim() or a.dim() not in (2, 3) or a.shape[-1] != b.shape[-2] or a.shape[:-2] != b.shape[:-2]:
        raise ValueError(f"matmul: cannot multiply {tuple(a.shape)} by {tuple(b.shape)}")
    if a.dtype != b.dtype:
        raise ValueError(f"matmul: a and b must share a dtype, got {a.dtype} and {b.dtype}")


def _readable(t: Tensor) -> Tensor:
    # The kernels read any strides, but only a view with a unit stride in one of its last two dims streams rows;
    # anything else (a stepped slice, a broadcast row) is copied once.
    if t.stride(-1) == 1 or t.stride(-2) == 1:
        return t
    return t.contiguous()


def _tma_stride(stride: int, size: int, element: int) -> int | None:
    # A TMA stride must be a positive multiple of 16 bytes; the stride of a size-1 dim is never used and may be
    # replaced.
    if size == 1:
        return 16 // element
    return stride if stride > 0 and (stride * element) % 16 == 0 else None


def _tma_layout(t: Tensor) -> tuple[list[int], list[int], bool] | None:
    """Shape and strides of a TMA descriptor over the [B, R, C] view ``t`` and whether it is over the transposed
    storage order [B, C, R] (a view with unit row stride); None when the view does not suit TMA."""
    if t.dtype not in _TMA_DTYPES or not aligned(t) or not descriptors_ok():
        return None
    nb, r, c = t.shape
    sb, sr, sc = t.stride()
    e = t.element_size()
    transposed = not (sc == 1 or c == 1) and (sr == 1 or r == 1)
    if transposed:
        r, c, sr = c, r, sc
    elif not (sc == 1 or c == 1):
        return None
    sb, sr = _tma_stride(sb, nb, e), _tma_stride(sr, r, e)
    if sb is None or sr is None or c * e < 16:
        return None
    return [nb, r, c], [sb, sr, 1], transposed


def matmul_fwd(
    a: Tensor, b: Tensor, bias: Tensor | None, activation: str | None, keep_pre: bool
) -> tuple[Tensor, Tensor | None]:
    """a: [M, K] or [B, M, K], b: [K, N] or [B, K, N], bias: [N] or None -> (y, z or None), [.., M, N] contiguous.

    y = act(a @ b + bias) in a's dtype; z = a @ b + bias in a's dtype when ``keep_pre`` and an activation is given.
    """
    return _bind_fwd(a, b, bias, activation, keep_pre)(a, b, bias, activation, keep_pre)


def _bind_fwd(a: Tensor, b: Tensor, bias: Tensor | None, activation: str | None, keep_pre: bool
              ) -> Callable[..., tuple[Tensor, Tensor | None]]:
    """The forward for arguments of this signature: its layouts, config, grid and tensor-descriptor blocks found
    once; ``run(a, b, bias, activation, keep_pre)``."""
    _check(a, b, activation)
    copy_a = not (a.stride(-1) == 1 or a.stride(-2) == 1)  # see _readable
    copy_b = not (b.stride(-1) == 1 or b.stride(-2) == 1)
    batched = a.dim() == 3
    a3 = _readable(a) if batched else _readable(a).unsqueeze(0)
    b3 = _readable(b) if batched else _readable(b).unsqueeze(0)
    nb, m, k = a3.shape
    n = b3.shape[2]
    dtype, device = a.dtype, a.device
    keep = keep_pre and activation is not None
    out_shape = (*a.shape[:-1], n)
    if nb * m * n == 0:
        def empty(a: Tensor, b: Tensor, bias: Tensor | None, activation: str | None, keep_pre: bool
                  ) -> tuple[Tensor, Tensor | None]:
            y = torch.empty(out_shape, dtype=dtype, device=device)
            return y, (torch.empty_like(y) if keep else None)
        return empty
    copy_bias = bias is not None and not bias.is_contiguous()
    act = activation or ""
    upcast = interpreting() and dtype == torch.bfloat16
    y_example = torch.empty((nb, m, n), dtype=dtype, device="meta")  # y's layout (a fresh buffer: aligned)
    layouts = [_tma_layout(t) for t in (a3, b3, y_example)]
    sms = num_sms(device)
    # TMA needs every operand in a suitable layout (y's rows: N a multiple of 8 elements), and K > 0. Decode rows
    # (tile class 0) take the pointer kernel: the same tiles, and no tensor descriptors to build per call (their
    # host time exceeds the kernel's GPU time there).
    tma = k > 0 and all(lay is not None for lay in layouts) and not layouts[2][2] and tile_class(m, n, nb, sms) > 0
    cfg = matmul_config(m, n, k, nb, dtype, sms, tma)
    tiles = nb * cdiv(m, cfg.block_m) * cdiv(n, cfg.block_n)
    meta = {"ACTIVATION": act, "KEEP_PRE": keep, "UPCAST": upcast, "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n,
            "BLOCK_K": cfg.block_k, "GROUP_M": cfg.group_m, "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}

    def operands(a: Tensor, b: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor, Tensor | None]:
        if copy_a:
            a = a.contiguous()
        if copy_b:
            b = b.contiguous()
        if copy_bias:
            bias = bias.contiguous()  # type: ignore[union-attr]
        return (a, b, bias) if batched else (a.unsqueeze(0), b.unsqueeze(0), bias)

    if tma:
        (a_shape, a_strides, a_t), (b_shape, b_strides, b_t), (y_shape, y_strides, _) = layouts
        a_block = [1, cfg.block_k, cfg.block_m] if a_t else [1, cfg.block_m, cfg.block_k]
        b_block = [1, cfg.block_n, cfg.block_k] if b_t else [1, cfg.block_k, cfg.block_n]
        out_block = [1, cfg.block_m, cfg.block_n // cfg.subtile]
        programs = max(1, min(tiles, sms * cfg.programs_per_sm))
        kt = Bound(_matmul_tma_kernel, (programs,), A_T=a_t, B_T=b_t, **meta, SUBTILE=cfg.subtile,
                   FLATTEN=cfg.flatten, NUM_PROGRAMS=programs, WARP_SPECIALIZE=cfg.warp_specialize)

        def run_tma(a: Tensor, b: Tensor, bias: Tensor | None, activation: str | None, keep_pre: bool
                    ) -> tuple[Tensor, Tensor | None]:
            a3, b3, bias = operands(a, b, bias)
            y = torch.empty((nb, m, n), dtype=dtype, device=device)
            y_desc = TensorDescriptor(y, y_shape, y_strides, out_block)
            z = torch.empty_like(y) if keep else None
            kt.go(TensorDescriptor(a3, a_shape, a_strides, a_block), TensorDescriptor(b3, b_shape, b_strides, b_block),
                  y_desc, TensorDescriptor(z, y_shape, y_strides, out_block) if keep else y_desc, bias, m, n, k, nb)
            return y.view(out_shape), None if z is None else z.view(out_shape)
        return run_tma
    strides = (*a3.stride(), *b3.stride())
    # (a symbolic K, the length in aᵀ @ dz: the masked K loop, no guard on its remainder)
    kp = Bound(_matmul_kernel, (tiles,), **meta, EVEN_K=type(k) is int and k % cfg.block_k == 0)

    def run(a: Tensor, b: Tensor, bias: Tensor | None, activation: str | None, keep_pre: bool
            ) -> tuple[Tensor, Tensor | None]:
        a3, b3, bias = operands(a, b, bias)
        y = torch.empty((nb, m, n), dtype=dtype, device=device)
        z = torch.empty_like(y) if keep else None
        kp.go(a3, b3, y, z if keep else y, bias, m, n, k, *strides)
        return y.view(out_shape), None if z is None else z.view(out_shape)
    return run


# Binder (see hkernels/runtime/plan.py): the same function for every call of one signature, set up once.
matmul_fwd.bind = _bind_fwd  # type: ignore[attr-defined]


def matmul_act_bwd(dy: Tensor, z: Tensor, activation: str) -> Tensor:
    """dy, z: [.., M, N] -> dz = dy·act'(z) in dy's dtype, [.., M, N] contiguous."""
    if activation not in ACTIVATIONS[1:]:
        raise ValueError(f"matmul_act_bwd: activation must be one of {ACTIVATIONS[1:]}, got {activation!r}")
    n = z.shape[-1]
    dy2 = dy.reshape(-1, n)
    z2 = z.reshape(-1, n)
    if dy2.stride(-1) != 1:
        dy2 = dy2.contiguous()
    if z2.stride(-1) != 1:
        z2 = z2.contiguous()
    r = z2.shape[0]
    dz = torch.empty((r, n), dtype=dy.dtype, device=dy.device)
    if dz.numel() == 0:
        return dz.view(z.shape)
    s = launch_settings(r, n, dy.device)
    launch(_matmul_act_bwd_kernel, (s.programs,),
        dy2, z2, dz, r, n, dy2.stride(0), z2.stride(0),
        ACTIVATION=activation, FAST_CDF=dy.dtype != torch.float32,
        BLOCK_M=s.block_m, BLOCK_N=s.block_n, num_warps=s.num_warps,
    )
    return dz.view(z.shape)
