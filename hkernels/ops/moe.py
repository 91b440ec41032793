"""The experts of a SwiGLU mixture-of-experts layer in Helion: the twin of ``triton_fallback/moe.py``, whose
docstring gives the math, the sorted layout and what the backward keeps.

A program takes one row tile of the sorted rows (each inside one expert's, from a tile map built on the device,
no host sync) and one column tile, as ``hkernels/ops/grouped_matmul.py`` does: the up projection gathers x's rows
by token and writes silu(g)·u (and g, u for the backward); the down projection is the grouped matmul; the combine
sums each token's k rows. Rows of out-of-range ids (past the last group) are never read.
"""

from __future__ import annotations

import helion
import helion.language as hl
import torch
import torch.nn.functional as F

from hkernels.ops import _helion
from hkernels.ops.grouped_matmul import _grouped_matmul_fwd, block_m
from hkernels.runtime.routing import ROUTE_MAX, bounds, routing, tile_map

Tensor = torch.Tensor

# Recorded with a symbolic token count (see ``hkernels/ops/rms_norm.py``): routed by the sort on the device, the
# group bounds read on the device.
SYMBOLIC = frozenset({"moe_fwd", "moe_bwd"})


@helion.kernel(static_shapes=False)
def _moe_route(ids: Tensor, src: Tensor, order: Tensor, pos: Tensor, starts: Tensor, ends: Tensor, tails: Tensor,
               k: int) -> None:
    # ids [N] the experts chosen, flat (N = T·k); src, order, pos [N] int32 out (hkernels/runtime/routing.py);
    # starts, ends, tails [E + 1] int32 out: each group's rows, the rows past the last group in tails[E − 1] (its
    # bounds(), the first E entries), and ends[E] = N. A stable sort by counting: a slot's sorted row is the number
    # of slots whose key (its id, or E for an id outside [0, E)) is smaller, or equal at an earlier slot. For the
    # decode sizes (N ≤ ROUTE_MAX): reads the N ids once per tile of slots or groups.
    n = ids.size(0)
    groups = starts.size(0) - 1
    for tile_i in hl.tile(n):
        key_i = ids[tile_i]
        key_i = torch.where((key_i >= 0) & (key_i < groups), key_i, groups)
        rank = hl.zeros([tile_i], dtype=torch.int32)
        for tile_j in hl.tile(n):
            key_j = ids[tile_j]
            key_j = torch.where((key_j >= 0) & (key_j < groups), key_j, groups)
            earlier = (key_j[None, :] < key_i[:, None]) | (
                (key_j[None, :] == key_i[:, None]) & (tile_j.index[None, :] < tile_i.index[:, None]))
            rank = rank + torch.sum((earlier & (tile_j.index < n)[None, :]).to(torch.int32), 1).to(torch.int32)
        src[rank] = (tile_i.index // k).to(torch.int32)
        order[rank] = tile_i.index.to(torch.int32)
        pos[tile_i] = rank
    for tile_g in hl.tile(groups + 1):
        upto = hl.zeros([tile_g], dtype=torch.int32)
        below = hl.zeros([tile_g], dtype=torch.int32)
        for tile_j in hl.tile(n):
            key_j = ids[tile_j]
            key_j = torch.where((key_j >= 0) & (key_j < groups), key_j, groups)
            valid = (tile_j.index < n)[None, :]
            upto = upto + torch.sum(((key_j[None, :] <= tile_g.index[:, None]) & valid).to(torch.int32), 1).to(
                torch.int32)
            below = below + torch.sum(((key_j[None, :] < tile_g.index[:, None]) & valid).to(torch.int32), 1).to(
                torch.int32)
        starts[tile_g] = below
        ends[tile_g] = torch.where(tile_g.index < groups, upto, n)
        tails[tile_g] = torch.where(tile_g.index == groups - 1, n - upto, 0)


def _route(topk_ids: Tensor, experts: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(src, order, pos, ends [E + 1]) of hkernels/runtime/routing.py's routing and its bounds (starts, ends,
    tails [E]): one launch up to ROUTE_MAX slots (the decode sizes, where ~20 PyTorch ops cost more host time
    than the experts' kernels), torch.sort past it."""
    n = topk_ids.numel()
    if type(n) is not int or n > ROUTE_MAX or n == 0:  # (a symbolic count: the sort, which serves every count)
        src, order, pos, ends = routing(topk_ids, experts)
        return src, order, pos, ends, *bounds(ends)
    # Separate buffers: the custom op returns src, order, pos and ends, which may not alias one another.
    src, order, pos = (torch.empty(n, dtype=torch.int32, device=topk_ids.device) for _ in range(3))
    starts, ends, tails = (torch.empty(experts + 1, dtype=torch.int32, device=topk_ids.device) for _ in range(3))
    _helion.run(_moe_route, (topk_ids.view(-1), src, order, pos, starts, ends, tails, topk_ids.shape[1]), n,
                topk_ids.device)
    return src, order, pos, ends, *(t.narrow(0, 0, experts) for t in (starts, ends, tails))


@helion.kernel(static_shapes=False, dot_precision="ieee")
def _moe_up(x: Tensor, w: Tensor, src: Tensor, tile_group: Tensor, tile_row: Tensor, tile_end: Tensor, pre: Tensor,
            h: Tensor, block_m: hl.constexpr, save: hl.constexpr) -> None:
    # x [T, H]; w [E, 2I, H] gate_up; src [T·k] int32 tokens of the sorted rows; tile_group, tile_row, tile_end [R]
    # int32 the row tiles (grouped_matmul's tile map over the E groups); pre [T·k, 2I] out where save; h [T·k, I]
    # out. A program: a row tile, a column tile of I; reads the tile's gathered x rows and the gate and up rows of
    # w[e] once.
    hidden = x.size(1)
    inter = h.size(1)
    for tile_t, tile_n in hl.tile([tile_group.size(0), inter], block_size=[1, None]):
        t = tile_t.begin
        g = tile_group[t]
        start = tile_row[t]
        for tile_m in hl.tile(tile_end[t] - start, block_size=block_m):
            for tile_e in hl.tile(g, g + 1, block_size=1):  # (the expert: see _grouped_matmul_fwd)
                e = tile_e.begin
                rows = start + tile_m.index
                tokens = src[rows]
                acc_g = hl.zeros([tile_m, tile_n], dtype=torch.float32)
                acc_u = hl.zeros([tile_m, tile_n], dtype=torch.float32)
                for tile_k in hl.tile(hidden):
                    a = x[tokens, tile_k]
                    acc_g = torch.addmm(acc_g, a, w[e, tile_n, tile_k].T)
                    acc_u = torch.addmm(acc_u, a, w[e, tile_n.index + inter, tile_k].T)
                h[rows, tile_n] = (acc_g * torch.sigmoid(acc_g) * acc_u).to(h.dtype)
                if save:
                    pre[rows, tile_n] = acc_g.to(pre.dtype)
                    pre[rows, tile_n.index + inter] = acc_u.to(pre.dtype)


@helion.kernel(static_shapes=False, dot_precision="ieee")
def _moe_down_bwd(dout: Tensor, w: Tensor, src: Tensor, order: Tensor, tw: Tensor, pre: Tensor, tile_group: Tensor,
                  tile_row: Tensor, tile_end: Tensor, dpre: Tensor, hw: Tensor, dsw: Tensor,
                  block_m: hl.constexpr) -> None:
    # dout [T, H]; w [E, H, I] down; src, order [T·k] int32; tw [T·k] routing weights, flat; pre [T·k, 2I]; the
    # row tiles as _moe_up's; dpre [T·k, 2I], hw [T·k, I] out; dsw [T·k] float32, zeroed, accumulated over I tiles.
    # A program: a row tile, a column tile of I; reads the tile's gathered dout rows and w[e][:, tile] once.
    hidden = dout.size(1)
    inter = hw.size(1)
    for tile_t, tile_n in hl.tile([tile_group.size(0), inter], block_size=[1, None]):
        t = tile_t.begin
        g = tile_group[t]
        start = tile_row[t]
        for tile_m in hl.tile(tile_end[t] - start, block_size=block_m):
            for tile_e in hl.tile(g, g + 1, block_size=1):
                e = tile_e.begin
                rows = start + tile_m.index
                tokens = src[rows]
                acc = hl.zeros([tile_m, tile_n], dtype=torch.float32)
                for tile_k in hl.tile(hidden):
                    acc = torch.addmm(acc, dout[tokens, tile_k], w[e, tile_k, tile_n])
                gate = pre[rows, tile_n].to(torch.float32)
                u = pre[rows, tile_n.index + inter].to(torch.float32)
                wt = tw[order[rows]].to(torch.float32)
                sig = torch.sigmoid(gate)
                silu = gate * sig
                hh = silu * u
                hl.atomic_add(dsw, [rows], torch.sum(acc * hh, dim=1))
                dh = acc * wt[:, None]
                dpre[rows, tile_n] = (dh * u * sig * (1.0 + gate * (1.0 - sig))).to(dpre.dtype)
                dpre[rows, tile_n.index + inter] = (dh * silu).to(dpre.dtype)
                hw[rows, tile_n] = (hh * wt[:, None]).to(hw.dtype)


@helion.kernel(static_shapes=False, dot_precision="ieee")
def _moe_dweight(dy: Tensor, x: Tensor, rows_of: Tensor, starts: Tensor, ends: Tensor, dw: Tensor,
                 gather_x: hl.constexpr) -> None:
    # dw[e] = dy[rows_e]ᵀ @ x[rows_e], [E, N, K] (zeros for an empty group), one side's rows gathered through
    # rows_of: x's where gather_x (the gate/up weights' gradient: x by token), else dy's (the down weight's: dout by
    # token). A program: one expert's N × K tile; reads the group's rows of dy and x once.
    groups, n, k = dw.size()
    for tile_g, tile_n, tile_k in hl.tile([groups, n, k], block_size=[1, None, None]):
        g = tile_g.begin
        start = starts[g]
        acc = hl.zeros([tile_n, tile_k], dtype=torch.float32)
        for tile_m in hl.tile(ends[g] - start):
            rows = start + tile_m.index
            if gather_x:
                acc = torch.addmm(acc, dy[rows, tile_n].T, x[rows_of[rows], tile_k])
            else:
                acc = torch.addmm(acc, dy[rows_of[rows], tile_n].T, x[rows, tile_k])
        dw[g, tile_n, tile_k] = acc.to(dw.dtype)


@helion.kernel(static_shapes=False)
def _moe_combine(y: Tensor, pos: Tensor, ends: Tensor, tw: Tensor, out: Tensor, weighted: hl.constexpr) -> None:
    # out[t] = Σ_j (tw[t, j] ·) y[pos[t, j]] in float32 over the slots with an id in [0, E): those sorted before
    # the last group's end; y [T·k, H], pos, tw [T, k], ends [E] the groups' ends. Reads k rows of y per token,
    # writes one.
    tokens, hidden = out.size()
    slots = pos.size(1)
    groups = ends.size(0)
    for tile_t, tile_h in hl.tile([tokens, hidden]):
        routed = ends[groups - 1]
        acc = hl.zeros([tile_t, tile_h], dtype=torch.float32)
        for j in hl.grid(slots):
            rows = pos[tile_t, j]
            v = y[rows, tile_h].to(torch.float32)
            if weighted:
                v = v * tw[tile_t, j].to(torch.float32)[:, None]
            acc = acc + torch.where((rows < routed)[:, None], v, 0.0)
        out[tile_t, tile_h] = acc.to(out.dtype)


def _combine(y: Tensor, pos: Tensor, group_ends: Tensor, tw: Tensor | None, T: int) -> Tensor:
    out = torch.empty((T, y.shape[1]), dtype=y.dtype, device=y.device)
    if out.numel():
        _helion.run(_moe_combine, (y, pos.view(T, -1), group_ends, tw if tw is not None else pos, out,
                                   tw is not None), y.shape[1], y.device)
    return out


def _widen(x: Tensor, gate_up: Tensor, down: Tensor, pre: Tensor | None = None
           ) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """H or I of 1 padded to 2 with zeros (exact: the padding adds zero terms, silu(0)·0 = 0): Helion 1.5.0 drops
    the mask of a multi-element tile over a size-1 dim."""
    H, I = x.shape[1], down.shape[2]  # noqa: E741
    if H == 1:
        x, gate_up, down = F.pad(x, (0, 1)), F.pad(gate_up, (0, 1)), F.pad(down, (0, 0, 0, 1))
    if I == 1:  # gate_up rows (g, 0, u, 0), pre columns likewise
        gate_up = F.pad(gate_up.unflatten(1, (2, 1)), (0, 0, 0, 1)).flatten(1, 2)
        down = F.pad(down, (0, 1))
        if pre is not None and pre.numel():
            pre = F.pad(pre.unflatten(1, (2, 1)), (0, 1)).flatten(1, 2)
    return x, gate_up, down, pre


def moe_fwd(x: Tensor, gate_up: Tensor, down: Tensor, topk_ids: Tensor, topk_weights: Tensor, save: bool
            ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """x [T, H] (unit stride along H), gate_up [E, 2I, H], down [E, H, I], topk_ids [T, k] integer, topk_weights
    [T, k] -> (out [T, H], pre [T·k, 2I] (empty unless save), src, order, pos, ends)."""
    T, H = x.shape
    E, I2, _ = gate_up.shape
    if H == 1 or I2 == 2:
        out, pre, *routed = moe_fwd(*_widen(x, gate_up, down)[:3], topk_ids, topk_weights, save)
        if I2 == 2 and pre.numel():
            pre = pre[:, ::2].contiguous()
        return out[:, :H].contiguous(), pre, *routed
    src, order, pos, ends, _, group_ends, _ = _route(topk_ids, E)
    rows = src.numel()
    h = torch.empty((rows, I2 // 2), dtype=x.dtype, device=x.device)
    pre = torch.empty((rows, I2) if save else (0,), dtype=x.dtype, device=x.device)
    # The row tiles of the E groups (the rows of out-of-range ids, past them, are left unwritten: never read)
    bm = block_m(_moe_up.name, I2 // 2, x.device, x.dtype)
    group, first, end = tile_map(group_ends, bm, rows)
    _helion.run(_moe_up, (x, gate_up, src, group, first, end, pre if save else h, h, bm, save), I2 // 2, x.device)
    y = torch.empty((rows, H), dtype=x.dtype, device=x.device)
    _helion.run(_grouped_matmul_fwd, (h, down, group, first, end, y, bm), H, x.device)
    return _combine(y, pos, group_ends, topk_weights, T), pre, src, order, pos, ends


def moe_bwd(dout: Tensor, x: Tensor, gate_up: Tensor, down: Tensor, topk_ids: Tensor, topk_weights: Tensor,
            pre: Tensor, src: Tensor, order: Tensor, pos: Tensor, ends: Tensor, need_x: bool = True,
            need_weights: bool = True) -> tuple[Tensor | None, Tensor | None, Tensor | None, Tensor]:
    """dout [T, H] (unit stride along H) and what :func:`moe_fwd` kept -> (dx [T, H], dgate_up [E, 2I, H], ddown
    [E, H, I], each None where not needed, and dtopk_weights [T, k] in topk_weights' dtype)."""
    T, H = x.shape
    I2 = gate_up.shape[1]
    if H == 1 or I2 == 2:
        xw, gw, dw, pw = _widen(x, gate_up, down, pre)
        dx, dgate_up, ddown, dtw = moe_bwd(F.pad(dout, (0, xw.shape[1] - H)), xw, gw, dw, topk_ids, topk_weights, pw,
                                           src, order, pos, ends, need_x, need_weights)
        keep = slice(None, None, 2) if I2 == 2 else slice(None)
        return (dx[:, :H].contiguous() if dx is not None else None,
                dgate_up[:, keep, :H].contiguous() if dgate_up is not None else None,
                ddown[:, :H, :I2 // 2].contiguous() if ddown is not None else None, dtw)
    rows = src.numel()
    starts, group_ends, _ = bounds(ends)
    # Two rows at least: Helion 1.5.0 reads a one-row operand as a broadcast dim (the extra row is in no group).
    tw = topk_weights.reshape(-1)
    one = type(rows) is int and rows == 1  # (a symbolic count is at least 2: torch.compile specialises 0 and 1)
    if one:
        src, order, tw, pre = (torch.cat([t, t]) for t in (src, order, tw, pre))
    padded = 2 if one else rows
    dpre = torch.empty((padded, I2), dtype=x.dtype, device=x.device)
    hw = torch.empty((padded, I2 // 2), dtype=x.dtype, device=x.device)
    dsw = torch.zeros(padded, dtype=torch.float32, device=x.device)
    bm = block_m(_moe_up.name, I2 // 2, x.device, x.dtype)  # (the forward's row tiles)
    group, first, end = tile_map(group_ends, bm, rows)
    _helion.run(_moe_down_bwd, (dout, down, src, order, tw, pre, group, first, end, dpre, hw, dsw, bm), I2 // 2,
                x.device)
    # The Triton twin's order: each buffer freed once read for the last time.
    dx = dgate_up = ddown = None
    if need_x:
        dx_rows = torch.empty((padded, H), dtype=x.dtype, device=x.device)
        _helion.run(_grouped_matmul_fwd, (dpre, gate_up.transpose(1, 2), group, first, end, dx_rows, bm), H, x.device)
        dx = _combine(dx_rows, pos, group_ends, None, T)
        del dx_rows
    if need_weights:
        dgate_up = torch.empty(gate_up.shape, dtype=gate_up.dtype, device=gate_up.device)
        _helion.run(_moe_dweight, (dpre, x, src, starts, group_ends, dgate_up, True), H, x.device)
        del dpre
        ddown = torch.empty(down.shape, dtype=down.dtype, device=down.device)
        _helion.run(_moe_dweight, (dout, hw, src, starts, group_ends, ddown, False), I2 // 2, x.device)
    del hw
    dtw = dsw.index_select(0, pos).view(topk_weights.shape).to(topk_weights.dtype)
    return dx, dgate_up, ddown, dtw
