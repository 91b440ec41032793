"""The experts of a SwiGLU mixture-of-experts layer in hand-written Triton: the twin of ``hkernels/ops/moe.py``.

Math: x [T, H], gate_up [E, 2I, H] (gate rows, then up rows), down [E, H, I], topk_ids / topk_weights [T, k]. The
T·k (token, slot) pairs are sorted by expert (ids outside [0, E) last: they select nothing); sorted row r is token
src[r] = order[r] // k with weight w_r = topk_weights.flat[order[r]], and pos is the inverse of order. Then

    forward   (g, u) = x[src] @ gate_upᵀ[e]      pre [T·k, 2I] (kept for the backward when a gradient is wanted)
              h = silu(g) · u                     [T·k, I]       (the first matmul's epilogue)
              y = h @ downᵀ[e]                    [T·k, H]
              out[t] = Σ_j w · y[pos[t, j]]       [T, H]         (the combine: k rows per token, float32 sum)
    backward  dh' = dout[src] @ down[e]           [T·k, I]
              dw_r = Σ_i dh'·h                    the routing weight's gradient (float32 atomics across I tiles)
              dg = w·dh'·u·σ(g)(1 + g(1 − σ(g))), du = w·dh'·silu(g)    d_pre [T·k, 2I]   (dh' matmul's epilogue,
              hw = w·h (recomputed from pre)      [T·k, I]                                  with hw and dw_r)
              ddown[e] = dout[src]ᵀ @ hw          [E, H, I]
              dx[t] = Σ_j (d_pre @ gate_up[e])[pos[t, j]]                [T, H]
              dgate_up[e] = d_preᵀ @ x[src]       [E, 2I, H]

Flops: 6·T·k·H·I forward, 12·T·k·H·I backward. No host sync: the routing is sorted and counted on the device and
the grouped kernels walk an on-device tile schedule (``triton_fallback/grouped_matmul.py``). Activations kept for
the backward: pre (2I per sorted row, 16-bit) and the routing's int32 indices; y and h are not kept.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from hkernels.runtime import plan as _plan
from hkernels.runtime.device import cdiv
from hkernels.runtime.interpret import interpreting
from hkernels.runtime.launch import launch
from hkernels.runtime.routing import ROUTE_MAX, routing, tile_ends
from triton_fallback._common import persistent_programs
from triton_fallback.grouped_matmul import (
    _pair_tile,
    _settings,
    _tma_rows,
    _tma_size,
    _upcast,
    dweight_into,
    fwd_into,
)

Tensor = torch.Tensor
# traced at a symbolic length (see triton_fallback/rms_norm.py): routed by a sort on the device, persistent grids of
# a fixed count of programs, tiles from the dtype
SYMBOLIC = frozenset({"moe_fwd", "moe_bwd"})


@triton.jit
def _moe_up_kernel(
    x_ptr,  # [T, H], unit stride along H
    w_ptr,  # [E, 2I, H] gate_up by strides
    w_desc,  # where W_TMA: a TMA descriptor over gate_up's storage [E·2I, H], blocks [BLOCK_N, BLOCK_K]
    src_ptr,  # [T·k] int32: the token of each sorted row
    pre_ptr,  # [T·k, 2I] out (written where SAVE_PRE): g, then u
    h_ptr,  # [T·k, I] out: silu(g) · u
    ends_ptr, tile_ends_ptr,  # the schedule (grouped_matmul.schedule)
    I, H, E,  # noqa: E741
    stride_x, stride_we, stride_wn, stride_wk,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    STEPS: tl.constexpr, SAVE_PRE: tl.constexpr, W_TMA: tl.constexpr, UPCAST: tl.constexpr,
):
    # Per (row tile, column tile of I): reads BLOCK_M gathered rows of x and BLOCK_N gate and up rows of
    # gate_up[e] over H; writes h (and g, u) for the tile. Rows past the last group (ids out of range) get zeros.
    n_tiles = tl.cdiv(I, BLOCK_N)
    m_tiles = tl.load(tile_ends_ptr + E)
    for pair in tl.range(tl.program_id(0), m_tiles * n_tiles, tl.num_programs(0)):
        e, rows, row_ok, n0 = _pair_tile(pair, ends_ptr, tile_ends_ptr, n_tiles, m_tiles, E,
                                         BLOCK_M, BLOCK_N, GROUP_M, STEPS)
        cols = n0 + tl.arange(0, BLOCK_N)
        col_ok = cols < I
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        if e < E:
            src = tl.load(src_ptr + rows, mask=row_ok, other=0)
            x_rows = x_ptr + src.to(tl.int64)[:, None] * stride_x
            w_gate = w_ptr + e.to(tl.int64) * stride_we + cols.to(tl.int64)[:, None] * stride_wn
            w_up = w_ptr + e.to(tl.int64) * stride_we + (cols + I).to(tl.int64)[:, None] * stride_wn
            for k0 in range(0, H, BLOCK_K):
                ks = k0 + tl.arange(0, BLOCK_K)
                k_ok = (ks < H)[None, :]
                a = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & k_ok, other=0.0)
                if W_TMA:  # rows past I (or past the expert) give columns the stores drop; past H zeros
                    bg = w_desc.load([e * 2 * I + n0, k0])
                    bu = w_desc.load([e * 2 * I + I + n0, k0])
                else:
                    bg = tl.load(w_gate + ks[None, :].to(tl.int64) * stride_wk, mask=col_ok[:, None] & k_ok,
                                 other=0.0)
                    bu = tl.load(w_up + ks[None, :].to(tl.int64) * stride_wk, mask=col_ok[:, None] & k_ok,
                                 other=0.0)
                if UPCAST:  # interpret mode: the interpreter multiplies bf16 tiles' raw bits
                    a = a.to(tl.float32)
                    bg = bg.to(tl.float32)
                    bu = bu.to(tl.float32)
                acc_g = tl.dot(a, tl.trans(bg), acc_g, input_precision="ieee")
                acc_u = tl.dot(a, tl.trans(bu), acc_u, input_precision="ieee")
        mask = row_ok[:, None] & col_ok[None, :]
        out = rows.to(tl.int64)[:, None] * I + cols[None, :]
        h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
        tl.store(h_ptr + out, h.to(h_ptr.dtype.element_ty), mask=mask)
        if SAVE_PRE:
            pre = pre_ptr + rows.to(tl.int64)[:, None] * (2 * I) + cols[None, :]
            tl.store(pre, acc_g.to(pre_ptr.dtype.element_ty), mask=mask)
            tl.store(pre + I, acc_u.to(pre_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _moe_down_bwd_kernel(
    dout_ptr,  # [T, H], unit stride along H
    w_ptr,  # [E, H, I] down by strides
    w_desc,  # where W_TMA: a TMA descriptor over down's storage [E·H, I], blocks [BLOCK_K, BLOCK_N] (H a multiple
             # of BLOCK_K)
    src_ptr,  # [T·k] int32: the token of each sorted row
    order_ptr,  # [T·k] int32: each sorted row's flat (token, slot) index
    tw_ptr,  # [T·k] routing weights, flat
    pre_ptr,  # [T·k, 2I]: g, then u
    dpre_ptr,  # [T·k, 2I] out: dg, then du
    hw_ptr,  # [T·k, I] out: w · silu(g) · u
    dsw_ptr,  # [T·k] float32, zeroed: the routing weights' gradient by sorted row (accumulated over I tiles)
    ends_ptr, tile_ends_ptr,
    I, H, E,  # noqa: E741
    stride_dout, stride_we, stride_wh, stride_wi,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    STEPS: tl.constexpr, W_TMA: tl.constexpr, UPCAST: tl.constexpr,
):
    # Per (row tile, column tile of I): reads BLOCK_M gathered rows of dout and down[e][:, cols] over H, and the
    # tile's g, u; writes dg, du and w·h for the tile, adds the tile's share of each row's dw.
    n_tiles = tl.cdiv(I, BLOCK_N)
    m_tiles = tl.load(tile_ends_ptr + E)
    for pair in tl.range(tl.program_id(0), m_tiles * n_tiles, tl.num_programs(0)):
        e, rows, row_ok, n0 = _pair_tile(pair, ends_ptr, tile_ends_ptr, n_tiles, m_tiles, E,
                                         BLOCK_M, BLOCK_N, GROUP_M, STEPS)
        cols = n0 + tl.arange(0, BLOCK_N)
        col_ok = cols < I
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        if e < E:
            src = tl.load(src_ptr + rows, mask=row_ok, other=0)
            d_rows = dout_ptr + src.to(tl.int64)[:, None] * stride_dout
            w_cols = w_ptr + e.to(tl.int64) * stride_we + cols.to(tl.int64)[None, :] * stride_wi
            for k0 in range(0, H, BLOCK_K):
                ks = k0 + tl.arange(0, BLOCK_K)
                a = tl.load(d_rows + ks[None, :], mask=row_ok[:, None] & (ks < H)[None, :], other=0.0)
                if W_TMA:  # columns past I read zeros
                    b = w_desc.load([e * H + k0, n0])
                else:
                    b = tl.load(w_cols + ks[:, None].to(tl.int64) * stride_wh,
                                mask=(ks < H)[:, None] & col_ok[None, :], other=0.0)
                if UPCAST:
                    a = a.to(tl.float32)
                    b = b.to(tl.float32)
                acc = tl.dot(a, b, acc, input_precision="ieee")
        mask = row_ok[:, None] & col_ok[None, :]
        pre = pre_ptr + rows.to(tl.int64)[:, None] * (2 * I) + cols[None, :]
        # rows past the last group read zeros, whatever another backend's forward left in pre there
        in_group = mask & (rows < tl.load(ends_ptr + E - 1))[:, None]
        g = tl.load(pre, mask=in_group, other=0.0).to(tl.float32)
        u = tl.load(pre + I, mask=in_group, other=0.0).to(tl.float32)
        w = tl.load(tw_ptr + tl.load(order_ptr + rows, mask=row_ok, other=0), mask=row_ok, other=0.0).to(tl.float32)
        sig = 1.0 / (1.0 + tl.exp(-g))
        silu = g * sig
        h = silu * u
        tl.atomic_add(dsw_ptr + rows, tl.sum(acc * h, axis=1), mask=row_ok, sem="relaxed")
        dh = acc * w[:, None]
        dpre = dpre_ptr + rows.to(tl.int64)[:, None] * (2 * I) + cols[None, :]
        tl.store(dpre, (dh * u * sig * (1.0 + g * (1.0 - sig))).to(dpre_ptr.dtype.element_ty), mask=mask)
        tl.store(dpre + I, (dh * silu).to(dpre_ptr.dtype.element_ty), mask=mask)
        tl.store(hw_ptr + rows.to(tl.int64)[:, None] * I + cols[None, :], (h * w[:, None]).to(hw_ptr.dtype.element_ty),
                 mask=mask)


@triton.jit
def _moe_combine_kernel(
    y_ptr,  # [T·k, H] by sorted row, unit stride along H
    pos_ptr,  # [T·k] int32: the sorted row of each flat (token, slot)
    ids_ptr,  # [T·k] the experts chosen, flat (a slot outside [0, E) adds nothing)
    tw_ptr,  # [T·k] routing weights, flat (read where WEIGHTED)
    out_ptr,  # [T, H] out
    H, E, K,
    BLOCK_H: tl.constexpr, WEIGHTED: tl.constexpr,
):
    # out[t] = Σ_j (w[t, j] ·) y[pos[t, j]] in float32: reads k rows of y per token, writes one row.
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in range(K):
        slot = t * K + j
        e = tl.load(ids_ptr + slot)
        if (e >= 0) & (e < E):
            row = tl.load(pos_ptr + slot).to(tl.int64)
            v = tl.load(y_ptr + row * H + cols, mask=cols < H, other=0.0).to(tl.float32)
            if WEIGHTED:
                v = v * tl.load(tw_ptr + slot).to(tl.float32)
            acc += v
    tl.store(out_ptr + t * H + cols, acc.to(out_ptr.dtype.element_ty), mask=cols < H)


@triton.jit
def _moe_route_kernel(
    ids_ptr,  # [N] the experts chosen, flat (N = T·k)
    src_ptr, order_ptr, pos_ptr,  # [N] int32 out each (hkernels/runtime/routing.py)
    ends_ptr, tile_ends_ptr,  # [E + 1] int32 out each: ends, and the schedule's tile_ends (row tiles of BLOCK_M)
    N, E, K,
    BLOCK: tl.constexpr, CHUNK: tl.constexpr, E_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr,
):
    # One program routes every slot (decode sizes: N ≤ BLOCK). A slot's sorted row is the number of slots whose key
    # (its id, or E for an id outside [0, E)) is smaller, or equal at an earlier slot: a stable sort by counting,
    # CHUNK slots compared at a time; ends[g] counts the keys ≤ g. Reads N ids, writes 3N + 2(E + 1) int32.
    i = tl.arange(0, BLOCK)
    ok = i < N
    key = tl.load(ids_ptr + i, mask=ok, other=0)
    key = tl.where((key >= 0) & (key < E), key, E)
    key = tl.where(ok, key, E + 1).to(tl.int32)
    g = tl.arange(0, E_BLOCK)
    rank = tl.zeros([BLOCK], dtype=tl.int32)
    count = tl.zeros([E_BLOCK], dtype=tl.int32)
    below = tl.zeros([E_BLOCK], dtype=tl.int32)  # keys < g: the group's start
    for j0 in range(0, N, CHUNK):
        j = j0 + tl.arange(0, CHUNK)
        other = tl.load(ids_ptr + j, mask=j < N, other=0)
        other = tl.where((other >= 0) & (other < E), other, E)
        other = tl.where(j < N, other, E + 1).to(tl.int32)
        before = (other[None, :] < key[:, None]) | ((other[None, :] == key[:, None]) & (j[None, :] < i[:, None]))
        rank += tl.sum(before.to(tl.int32), axis=1)
        count += tl.sum((other[None, :] <= g[:, None]).to(tl.int32), axis=1)
        below += tl.sum((other[None, :] < g[:, None]).to(tl.int32), axis=1)
    tl.store(src_ptr + rank, i // K, mask=ok)  # src[rank] = token
    tl.store(order_ptr + rank, i, mask=ok)  # order[rank] = slot
    tl.store(pos_ptr + i, rank, mask=ok)  # pos[slot] = rank
    ends = tl.where(g < E, count, N)
    tl.store(ends_ptr + g, ends, mask=g <= E)
    tiles = tl.where(g <= E, (ends - below + BLOCK_M - 1) // BLOCK_M, 0)
    tl.store(tile_ends_ptr + g, tl.cumsum(tiles, 0), mask=g <= E)


def route(topk_ids: Tensor, experts: int, block_m: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """:func:`hkernels.runtime.routing.routing`'s (src, order, pos, ends) and the schedule's tile_ends for row
    tiles of block_m: one launch up to ROUTE_MAX slots (the decode sizes, where ~20 PyTorch ops cost more host time
    than the experts' kernels), torch.sort past it."""
    n = topk_ids.numel()
    if type(n) is not int or n > ROUTE_MAX or n == 0:  # (a symbolic count: a graph's varying length, sorted)
        src, order, pos, ends = routing(topk_ids, experts)
        return src, order, pos, ends, tile_ends(ends, block_m)
    e1 = experts + 1
    # Separate buffers: the custom op returns src, order, pos and ends, which may not alias one another (nor may
    # the schedule be a view of ends: in a compiled graph a kernel reading both through its tile helper counts as
    # writing them, and views of one buffer written that way are not kept apart).
    src, order, pos = (torch.empty(n, dtype=torch.int32, device=topk_ids.device) for _ in range(3))
    ends, tiles = (torch.empty(e1, dtype=torch.int32, device=topk_ids.device) for _ in range(2))
    block = max(16, triton.next_power_of_2(n))
    launch(_moe_route_kernel, (1,), topk_ids, src, order, pos, ends, tiles, n, experts, topk_ids.shape[1],
           BLOCK=block, CHUNK=min(block, 32), E_BLOCK=max(16, triton.next_power_of_2(e1)), BLOCK_M=block_m,
           num_warps=8)
    return src, order, pos, ends, tiles


def _weight_desc(w: Tensor, rows: int, block: list[int]) -> TensorDescriptor | None:
    """A TMA descriptor over the experts' weight storage [E·R, C] for a launch over ``rows`` sorted rows, where
    TMA pays (grouped_matmul's threshold) and w's layout allows it; else None."""
    if not _tma_size(rows) or not w.is_contiguous():
        return None
    return _tma_rows(w.view(-1, w.shape[2]), block)


def _programs(rows: int, n: int, experts: int, dtype: torch.dtype, device: torch.device) -> int:
    bm, bn = _settings(dtype, "pair")[:2]
    programs = (cdiv(rows, bm) + experts + 1) * cdiv(n, bn)
    # persistent: at a symbolic count of rows, the full count of programs, each walking the tiles that exist
    return programs if interpreting() else persistent_programs(device, programs)


def combine(y: Tensor, pos: Tensor, ids: Tensor, weights: Tensor | None, T: int, E: int) -> Tensor:
    """[T, H] in y's dtype: out[t] = Σ_j (weights[t, j] ·) y[pos[t, j]] over the slots whose id is in [0, E)."""
    H = y.shape[1]
    out = torch.empty((T, H), dtype=y.dtype, device=y.device)
    if out.numel():
        block = min(1024, triton.next_power_of_2(H)) if not interpreting() else 32
        launch(_moe_combine_kernel, (T, cdiv(H, block)),
               y, pos, ids, weights if weights is not None else y, out, H, E, ids.numel() // T,
               BLOCK_H=block, WEIGHTED=weights is not None, num_warps=4)
    return out


def moe_fwd(x: Tensor, gate_up: Tensor, down: Tensor, topk_ids: Tensor, topk_weights: Tensor, save: bool
            ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """x [T, H] (unit stride along H), gate_up [E, 2I, H], down [E, H, I] (any strides), topk_ids [T, k] integer,
    topk_weights [T, k] -> (out [T, H], pre [T·k, 2I] (empty unless save), and the routing src, order, pos, ends
    (hkernels/runtime/routing.py)): pre and the routing are what the backward reads."""
    T, H = x.shape
    E, I2, _ = gate_up.shape
    I = I2 // 2  # noqa: E741
    bm, bn, bk, group_m, warps, stages = _settings(x.dtype, "pair")
    src, order, pos, ends, tiles = route(topk_ids, E, bm)
    rows = src.numel()
    ids = topk_ids.reshape(-1)
    h = torch.empty((rows, I), dtype=x.dtype, device=x.device)
    pre = torch.empty((rows, I2) if save else (0,), dtype=x.dtype, device=x.device)
    if rows == 0:
        return x.new_zeros((T, H)), pre, src, order, pos, ends
    w_desc = _weight_desc(gate_up, rows, [bn, bk])
    launch(_moe_up_kernel, (_programs(rows, I, E, x.dtype, x.device),),
        x, gate_up, gate_up if w_desc is None else w_desc, src, pre if save else h, h, ends, tiles, I, H, E,
        x.stride(0), *gate_up.stride(),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group_m, STEPS=(E + 1).bit_length(), SAVE_PRE=save,
        W_TMA=w_desc is not None, UPCAST=_upcast(x.dtype), num_warps=warps, num_stages=stages,
    )
    y = fwd_into(h, down, torch.empty((rows, H), dtype=x.dtype, device=x.device), ends, tiles)
    out = combine(y, pos, ids, topk_weights.reshape(-1), T, E)
    return out, pre, src, order, pos, ends


def moe_bwd(dout: Tensor, x: Tensor, gate_up: Tensor, down: Tensor, topk_ids: Tensor, topk_weights: Tensor,
            pre: Tensor, src: Tensor, order: Tensor, pos: Tensor, ends: Tensor, need_x: bool = True,
            need_weights: bool = True) -> tuple[Tensor | None, Tensor | None, Tensor | None, Tensor]:
    """dout [T, H] (unit stride along H) and what :func:`moe_fwd` kept -> (dx [T, H], dgate_up [E, 2I, H], ddown
    [E, H, I], each None where not needed, and dtopk_weights [T, k] in topk_weights' dtype)."""
    T, H = x.shape
    E, I2, _ = gate_up.shape
    I = I2 // 2  # noqa: E741
    rows = src.numel()
    bm, bn, bk, group_m, warps, stages = _settings(x.dtype, "pair")
    if rows == 0:
        return (x.new_zeros(x.shape) if need_x else None, torch.zeros_like(gate_up) if need_weights else None,
                torch.zeros_like(down) if need_weights else None, torch.zeros_like(topk_weights))
    if _plan.TRACING:
        # The kernels read the schedule through a helper, which torch.compile's analysis of which arguments a
        # kernel writes counts as writing it: a copy, so that the graph writes none of its inputs.
        ends = ends.clone()
    tiles = tile_ends(ends, bm)
    dpre = torch.empty_like(pre)
    hw = torch.empty((rows, I), dtype=x.dtype, device=x.device)
    dsw = torch.zeros(rows, dtype=torch.float32, device=x.device)
    # TMA for down's columns where a K step never runs into the next expert's rows
    w_desc = _weight_desc(down, rows, [bk, bn]) if H % bk == 0 else None
    launch(_moe_down_bwd_kernel, (_programs(rows, I, E, x.dtype, x.device),),
        dout, down, down if w_desc is None else w_desc, src, order, topk_weights.reshape(-1), pre, dpre, hw, dsw,
        ends, tiles, I, H, E, dout.stride(0), *down.stride(),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group_m, STEPS=(E + 1).bit_length(),
        W_TMA=w_desc is not None, UPCAST=_upcast(x.dtype), num_warps=warps, num_stages=stages,
    )
    # In this order, each buffer freed once read for the last time: at most pre, two [T·k, ·] buffers and the
    # weight gradients are alive at once (the peak of a forward+backward).
    dx = dgate_up = ddown = None
    if need_x:
        dx_rows = fwd_into(dpre, gate_up.transpose(1, 2), torch.empty((rows, H), dtype=x.dtype, device=x.device),
                           ends, tiles)
        dx = combine(dx_rows, pos, topk_ids.reshape(-1), None, T, E)
        del dx_rows
    if need_weights:
        dgate_up = dweight_into(dpre, x, torch.empty(gate_up.shape, dtype=gate_up.dtype, device=gate_up.device),
                                ends, x_rows=src)
        del dpre
        ddown = dweight_into(dout, hw, torch.empty(down.shape, dtype=down.dtype, device=down.device), ends,
                             dy_rows=src)
    del hw
    dtw = dsw.index_select(0, pos).view(topk_weights.shape).to(topk_weights.dtype)
    return dx, dgate_up, ddown, dtw
