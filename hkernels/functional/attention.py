"""attention: scaled dot-product attention, flash algorithm, ``softmax(scale · q kᵀ [causal mask]) v``.

The public function and its checks, its autograd (custom ops ``hkernels::attention_fwd`` / ``_bwd``), then the
reference math and the torch backend. Kernels: ``hkernels/ops/attention.py`` (Helion),
``triton_fallback/attention.py``.
"""

from __future__ import annotations

from typing import Any

import torch

from hkernels import dispatch
from hkernels.functional._base import Public, Tensor, autograd, call, check_same, check_tensor, compute_dtype

OP = "attention"
HEAD_DIMS = (16, 32, 64, 128)


def attention(q: Tensor, k: Tensor, v: Tensor, causal: bool = False, scale: float | None = None) -> Tensor:
    """Scaled dot-product attention, flash algorithm: ``softmax(scale · q kᵀ [causal mask]) v``.

    q: [B, Hq, S, D]; k, v: [B, Hk, Skv, D] with Hq a multiple of Hk (grouped-query attention); D in 16, 32, 64,
    128; one dtype (bfloat16/float16; float32 too); any strides with unit stride along D (transposed views of
    [B, S, H, D] projections are read in place). ``scale`` defaults to D^-0.5. ``causal`` masks key j > query i
    and needs S == Skv (with different lengths, whether the mask aligns top-left or bottom-right is ambiguous:
    build the mask yourself). Returns [B, Hq, S, D] in q's dtype. Differentiable in q, k, v; the backward never
    materialises the S × Skv matrix.
    """
    return _CALLS(q, k, v, causal, scale)


def _check(q: Any, k: Any, v: Any, causal: Any, scale: Any) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(OP, name, t, (4,))
    check_same(OP, ("q", "k", "v"), q, k, v, shape=False)
    B, Hq, S, D = q.shape
    if k.shape != v.shape:
        raise ValueError(f"hkernels.attention: k and v must have the same shape, got {list(k.shape)} and "
                         f"{list(v.shape)}")
    if k.shape[0] != B or k.shape[3] != D:
        raise ValueError(f"hkernels.attention: q [B, Hq, S, D] = {list(q.shape)} and k [B, Hk, Skv, D] = "
                         f"{list(k.shape)} must agree on B and D")
    if k.shape[1] == 0 or Hq % k.shape[1]:
        raise ValueError(f"hkernels.attention: the query heads ({Hq}) must be a multiple of the key/value heads "
                         f"({k.shape[1]})")
    if D not in HEAD_DIMS:
        raise ValueError(f"hkernels.attention: head dim D must be one of {HEAD_DIMS}, got {D}")
    if causal and k.shape[2] != S:
        raise ValueError(f"hkernels.attention: causal=True needs as many queries as keys (S = {S}, Skv = "
                         f"{k.shape[2]}): with different lengths the mask's alignment is ambiguous")
    if scale is not None and (not isinstance(scale, (int, float)) or isinstance(scale, bool)):
        raise TypeError(f"hkernels.attention: scale must be a float or None, got {type(scale).__name__}")


def _body(request: str, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float | None) -> Tensor:
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    o, _ = call(_fwd, q, k, v, bool(causal), scale, request)
    return o


# ------------------------------------------------------------------------------------------------------ autograd


def _d_unit(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


@torch.library.custom_op("hkernels::attention_fwd", mutates_args=())
def _fwd(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, backend: str) -> tuple[Tensor, Tensor]:
    if q.numel() == 0 or k.numel() == 0:
        backend = "torch"
    return dispatch.run(OP, "attention_fwd", backend, _d_unit(q), _d_unit(k), _d_unit(v), causal, scale)


@_fwd.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, backend: str) -> tuple[Tensor, Tensor]:
    return q.new_empty(q.shape), q.new_empty(q.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("hkernels::attention_bwd", mutates_args=())
def _bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, causal: bool, scale: float,
         backend: str) -> tuple[Tensor, Tensor, Tensor]:
    if q.numel() == 0 or k.numel() == 0:
        backend = "torch"
    return dispatch.run(OP, "attention_bwd", backend, _d_unit(do), _d_unit(q), _d_unit(k), _d_unit(v), o, lse,
                        causal, scale)


