"""Per-head RMS norm of q and k, then rotary embedding, in Helion (the twin of ``triton_fallback/qk_norm_rope.py``).

Math, per head row x of D elements with weight w [D], and the halves c1, c2 of cos and s1, s2 of sin at the row's
(batch, position):
    forward   r = 1 / sqrt(mean(x²) + eps),  n = x·r·w,  y1 = n1·c1 − n2·s1,  y2 = n2·c2 + n1·s2
    backward  dn1 = dy1·c1 + dy2·s2,  dn2 = dy2·c2 − dy1·s1  (the rotation transposed), then the norm's:
              x̂ = x·r,  g = dn·w,  dx = r·(g − x̂·mean(g·x̂)),  dw = Σ_rows dn·x̂

Shapes: q [B, Hq, S, D], k [B, Hk, S, D] (any strides with unit stride along D), weights [D], cos and sin [Bc, S, D]
contiguous (Bc = 1: shared by the batch, or B). Each tensor is one launch: the kernel sees it as [B, H, S, 2, D/2]
(the halves as an index), the tables as [B, S, 2, D/2] (stride 0 along B when shared).
Bytes for T = B·S tokens of b-byte elements, H = Hq + Hk heads: the forward reads and writes T·H·D·b each (plus
4·T·H for rstd and the tables, which each program re-reads from L2); the backward reads dy and x, writes dx:
3·T·H·D·b, plus a float32 partial of dw per program. The unfused pair (rms_norm, then rope) moves twice as much.
"""

from __future__ import annotations

from collections.abc import Callable

import helion
import helion.language as hl
import torch

from hkernels.ops import _helion
from hkernels.runtime.device import cdiv, num_sms
from triton_fallback.qk_norm_rope import outputs

Tensor = torch.Tensor
# The custom ops whose launches these host functions record at a symbolic length (see hkernels/ops/rms_norm.py).
SYMBOLIC = frozenset({"qk_norm_rope_fwd", "qk_norm_rope_bwd"})


@helion.kernel(static_shapes=False)
def _qk_norm_rope_fwd(
    x: Tensor, w: Tensor, cos: Tensor, sin: Tensor, eps: float, y: Tensor, rstd: Tensor
) -> None:
    # x, y: [B, H, S, 2, D/2]; w: [2, D/2]; cos, sin: [B, S, 2, D/2]; rstd: [B, H, S] float32.
    # A program normalises and rotates a block of positions of one (batch, head): reads its rows and the
    # positions' cos and sin once, writes the rotated rows and their rstd.
    b, h, s, _, half = x.size()
    half = hl.specialize(half)
    for tile_b, tile_h, tile_s in hl.tile([b, h, s], block_size=[1, 1, None]):
        x1 = x[tile_b, tile_h, tile_s, 0, :].to(torch.float32)
        x2 = x[tile_b, tile_h, tile_s, 1, :].to(torch.float32)
        r = torch.rsqrt((torch.sum(x1 * x1, dim=-1) + torch.sum(x2 * x2, dim=-1)) / (2 * half) + eps)
        n1 = x1 * r[:, :, :, None] * w[0, :].to(torch.float32)
        n2 = x2 * r[:, :, :, None] * w[1, :].to(torch.float32)
        c1 = cos[tile_b, tile_s, 0, :].to(torch.float32)[:, None, :, :]
        c2 = cos[tile_b, tile_s, 1, :].to(torch.float32)[:, None, :, :]
        s1 = sin[tile_b, tile_s, 0, :].to(torch.float32)[:, None, :, :]
        s2 = sin[tile_b, tile_s, 1, :].to(torch.float32)[:, None, :, :]
        y[tile_b, tile_h, tile_s, 0, :] = (n1 * c1 - n2 * s1).to(y.dtype)
        y[tile_b, tile_h, tile_s, 1, :] = (n2 * c2 + n1 * s2).to(y.dtype)
        rstd[tile_b, tile_h, tile_s] = r


