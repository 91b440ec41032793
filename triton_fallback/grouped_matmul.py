"""Grouped matmul (the experts of a mixture of experts) in hand-written Triton: the twin of
``hkernels/ops/grouped_matmul.py``.

Math: x [T, K] holds E groups of rows in order, group e being rows starts[e] .. ends[e] (ends = cumsum of
group_sizes, clamped to [0, T]); weight [E, N, K] (each expert an nn.Linear weight). Then
    forward   y[rows_e] = x[rows_e] @ weight[e]ᵀ     [T, N]; rows past ends[E−1] get zeros
    backward  dx[rows_e] = dy[rows_e] @ weight[e]    (the forward's kernel, weight read as [E, K, N])
              dweight[e] = dy[rows_e]ᵀ @ x[rows_e]   [E, N, K]; zeros for an empty group

No host sync: the tile schedule is built on the device (a cumsum of the groups' tile counts) and the launch
covers its upper bound, cdiv(T, BLOCK_M) + E row tiles; a persistent grid walks the tiles that exist and finds
each tile's group by a binary search over the schedule.

Loads: from 1024 rows on, 16-bit operands whose layout allows it are read by TMA (host tensor descriptors); a
gathered operand of the weight gradient is first copied into group order for that. Smaller calls, float32 and
other layouts use pointer loads.

Work and traffic: 2·T·N·K flops forward (2× that backward). The forward reads each x row once per column tile and
each expert's weight once per row tile of that expert; the dweight kernel reads the group's rows of dy and x once
per (N, K) tile of that expert.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from hkernels.runtime.device import cdiv
from hkernels.runtime.interpret import interpreting
from hkernels.runtime.launch import aligned, descriptors_ok, launch
from hkernels.runtime.routing import group_ends, tile_ends
from triton_fallback._common import persistent_programs

Tensor = torch.Tensor
# traced at a symbolic length (see triton_fallback/rms_norm.py): tiles from the dtype, a persistent grid of a fixed
# count of programs at a symbolic T, the schedule built on the device
SYMBOLIC = frozenset({"grouped_matmul_fwd", "grouped_matmul_bwd"})


@triton.jit
def _group_of(tile, tile_ends, n, STEPS: tl.constexpr):
    # The first g in [0, n) with tile_ends[g] > tile (binary search over the schedule; STEPS = n.bit_length()).
    lo = 0
    hi = n
    for _ in tl.static_range(STEPS):
        active = lo < hi
        mid = (lo + hi) // 2
        past = tl.load(tile_ends + tl.minimum(mid, n - 1)) <= tile
        lo = tl.where(active & past, mid + 1, lo)
        hi = tl.where(active & (not past), mid, hi)
    return lo


@triton.jit
def _pair_tile(pair, ends_ptr, tile_ends_ptr, n_tiles, m_tiles, E,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr, STEPS: tl.constexpr):
    # (group e, the tile's rows, which rows are in the group, first column) of the pair-th (row tile, column
    # tile) pair. Pairs run in bands of GROUP_M row tiles, row tile fastest inside a band, so the programs running
    # at once share a band's rows of the A operand and a few column tiles of weight in L2 (an expert's weight is
    # read once per band, not once per row tile).
    band = pair // (GROUP_M * n_tiles)
    band_rows = tl.minimum(m_tiles - band * GROUP_M, GROUP_M)
    in_band = pair % (GROUP_M * n_tiles)
    tile = band * GROUP_M + in_band % band_rows
    n0 = (in_band // band_rows) * BLOCK_N
    e = _group_of(tile, tile_ends_ptr, E + 1, STEPS)
    first_tile = tl.where(e > 0, tl.load(tile_ends_ptr + e - 1, mask=e > 0, other=0), 0)
    start = tl.where(e > 0, tl.load(ends_ptr + e - 1, mask=e > 0, other=0), 0)
    end = tl.load(ends_ptr + e)
    rows = start + (tile - first_tile) * BLOCK_M + tl.arange(0, BLOCK_M)
    return e, rows, rows < end, n0


@triton.jit
def _grouped_matmul_fwd_kernel(
    x_ptr,  # [T, K], unit stride along K
    w_ptr,  # [E, N, K] by strides (any: the backward reads weight as [E, K, N])
    y_ptr,  # [T, N] out, contiguous
    ends_ptr,  # [E + 1] int32: ends[e] of group e, and T (the zero tail: group E, no weight)
    tile_ends_ptr,  # [E + 1] int32: cumsum of the groups' row tiles (the tail's included)
    T, N, K, E,
    stride_x, stride_we, stride_wn, stride_wk, stride_y,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    STEPS: tl.constexpr, UPCAST: tl.constexpr,
):
    # A persistent program walks (row tile, column tile) pairs (_pair_tile's order). Per pair: reads BLOCK_M rows
    # of x and BLOCK_N rows of weight[e] over K, writes BLOCK_M × BLOCK_N of y.
    n_tiles = tl.cdiv(N, BLOCK_N)
    m_tiles = tl.load(tile_ends_ptr + E)
    for pair in tl.range(tl.program_id(0), m_tiles * n_tiles, tl.num_programs(0)):
        e, rows, row_ok, n0 = _pair_tile(pair, ends_ptr, tile_ends_ptr, n_tiles, m_tiles, E,
                                         BLOCK_M, BLOCK_N, GROUP_M, STEPS)
        cols = n0 + tl.arange(0, BLOCK_N)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        if e < E:  # the tail (rows past the last group) stays zero
            x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_x
            w_rows = w_ptr + e.to(tl.int64) * stride_we + cols.to(tl.int64)[:, None] * stride_wn
            for k0 in range(0, K, BLOCK_K):
                ks = k0 + tl.arange(0, BLOCK_K)
                a = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & (ks < K)[None, :], other=0.0)
                b = tl.load(w_rows + ks[None, :].to(tl.int64) * stride_wk,
                            mask=(cols < N)[:, None] & (ks < K)[None, :], other=0.0)
                if UPCAST:  # interpret mode: the interpreter multiplies bf16 tiles' raw bits
                    a = a.to(tl.float32)
                    b = b.to(tl.float32)
                acc = tl.dot(a, tl.trans(b), acc, input_precision="ieee")
        y = y_ptr + rows.to(tl.int64)[:, None] * stride_y + cols[None, :]
        tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & (cols < N)[None, :])


@triton.jit
def _grouped_matmul_tma_kernel(
    x_desc,  # TMA descriptor over x [T, K], blocks [BLOCK_M, BLOCK_K]
    w_desc,  # TMA descriptor over the weight's storage [E·N_s, K_s] (B_T: blocks [BLOCK_K, BLOCK_N], else [BLOCK_N,
             # BLOCK_K])
    y_ptr,  # [T, N] out, contiguous
    ends_ptr, tile_ends_ptr,  # the schedule (see schedule())
    T, N, K, E, ROWS_PER_EXPERT,  # ROWS_PER_EXPERT: N_s, the storage rows of one expert
    stride_y,
    B_T: tl.constexpr,  # the weight is a transposed view [E, K, N] of storage [E, N_s = K, K_s = N] (the dx path)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    STEPS: tl.constexpr, UPCAST: tl.constexpr,
):
    # The pointer kernel's schedule with TMA loads. A block may run past its group's rows (other groups' rows:
    # their products land in rows the masked store drops), past an expert's weight rows into the next expert's
    # (columns the store drops; the transposed weight of the dx path is read only where K is a multiple of
    # BLOCK_K, so a K step never reaches the next expert), or past the tensors' ends (zero-filled).
    n_tiles = tl.cdiv(N, BLOCK_N)
    m_tiles = tl.load(tile_ends_ptr + E)
    for pair in tl.range(tl.program_id(0), m_tiles * n_tiles, tl.num_programs(0)):
        e, rows, row_ok, n0 = _pair_tile(pair, ends_ptr, tile_ends_ptr, n_tiles, m_tiles, E,
                                         BLOCK_M, BLOCK_N, GROUP_M, STEPS)
        cols = n0 + tl.arange(0, BLOCK_N)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        if e < E:
            row0 = tl.min(rows, axis=0)
            for k0 in range(0, K, BLOCK_K):
                a = x_desc.load([row0, k0])
                if B_T:
                    b = w_desc.load([e * ROWS_PER_EXPERT + k0, n0])
                else:
                    b = tl.trans(w_desc.load([e * ROWS_PER_EXPERT + n0, k0]))
                if UPCAST:
                    a = a.to(tl.float32)
                    b = b.to(tl.float32)
                acc = tl.dot(a, b, acc, input_precision="ieee")
        y = y_ptr + rows.to(tl.int64)[:, None] * stride_y + cols[None, :]
        tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & (cols < N)[None, :])


@triton.jit
def _dweight_rows(ptr, desc, rows_ptr, m0, end, c0, C, stride,
                  BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, GATHER: tl.constexpr, TMA: tl.constexpr,
                  MASKED: tl.constexpr):
    # BLOCK_M rows from m0 (row r read at rows_ptr[r] where GATHER) × BLOCK_C columns from c0 of one operand.
    # TMA: a full block of rows inside the group (MASKED is then False: rows past the group end are never read).
    if TMA and not MASKED:
        return desc.load([m0, c0])
    rows = m0 + tl.arange(0, BLOCK_M)
    cols = c0 + tl.arange(0, BLOCK_C)
    row_ok = rows < end
    src = rows
    if GATHER:
        src = tl.load(rows_ptr + rows, mask=row_ok, other=0)
    return tl.load(ptr + src.to(tl.int64)[:, None] * stride + cols[None, :],
                   mask=row_ok[:, None] & (cols < C)[None, :], other=0.0)


@triton.jit
def _grouped_matmul_dweight_kernel(
    dy_ptr,  # [*, N], unit stride along N: row r of the group is dy row dy_rows[r] (or r)
    x_ptr,  # [*, K], unit stride along K: row r is x row x_rows[r] (or r)
    dy_desc, x_desc,  # TMA descriptors over dy and x (blocks [BLOCK_M, BLOCK_N], [BLOCK_M, BLOCK_K]) where DY_TMA,
                      # X_TMA; the pointers otherwise
    dy_rows_ptr, x_rows_ptr,  # [T] int32 gathers (read where DY_GATHER / X_GATHER)
    dw_ptr,  # [E, N, K] out, unit stride along K
    ends_ptr,  # [E + 1] int32 (see the forward)
    N, K,
    stride_dy, stride_x, stride_dwe, stride_dwn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_N: tl.constexpr,
    DY_GATHER: tl.constexpr, X_GATHER: tl.constexpr, DY_TMA: tl.constexpr, X_TMA: tl.constexpr,
    UPCAST: tl.constexpr,
):
    # One program: expert e, a BLOCK_N × BLOCK_K tile of dweight[e]; reads the group's rows of dy and x once
    # (BLOCK_M at a time), writes the tile once (zeros for an empty group). An expert's tiles run in bands of
    # GROUP_N row tiles, row tile fastest: the programs running at once read a few column stripes of dy and x's
    # group rows, which stay in L2, instead of all of x's columns per row tile of dy.
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    per_e = n_tiles * k_tiles
    e = pid // per_e
    tile = pid % per_e
    band = tile // (GROUP_N * k_tiles)
    band_rows = tl.minimum(n_tiles - band * GROUP_N, GROUP_N)
    in_band = tile % (GROUP_N * k_tiles)
    n0 = (band * GROUP_N + in_band % band_rows) * BLOCK_N
    k0 = (in_band // band_rows) * BLOCK_K
    start = tl.where(e > 0, tl.load(ends_ptr + e - 1, mask=e > 0, other=0), 0)
    end = tl.load(ends_ptr + e)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    full = start + (end - start) // BLOCK_M * BLOCK_M
    for m0 in range(start, full, BLOCK_M):  # whole blocks of the group's rows: no row mask
        g = _dweight_rows(dy_ptr, dy_desc, dy_rows_ptr, m0, end, n0, N, stride_dy, BLOCK_M, BLOCK_N,
                          DY_GATHER, DY_TMA, False)
        a = _dweight_rows(x_ptr, x_desc, x_rows_ptr, m0, end, k0, K, stride_x, BLOCK_M, BLOCK_K,
                          X_GATHER, X_TMA, False)
        if UPCAST:  # interpret mode: the interpreter multiplies bf16 tiles' raw bits
            g = g.to(tl.float32)
            a = a.to(tl.float32)
        acc = tl.dot(tl.trans(g), a, acc, input_precision="ieee")
    if full < end:  # the group's last rows, masked
        g = _dweight_rows(dy_ptr, dy_desc, dy_rows_ptr, full, end, n0, N, stride_dy, BLOCK_M, BLOCK_N,
                          DY_GATHER, DY_TMA, True)
        a = _dweight_rows(x_ptr, x_desc, x_rows_ptr, full, end, k0, K, stride_x, BLOCK_M, BLOCK_K,
                          X_GATHER, X_TMA, True)
        if UPCAST:
            g = g.to(tl.float32)
            a = a.to(tl.float32)
        acc = tl.dot(tl.trans(g), a, acc, input_precision="ieee")
    cols = n0 + tl.arange(0, BLOCK_N)
    ks = k0 + tl.arange(0, BLOCK_K)
    dw = dw_ptr + e.to(tl.int64) * stride_dwe + cols.to(tl.int64)[:, None] * stride_dwn + ks[None, :]
    tl.store(dw, acc.to(dw_ptr.dtype.element_ty), mask=(cols < N)[:, None] & (ks < K)[None, :])


# Launch settings per kernel kind for 16-bit inputs on a GPU: (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, warps, stages).
# BLOCK_M is the schedule's row tile, the same for every kind (one schedule serves a call's kernels). From a sweep
# at Mixtral's and Qwen3-MoE's shapes (bench/results/h200): "fwd" the grouped product, "dweight" the weight
# gradient (BLOCK_M is then its reduction step: rows read per iteration, GROUP_M its band of row tiles of
# dweight), "pair" the moe kernels with two
# accumulators (gate and up) or an epilogue that reads two more tiles.
_GPU = {"fwd": (128, 256, 64, 8, 8, 3), "dweight": (64, 128, 256, 8, 8, 3), "pair": (128, 128, 64, 8, 8, 3)}


# TMA loads (host descriptors, which take Triton's slower launch path) from this many rows of the A operand on.
_TMA = True
_TMA_ROWS = 1024
# A gathered operand of the weight gradient this large (bytes) is copied into group order a quarter at a time.
_SLICED_COPY = 32 * 2**20


def _tma_size(rows: int) -> bool:
    # (a symbolic row count is a compiled graph's, where tiles load through pointers)
    return _TMA and type(rows) is int and (rows >= _TMA_ROWS or interpreting())


def _settings(dtype: torch.dtype, kind: str = "fwd") -> tuple[int, int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, warps, stages) of ``kind`` (see _GPU). Interpreter: small tiles
    (two-tile bands, so a band crossing a group boundary is tested); float32 (no tensor cores): small tiles too."""
    if interpreting():
        return 16, 32, 32, 2, 4, 1
    if dtype == torch.float32:
        return 32, 32, 32, 8, 4, 2
    return _GPU[kind]


