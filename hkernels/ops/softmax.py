"""Softmax over the last dim in Helion (the twin of ``triton_fallback/softmax.py``).

Math, per row:  y = exp(x − max x) / Σ exp(x − max x).  Backward:  dx = y·(dy − Σ dy·y).

Bytes for x: [M, N] of b-byte elements: forward reads and writes M·N·b; backward reads dy and y, writes dx.
Rows that fit a block of registers (N ≤ MAX_RESIDENT_FWD forward, MAX_RESIDENT_BWD backward) are read once by
the resident kernels. Longer rows are split into chunks walked twice by a persistent grid (the design is
``triton_fallback/_split.py``'s; the Helion side is ``hkernels/ops/_split.py``): phase 1 reads a chunk and writes
its partials (forward: its max and Σ exp(x − max); backward: its Σ dy·y), phase 2 combines the row's partials and
reads the chunk again, from L2, to write y or dx. So these rows too cross the memory bus once each way.
"""

from __future__ import annotations

from collections.abc import Callable

import helion
import helion.language as hl
import torch
import triton

from hkernels.ops import _helion, _split
from hkernels.ops.swiglu import int64_twin, spans_past_int32

Tensor = torch.Tensor
# The longest rows kept in registers (the configs' resident buckets); longer rows take the split kernels.
MAX_RESIDENT_FWD = 32768
MAX_RESIDENT_BWD = 16384

# The custom ops whose launches these host functions record at a symbolic row count (see hkernels/ops/rms_norm.py),
# for resident rows (symbolic_ok): the split kernels' walk is planned from the row count.
SYMBOLIC = frozenset({"softmax_fwd", "softmax_bwd"})


def symbolic_ok(name: str, tensors: tuple[Tensor, ...]) -> bool:
    """Whether the call of custom op ``name`` on ``tensors`` traces at a symbolic length: its rows are resident."""
    return int(tensors[0].shape[-1]) <= (MAX_RESIDENT_BWD if name == "softmax_bwd" else MAX_RESIDENT_FWD)


@helion.kernel(static_shapes=False)
def _softmax_fwd(x: Tensor, like: Tensor) -> Tensor:
    # Resident rows: x: [M, N] -> y [M, N] in like's dtype (x's, or wider); reads x once.
    m, n = x.size()
    n = hl.specialize(n)
    y = torch.empty([m, n], dtype=like.dtype, device=x.device)
    for tile_m in hl.tile(m):
        xf = x[tile_m, :].to(torch.float32)
        e = torch.exp(xf - torch.amax(xf, dim=-1)[:, None])
        y[tile_m, :] = (e / torch.sum(e, dim=-1)[:, None]).to(y.dtype)
    return y


