"""Plain-PyTorch references: the truth the kernels are tested against, and the ``torch`` backend.

The first part is one function per op, written like the math. Math runs in float32 for 16-bit inputs (as the
kernels do) and in the input's own precision for float32 and float64, so ``reference.rms_norm(x.double(), ...)``
is the float64 reference the tests use. Results come back in the input's dtype.

The second part is the ``torch`` backend: ``<op>_fwd`` / ``<op>_bwd`` with the same signatures as the Helion
(``hkernels/ops``) and Triton (``triton_fallback``) backends, on 2-D ``[M, N]`` inputs, normalising over N.
"""

from __future__ import annotations

import math

import torch

Tensor = torch.Tensor


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def rms_norm(x: Tensor, weight: Tensor | None = None, eps: float = 1e-6) -> Tensor:
    """y = x / sqrt(mean(x², last dim) + eps) * weight.  x: [..., N], weight: [N]."""
    xf = x.to(_compute_dtype(x.dtype))
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.to(xf.dtype)
    return y.to(x.dtype)


def layer_norm(x: Tensor, weight: Tensor | None = None, bias: Tensor | None = None, eps: float = 1e-5) -> Tensor:
    """y = (x - mean) / sqrt(var + eps) * weight + bias over the last dim (biased variance).  x: [..., N]."""
    xf = x.to(_compute_dtype(x.dtype))
    mean = xf.mean(-1, keepdim=True)
    var = (xf - mean).pow(2).mean(-1, keepdim=True)
    y = (xf - mean) * torch.rsqrt(var + eps)
    if weight is not None:
        y = y * weight.to(xf.dtype)
    if bias is not None:
        y = y + bias.to(xf.dtype)
    return y.to(x.dtype)


def softmax(x: Tensor, dim: int = -1) -> Tensor:
    """y = exp(x - max(x)) / sum(exp(x - max(x))) along ``dim``."""
    xf = x.to(_compute_dtype(x.dtype))
    e = torch.exp(xf - xf.amax(dim, keepdim=True))
    return (e / e.sum(dim, keepdim=True)).to(x.dtype)


# ---------------------------------------------------------------------------------------------------------
# The torch backend. Forward returns what the backward of every backend needs; the backward formulas are the
# analytic ones (the tests hold them against autograd of the float64 reference above).
# ---------------------------------------------------------------------------------------------------------


def rms_norm_fwd(x: Tensor, weight: Tensor | None, eps: float) -> tuple[Tensor, Tensor]:
    """x: [M, N] -> (y [M, N] in x.dtype, rstd [M] float32)."""
    xf = x.to(_compute_dtype(x.dtype))
    rstd = torch.rsqrt(xf.pow(2).mean(-1) + eps)
    y = xf * rstd[:, None]
    if weight is not None:
        y = y * weight.to(xf.dtype)
    return y.to(x.dtype), rstd.float()


def rms_norm_bwd(dy: Tensor, x: Tensor, weight: Tensor | None, rstd: Tensor) -> tuple[Tensor, Tensor | None]:
    """dx = rstd·(w·dy) − x·rstd³·mean(w·dy·x);  dw = Σ_rows dy·x·rstd."""
    ct = _compute_dtype(x.dtype)
    xf, dyf, r = x.to(ct), dy.to(ct), rstd.to(ct)[:, None]
    wdy = dyf * weight.to(ct) if weight is not None else dyf
    dx = r * wdy - xf * r.pow(3) * (wdy * xf).mean(-1, keepdim=True)
    dw = (dyf * xf * r).sum(0).to(weight.dtype) if weight is not None else None
    return dx.to(x.dtype), dw