def _upcast(dtype: torch.dtype) -> bool:
    return interpreting() and dtype == torch.bfloat16


def schedule(group_sizes: Tensor, T: int, block_m: int) -> tuple[Tensor, Tensor]:
    """(ends [E + 1], tile_ends [E + 1]) int32 on the device, no sync: each group's end row (sizes clamped at 0,
    ends at T) with T appended (the zero tail past the last group), and the cumsum of each group's row tiles."""
    ends = group_ends(group_sizes, T)
    return ends, tile_ends(ends, block_m)


def _tma_weight(x: Tensor, weight: Tensor) -> tuple[Tensor, bool] | None:
    """(the weight's storage as [E·N_s, K_s], whether weight is its transposed view) when x and the weight suit
    TMA (16-bit, contiguous storage, 16-byte aligned rows), else None."""
    if x.dtype not in (torch.float16, torch.bfloat16) or weight.dtype != x.dtype or not descriptors_ok():
        return None
    if x.stride(1) != 1 or x.stride(0) < x.shape[1] or (x.stride(0) * 2) % 16 or not aligned(x) \
            or not aligned(weight):  # rows that overlap (an expanded x: stride 0) go by pointer
        return None
    if weight.is_contiguous():
        storage, b_t = weight, False
    elif weight.transpose(1, 2).is_contiguous():
        storage, b_t = weight.transpose(1, 2), True
    else:
        return None
    if (storage.shape[2] * 2) % 16:
        return None
    return storage.reshape(-1, storage.shape[2]), b_t


