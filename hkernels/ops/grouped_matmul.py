"""Grouped matmul (the experts of a mixture of experts) in Helion: the twin of ``triton_fallback/grouped_matmul.py``,
whose docstring gives the math and the clamped group bounds.

A program takes one group and one column tile, and walks the group's row tiles: the group bounds are loaded on
the device (no host sync), and Helion masks the rows past a group's end. The last group's programs also write
zeros over the tail (rows past the sizes' sum, normally none).
"""

from __future__ import annotations

import helion
import helion.language as hl
import torch

from hkernels.ops import _helion
from hkernels.runtime.routing import bounds, group_ends

Tensor = torch.Tensor

# Recorded with a symbolic row count (see ``hkernels/ops/rms_norm.py``): the group bounds are read on the device.
SYMBOLIC = frozenset({"grouped_matmul_fwd", "grouped_matmul_bwd"})


@helion.kernel(static_shapes=False, dot_precision="ieee")
def _grouped_matmul_fwd(x: Tensor, weight: Tensor, starts: Tensor, ends: Tensor, tails: Tensor, y: Tensor) -> None:
    # x [T, K]; weight [E, N, K] (any strides); starts, ends, tails [E] int32: group e's rows, and after the last
    # group the rows past the sizes' sum (0 for the others); y [T, N] out.
    # A program: group e, a column tile; reads the group's rows of x and weight[e]'s tile once per row tile, and
    # the last group's programs write the tail's zeros.
    k = x.size(1)
    groups, n, _ = weight.size()
    for tile_e, tile_n in hl.tile([groups, n], block_size=[1, None]):
        e = tile_e.begin
        start = starts[e]
        end = ends[e]
        for tile_m in hl.tile(end - start):
            rows = start + tile_m.index
            acc = hl.zeros([tile_m, tile_n], dtype=torch.float32)
            for tile_k in hl.tile(k):
                acc = torch.addmm(acc, x[rows, tile_k], weight[e, tile_n, tile_k].T)
            y[rows, tile_n] = acc.to(y.dtype)
        for tile_t in hl.tile(tails[e]):
            y[end + tile_t.index, tile_n] = hl.zeros([tile_t, tile_n], dtype=y.dtype)


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


def _groups(group_sizes: Tensor, T: int) -> tuple[Tensor, Tensor, Tensor]:
    """(starts, ends, tails) [E] int32 on the device (hkernels/runtime/routing.py's bounds)."""
    return bounds(group_ends(group_sizes, T))


def grouped_matmul_fwd(x: Tensor, weight: Tensor, group_sizes: Tensor) -> Tensor:
    """x [T, K] (unit stride along K), weight [E, N, K] (any strides), group_sizes [E] integer on x's device ->
    y [T, N] contiguous in x's dtype; rows past the groups' sum are zeros."""
    T, N = x.shape[0], weight.shape[1]
    if N == 1 and T > 0:  # Helion 1.5.0 drops the mask of a multi-column tile over a size-1 dim: a zero column
        wide = torch.cat([weight, weight.new_zeros((weight.shape[0], 1, weight.shape[2]))], 1)
        return grouped_matmul_fwd(x, wide, group_sizes)[:, :1].contiguous()
    y = torch.empty((T, N), dtype=x.dtype, device=x.device)
    if y.numel() == 0:
        return y
    starts, ends, tails = _groups(group_sizes, T)
    _helion.run(_grouped_matmul_fwd, (x, weight, starts, ends, tails, y), N, x.device)
    return y


def grouped_matmul_bwd(dy: Tensor, x: Tensor, weight: Tensor, group_sizes: Tensor, need_x: bool, need_weight: bool
                       ) -> tuple[Tensor | None, Tensor | None]:
    """dy [T, N], x [T, K], weight [E, N, K] -> (dx [T, K] or None, dweight [E, N, K] in weight's dtype or None)."""
    T, K = x.shape
    E, N, _ = weight.shape
    dx = grouped_matmul_fwd(dy, weight.transpose(1, 2), group_sizes) if need_x else None
    dw = None
    if need_weight:
        dw = torch.empty((E, N, K), dtype=weight.dtype, device=weight.device)
        if dw.numel():
            starts, ends, _ = _groups(group_sizes, T)
            _helion.run(_grouped_matmul_dweight, (dy, x, starts, ends, dw), K, x.device)
    return dx, dw
