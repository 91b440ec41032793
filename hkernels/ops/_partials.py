"""The norms' last backward step in Helion (the twin of ``triton_fallback/_partials.py``, whose docstring says why).

dw (and layer_norm's db) arrive as [P, N] float32 partials, one row per program or row group; one kernel sums
them over P in float32, in a fixed order, and writes [N] in the parameter's dtype. Bytes: reads P·N·4, writes N·b.
"""

from __future__ import annotations

from collections.abc import Callable

import helion
import helion.language as hl
import torch

from hkernels.ops import _helion

Tensor = torch.Tensor


@helion.kernel(static_shapes=False)
def _sum_partials(part: Tensor, param: Tensor) -> Tensor:
    # part: [P, N] float32 -> [N] in param's dtype. Reads each column block of every partial row once; a
    # [block_p, tile_n] block is accumulated and summed across rows once at the end (a cross-row sum per step is
    # no faster: see bench/results/h200/README.md).
    p, n = part.size()
    out = torch.empty([n], dtype=param.dtype, device=part.device)
    block_p = hl.register_block_size(p)
    for tile_n in hl.tile(n):
        acc = hl.zeros([block_p, tile_n], dtype=torch.float32)
        for tile_p in hl.tile(p, block_size=block_p):
            acc = acc + part[tile_p, tile_n]
        out[tile_n] = torch.sum(acc, dim=0).to(out.dtype)
    return out


def sum_partials(part: Tensor, param: Tensor) -> Tensor:
    """part: [P, N] float32 (unit column stride), param: the parameter [N] -> the sum of part over P, [N] in
    param's dtype (summed in float32)."""
    return bind_sum_partials(part, param)(part, param)


def bind_sum_partials(part: Tensor, param: Tensor) -> Callable[[Tensor, Tensor], Tensor]:
    """``sum_partials`` for arguments of this signature, set up once (its callers bind it with their own plan)."""
    P, N = part.shape
    dtype, device = param.dtype, param.device
    if type(P) is not int:  # a symbolic count (a graph with every size symbolic): at least 2 rows, never guarded
        pass
    elif N == 0 or P == 0:
        return lambda part, param: torch.zeros(N, dtype=dtype, device=device)
    fn, launcher = _helion.bind(_sum_partials, (part, param), N, device, rows=(0,))  # (one partial: bound at two)
    return lambda part, param: fn(part, param, _launcher=launcher)


def lazy_sum_partials() -> Callable[[Tensor, Tensor], Tensor]:
    """``sum_partials`` bound on its first call (for a partial that a bound kernel makes: same shape every call)."""
    bound: list[Callable[[Tensor, Tensor], Tensor]] = []

    def run(part: Tensor, param: Tensor) -> Tensor:
        if not bound:
            bound.append(bind_sum_partials(part, param))
        return bound[0](part, param)
    return run