def fwd_into(x: Tensor, weight: Tensor, y: Tensor, ends: Tensor, tile_ends: Tensor) -> Tensor:
    """y[rows of group e] = x[rows] @ weight[e]ᵀ on a schedule from :func:`schedule` (built with _settings'
    BLOCK_M for x's dtype); y [T, N] contiguous. TMA loads where the layouts allow (:func:`_tma_weight`)."""
    T, K = x.shape
    E, N, _ = weight.shape
    bm, bn, bk, group_m, warps, stages = _settings(x.dtype)
    programs = (cdiv(T, bm) + E + 1) * cdiv(N, bn)  # the most (row tile, column tile) pairs there can be
    if not interpreting():  # (persistent: at a symbolic T, the full count, each walking the tiles that exist)
        programs = persistent_programs(x.device, programs)
    tma = _tma_weight(x, weight) if K and _tma_size(T) else None
    if tma is not None and tma[1] and K % bk:  # transposed storage: a K tail would read the next expert's rows
        tma = None
    if tma is not None:
        storage, b_t = tma
        x_desc = TensorDescriptor(x, [T, K], [x.stride(0), 1], [bm, bk])
        w_block = [bk, bn] if b_t else [bn, bk]
        w_desc = TensorDescriptor(storage, list(storage.shape), [storage.stride(0), 1], w_block)
        launch(_grouped_matmul_tma_kernel, (programs,),
            x_desc, w_desc, y, ends, tile_ends, T, N, K, E, storage.shape[0] // E, y.stride(0),
            B_T=b_t, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group_m, STEPS=(E + 1).bit_length(),
            UPCAST=_upcast(x.dtype), num_warps=warps, num_stages=stages,
        )
        return y
    launch(_grouped_matmul_fwd_kernel, (programs,),
        x, weight, y, ends, tile_ends, T, N, K, E,
        x.stride(0), *weight.stride(), y.stride(0),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group_m, STEPS=(E + 1).bit_length(), UPCAST=_upcast(x.dtype),
        num_warps=warps, num_stages=stages,
    )
    return y