@helion.kernel(static_shapes=False, autotune_config_overrides=_split.TUNE_OVERRIDES)
def _softmax_fwd_split(x: Tensor, like: Tensor, programs: int, lag: int, block: hl.constexpr) -> Tensor:
    # Long rows, split (see hkernels/ops/_split.py): x [M, N] -> y [M, N] in like's dtype; chunks of ``block``
    # elements walked by ``programs`` programs, phase 2 ``lag`` steps behind phase 1.
    m, n = x.size()
    n = hl.specialize(n)
    chunks = (n + block - 1) // block
    y = torch.empty([m, n], dtype=like.dtype, device=x.device)
    slots = torch.full([m, chunks], -1, dtype=torch.int64, device=x.device)  # per chunk (max, Σ exp(x − max))
    items = m * chunks
    for pid in hl.grid(programs):
        mine = (items - pid + programs - 1) // programs
        for step in hl.grid(mine + lag):
            if step < mine:
                # Phase 1: read the chunk (kept in L2 for phase 2), publish its max and sum.
                item = pid + step * programs
                row = item // chunks
                chunk = item % chunks
                cols = chunk * block + hl.arange(block)
                xf = hl.load(x, [row, cols], extra_mask=cols < n, eviction_policy="evict_last")
                xf = torch.where(cols < n, xf.to(torch.float32), float("-inf"))
                chunk_max = torch.amax(xf, dim=0)
                # A chunk of -inf only (masked lanes past N included) shifts by 0: no inf − inf = NaN in its sum.
                shift = torch.where(chunk_max == float("-inf"), 0.0, chunk_max)
                # One 64-bit store publishes both; a NaN max is written as the canonical NaN (never "empty").
                hi = torch.where(chunk_max != chunk_max, float("nan"), chunk_max).view(torch.int32).to(torch.int64)
                lo = torch.sum(torch.exp(xf - shift), dim=0).view(torch.int32).to(torch.int64)
                slots[row, chunk] = (hi << 32) | (lo & 0xFFFFFFFF)
            if step >= lag:
                # Phase 2: the chunk again (from L2); the row's max and sum from its slots, read until none is
                # empty; y out.
                item2 = pid + (step - lag) * programs
                row2 = item2 // chunks
                cols2 = (item2 % chunks) * block + hl.arange(block)
                x_again = hl.load(x, [row2, cols2], extra_mask=cols2 < n, eviction_policy="evict_first")
                k = hl.arange(triton.next_power_of_2(chunks))
                k_in = torch.clamp_max(k, chunks - 1)  # lanes past the last chunk read it again (masked out below)
                bits = hl.atomic_add(slots, [row2, k_in], 0)
                while torch.sum(((bits == -1) & (k < chunks)).to(torch.int32)) > 0:
                    bits = hl.atomic_add(slots, [row2, k_in], 0)
                max_k = torch.where(k < chunks, (bits >> 32).to(torch.int32).view(torch.float32), float("-inf"))
                sum_k = torch.where(k < chunks, bits.to(torch.int32).view(torch.float32), 0.0)
                row_max = torch.amax(max_k, dim=0)
                shift = torch.where(row_max == float("-inf"), 0.0, row_max)
                inv_sum = 1.0 / torch.sum(sum_k * torch.exp(max_k - shift), dim=0)
                yf = torch.exp(x_again.to(torch.float32) - row_max) * inv_sum
                hl.store(y, [row2, cols2], yf.to(y.dtype), extra_mask=cols2 < n)
    return y


@helion.kernel(static_shapes=False)
def _softmax_bwd(dy: Tensor, y: Tensor, like: Tensor) -> Tensor:
    # Resident rows: dy, y: [M, N] -> dx [M, N] in like's dtype (y's, or narrower); reads dy and y once.
    m, n = y.size()
    n = hl.specialize(n)
    dx = torch.empty([m, n], dtype=like.dtype, device=y.device)
    for tile_m in hl.tile(m):
        yf = y[tile_m, :].to(torch.float32)
        dyf = dy[tile_m, :].to(torch.float32)
        dx[tile_m, :] = (yf * (dyf - torch.sum(dyf * yf, dim=-1)[:, None])).to(dx.dtype)
    return dx


@helion.kernel(static_shapes=False, autotune_config_overrides=_split.TUNE_OVERRIDES)
def _softmax_bwd_split(dy: Tensor, y: Tensor, like: Tensor, programs: int, lag: int, block: hl.constexpr
                       ) -> Tensor:
    # Long rows, split (see hkernels/ops/_split.py): dy, y [M, N] -> dx [M, N] in like's dtype; chunks of
    # ``block`` elements walked by ``programs`` programs, phase 2 ``lag`` steps behind phase 1.
    m, n = y.size()
    n = hl.specialize(n)
    chunks = (n + block - 1) // block
    dx = torch.empty([m, n], dtype=like.dtype, device=y.device)
    slots = torch.full([m, chunks], -1, dtype=torch.int64, device=y.device)  # per chunk (Σ dy·y, 0)
    items = m * chunks
    for pid in hl.grid(programs):
        mine = (items - pid + programs - 1) // programs
        for step in hl.grid(mine + lag):
            if step < mine:
                # Phase 1: read the chunk of dy and of y (kept in L2 for phase 2), publish its Σ dy·y.
                item = pid + step * programs
                row = item // chunks
                chunk = item % chunks
                cols = chunk * block + hl.arange(block)
                dyf = hl.load(dy, [row, cols], extra_mask=cols < n, eviction_policy="evict_last").to(torch.float32)
                yf = hl.load(y, [row, cols], extra_mask=cols < n, eviction_policy="evict_last").to(torch.float32)
                # One 64-bit store publishes it; a NaN is written as the canonical NaN (never "empty").
                dot = torch.sum(dyf * yf, dim=0)
                slots[row, chunk] = torch.where(dot != dot, float("nan"), dot).view(torch.int32).to(torch.int64) << 32
            if step >= lag:
                # Phase 2: both chunks again (from L2); the row's Σ dy·y from its slots, read until none is empty;
                # dx out.
                item2 = pid + (step - lag) * programs
                row2 = item2 // chunks
                cols2 = (item2 % chunks) * block + hl.arange(block)
                dy_again = hl.load(dy, [row2, cols2], extra_mask=cols2 < n, eviction_policy="evict_first")
                y_again = hl.load(y, [row2, cols2], extra_mask=cols2 < n, eviction_policy="evict_first")
                k = hl.arange(triton.next_power_of_2(chunks))
                k_in = torch.clamp_max(k, chunks - 1)  # lanes past the last chunk read it again (masked out below)
                bits = hl.atomic_add(slots, [row2, k_in], 0)
                while torch.sum(((bits == -1) & (k < chunks)).to(torch.int32)) > 0:
                    bits = hl.atomic_add(slots, [row2, k_in], 0)
                dot = torch.sum(torch.where(k < chunks, (bits >> 32).to(torch.int32).view(torch.float32), 0.0), dim=0)
                dxf = y_again.to(torch.float32) * (dy_again.to(torch.float32) - dot)
                hl.store(dx, [row2, cols2], dxf.to(dx.dtype), extra_mask=cols2 < n)
    return dx