def layer_norm_fwd(
    x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    """x: [M, N] -> (y [M, N] in x.dtype, mean [M] float32, rstd [M] float32)."""
    xf = x.to(_compute_dtype(x.dtype))
    mean = xf.mean(-1)
    rstd = torch.rsqrt((xf - mean[:, None]).pow(2).mean(-1) + eps)
    y = (xf - mean[:, None]) * rstd[:, None]
    if weight is not None:
        y = y * weight.to(xf.dtype)
    if bias is not None:
        y = y + bias.to(xf.dtype)
    return y.to(x.dtype), mean.float(), rstd.float()


def layer_norm_bwd(
    dy: Tensor, x: Tensor, weight: Tensor | None, bias: Tensor | None, mean: Tensor, rstd: Tensor
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """x̂ = (x−mean)·rstd;  dx = rstd·(w·dy − mean(w·dy) − x̂·mean(w·dy·x̂));  dw = Σ dy·x̂;  db = Σ dy."""
    ct = _compute_dtype(x.dtype)
    dyf = dy.to(ct)
    xhat = (x.to(ct) - mean.to(ct)[:, None]) * rstd.to(ct)[:, None]
    wdy = dyf * weight.to(ct) if weight is not None else dyf
    dx = (wdy - wdy.mean(-1, keepdim=True) - xhat * (wdy * xhat).mean(-1, keepdim=True)) * rstd.to(ct)[:, None]
    dw = (dyf * xhat).sum(0).to(weight.dtype) if weight is not None else None
    db = dyf.sum(0).to(bias.dtype) if bias is not None else None
    return dx.to(x.dtype), dw, db


def softmax_fwd(x: Tensor) -> Tensor:
    """x: [M, N] -> softmax over N, in x.dtype."""
    return softmax(x, -1)


def softmax_bwd(dy: Tensor, y: Tensor) -> Tensor:
    """dx = y·(dy − Σ dy·y)."""
    ct = _compute_dtype(y.dtype)
    yf, dyf = y.to(ct), dy.to(ct)
    return (yf * (dyf - (dyf * yf).sum(-1, keepdim=True))).to(y.dtype)


# ---------------------------------------------------------------------------------------------------------
# The LLM operator set: references written like the math, then the torch backend of each.
# ---------------------------------------------------------------------------------------------------------


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """y = silu(gate) · up."""
    ct = _compute_dtype(gate.dtype)
    return (torch.nn.functional.silu(gate.to(ct)) * up.to(ct)).to(gate.dtype)


def geglu(gate: Tensor, up: Tensor, approximate: str = "tanh") -> Tensor:
    """y = gelu(gate) · up, gelu exact (``"none"``) or its tanh approximation."""
    ct = _compute_dtype(gate.dtype)
    return (torch.nn.functional.gelu(gate.to(ct), approximate=approximate) * up.to(ct)).to(gate.dtype)


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """Rotary embedding, Hugging Face's rotate_half form: x·cos + rotate_half(x)·sin for x in (q, k).

    q [B, Hq, S, D], k [B, Hk, S, D], cos/sin [S, D] or [B, S, D] (broadcast over heads).
    """
    ct = _compute_dtype(q.dtype)
    c = cos.to(ct).unsqueeze(-3)  # [.., 1, S, D]: the same angle for every head
    s = sin.to(ct).unsqueeze(-3)
    qf, kf = q.to(ct), k.to(ct)
    return (qf * c + _rotate_half(qf) * s).to(q.dtype), (kf * c + _rotate_half(kf) * s).to(k.dtype)


def add_rms_norm(
    x: Tensor, residual: Tensor, weight: Tensor | None = None, eps: float = 1e-6
) -> tuple[Tensor, Tensor]:
    """(rms_norm(x + residual) · weight, x + residual): the residual sum rounded to x's dtype, as in a model."""
    s = x + residual
    return rms_norm(s, weight, eps), s


def cross_entropy(
    logits: Tensor, target: Tensor, ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0
) -> Tensor:
    """torch.nn.functional.cross_entropy over logits [T, V] (float32 math for 16-bit logits)."""
    ct = _compute_dtype(logits.dtype)
    loss = torch.nn.functional.cross_entropy(
        logits.to(ct), target, ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing
    )
    return loss.to(logits.dtype)


def fused_linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
) -> Tensor:
    """cross_entropy(hidden @ weight.T + bias, target): hidden [T, H], weight [V, H], bias [V]. The logits are
    rounded to hidden's dtype (they come from a matmul in it); the loss is float32 (float64 for float64 input),
    as in Hugging Face's and Liger's losses: no logits are returned whose dtype the loss should follow."""
    logits = torch.nn.functional.linear(hidden, weight, bias)
    return cross_entropy(logits.to(_compute_dtype(logits.dtype)), target, ignore_index, reduction, label_smoothing)


def swiglu_fwd(gate: Tensor, up: Tensor) -> Tensor:
    """gate, up: [M, N] -> y [M, N]."""
    return swiglu(gate, up)


def swiglu_bwd(dy: Tensor, gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
    """dgate = dy·up·σ(g)·(1 + g·(1 − σ(g))),  dup = dy·silu(g)."""
    ct = _compute_dtype(gate.dtype)
    g, u, d = gate.to(ct), up.to(ct), dy.to(ct)
    sig = torch.sigmoid(g)
    return (d * u * sig * (1 + g * (1 - sig))).to(gate.dtype), (d * g * sig).to(up.dtype)


def geglu_fwd(gate: Tensor, up: Tensor, approximate: str) -> Tensor:
    """gate, up: [M, N] -> y [M, N]."""
    return geglu(gate, up, approximate)


def geglu_bwd(dy: Tensor, gate: Tensor, up: Tensor, approximate: str) -> tuple[Tensor, Tensor]:
    """dgate = dy·up·gelu'(g),  dup = dy·gelu(g)."""
    ct = _compute_dtype(gate.dtype)
    g, u, d = gate.to(ct), up.to(ct), dy.to(ct)
    if approximate == "tanh":
        k = math.sqrt(2 / math.pi)
        t = torch.tanh(k * (g + 0.044715 * g**3))
        gelu = 0.5 * g * (1 + t)
        dgelu = 0.5 * (1 + t) + 0.5 * g * (1 - t * t) * k * (1 + 3 * 0.044715 * g * g)
    else:
        gelu = 0.5 * g * (1 + torch.erf(g / math.sqrt(2)))
        dgelu = 0.5 * (1 + torch.erf(g / math.sqrt(2))) + g * torch.exp(-0.5 * g * g) / math.sqrt(2 * math.pi)
    return (d * u * dgelu).to(gate.dtype), (d * gelu).to(up.dtype)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor, transpose: bool) -> Tensor:
    # out1 = x1·c1 − x2·s1, out2 = x2·c2 + x1·s2; the transpose: dx1 = y1·c1 + y2·s2, dx2 = y2·c2 − y1·s1
    ct = _compute_dtype(x.dtype)
    half = x.shape[-1] // 2
    xf = x.to(ct)
    c, s = cos.to(ct).unsqueeze(1), sin.to(ct).unsqueeze(1)  # [Bc, 1, S, D]
    x1, x2 = xf[..., :half], xf[..., half:]
    c1, c2, s1, s2 = c[..., :half], c[..., half:], s[..., :half], s[..., half:]
    if transpose:
        out = torch.cat([x1 * c1 + x2 * s2, x2 * c2 - x1 * s1], dim=-1)
    else:
        out = torch.cat([x1 * c1 - x2 * s1, x2 * c2 + x1 * s2], dim=-1)
    return out.to(x.dtype)


def rope_fwd(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """q [B, Hq, S, D], k [B, Hk, S, D], cos/sin [Bc, S, D] (Bc = 1 or B) -> (q_rot, k_rot)."""
    return _rotate(q, cos, sin, False), _rotate(k, cos, sin, False)


def rope_bwd(dq: Tensor, dk: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """The transposed rotation of the upstream gradients."""
    return _rotate(dq, cos, sin, True), _rotate(dk, cos, sin, True)


def add_rms_norm_fwd(
    x: Tensor, residual: Tensor, weight: Tensor | None, eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    """x, residual: [M, N] -> (y, s = x + residual, rstd [M] float32 of s)."""
    s = x + residual
    y, rstd = rms_norm_fwd(s, weight, eps)
    return y, s, rstd


def add_rms_norm_bwd(
    dy: Tensor, ds: Tensor | None, s: Tensor, weight: Tensor | None, rstd: Tensor
) -> tuple[Tensor, Tensor | None]:
    """dsum = rms_norm's dx at s + ds (the gradient of x and of residual); dw."""
    ct = _compute_dtype(s.dtype)
    sf, dyf, r = s.to(ct), dy.to(ct), rstd.to(ct)[:, None]
    wdy = dyf * weight.to(ct) if weight is not None else dyf
    dx = r * wdy - sf * r.pow(3) * (wdy * sf).mean(-1, keepdim=True)
    if ds is not None:
        dx = dx + ds.to(ct)
    dw = (dyf * sf * r).sum(0).to(weight.dtype) if weight is not None else None
    return dx.to(s.dtype), dw


def cross_entropy_fwd(
    logits: Tensor, target: Tensor, scale: Tensor, ignore_index: int, label_smoothing: float, grad: Tensor | None
) -> Tensor:
    """logits [T, V], target [T], scale [T] -> loss [T] float32; gradient·scale into ``grad`` (may be logits).

    An out-of-range target (not ignore_index) gives a NaN loss and gradient row, as the kernels do.
    """
    ct = _compute_dtype(logits.dtype)
    V = logits.shape[1]
    valid = target != ignore_index
    in_range = (target >= 0) & (target < V)
    safe = torch.where(valid & in_range, target, 0)
    logp = torch.log_softmax(logits.to(ct), dim=-1)
    picked = logp.gather(1, safe[:, None])[:, 0]
    loss = -(1 - label_smoothing) * picked - label_smoothing * logp.mean(-1)
    bad = valid & ~in_range
    loss = torch.where(valid, torch.where(bad, float("nan"), loss), 0.0).float()
    if grad is None:
        return loss
    g = logp.exp() - label_smoothing / V
    g.scatter_add_(1, safe[:, None], torch.full_like(g[:, :1], -(1 - label_smoothing)))
    s = torch.where(valid, torch.where(bad, float("nan"), scale.to(ct)), 0.0)
    grad.copy_(g * s[:, None])
    return loss


def cross_entropy_bwd(dloss: Tensor, grad: Tensor) -> Tensor:
    """grad [R, V] *= dloss [R], in place."""
    ct = _compute_dtype(grad.dtype)
    return grad.copy_(grad.to(ct) * dloss.to(ct)[:, None])


def fused_linear_cross_entropy_fwd(
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Tensor | None,
    scale: Tensor,
    ignore_index: int,
    label_smoothing: float,
    with_grad: bool,
) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor | None]:
    """Chunked over tokens (the [T, V] logits never exist at once); see hkernels/_chunked.py."""
    from hkernels import _chunked

    return _chunked.linear_cross_entropy(
        hidden, weight, target, bias, scale, ignore_index, label_smoothing, with_grad, cross_entropy_fwd
    )


def fused_linear_cross_entropy_bwd(dloss: Tensor, grad: Tensor) -> Tensor:
    """grad [R, C] *= dloss [R], in place."""
    return cross_entropy_bwd(dloss, grad)


# ---------------------------------------------------------------------------------------------------------
# Matmul with an epilogue, and attention.
# ---------------------------------------------------------------------------------------------------------

ACTIVATIONS = (None, "relu", "gelu", "gelu_tanh", "silu")


def _activate(z: Tensor, activation: str | None) -> Tensor:
    if activation is None:
        return z
    if activation == "relu":
        return torch.relu(z)
    if activation == "gelu":
        return torch.nn.functional.gelu(z)
    if activation == "gelu_tanh":
        return torch.nn.functional.gelu(z, approximate="tanh")
    return torch.nn.functional.silu(z)


def matmul(a: Tensor, b: Tensor, bias: Tensor | None = None, activation: str | None = None) -> Tensor:
    """act(a @ b + bias): a [M, K] or [B, M, K], b [K, N] or [B, K, N]; float32 accumulation for 16-bit inputs."""
    ct = _compute_dtype(a.dtype)
    z = torch.matmul(a.to(ct), b.to(ct))
    if bias is not None:
        z = z + bias.to(ct)
    return _activate(z, activation).to(a.dtype)


def attention(q: Tensor, k: Tensor, v: Tensor, causal: bool = False, scale: float | None = None) -> Tensor:
    """softmax(scale · q kᵀ, causal mask) v, with GQA: q [B, Hq, S, D], k/v [B, Hk, Skv, D], Hq a multiple of Hk."""
    ct = _compute_dtype(q.dtype)
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


def matmul_fwd(
    a: Tensor, b: Tensor, bias: Tensor | None, activation: str | None, keep_pre: bool
) -> tuple[Tensor, Tensor | None]:
    """-> (act(a @ b + bias) in a's dtype, the pre-activation a @ b + bias (when keep_pre and an activation))."""
    ct = _compute_dtype(a.dtype)
    z = torch.matmul(a.to(ct), b.to(ct))
    if bias is not None:
        z = z + bias.to(ct)
    pre = z.to(a.dtype) if keep_pre and activation is not None else None
    return _activate(z, activation).to(a.dtype), pre


def matmul_act_bwd(dy: Tensor, z: Tensor, activation: str) -> Tensor:
    """dz = dy · act'(z) (written out: a custom op's implementation runs without autograd)."""
    ct = _compute_dtype(z.dtype)
    zf, d = z.to(ct), dy.to(ct)
    if activation == "relu":
        return torch.where(zf <= 0, 0.0, d).to(dy.dtype)  # NaN passes, as in torch.relu's backward
    if activation == "silu":
        sig = torch.sigmoid(zf)
        return (d * sig * (1 + zf * (1 - sig))).to(dy.dtype)
    if activation == "gelu":
        cdf = 0.5 * (1 + torch.erf(zf / math.sqrt(2)))
        return (d * (cdf + zf * torch.exp(-0.5 * zf * zf) / math.sqrt(2 * math.pi))).to(dy.dtype)
    k = math.sqrt(2 / math.pi)  # gelu_tanh
    t = torch.tanh(k * (zf + 0.044715 * zf**3))
    dgelu = 0.5 * (1 + t) + 0.5 * zf * (1 - t * t) * k * (1 + 3 * 0.044715 * zf * zf)
    return (d * dgelu).to(dy.dtype)


def attention_fwd(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    """-> (o [B, Hq, S, D] in q's dtype, lse [B, Hq, S] float32: logsumexp of the scaled, masked scores)."""
    ct = _compute_dtype(q.dtype)
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


def attention_bwd(
    do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, causal: bool, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    """P = exp(S − lse);  dV = Pᵀ dO;  dP = dO Vᵀ;  dS = P ∘ (dP − rowsum(dO ∘ O));  dQ = scale·dS K;  dK = scale·dSᵀ Q
    (dK, dV summed over each group's query heads)."""
    ct = _compute_dtype(q.dtype)
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