def _tma_rows(t: Tensor, block: list[int]) -> TensorDescriptor | None:
    """A TMA descriptor over the 2-D t (16-bit, unit column stride, rows that do not overlap, 16-byte aligned base
    and rows) with the given block, else None."""
    if t.dtype not in (torch.float16, torch.bfloat16) or not descriptors_ok() or t.stride(1) != 1 \
            or t.stride(0) < t.shape[1] \
            or (t.stride(0) * 2) % 16 or not aligned(t) or (t.shape[1] * 2) % 16:
        return None
    return TensorDescriptor(t, list(t.shape), [t.stride(0), 1], block)


def dweight_into(dy: Tensor, x: Tensor, dw: Tensor, ends: Tensor, dy_rows: Tensor | None = None,
                 x_rows: Tensor | None = None) -> Tensor:
    """dw[e] = dy[rows of e]ᵀ @ x[rows of e] (float32 accumulation), where row r of a group reads dy row
    dy_rows[r] and x row x_rows[r] when those gathers are given; dw [E, N, K], unit stride along K. TMA loads for
    operands read in order whose layout allows it."""
    _, N, K = dw.shape
    if not dw.numel():
        return dw
    rows = dy_rows.numel() if dy_rows is not None else x_rows.numel() if x_rows is not None else dy.shape[0]
    if _tma_size(rows) and x.dtype in (torch.float16, torch.bfloat16):
        # A gathered operand is copied into group order first, so that TMA reads it: the copy moves rows·cols
        # elements, far less time than the rows·N·K product it speeds up. Large copies go a column slice at a time
        # (a slice of dw each), so the copy adds a quarter of the operand to the backward's peak memory.
        for which, gathered, rows_of, cols in ((1, dy, dy_rows, N), (2, x, x_rows, K)):
            if rows_of is None or (cols * 2) % 16:
                continue
            block = _settings(x.dtype, "dweight")[which]  # BLOCK_N for dy's columns, BLOCK_K for x's
            parts = 4 if rows * cols * gathered.element_size() >= _SLICED_COPY else 2 if interpreting() else 1
            width = cdiv(cdiv(cols, parts), block) * block
            for c0 in range(0, cols, width):
                part = gathered[:, c0:c0 + width].index_select(0, rows_of)
                if which == 1:
                    _dweight(part, x, dw[:, c0:c0 + width], ends, None, x_rows)
                else:
                    _dweight(dy, part, dw[:, :, c0:c0 + width], ends, dy_rows, None)
                del part  # before the next slice's copy: one slice alive at a time
            return dw
    return _dweight(dy, x, dw, ends, dy_rows, x_rows)


