"""qk_norm_rope: per-head RMS norm of q and k over the head dim, then rotary embedding, in one kernel (Qwen3, Gemma 3).

The public function and its checks, its autograd (custom ops ``hkernels::qk_norm_rope_fwd`` / ``_bwd``), then the
reference math and the torch backend. Kernels: ``hkernels/ops/qk_norm_rope.py`` (Helion),
``triton_fallback/qk_norm_rope.py``.
"""

from __future__ import annotations

from typing import Any

import torch

from hkernels import dispatch
from hkernels.functional._base import Public, Tensor, autograd, call, check_eps, check_tensor, compute_dtype
from hkernels.functional.rope import (
    _at,
    _d_unit,
    _rotate_half,
    _table,
    _table_grads,
    check_position_values,
    check_positions,
    check_tables,
)

OP = "qk_norm_rope"


def qk_norm_rope(q: Tensor, k: Tensor, q_weight: Tensor, k_weight: Tensor, cos: Tensor, sin: Tensor,
                 eps: float = 1e-6, position_ids: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """RMS norm of each head's row of q and of k over D (``x / sqrt(mean(x²) + eps) * weight``), then rotary position
    embedding in Hugging Face's rotate_half convention (``n·cos + rotate_half(n)·sin``): Qwen3's and Gemma 3's
    ``q_norm`` / ``k_norm`` followed by ``apply_rotary_pos_emb``, one read and one write of q and k.

    q: [B, Hq, S, D], k: [B, Hk, S, D] (GQA: Hk may differ), one dtype, D even and at least 4; any strides with unit
    stride along D (``proj(x).view(B, S, H, D).transpose(1, 2)`` is read in place). q_weight, k_weight: [D] (Gemma
    3's ``1 + weight`` is passed as that sum). cos, sin: [S, D] or [B, S, D]; with ``position_ids`` [S] or [B, S],
    tables [P, D] read at those rows (as :func:`hkernels.rope`). Math in float32 with one rounding at the end (the
    unfused modules round the normalised rows to q's dtype before rotating them). Returns (q_out, k_out),
    contiguous [B, H, S, D] in q's dtype. Differentiable in q, k and both weights (and in cos/sin, by PyTorch ops,
    when they require grad).
    """
    if position_ids is None:
        return _CALLS(q, k, q_weight, k_weight, cos, sin, eps)
    return _CALLS_AT(q, k, q_weight, k_weight, cos, sin, eps, position_ids)


def _check_weights(q: Tensor, k: Tensor, q_weight: Any, k_weight: Any, eps: Any) -> None:
    D = q.shape[-1]
    if D < 4:
        raise ValueError(f"hkernels.qk_norm_rope: the head dim D must be at least 4, got {D}")
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        check_tensor(OP, name, w, (1,))
        if w.shape[0] != D:
            raise ValueError(f"hkernels.qk_norm_rope: {name} must be [D] = [{D}], got {list(w.shape)}")
        if w.device != q.device:
            raise ValueError(f"hkernels.qk_norm_rope: {name} is on {w.device} but q is on {q.device}")
    check_eps(OP, eps)


def _check(q: Any, k: Any, q_weight: Any, k_weight: Any, cos: Any, sin: Any, eps: Any) -> None:
    check_tables(q, k, cos, sin, OP)
    _check_weights(q, k, q_weight, k_weight, eps)


def _check_at(q: Any, k: Any, q_weight: Any, k_weight: Any, cos: Any, sin: Any, eps: Any, position_ids: Any) -> None:
    check_positions(q, k, cos, sin, position_ids, OP)
    _check_weights(q, k, q_weight, k_weight, eps)


def _values_at(q: Tensor, k: Tensor, q_weight: Tensor, k_weight: Tensor, cos: Tensor, sin: Tensor, eps: float,
               position_ids: Tensor) -> None:
    check_position_values(cos, position_ids, OP)


def _body(request: str, q: Tensor, k: Tensor, q_weight: Tensor, k_weight: Tensor, cos: Tensor, sin: Tensor,
          eps: float) -> tuple[Tensor, Tensor]:
    qo, ko, _, _ = call(_fwd, q, k, q_weight, k_weight, _table(cos), _table(sin), float(eps), request)
    return qo, ko


def _body_at(request: str, q: Tensor, k: Tensor, q_weight: Tensor, k_weight: Tensor, cos: Tensor, sin: Tensor,
             eps: float, position_ids: Tensor) -> tuple[Tensor, Tensor]:
    c, s = _at(cos, sin, position_ids)  # the rows at the positions: the tables the kernels take without them
    qo, ko, _, _ = call(_fwd, q, k, q_weight, k_weight, _table(c), _table(s), float(eps), request)
    return qo, ko


# ------------------------------------------------------------------------------------------------------ autograd


@torch.library.custom_op("hkernels::qk_norm_rope_fwd", mutates_args=())
def _fwd(q: Tensor, k: Tensor, q_weight: Tensor, k_weight: Tensor, cos: Tensor, sin: Tensor, eps: float,
         backend: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    if q.numel() == 0 or k.numel() == 0:  # nothing for a kernel to do
        backend = "torch"
    return dispatch.run(OP, "qk_norm_rope_fwd", backend, _d_unit(q), _d_unit(k), q_weight, k_weight, cos, sin, eps)


@_fwd.register_fake
def _(q: Tensor, k: Tensor, q_weight: Tensor, k_weight: Tensor, cos: Tensor, sin: Tensor, eps: float,
      backend: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    stats = torch.float64 if q.dtype == torch.float64 else torch.float32
    return (q.new_empty(q.shape), k.new_empty(k.shape), q.new_empty(q.shape[:3], dtype=stats),
            k.new_empty(k.shape[:3], dtype=stats))


@torch.library.custom_op("hkernels::qk_norm_rope_bwd", mutates_args=())
def _bwd(dq_out: Tensor, dk_out: Tensor, q: Tensor, k: Tensor, q_weight: Tensor, k_weight: Tensor, cos: Tensor,
         sin: Tensor, rstd_q: Tensor, rstd_k: Tensor, backend: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    if q.numel() == 0 or k.numel() == 0:
        backend = "torch"
    return dispatch.run(OP, "qk_norm_rope_bwd", backend, _d_unit(dq_out), _d_unit(dk_out), _d_unit(q), _d_unit(k),
                        q_weight, k_weight, cos, sin, rstd_q, rstd_k)


@_bwd.register_fake
def _(dq_out: Tensor, dk_out: Tensor, q: Tensor, k: Tensor, q_weight: Tensor, k_weight: Tensor, cos: Tensor,
      sin: Tensor, rstd_q: Tensor, rstd_k: Tensor, backend: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return q.new_empty(q.shape), k.new_empty(k.shape), q_weight.new_empty(q_weight.shape), k_weight.new_empty(
        k_weight.shape)


def _setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, ...]) -> None:
    q, k, q_weight, k_weight, cos, sin, _eps, backend = inputs
    ctx.save_for_backward(q, k, q_weight, k_weight, cos, sin, output[2], output[3])
    ctx.backend = backend
    ctx.mark_non_differentiable(output[2], output[3])
    ctx.set_materialize_grads(False)


def _backward(ctx: Any, dq_out: Tensor | None, dk_out: Tensor | None, _drq: Any, _drk: Any
              ) -> tuple[Tensor | None, ...]:
    q, k, q_weight, k_weight, cos, sin, rstd_q, rstd_k = ctx.saved_tensors
    if dq_out is None and dk_out is None:
        return (None,) * 8
    dq_out = dq_out if dq_out is not None else q.new_zeros(q.shape)
    dk_out = dk_out if dk_out is not None else k.new_zeros(k.shape)
    dq, dk, dqw, dkw = call(_bwd, dq_out, dk_out, q, k, q_weight, k_weight, cos, sin, rstd_q, rstd_k, ctx.backend)
    dcos = dsin = None
    if cos.requires_grad or sin.requires_grad:
        # Learned rotary tables (rare): their gradients by PyTorch ops, from the normalised rows.
        nq, nk = _normed(q, q_weight, rstd_q), _normed(k, k_weight, rstd_k)
        dcos, dsin = _table_grads(nq, nk, dq_out, dk_out, cos)
    return dq, dk, dqw, dkw, dcos, dsin, None, None


def _normed(x: Tensor, w: Tensor, rstd: Tensor) -> Tensor:
    ct = compute_dtype(x.dtype)
    return x.to(ct) * rstd.to(ct).unsqueeze(-1) * w.to(ct)


autograd(_fwd, _backward, _setup)


# ------------------------------------------------------------------------------- reference and the torch backend


def reference(q: Tensor, k: Tensor, q_weight: Tensor, k_weight: Tensor, cos: Tensor, sin: Tensor, eps: float = 1e-6,
              position_ids: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """n = x / sqrt(mean(x², over D) + eps) · w for x in (q, k), then n·cos + rotate_half(n)·sin; in float32 (float64
    for float64 inputs), rounded once. q [B, Hq, S, D], k [B, Hk, S, D], weights [D], cos/sin [S, D] or [B, S, D]
    (with position_ids [S] or [B, S]: tables [P, D], NaN rows for positions outside [0, P))."""
    if position_ids is not None:
        cos, sin = _at(cos, sin, position_ids)
    ct = compute_dtype(q.dtype)
    c, s = cos.to(ct).unsqueeze(-3), sin.to(ct).unsqueeze(-3)  # [.., 1, S, D]: the same angle for every head

    def one(x: Tensor, w: Tensor) -> Tensor:
        xf = x.to(ct)
        n = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.to(ct)
        return (n * c + _rotate_half(n) * s).to(x.dtype)

    return one(q, q_weight), one(k, k_weight)


def _norm_rotate(x: Tensor, w: Tensor, cos: Tensor, sin: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    ct = compute_dtype(x.dtype)
    xf = x.to(ct)
    r = torch.rsqrt(xf.pow(2).mean(-1) + eps)  # [B, H, S]
    n = xf * r.unsqueeze(-1) * w.to(ct)
    c, s = cos.to(ct).unsqueeze(1), sin.to(ct).unsqueeze(1)  # [Bc, 1, S, D]
    return (n * c + _rotate_half(n) * s).to(x.dtype), r.to(torch.float64 if ct == torch.float64 else torch.float32)


def _norm_rotate_bwd(dy: Tensor, x: Tensor, w: Tensor, cos: Tensor, sin: Tensor, rstd: Tensor
                     ) -> tuple[Tensor, Tensor]:
    # dn = the rotation transposed: dn1 = dy1·c1 + dy2·s2, dn2 = dy2·c2 − dy1·s1; then the norm's backward:
    # dx = r·(g − x̂·mean(g·x̂)) with g = dn·w, x̂ = x·r; dw = Σ_rows dn·x̂.
    ct = compute_dtype(x.dtype)
    half = x.shape[-1] // 2
    dyf = dy.to(ct)
    c, s = cos.to(ct).unsqueeze(1), sin.to(ct).unsqueeze(1)
    d1, d2 = dyf[..., :half], dyf[..., half:]
    dn = torch.cat([d1 * c[..., :half] + d2 * s[..., half:], d2 * c[..., half:] - d1 * s[..., :half]], dim=-1)
    r = rstd.to(ct).unsqueeze(-1)
    xh = x.to(ct) * r
    g = dn * w.to(ct)
    dx = r * (g - xh * (g * xh).mean(-1, keepdim=True))
    return dx.to(x.dtype), (dn * xh).sum((0, 1, 2)).to(w.dtype)


def qk_norm_rope_fwd(q: Tensor, k: Tensor, q_weight: Tensor, k_weight: Tensor, cos: Tensor, sin: Tensor, eps: float
                     ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """q [B, Hq, S, D], k [B, Hk, S, D], weights [D], cos/sin [Bc, S, D] -> (q_out, k_out, rstd_q, rstd_k)."""
    qo, rq = _norm_rotate(q, q_weight, cos, sin, eps)
    ko, rk = _norm_rotate(k, k_weight, cos, sin, eps)
    return qo, ko, rq, rk


def qk_norm_rope_bwd(dq_out: Tensor, dk_out: Tensor, q: Tensor, k: Tensor, q_weight: Tensor, k_weight: Tensor,
                     cos: Tensor, sin: Tensor, rstd_q: Tensor, rstd_k: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The gradients of q, k and the weights from those of the outputs."""
    dq, dqw = _norm_rotate_bwd(dq_out, q, q_weight, cos, sin, rstd_q)
    dk, dkw = _norm_rotate_bwd(dk_out, k, k_weight, cos, sin, rstd_k)
    return dq, dk, dqw, dkw


_CALLS = Public(OP, _check, _body)
_CALLS_AT = Public(OP, _check_at, _body_at, values=_values_at)  # calls with position_ids: a path of their own
