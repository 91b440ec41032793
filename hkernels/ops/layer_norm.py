"""Layer norm in Helion (the twin of ``triton_fallback/layer_norm.py``).

Math, per row of N elements:  mean = Σx/N,  rstd = 1/sqrt(Σ(x−mean)²/N + eps),  x̂ = (x−mean)·rstd,
y = x̂·w + b.  Backward:  dx = rstd·(w·dy − mean(w·dy) − x̂·mean(w·dy·x̂)),  dw = Σ_rows dy·x̂,  db = Σ_rows dy.

The variance is taken around the mean: resident rows subtract it in registers; long rows merge per-chunk
(count, mean, M2) with Chan's formula and are read twice. Bytes for x: [M, N] of b-byte elements: forward reads
and writes M·N·b (+ 8M); backward reads dy and x, writes dx, plus [programs, N] float32 partials of dw and db
(each summed and cast by ``_partials.sum_partials``).
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
# traced at a symbolic row count (see hkernels/ops/rms_norm.py)
SYMBOLIC = frozenset({"layer_norm_fwd", "layer_norm_bwd"})
MAX_RESIDENT_FWD = 32768
MAX_RESIDENT_BWD = 8192


@helion.kernel(static_shapes=False)
def _layer_norm_fwd(
    x: Tensor, like: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float, mean: Tensor | None,
    rstd: Tensor | None,
) -> Tensor:
    # Resident rows: x: [M, N] -> y [M, N] in like's dtype (x's, or wider), and mean [M] and rstd [M] float32
    # written where given (a backward will follow); reads x once.
    m, n = x.size()
    n = hl.specialize(n)
    y = torch.empty([m, n], dtype=like.dtype, device=x.device)
    for tile_m in hl.tile(m):
        xf = x[tile_m, :].to(torch.float32)
        mu = torch.sum(xf, dim=-1) / n
        xc = xf - mu[:, None]
        r = torch.rsqrt(torch.sum(xc * xc, dim=-1) / n + eps)
        out = xc * r[:, None]
        if weight is not None:
            out = out * weight[None, :].to(torch.float32)
        if bias is not None:
            out = out + bias[None, :].to(torch.float32)
        y[tile_m, :] = out.to(y.dtype)
        if mean is not None:
            mean[tile_m] = mu
        if rstd is not None:
            rstd[tile_m] = r
    return y


@helion.kernel(static_shapes=False)
def _layer_norm_fwd_looped(
    x: Tensor, like: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float, mean: Tensor | None,
    rstd: Tensor | None,
) -> Tensor:
    # Long rows: pass 1 merges each chunk's (count, mean, M2) into the running ones (Chan et al.); pass 2 reads
    # the row again and writes y (in like's dtype); mean and rstd as the resident kernel's.
    m, n = x.size()
    n = hl.specialize(n)
    y = torch.empty([m, n], dtype=like.dtype, device=x.device)
    for tile_m in hl.tile(m):
        count = hl.zeros([tile_m], dtype=torch.float32)
        mu = hl.zeros([tile_m], dtype=torch.float32)
        m2 = hl.zeros([tile_m], dtype=torch.float32)
        for tile_n in hl.tile(n):
            xf = x[tile_m, tile_n].to(torch.float32)
            n_c = (tile_n.end - tile_n.begin) * 1.0
            mu_c = torch.sum(xf, dim=-1) / n_c
            d = torch.where((tile_n.index < n)[None, :], xf - mu_c[:, None], 0.0)
            total = count + n_c
            delta = mu_c - mu
            mu = mu + delta * (n_c / total)
            m2 = m2 + torch.sum(d * d, dim=-1) + delta * delta * (count * n_c / total)
            count = total
        r = torch.rsqrt(m2 / n + eps)
        for tile_n in hl.tile(n):
            out = (x[tile_m, tile_n].to(torch.float32) - mu[:, None]) * r[:, None]
            if weight is not None:
                out = out * weight[None, tile_n].to(torch.float32)
            if bias is not None:
                out = out + bias[None, tile_n].to(torch.float32)
            y[tile_m, tile_n] = out.to(y.dtype)
        if mean is not None:
            mean[tile_m] = mu
        if rstd is not None:
            rstd[tile_m] = r
    return y


@helion.kernel(static_shapes=False)
def _layer_norm_bwd(
    dy: Tensor,
    x: Tensor,
    weight: Tensor | None,
    mean: Tensor,
    rstd: Tensor,
    rows_per_program: int,
    programs: int,
    with_bias: hl.constexpr,
) -> tuple[Tensor, Tensor, Tensor]:
    # Resident rows, persistent: program g walks rows [g·R, (g+1)·R) (none past M), reads dy and x once, writes
    # dx, and keeps its share of dw and db in registers; returns dx and the partials [programs, N] float32.
    m, n = x.size()
    n = hl.specialize(n)
    dx = torch.empty([m, n], dtype=x.dtype, device=x.device)
    dw_part = torch.empty([programs, n], dtype=torch.float32, device=x.device)
    db_part = torch.empty([programs, n], dtype=torch.float32, device=x.device)
    for g in hl.grid(programs):
        dw_acc = hl.zeros([n], dtype=torch.float32)
        db_acc = hl.zeros([n], dtype=torch.float32)
        first = g * rows_per_program
        for tile_m in hl.tile(first, min(first + rows_per_program, m)):
            dyf = dy[tile_m, :].to(torch.float32)
            r = rstd[tile_m]
            xhat = (x[tile_m, :].to(torch.float32) - mean[tile_m][:, None]) * r[:, None]
            wdy = dyf
            if weight is not None:
                wdy = dyf * weight[None, :].to(torch.float32)
            c1 = torch.sum(xhat * wdy, dim=-1) / n
            c2 = torch.sum(wdy, dim=-1) / n
            dx[tile_m, :] = ((wdy - (xhat * c1[:, None] + c2[:, None])) * r[:, None]).to(dx.dtype)
            dw_acc = dw_acc + torch.sum(dyf * xhat, dim=0)
            if with_bias:
                db_acc = db_acc + torch.sum(dyf, dim=0)
        dw_part[g, :] = dw_acc
        if with_bias:
            db_part[g, :] = db_acc
    return dx, dw_part, db_part


@helion.kernel(static_shapes=False)
def _layer_norm_bwd_dot(
    dy: Tensor, x: Tensor, weight: Tensor | None, mean: Tensor, rstd: Tensor
) -> tuple[Tensor, Tensor]:
    # Long rows, step 1 of 2: c1 = mean(w·dy·x̂), c2 = mean(w·dy) per row (looped reductions over dy and x).
    m, n = x.size()
    n = hl.specialize(n)
    c1 = torch.empty([m], dtype=torch.float32, device=x.device)
    c2 = torch.empty([m], dtype=torch.float32, device=x.device)
    for tile_m in hl.tile(m):
        wdy = dy[tile_m, :].to(torch.float32)
        if weight is not None:
            wdy = wdy * weight[None, :].to(torch.float32)
        xhat = (x[tile_m, :].to(torch.float32) - mean[tile_m][:, None]) * rstd[tile_m][:, None]
        c1[tile_m] = torch.sum(xhat * wdy, dim=-1) / n
        c2[tile_m] = torch.sum(wdy, dim=-1) / n
    return c1, c2


@helion.kernel(static_shapes=False)
def _layer_norm_bwd_looped(
    dy: Tensor,
    x: Tensor,
    weight: Tensor | None,
    mean: Tensor,
    rstd: Tensor,
    c1: Tensor,
    c2: Tensor,
    rows_per_program: int,
    groups: int,
    with_bias: hl.constexpr,
) -> tuple[Tensor, Tensor, Tensor]:
    # Long rows, step 2 of 2: program (row group, column block) reads dy and x again, writes dx, and sums its
    # rows' share of dw and db for its columns.
    m, n = x.size()
    n = hl.specialize(n)
    dx = torch.empty([m, n], dtype=x.dtype, device=x.device)
    dw_part = torch.empty([groups, n], dtype=torch.float32, device=x.device)
    db_part = torch.empty([groups, n], dtype=torch.float32, device=x.device)
    for tile_g, tile_n in hl.tile([groups, n], block_size=[1, None]):
        dw_acc = hl.zeros([tile_n], dtype=torch.float32)
        db_acc = hl.zeros([tile_n], dtype=torch.float32)
        first = tile_g.begin * rows_per_program
        for tile_m in hl.tile(first, min(first + rows_per_program, m)):
            dyf = dy[tile_m, tile_n].to(torch.float32)
            r = rstd[tile_m]
            xhat = (x[tile_m, tile_n].to(torch.float32) - mean[tile_m][:, None]) * r[:, None]
            wdy = dyf
            if weight is not None:
                wdy = dyf * weight[None, tile_n].to(torch.float32)
            dx[tile_m, tile_n] = ((wdy - (xhat * c1[tile_m][:, None] + c2[tile_m][:, None])) * r[:, None]).to(
                dx.dtype
            )
            dw_acc = dw_acc + torch.sum(dyf * xhat, dim=0)
            if with_bias:
                db_acc = db_acc + torch.sum(dyf, dim=0)
        dw_part[tile_g.begin, tile_n] = dw_acc
        if with_bias:
            db_part[tile_g.begin, tile_n] = db_acc
    return dx, dw_part, db_part


def layer_norm_fwd(
    x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float, dtype: torch.dtype | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """x: [M, N], weight/bias: [N] or None -> (y [M, N] in ``dtype`` (default x.dtype), mean [M] float32, rstd [M]
    float32)."""
    return _bind_fwd(x, weight, bias, eps, dtype)(x, weight, bias, eps, dtype)


def layer_norm_bwd(
    dy: Tensor, x: Tensor, weight: Tensor | None, bias: Tensor | None, mean: Tensor, rstd: Tensor
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """dy, x: [M, N]; weight/bias: [N] or None; mean, rstd: [M] -> (dx, dw or None, db or None)."""
    return _bind_bwd(dy, x, weight, bias, mean, rstd)(dy, x, weight, bias, mean, rstd)


def _bind_fwd(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float, out: torch.dtype | None = None,
              stats: bool = True) -> Callable[..., Any]:
    """``run(x, weight, bias, eps, out) -> (y, mean, rstd)``, or y alone with ``stats=False``."""
    N = x.shape[1]
    like = _helion.like(out or x.dtype, x.device)
    kernel = _layer_norm_fwd if N <= MAX_RESIDENT_FWD else _layer_norm_fwd_looped
    if not stats:  # (no mean or rstd: neither allocated nor written)
        fn, launcher = _helion.bind(kernel, (x, like, weight, bias, eps, None, None), N, x.device, rows=(0,))
        return lambda x, weight, bias, eps, out=None: fn(x, like, weight, bias, eps, None, None, _launcher=launcher)
    fn, launcher = _helion.bind(kernel, (x, like, weight, bias, eps, row_stats(x), row_stats(x)), N, x.device,
                                rows=(0, 5, 6))  # (examples of mean and rstd, for binding)

    def run(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float, out: torch.dtype | None = None
            ) -> tuple[Tensor, Tensor, Tensor]:
        mean, rstd = row_stats(x), row_stats(x)
        return fn(x, like, weight, bias, eps, mean, rstd, _launcher=launcher), mean, rstd
    return run


def _bind_bwd(dy: Tensor, x: Tensor, weight: Tensor | None, bias: Tensor | None, mean: Tensor, rstd: Tensor
              ) -> Callable[..., Any]:
    M, N = x.shape
    device = x.device
    with_bias = bias is not None
    sum_dw = lazy_sum_partials() if weight is not None else None
    sum_db = lazy_sum_partials() if bias is not None else None
    dot = None
    if N <= MAX_RESIDENT_BWD:
        rows, programs = _helion.persistent(M, device, _helion.programs_per_sm("_layer_norm_bwd", N, device, x.dtype))
        fn, launcher = _helion.bind(_layer_norm_bwd, (dy, x, weight, mean, rstd, rows, programs, with_bias), N,
                                    device, rows=(0, 1, 3, 4))
    else:
        dot, dot_launcher = _helion.bind(_layer_norm_bwd_dot, (dy, x, weight, mean, rstd), N, device,
                                         rows=(0, 1, 3, 4))
        block_n = _helion.config_for("_layer_norm_bwd_looped", N, device, x.dtype).block_sizes[0]
        rows, programs = _helion.row_groups(M, N, block_n, device)
        c1, c2 = (torch.empty(M, dtype=torch.float32, device=device) for _ in range(2))  # the dot's, for binding
        fn, launcher = _helion.bind(_layer_norm_bwd_looped,
                                    (dy, x, weight, mean, rstd, c1, c2, rows, programs, with_bias), N, device,
                                    rows=(0, 1, 3, 4, 5, 6))

    def run(dy: Tensor, x: Tensor, weight: Tensor | None, bias: Tensor | None, mean: Tensor, rstd: Tensor
            ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        if dot is None:
            dx, dw_part, db_part = fn(dy, x, weight, mean, rstd, rows, programs, with_bias, _launcher=launcher)
        else:
            c1, c2 = dot(dy, x, weight, mean, rstd, _launcher=dot_launcher)
            dx, dw_part, db_part = fn(dy, x, weight, mean, rstd, c1, c2, rows, programs, with_bias,
                                      _launcher=launcher)
        dw = sum_dw(dw_part, weight) if sum_dw is not None else None
        db = sum_db(db_part, bias) if sum_db is not None else None
        return dx, dw, db
    return run


# Binders (see hkernels/runtime/plan.py): the same function for every call of one signature, set up once.
layer_norm_fwd.bind = _bind_fwd  # type: ignore[attr-defined]
layer_norm_bwd.bind = _bind_bwd  # type: ignore[attr-defined]