def _dweight(dy: Tensor, x: Tensor, dw: Tensor, ends: Tensor, dy_rows: Tensor | None, x_rows: Tensor | None
             ) -> Tensor:
    E, N, K = dw.shape
    bm, bn, bk, group_n, warps, stages = _settings(x.dtype, "dweight")
    rows = dy_rows.numel() if dy_rows is not None else dy.shape[0]
    big = _tma_size(rows)
    dy_desc = _tma_rows(dy, [bm, bn]) if big and dy_rows is None else None
    x_desc = _tma_rows(x, [bm, bk]) if big and x_rows is None else None
    launch(_grouped_matmul_dweight_kernel, (E * cdiv(N, bn) * cdiv(K, bk),),
        dy, x, dy if dy_desc is None else dy_desc, x if x_desc is None else x_desc,
        dy_rows if dy_rows is not None else ends, x_rows if x_rows is not None else ends, dw, ends,
        N, K, dy.stride(0), x.stride(0), dw.stride(0), dw.stride(1),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_N=group_n, DY_GATHER=dy_rows is not None,
        X_GATHER=x_rows is not None, DY_TMA=dy_desc is not None, X_TMA=x_desc is not None,
        UPCAST=_upcast(x.dtype), num_warps=warps, num_stages=stages,
    )
    return dw