@helion.kernel(static_shapes=False)
def _qk_norm_rope_bwd(
    dy: Tensor, x: Tensor, w: Tensor, cos: Tensor, sin: Tensor, rstd: Tensor, dx: Tensor, chunk: int, split: int
) -> Tensor:
    # dy, x, dx: [B, H, S, 2, D/2]; w: [2, D/2]; cos, sin: [B, S, 2, D/2]; rstd: [B, H, S].
    # Program (batch, head, g < split) walks positions [g·chunk, (g + 1)·chunk) (none past S) block by block:
    # reads dy, x and rstd once, writes dx, and keeps its share of dw in registers; returns the dw partials
    # [B, H, split, 2, D/2].
    b, h, s, _, half = x.size()
    half = hl.specialize(half)
    dw_part = torch.empty([b, h, split, 2, half], dtype=torch.float32, device=x.device)
    for tile_b, tile_h, tile_g in hl.tile([b, h, split], block_size=[1, 1, 1]):
        acc1 = hl.zeros([half], dtype=torch.float32)
        acc2 = hl.zeros([half], dtype=torch.float32)
        first = tile_g.begin * chunk
        for tile_s in hl.tile(first, min(first + chunk, s)):
            dy1 = dy[tile_b.begin, tile_h.begin, tile_s, 0, :].to(torch.float32)
            dy2 = dy[tile_b.begin, tile_h.begin, tile_s, 1, :].to(torch.float32)
            c1 = cos[tile_b.begin, tile_s, 0, :].to(torch.float32)
            c2 = cos[tile_b.begin, tile_s, 1, :].to(torch.float32)
            s1 = sin[tile_b.begin, tile_s, 0, :].to(torch.float32)
            s2 = sin[tile_b.begin, tile_s, 1, :].to(torch.float32)
            dn1 = dy1 * c1 + dy2 * s2
            dn2 = dy2 * c2 - dy1 * s1
            r = rstd[tile_b.begin, tile_h.begin, tile_s][:, None]
            xh1 = x[tile_b.begin, tile_h.begin, tile_s, 0, :].to(torch.float32) * r
            xh2 = x[tile_b.begin, tile_h.begin, tile_s, 1, :].to(torch.float32) * r
            g1 = dn1 * w[0, :].to(torch.float32)
            g2 = dn2 * w[1, :].to(torch.float32)
            dot = ((torch.sum(g1 * xh1, dim=-1) + torch.sum(g2 * xh2, dim=-1)) / (2 * half))[:, None]
            dx[tile_b.begin, tile_h.begin, tile_s, 0, :] = (r * (g1 - xh1 * dot)).to(dx.dtype)
            dx[tile_b.begin, tile_h.begin, tile_s, 1, :] = (r * (g2 - xh2 * dot)).to(dx.dtype)
            acc1 = acc1 + torch.sum(dn1 * xh1, dim=0)
            acc2 = acc2 + torch.sum(dn2 * xh2, dim=0)
        dw_part[tile_b.begin, tile_h.begin, tile_g.begin, 0, :] = acc1
        dw_part[tile_b.begin, tile_h.begin, tile_g.begin, 1, :] = acc2
    return dw_part


