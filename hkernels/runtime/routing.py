"""Routing of a mixture of experts' (token, slot) pairs, on the device and without a host sync: shared by the
moe op's backends (plain torch, so it also runs where Triton does not)."""

from __future__ import annotations

import torch

Tensor = torch.Tensor

# Slots routed by one launch of a backend's routing kernel (a counting sort: decode sizes); more go through
# torch.sort (:func:`routing`).
ROUTE_MAX = 1024


def routing(topk_ids: Tensor, experts: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(src, order, pos, ends) for topk_ids [T, k]: the T·k (token, slot) pairs sorted by expert, stably, ids
    outside [0, E) last (in no group). src [T·k] int32: each sorted row's token; order [T·k] int32: its flat slot
    t·k + j; pos [T·k] int32: the sorted row of each flat slot; ends [E + 1] int32: each expert's end row, then
    T·k (the rows past ends[E − 1] are the out-of-range slots)."""
    k = topk_ids.shape[1]
    ids = topk_ids.reshape(-1)
    key = torch.where((ids >= 0) & (ids < experts), ids, experts).to(torch.int32)
    sorted_key, order = torch.sort(key, stable=True)
    # (the last entry, for key E + 1, is T·k: every key is at most E)
    ends = torch.searchsorted(sorted_key, torch.arange(1, experts + 2, device=ids.device, dtype=torch.int32))
    ends = ends.to(torch.int32)
    order32 = order.to(torch.int32)
    pos = torch.empty_like(order32).scatter_(0, order, torch.arange(order.numel(), device=ids.device,
                                                                     dtype=torch.int32))
    return torch.div(order32, k, rounding_mode="floor"), order32, pos, ends


def group_ends(group_sizes: Tensor, rows: int) -> Tensor:
    """[E + 1] int32: each group's end row (sizes clamped at 0, ends at ``rows``), then ``rows`` (the tail past the
    last group)."""
    ends = torch.cumsum(group_sizes.clamp(min=0), 0).clamp(max=rows)
    return torch.cat([ends, ends.new_full((1,), rows)]).to(torch.int32)


def bounds(ends: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(starts, ends, tails) [E] int32 from ends [E + 1] (:func:`group_ends`, :func:`routing`): each group's rows,
    and the rows past the last group in the last entry (0 in the others): what the Helion kernels walk. (Narrowed,
    not indexed: Python indexing takes a device guard, which fails on fake tensors of a device this build of torch
    lacks.)"""
    e = ends.shape[0] - 1
    starts = torch.cat([ends.new_zeros(1), ends.narrow(0, 0, e - 1)])
    tails = torch.cat([ends.new_zeros(e - 1), ends.narrow(0, e, 1) - ends.narrow(0, e - 1, 1)])
    return starts, ends.narrow(0, 0, e), tails


def tile_ends(ends: Tensor, block_m: int) -> Tensor:
    """[E + 1] int32: the cumsum of each group's row tiles of block_m (the tail past the last group included),
    the schedule the grouped kernels walk (see triton_fallback/grouped_matmul.py)."""
    sizes = torch.diff(ends, prepend=ends.new_zeros(1))
    return torch.cumsum((sizes + block_m - 1) // block_m, 0, dtype=torch.int32)


def zero_rows_past(y: Tensor, end: Tensor) -> Tensor:
    """``y`` [R, ...] with its rows from ``end`` (a one-element device tensor) on set to zero, in place and without a
    host sync: the rows a grouped or packed kernel leaves unwritten past its last group or sequence."""
    rows = torch.arange(y.shape[0], device=y.device, dtype=end.dtype)
    return y.masked_fill_((rows >= end).view(-1, *[1] * (y.dim() - 1)), 0)


def tile_map(ends: Tensor, block_m: int, rows: int) -> tuple[Tensor, Tensor, Tensor]:
    """(group, first row, end row) of each tile of ``block_m`` rows, [rows // block_m + G] int32 each, for the G
    groups whose end rows are ``ends`` [G] int32 (group g is rows ends[g − 1] .. ends[g], the first from 0, the last
    ending at most at ``rows``): every group's rows cut into tiles in group order, each tile inside one group, then
    empty entries (first = end = 0) up to the bound (each group adds at most one partial tile). On the device, no
    host sync: what a flat grid of row tiles × column tiles walks (hkernels/ops/grouped_matmul.py)."""
    groups = ends.shape[0]
    starts = torch.cat([ends.new_zeros(1), ends.narrow(0, 0, groups - 1)])
    tiles = torch.div(ends - starts + (block_m - 1), block_m, rounding_mode="floor")
    last = torch.cumsum(tiles, 0, dtype=torch.int32)  # one past each group's last tile
    i = torch.arange(rows // block_m + groups, device=ends.device, dtype=torch.int32)
    group = torch.searchsorted(last, i, right=True, out_int32=True).clamp_(max=groups - 1)
    first = starts.index_select(0, group) + (i - (last - tiles).index_select(0, group)) * block_m
    end = torch.minimum(first + block_m, ends.index_select(0, group))
    empty = i >= last.narrow(0, groups - 1, 1)
    return group, first.masked_fill_(empty, 0), end.masked_fill_(empty, 0)