def grouped_matmul_fwd(x: Tensor, weight: Tensor, group_sizes: Tensor) -> Tensor:
    """x [T, K] (unit stride along K), weight [E, N, K] (any strides), group_sizes [E] integer on x's device ->
    y [T, N] contiguous in x's dtype; rows past the groups' sum are zeros."""
    T = x.shape[0]
    y = torch.empty((T, weight.shape[1]), dtype=x.dtype, device=x.device)
    if y.numel() == 0:
        return y
    ends, tile_ends = schedule(group_sizes, T, _settings(x.dtype)[0])
    return fwd_into(x, weight, y, ends, tile_ends)


def grouped_matmul_bwd(dy: Tensor, x: Tensor, weight: Tensor, group_sizes: Tensor, need_x: bool, need_weight: bool
                       ) -> tuple[Tensor | None, Tensor | None]:
    """dy [T, N], x [T, K], weight [E, N, K] -> (dx [T, K] or None, dweight [E, N, K] float32-accumulated in
    weight's dtype, or None)."""
    T = x.shape[0]
    ends, tile_ends = schedule(group_sizes, T, _settings(x.dtype)[0])
    dx = None
    if need_x:
        dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        if dx.numel():
            fwd_into(dy, weight.transpose(1, 2), dx, ends, tile_ends)
    dw = dweight_into(dy, x, torch.empty(weight.shape, dtype=weight.dtype, device=weight.device), ends) \
        if need_weight else None
    return dx, dw