def softmax_fwd(x: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """x: [M, N] (unit column stride) -> softmax over N, [M, N] in ``dtype`` (default x.dtype)."""
    return _bind_fwd(x, dtype)(x, dtype)


def softmax_bwd(dy: Tensor, y: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """dy, y: [M, N] -> dx [M, N] in ``dtype`` (default y.dtype)."""
    return _bind_bwd(dy, y, dtype)(dy, y, dtype)


_split.KERNELS.update(k.name for k in (_softmax_fwd_split, _softmax_bwd_split))

# The same kernels with 64-bit indices, for rows that reach past 2^31 elements (a row-strided view of a large
# tensor: Helion picks 32-bit indices by element count).
_WIDE = {
    **{k.name: int64_twin(k) for k in (_softmax_fwd, _softmax_bwd)},
    **{k.name: helion.kernel(k.fn, static_shapes=False, index_dtype=torch.int64,
                             autotune_config_overrides=_split.TUNE_OVERRIDES)
       for k in (_softmax_fwd_split, _softmax_bwd_split)},
}


def _kernel(kernel: helion.Kernel, *tensors: Tensor) -> helion.Kernel:
    return _WIDE[kernel.name] if any(spans_past_int32(t) for t in tensors) else kernel


def _bind_fwd(x: Tensor, out: torch.dtype | None = None) -> Callable[..., Tensor]:
    M, N = x.shape
    like = _helion.like(out or x.dtype, x.device)
    if N <= MAX_RESIDENT_FWD:
        fn, launcher = _helion.bind(_kernel(_softmax_fwd, x), (x, like), N, x.device)
        return lambda x, out=None: fn(x, like, _launcher=launcher)
    walk = _split.walk(_softmax_fwd_split, M, N, x.device, x.dtype)
    programs, lag, block = walk.programs, walk.lag, walk.block
    fn = _helion.bind(_kernel(_softmax_fwd_split, x), (x, like, programs, lag, block), N, x.device)[0]
    split_launcher = _split.bound_launcher(walk.per_sm)
    return lambda x, out=None: fn(x, like, programs, lag, block, _launcher=split_launcher)


def _bind_bwd(dy: Tensor, y: Tensor, out: torch.dtype | None = None) -> Callable[..., Tensor]:
    M, N = y.shape
    like = _helion.like(out or y.dtype, y.device)
    if N <= MAX_RESIDENT_BWD:
        fn, launcher = _helion.bind(_kernel(_softmax_bwd, dy, y), (dy, y, like), N, y.device)
        return lambda dy, y, out=None: fn(dy, y, like, _launcher=launcher)
    walk = _split.walk(_softmax_bwd_split, M, N, y.device, y.dtype)
    programs, lag, block = walk.programs, walk.lag, walk.block
    fn = _helion.bind(_kernel(_softmax_bwd_split, dy, y), (dy, y, like, programs, lag, block), N, y.device)[0]
    split_launcher = _split.bound_launcher(walk.per_sm)
    return lambda dy, y, out=None: fn(dy, y, like, programs, lag, block, _launcher=split_launcher)


# Binders (see hkernels/runtime/plan.py): the same function for every call of one signature, set up once.
softmax_fwd.bind = _bind_fwd  # type: ignore[attr-defined]
softmax_bwd.bind = _bind_bwd  # type: ignore[attr-defined]
