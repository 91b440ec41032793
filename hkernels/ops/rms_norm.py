"""RMS norm in Helion (the twin of ``triton_fallback/rms_norm.py``).

Math, per row of N elements:  rstd = 1 / sqrt(mean(x²) + eps),  y = x · rstd · w', w' = offset + w in float32
(offset 0, or Gemma's 1).
Backward:  dx = rstd·(w'·dy) − x·rstd³·mean(w'·dy·x),  dw = Σ_rows dy·x·rstd.

Bytes for x: [M, N] of b-byte elements: forward reads M·N·b, writes M·N·b (+ 4M for rstd); backward reads dy
and x, writes dx, plus a [programs, N] float32 partial of dw (summed and cast by ``_partials.sum_partials``).
Row counts are dynamic (one compile serves every token count); N is specialised. Block sizes come from
``hkernels/configs`` (see ``_helion.py``); rows longer than ``MAX_RESIDENT_BWD`` take a two-step backward, as in
the Triton twin.

The kernels also serve ``add_rms_norm`` (residual add + RMS norm): the forward takes an optional residual (the
row normalised is then s = x + residual, rounded to x's dtype and written out) and the backward an optional ds
(added to dx before the one rounding). When they are None the code is rms_norm's alone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import helion
import helion.language as hl
import torch

from hkernels.functional._base import stats as row_stats
from hkernels.ops import _helion
from hkernels.ops._partials import lazy_sum_partials

Tensor = torch.Tensor
MAX_RESIDENT_BWD = 8192

# The custom ops whose launches these host functions record with a symbolic row count (a compiled graph whose
# length varies): configs by N alone, a persistent grid of a constant count of programs (see ``_helion.persistent``).
SYMBOLIC = frozenset({"rms_norm_fwd", "rms_norm_bwd"})


@helion.kernel(static_shapes=False)
def _rms_norm_fwd(
    x: Tensor, residual: Tensor | None, weight: Tensor | None, eps: float, offset: float, s: Tensor | None,
    rstd: Tensor | None,
) -> Tensor:
    # x: [M, N] -> y [M, N], and rstd [M] float32 written where given (a backward will follow). A config with
    # reduction_loops=[None] keeps the row in registers (one read of x); reduction_loops=[chunk] loops over it
    # twice, for rows too long for registers. With a residual (add_rms_norm) it also reads residual [M, N], and
    # the row normalised is x + residual rounded to x's dtype, written to s [M, N].
    m, n = x.size()
    n = hl.specialize(n)
    y = torch.empty([m, n], dtype=x.dtype, device=x.device)
    for tile_m in hl.tile(m):
        xf = x[tile_m, :].to(torch.float32)
        if residual is not None:
            total = (xf + residual[tile_m, :].to(torch.float32)).to(x.dtype)
            s[tile_m, :] = total
            xf = total.to(torch.float32)
        r = torch.rsqrt(torch.sum(xf * xf, dim=-1) / n + eps)
        out = xf * r[:, None]
        if weight is not None:
            out = out * (weight[None, :].to(torch.float32) + offset)
        y[tile_m, :] = out.to(y.dtype)
        if rstd is not None:
            rstd[tile_m] = r
    return y


@helion.kernel(static_shapes=False)
def _rms_norm_bwd(
    dy: Tensor, ds: Tensor | None, x: Tensor, weight: Tensor | None, rstd: Tensor, dx: Tensor,
    rows_per_program: int, programs: int, offset: float,
) -> Tensor:
    # Resident rows, persistent: program g walks rows [g·R, (g+1)·R) (none past M), reads dy and x once, writes
    # dx [M, N] (the host's buffer: it may be dy, each element read before it is written), and keeps its share of
    # dw in registers; returns the dw partials [programs, N] float32. With ds (add_rms_norm: the gradient that
    # reaches x directly) it also reads ds and adds it to dx.
    m, n = x.size()
    n = hl.specialize(n)
    dw_part = torch.empty([programs, n], dtype=torch.float32, device=x.device)
    for g in hl.grid(programs):
        dw_acc = hl.zeros([n], dtype=torch.float32)
        first = g * rows_per_program
        for tile_m in hl.tile(first, min(first + rows_per_program, m)):
            dyf = dy[tile_m, :].to(torch.float32)
            xf = x[tile_m, :].to(torch.float32)
            r = rstd[tile_m]
            wdy = dyf
            if weight is not None:
                wdy = dyf * (weight[None, :].to(torch.float32) + offset)
            c = torch.sum(wdy * xf, dim=-1) / n
            dxf = (wdy - xf * (r * r * c)[:, None]) * r[:, None]
            if ds is not None:
                dxf = dxf + ds[tile_m, :].to(torch.float32)
            dx[tile_m, :] = dxf.to(dx.dtype)
            dw_acc = dw_acc + torch.sum(dyf * xf * r[:, None], dim=0)
        dw_part[g, :] = dw_acc
    return dw_part


@helion.kernel(static_shapes=False)
def _rms_norm_bwd_dot(dy: Tensor, x: Tensor, weight: Tensor | None, offset: float) -> Tensor:
    # Long rows, step 1 of 2: c = mean(w·dy·x) per row [M] (a looped reduction: reads dy and x once).
    m, n = x.size()
    n = hl.specialize(n)
    c = torch.empty([m], dtype=torch.float32, device=x.device)
    for tile_m in hl.tile(m):
        wdy = dy[tile_m, :].to(torch.float32)
        if weight is not None:
            wdy = wdy * (weight[None, :].to(torch.float32) + offset)
        c[tile_m] = torch.sum(wdy * x[tile_m, :].to(torch.float32), dim=-1) / n
    return c


@helion.kernel(static_shapes=False)
def _rms_norm_bwd_looped(
    dy: Tensor, ds: Tensor | None, x: Tensor, weight: Tensor | None, rstd: Tensor, c: Tensor, dx: Tensor,
    rows_per_program: int, groups: int, offset: float,
) -> Tensor:
    # Long rows, step 2 of 2: program (row group g, column block) reads dy and x again (and ds, once), writes dx
    # (as above), and sums its rows' share of dw for its columns.
    m, n = x.size()
    n = hl.specialize(n)
    dw_part = torch.empty([groups, n], dtype=torch.float32, device=x.device)
    for tile_g, tile_n in hl.tile([groups, n], block_size=[1, None]):
        dw_acc = hl.zeros([tile_n], dtype=torch.float32)
        first = tile_g.begin * rows_per_program
        for tile_m in hl.tile(first, min(first + rows_per_program, m)):
            dyf = dy[tile_m, tile_n].to(torch.float32)
            xf = x[tile_m, tile_n].to(torch.float32)
            r = rstd[tile_m]
            wdy = dyf
            if weight is not None:
                wdy = dyf * (weight[None, tile_n].to(torch.float32) + offset)
            dxf = (wdy - xf * (r * r * c[tile_m])[:, None]) * r[:, None]
            if ds is not None:
                dxf = dxf + ds[tile_m, tile_n].to(torch.float32)
            dx[tile_m, tile_n] = dxf.to(dx.dtype)
            dw_acc = dw_acc + torch.sum(dyf * xf * r[:, None], dim=0)
        dw_part[tile_g.begin, tile_n] = dw_acc
    return dw_part


def rms_norm_fwd(x: Tensor, weight: Tensor | None, eps: float, offset: float = 0.0) -> tuple[Tensor, Tensor]:
    """x: [M, N] (unit column stride), weight: [N] or None -> (y [M, N] in x.dtype, rstd [M] float32); the scale
    is ``offset + weight``."""
    return _bind_fwd(x, weight, eps, offset)(x, weight, eps, offset)


def rms_norm_bwd(dy: Tensor, x: Tensor, weight: Tensor | None, rstd: Tensor, dx: Tensor | None = None,
                 offset: float = 0.0) -> tuple[Tensor, Tensor | None]:
    """dy, x: [M, N], weight: [N] or None, rstd: [M] -> (dx [M, N] in x.dtype, dw [N] in weight.dtype or None);
    dx written into the given buffer (contiguous; it may be dy) where there is one; the scale is
    ``offset + weight``."""
    return _bind_bwd(dy, x, weight, rstd, None, offset)(dy, x, weight, rstd, dx, offset)


def _bind_fwd(x: Tensor, weight: Tensor | None, eps: float, offset: float = 0.0, stats: bool = True
              ) -> Callable[..., Any]:
    """``run(x, weight, eps, offset) -> (y, rstd)``, or y alone with ``stats=False``: for this eps and offset
    (scalars are constants of a replayed call, as in every binding here)."""
    if not stats:  # (no rstd: neither allocated nor written)
        fn, launcher = _helion.bind(_rms_norm_fwd, (x, None, weight, eps, offset, None, None), x.shape[1], x.device,
                                    rows=(0,))
        return lambda x, weight, eps, offset=0.0: fn(x, None, weight, eps, offset, None, None, _launcher=launcher)
    rstd = row_stats(x)  # (an example, for binding)
    fn, launcher = _helion.bind(_rms_norm_fwd, (x, None, weight, eps, offset, None, rstd), x.shape[1], x.device,
                                rows=(0, 6))

    def run(x: Tensor, weight: Tensor | None, eps: float, offset: float = 0.0) -> tuple[Tensor, Tensor]:
        rstd = row_stats(x)
        return fn(x, None, weight, eps, offset, None, rstd, _launcher=launcher), rstd
    return run


def _bind_bwd(dy: Tensor, x: Tensor, weight: Tensor | None, rstd: Tensor, dx: Tensor | None = None,
              offset: float = 0.0) -> Callable[..., Any]:
    run = bind_bwd(_rms_norm_bwd, _rms_norm_bwd_looped, dy, None, x, weight, rstd, offset)
    return lambda dy, x, weight, rstd, dx=None, offset=0.0: run(dy, None, x, weight, rstd, dx, offset)


# Binders (see hkernels/runtime/plan.py): the same function for every call of one signature, set up once.
rms_norm_fwd.bind = _bind_fwd  # type: ignore[attr-defined]
rms_norm_bwd.bind = _bind_bwd  # type: ignore[attr-defined]


def bind_bwd(
    resident: Any, looped: Any, dy: Tensor, ds: Tensor | None, x: Tensor, weight: Tensor | None, rstd: Tensor,
    offset: float = 0.0,
) -> Callable[..., tuple[Tensor, Tensor | None]]:
    """The backward for arguments of this signature, shared with add_rms_norm: ``run(dy, ds, x, weight, rstd,
    dx=None, offset) -> (dx [M, N] in x.dtype, dw [N] or None)``, the scale ``offset + weight`` (this offset).
    ``resident``,
    ``looped``: the two kernels as ``_helion.bind`` takes them (add_rms_norm passes them under its own names, for
    its own configs); ``ds`` [M, N] or None is added to dx before the one rounding; dx is written into the buffer
    given (contiguous; it may be dy) where there is one."""
    M, N = x.shape
    device, dtype = x.device, x.dtype
    sum_dw = lazy_sum_partials() if weight is not None else None
    example = torch.empty_like(x, memory_format=torch.contiguous_format)  # dx's, for binding
    if N <= MAX_RESIDENT_BWD:
        rows, programs = _helion.persistent(M, device, _helion.programs_per_sm(resident.name, N, device, x.dtype))
        fn, launcher = _helion.bind(resident, (dy, ds, x, weight, rstd, example, rows, programs, offset), N,
                                    device, rows=(0, 1, 2, 4, 5))

        def run(dy: Tensor, ds: Tensor | None, x: Tensor, weight: Tensor | None, rstd: Tensor,
                dx: Tensor | None = None, offset: float = 0.0) -> tuple[Tensor, Tensor | None]:
            if dx is None:
                dx = torch.empty((x.shape[0], N), dtype=dtype, device=device)
            dw_part = fn(dy, ds, x, weight, rstd, dx, rows, programs, offset, _launcher=launcher)
            return dx, (sum_dw(dw_part, weight) if sum_dw is not None else None)
        return run
    dot, dot_launcher = _helion.bind(_rms_norm_bwd_dot, (dy, x, weight, offset), N, device, rows=(0, 1))
    block_n = _helion.config_for(looped.name, N, device, x.dtype).block_sizes[0]
    rows, groups = _helion.row_groups(M, N, block_n, device)
    c = torch.empty(M, dtype=torch.float32, device=device)  # an example of the dot's output, for binding
    fn, launcher = _helion.bind(looped, (dy, ds, x, weight, rstd, c, example, rows, groups, offset), N, device,
                                rows=(0, 1, 2, 4, 5, 6))

    def run_looped(dy: Tensor, ds: Tensor | None, x: Tensor, weight: Tensor | None, rstd: Tensor,
                   dx: Tensor | None = None, offset: float = 0.0) -> tuple[Tensor, Tensor | None]:
        c = dot(dy, x, weight, offset, _launcher=dot_launcher)
        if dx is None:
            dx = torch.empty((x.shape[0], N), dtype=dtype, device=device)
        dw_part = fn(dy, ds, x, weight, rstd, c, dx, rows, groups, offset, _launcher=launcher)
        return dx, (sum_dw(dw_part, weight) if sum_dw is not None else None)
    return run_looped


def run_bwd(
    resident: Any, looped: Any, dy: Tensor, ds: Tensor | None, x: Tensor, weight: Tensor | None, rstd: Tensor
) -> tuple[Tensor, Tensor | None]:
    """:func:`bind_bwd`, run once."""
    return bind_bwd(resident, looped, dy, ds, x, weight, rstd)(dy, ds, x, weight, rstd)