@_bwd.register_fake
def _(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, causal: bool, scale: float,
      backend: str) -> tuple[Tensor, Tensor, Tensor]:
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
    q, k, v, causal, scale, backend = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.causal, ctx.scale, ctx.backend = causal, scale, backend
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)


def _backward(ctx: Any, do: Tensor | None, _dlse: Tensor | None) -> tuple[Tensor | None, ...]:
    if do is None:
        return (None,) * 6
    q, k, v, o, lse = ctx.saved_tensors
    dq, dk, dv = call(_bwd, do, q, k, v, o, lse, ctx.causal, ctx.scale, ctx.backend)
    return dq, dk, dv, None, None, None


autograd(_fwd, _backward, _setup)


# ------------------------------------------------------------------------------- reference and the torch backend


def reference(q: Tensor, k: Tensor, v: Tensor, causal: bool = False, scale: float | None = None) -> Tensor:
    """softmax(scale · q kᵀ, causal mask) v, with GQA: q [B, Hq, S, D], k/v [B, Hk, Skv, D], Hq a multiple of Hk."""
    ct = compute_dtype(q.dtype)
    group = q.shape[1] // k.shape[1]
    kf = k.to(ct).repeat_interleave(group, dim=1)
    vf = v.to(ct).repeat_interleave(group, dim=1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.matmul(q.to(ct), kf.transpose(-1, -2)) * scale
    if causal:
        s, skv = q.shape[2], k.shape[2]
        mask = torch.ones(s, skv, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), vf).to(q.dtype)


def attention_fwd(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    """-> (o [B, Hq, S, D] in q's dtype, lse [B, Hq, S] float32: logsumexp of the scaled, masked scores)."""
    ct = compute_dtype(q.dtype)
    group = q.shape[1] // k.shape[1]
    kf = k.to(ct).repeat_interleave(group, dim=1)
    vf = v.to(ct).repeat_interleave(group, dim=1)
    scores = torch.matmul(q.to(ct), kf.transpose(-1, -2)) * scale
    if causal:
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    o = torch.matmul(torch.exp(scores - lse[..., None]), vf)
    return o.to(q.dtype), lse.float()


def attention_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, causal: bool, scale: float
                  ) -> tuple[Tensor, Tensor, Tensor]:
    """P = exp(S − lse);  dV = Pᵀ dO;  dP = dO Vᵀ;  dS = P ∘ (dP − rowsum(dO ∘ O));  dQ = scale·dS K;  dK = scale·dSᵀ Q
    (dK, dV summed over each group's query heads)."""
    ct = compute_dtype(q.dtype)
    B, Hq, S, _ = q.shape
    Hk = k.shape[1]
    group = Hq // Hk
    qf, kf, vf = q.to(ct), k.to(ct).repeat_interleave(group, 1), v.to(ct).repeat_interleave(group, 1)
    dof, of = do.to(ct), o.to(ct)
    scores = torch.matmul(qf, kf.transpose(-1, -2)) * scale
    if causal:
        mask = torch.ones(S, k.shape[2], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
    p = torch.exp(scores - lse.to(ct)[..., None])
    dv = torch.matmul(p.transpose(-1, -2), dof)
    dp = torch.matmul(dof, vf.transpose(-1, -2))
    ds = p * (dp - (dof * of).sum(-1, keepdim=True))
    dq = torch.matmul(ds, kf) * scale
    dk = torch.matmul(ds.transpose(-1, -2), qf) * scale
    dk = dk.reshape(B, Hk, group, *dk.shape[2:]).sum(2)
    dv = dv.reshape(B, Hk, group, *dv.shape[2:]).sum(2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


_CALLS = Public(OP, _check, _body)
