"""Grouped matmul (the experts of a mixture of experts) in Helion: the twin of ``triton_fallback/grouped_matmul.py``,
whose docstring gives the math and the clamped group bounds.

A flat grid of (row tile, column tile) programs: the row tiles come from a map built on the device
(``hkernels/runtime/routing.py``'s tile_map: each tile's group and rows, no host sync), each inside one group, so
every program does one tile's product and the L2 grouping of the grid's order reads an expert's weight tile once
per band of row tiles (as the Triton twin's persistent programs do). The zero tail (rows past the sizes' sum,
normally none) is a group past the last expert, whose tiles are written with zeros.
"""

from __future__ import annotations

import helion
import helion.language as hl
import torch

from hkernels.ops import _helion
from hkernels.runtime.routing import bounds, group_ends, tile_map

Tensor = torch.Tensor

# Recorded with a symbolic row count (see ``hkernels/ops/rms_norm.py``): the group bounds are read on the device.
SYMBOLIC = frozenset({"grouped_matmul_fwd", "grouped_matmul_bwd"})


@helion.kernel(static_shapes=False, dot_precision="ieee")
def _grouped_matmul_fwd(x: Tensor, weight: Tensor, tile_group: Tensor, tile_row: Tensor, tile_end: Tensor, y: Tensor,
                        block_m: hl.constexpr) -> None:
    # x [T, K]; weight [E, N, K] (any strides); tile_group, tile_row, tile_end [R] int32: each row tile's group (E:
    # the zero tail) and rows (tile_map with tiles of block_m rows); y [T, N] out.
    # A program: one row tile, one column tile; reads the tile's rows of x and weight[e]'s column tile once.
    k = x.size(1)
    groups, n, _ = weight.size()
    for tile_t, tile_n in hl.tile([tile_group.size(0), n], block_size=[1, None]):
        t = tile_t.begin
        g = tile_group[t]
        start = tile_row[t]
        for tile_m in hl.tile(tile_end[t] - start, block_size=block_m):  # one tile, or none past the map
            # (the group as a one-step loop's index: Helion 1.5.0 indexes weight with a loaded scalar as a vector)
            for tile_e in hl.tile(g, g + 1, block_size=1):
                e = tile_e.begin
                # (rows offset from the tile's start: Helion 1.5.0 reads a tile of a one-row tensor as a broadcast)
                rows = start + tile_m.index
                acc = hl.zeros([tile_m, tile_n], dtype=torch.float32)
                if e < groups:  # (the tail's tiles stay zero)
                    for tile_k in hl.tile(k):
                        acc = torch.addmm(acc, x[rows, tile_k], weight[e, tile_n, tile_k].T)
                y[rows, tile_n] = acc.to(y.dtype)


@helion.kernel(static_shapes=False, dot_precision="ieee")
def _grouped_matmul_dweight(dy: Tensor, x: Tensor, starts: Tensor, ends: Tensor, dw: Tensor) -> None:
    # dy [T, N], x [T, K]; starts, ends [E] int32; dw [E, N, K] out: dw[e] = dy[rows_e]ᵀ @ x[rows_e] (zeros for an
    # empty group). A program: one expert's N × K tile; reads the group's rows of dy and x once.
    groups, n, k = dw.size()
    for tile_g, tile_n, tile_k in hl.tile([groups, n, k], block_size=[1, None, None]):
        g = tile_g.begin
        start = starts[g]
        rows_g = ends[g] - start
        acc = hl.zeros([tile_n, tile_k], dtype=torch.float32)
        for tile_m in hl.tile(rows_g):
            rows = start + tile_m.index
            acc = torch.addmm(acc, dy[rows, tile_n].T, x[rows, tile_k])
        dw[g, tile_n, tile_k] = acc.to(dw.dtype)


def block_m(kernel: str, n: int, device: torch.device, dtype: torch.dtype) -> int:
    """Rows per tile of the tile map that ``kernel`` starts a call's kernels on: a host-side setting kept beside
    its config (``"block_m"``); every kernel of the call takes the map's."""
    return int(_helion._bucket(_helion.arch_of(device), kernel, int(n), dtype).get("block_m", 128))


def grouped_matmul_fwd(x: Tensor, weight: Tensor, group_sizes: Tensor) -> Tensor:
    """x [T, K] (unit stride along K), weight [E, N, K] (any strides), group_sizes [E] integer on x's device ->
    y [T, N] contiguous in x's dtype; rows past the groups' sum are zeros."""
    return _forward(x, weight, group_ends(group_sizes, x.shape[0]))


def _forward(x: Tensor, weight: Tensor, ends: Tensor) -> Tensor:
    """:func:`grouped_matmul_fwd` on the groups' ends [E + 1] (routing.group_ends: the tail past them the last)."""
    T, N = x.shape[0], weight.shape[1]
    if N == 1 and T > 0:  # Helion 1.5.0 drops the mask of a multi-column tile over a size-1 dim: a zero column
        wide = torch.cat([weight, weight.new_zeros((weight.shape[0], 1, weight.shape[2]))], 1)
        return _forward(x, wide, ends)[:, :1].contiguous()
    y = torch.empty((T, N), dtype=x.dtype, device=x.device)
    if y.numel() == 0:
        return y
    bm = block_m(_grouped_matmul_fwd.name, N, x.device, x.dtype)
    group, first, end = tile_map(ends, bm, T)  # (the tail past the groups is a group: zeros)
    _helion.run(_grouped_matmul_fwd, (x, weight, group, first, end, y, bm), N, x.device)
    return y


def grouped_matmul_bwd(dy: Tensor, x: Tensor, weight: Tensor, group_sizes: Tensor, need_x: bool, need_weight: bool
                       ) -> tuple[Tensor | None, Tensor | None]:
    """dy [T, N], x [T, K], weight [E, N, K] -> (dx [T, K] or None, dweight [E, N, K] in weight's dtype or None)."""
    T, K = x.shape
    E, N, _ = weight.shape
    ends = group_ends(group_sizes, T)
    dx = _forward(dy, weight.transpose(1, 2), ends) if need_x else None
    dw = None
    if need_weight:
        dw = torch.empty((E, N, K), dtype=weight.dtype, device=weight.device)
        if dw.numel():
            starts, group_end, _ = bounds(ends)
            _helion.run(_grouped_matmul_dweight, (dy, x, starts, group_end, dw), K, x.device)
    return dx, dw