def _halves(t: Tensor) -> Tensor:
    """[B, H, S, D] -> [B, H, S, 2, D/2] (a view)."""
    return t.view(*t.shape[:3], 2, t.shape[3] // 2)


def _tables(cos: Tensor, sin: Tensor, B: int) -> tuple[Tensor, Tensor]:
    """[Bc, S, D] -> contiguous [B, S, 2, D/2] views (stride 0 along B when shared)."""
    S, D = cos.shape[1:]
    return tuple(t.contiguous().view(t.shape[0], S, 2, D // 2).expand(B, S, 2, D // 2) for t in (cos, sin))


def _weight(w: Tensor) -> Tensor:
    return w.contiguous().view(2, w.shape[0] // 2)


def _blocks(S: int) -> tuple[int, ...] | None:
    # Helion 1.5.0 takes a dim of size 1 for a broadcast and drops its mask and stride from the stores: every lane
    # of a larger block over it would write the one row. One position (decoding): blocks of one position.
    return (1,) if S == 1 else None


def _bind_fwd(q: Tensor, k: Tensor, q_weight: Tensor, k_weight: Tensor, cos: Tensor, sin: Tensor, eps: float
              ) -> Callable[..., tuple[Tensor, Tensor, Tensor, Tensor]]:
    """The forward for arguments of this signature: ``run(q, k, q_weight, k_weight, cos, sin, eps)``."""
    B, _, S, D = q.shape
    D = int(D)  # (the head dim the kernels specialise on: a constant of a graph with every size symbolic)
    device = q.device
    qo, ko, rq, rk = outputs(q, k)
    if B * S == 0:
        return lambda *args: (qo.clone(), ko.clone(), rq.clone(), rk.clone())
    c4, s4 = _tables(cos, sin, B)
    blocks = _blocks(S)
    fq, lq = _helion.bind(_qk_norm_rope_fwd, (_halves(q), _weight(q_weight), c4, s4, eps, _halves(qo), rq), D,
                          device, blocks)
    fk, lk = _helion.bind(_qk_norm_rope_fwd, (_halves(k), _weight(k_weight), c4, s4, eps, _halves(ko), rk), D,
                          device, blocks)

    def run(q: Tensor, k: Tensor, q_weight: Tensor, k_weight: Tensor, cos: Tensor, sin: Tensor, eps: float
            ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        qo, ko, rq, rk = outputs(q, k)
        c4, s4 = _tables(cos, sin, B)
        fq(_halves(q), _weight(q_weight), c4, s4, eps, _halves(qo), rq, _launcher=lq)
        fk(_halves(k), _weight(k_weight), c4, s4, eps, _halves(ko), rk, _launcher=lk)
        return qo, ko, rq, rk
    return run


def _chunk(S: int, B: int, H: int, device: torch.device) -> tuple[int, int]:
    """(positions per backward program, programs per head): about four programs per multiprocessor in all. For a
    symbolic length (a compiled graph's varying one) a constant count of programs per head, each walking a share
    of the length (a program past it loops zero times and writes a zero partial): no guard on S."""
    split = max(1, cdiv(4 * num_sms(device), (B if type(B) is int else 1) * int(H)))
    if type(S) is not int:
        return cdiv(S, split), split
    chunk = cdiv(S, max(1, min(S, split)))
    return chunk, cdiv(S, chunk)


def _bind_bwd(dq_out: Tensor, dk_out: Tensor, q: Tensor, k: Tensor, q_weight: Tensor, k_weight: Tensor, cos: Tensor,
              sin: Tensor, rstd_q: Tensor, rstd_k: Tensor) -> Callable[..., tuple[Tensor, Tensor, Tensor, Tensor]]:
    """The backward for arguments of this signature: ``run(dq_out, dk_out, q, k, q_weight, k_weight, cos, sin,
    rstd_q, rstd_k) -> (dq, dk, dq_weight, dk_weight)``."""
    B, _, S, D = q.shape
    D = int(D)  # (the head dim the kernels specialise on: a constant of a graph with every size symbolic)
    device = q.device
    if B * S == 0:
        def empty(*args: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
            return (torch.empty_like(q, memory_format=torch.contiguous_format),
                    torch.empty_like(k, memory_format=torch.contiguous_format), torch.zeros_like(q_weight),
                    torch.zeros_like(k_weight))
        return empty
    c4, s4 = _tables(cos, sin, B)
    bound = []
    for dy, x, w, rstd in ((dq_out, q, q_weight, rstd_q), (dk_out, k, k_weight, rstd_k)):
        dx = torch.empty((B, x.shape[1], S, D), dtype=x.dtype, device=device)
        chunk, split = _chunk(S, B, x.shape[1], device)
        fn, launcher = _helion.bind(_qk_norm_rope_bwd, (_halves(dy), _halves(x), _weight(w), c4, s4, rstd,
                                                        _halves(dx), chunk, split), D, device, _blocks(S))
        bound.append((fn, launcher, chunk, split))

    def one(i: int, dy: Tensor, x: Tensor, w: Tensor, c4: Tensor, s4: Tensor, rstd: Tensor) -> tuple[Tensor, Tensor]:
        fn, launcher, chunk, split = bound[i]
        dx = torch.empty((B, x.shape[1], S, D), dtype=x.dtype, device=device)
        part = fn(_halves(dy), _halves(x), _weight(w), c4, s4, rstd, _halves(dx), chunk, split, _launcher=launcher)
        return dx, part.sum((0, 1, 2)).reshape(D).to(w.dtype)

    def run(dq_out: Tensor, dk_out: Tensor, q: Tensor, k: Tensor, q_weight: Tensor, k_weight: Tensor, cos: Tensor,
            sin: Tensor, rstd_q: Tensor, rstd_k: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        c4, s4 = _tables(cos, sin, B)
        dq, dqw = one(0, dq_out, q, q_weight, c4, s4, rstd_q)
        dk, dkw = one(1, dk_out, k, k_weight, c4, s4, rstd_k)
        return dq, dk, dqw, dkw
    return run


def qk_norm_rope_fwd(q: Tensor, k: Tensor, q_weight: Tensor, k_weight: Tensor, cos: Tensor, sin: Tensor, eps: float
                     ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """As ``triton_fallback/qk_norm_rope.py``'s."""
    return _bind_fwd(q, k, q_weight, k_weight, cos, sin, eps)(q, k, q_weight, k_weight, cos, sin, eps)


def qk_norm_rope_bwd(dq_out: Tensor, dk_out: Tensor, q: Tensor, k: Tensor, q_weight: Tensor, k_weight: Tensor,
                     cos: Tensor, sin: Tensor, rstd_q: Tensor, rstd_k: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """As ``triton_fallback/qk_norm_rope.py``'s."""
    args = (dq_out, dk_out, q, k, q_weight, k_weight, cos, sin, rstd_q, rstd_k)
    return _bind_bwd(*args)(*args)


# Binders (see hkernels/runtime/plan.py): the same function for every call of one signature, set up once.
qk_norm_rope_fwd.bind = _bind_fwd  # type: ignore[attr-defined]
qk_norm_rope_bwd.bind = _bind_bwd  # type: ignore[attr-defined]
