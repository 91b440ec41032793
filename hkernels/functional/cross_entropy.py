"""cross_entropy: ``torch.nn.functional.cross_entropy`` for language-model logits, loss and gradient in one pass.

The public function and its checks, its autograd (custom ops ``hkernels::cross_entropy_fwd``, ``_grad`` and the
in-place ``loss_grad_scale_`` it shares with the linear loss), then the reference math and the torch backend.
Kernels: ``hkernels/ops/cross_entropy.py`` (Helion), ``triton_fallback/cross_entropy.py``.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

from hkernels import dispatch
from hkernels.functional._base import (
    Autocast,
    Public,
    Tensor,
    autograd,
    call,
    check_range,
    check_tensor,
    compute_dtype,
    placeholder,
    rows,
)

OP = "cross_entropy"
REDUCTIONS = ("mean", "sum", "none")


class CrossEntropyOutput(NamedTuple):
    """What the losses return when asked for more than the loss (the fields of Liger's ``CrossEntropyOutput``, and
    the entropy): each None unless asked for. ``z_loss`` is reduced as the loss is; ``token_accuracy`` and
    ``entropy`` are means over the tokens kept (per token, 0 where ignored, with reduction "none");
    ``predicted_tokens`` [T] int64 is each token's argmax class, −1 where ignored. All computed in the loss's own
    pass over the logits, none differentiable but ``loss``."""

    loss: Tensor
    z_loss: Tensor | None = None
    token_accuracy: Tensor | None = None
    predicted_tokens: Tensor | None = None
    entropy: Tensor | None = None


def cross_entropy(
    logits: Tensor, target: Tensor, ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0,
    *, lse_square_scale: float = 0.0, softcap: float | None = None, return_z_loss: bool = False,
    return_token_accuracy: bool = False, return_predicted_tokens: bool = False, return_entropy: bool = False,
    weight: Tensor | None = None,
) -> Tensor | CrossEntropyOutput:
    """``torch.nn.functional.cross_entropy`` for language-model logits, loss and gradient in one pass.

    logits: [T, V] (tokens × vocabulary; flatten leading dims first), float16/bfloat16/float32; target: [T] class
    indices; ``ignore_index`` tokens contribute nothing (a mean divides by the others; NaN when there are none, as
    PyTorch). A target outside [0, V) that is not ignore_index gives NaN (PyTorch raises; checking costs a host
    sync: ``HKERNELS_CHECK=1`` raises instead). Math in float32; the loss has logits' dtype. Differentiable in
    logits: with reduction mean or sum the gradient is written by the forward kernel while the logits are read (the
    logits need not be kept), and the backward only scales it, in place, when the upstream gradient is not 1.
    Under autocast (where PyTorch's cross_entropy computes in float32: CUDA and CPU) the loss is float32, the
    logits read as they are (no float32 copy) and their gradient in their own dtype.

    Options, as Liger's cross_entropy names them, fused into the same passes over the logits: ``softcap`` c > 0
    caps each logit to c·tanh(x / c) first (Gemma 2/3's final logit softcapping); ``lse_square_scale`` λ ≥ 0 adds
    the z-loss λ·lse² of each token to its loss. The metrics trainers log, from the same pass (no logits kept for
    them): ``return_z_loss`` (the z term, reduced as the loss is: it is part of ``loss``),
    ``return_token_accuracy``, ``return_predicted_tokens`` and ``return_entropy`` (of each token's softmax). With
    any of them the result is a :class:`CrossEntropyOutput` (a NamedTuple: Liger's field names, and entropy), else
    the loss. ``weight`` [V]: each class's weight, as ``F.cross_entropy`` takes it (keyword-only here; a mean
    divides by the kept tokens' weights; the z term and the metrics are not weighted).
    """
    if isinstance(weight, Tensor) and weight.is_floating_point():  # (a class weight takes no gradient, as in PyTorch)
        weight = weight.detach().float()
    return _CALLS(logits, target, ignore_index, reduction, label_smoothing, lse_square_scale, softcap,
                  (return_z_loss, return_token_accuracy, return_predicted_tokens, return_entropy), weight, False)


def check_loss_options(op: str, lse_square_scale: Any, softcap: Any, returns: Any) -> None:
    """The checks of the loss options the two losses share."""
    if not isinstance(lse_square_scale, (int, float)) or isinstance(lse_square_scale, bool) \
            or not 0.0 <= lse_square_scale < math.inf:
        raise ValueError(f"hkernels.{op}: lse_square_scale must be a finite float >= 0, got {lse_square_scale!r}")
    if softcap is not None and (not isinstance(softcap, (int, float)) or isinstance(softcap, bool)
                                or not 0.0 < softcap < math.inf):
        raise ValueError(f"hkernels.{op}: softcap must be None or a finite float > 0, got {softcap!r}")
    for name, flag in zip(RETURNS, returns, strict=True):
        if not isinstance(flag, bool):
            raise TypeError(f"hkernels.{op}: {name} must be a bool, got {type(flag).__name__}")


RETURNS = ("return_z_loss", "return_token_accuracy", "return_predicted_tokens", "return_entropy")


def loss_output(loss: Tensor, z: Tensor, pred: Tensor, ent: Tensor, target: Tensor, ignore_index: int,
                reduction: str, returns: tuple[bool, bool, bool, bool]) -> Tensor | CrossEntropyOutput:
    """The loss, or the :class:`CrossEntropyOutput` the ``returns`` flags ask for, from the custom op's outputs: the
    reduced z term, each row's predicted class and entropy (the accuracy follows from the prediction)."""
    if not any(returns):
        return loss
    want_z, want_acc, want_pred, want_ent = returns
    valid = target != ignore_index

    def per_token_mean(rows: Tensor) -> Tensor:  # the metrics: a mean over the kept tokens, or per token
        return rows if reduction == "none" else rows.sum() / valid.sum()

    accuracy = per_token_mean(((pred == target) & valid).float()) if want_acc else None
    return CrossEntropyOutput(loss, z if want_z else None, accuracy, pred if want_pred else None,
                              per_token_mean(ent) if want_ent else None)


def check_class_weight(op: str, weight: Any, v: int, device: torch.device) -> None:
    if weight is None:
        return
    if not isinstance(weight, torch.Tensor) or not weight.is_floating_point():
        raise TypeError(f"hkernels.{op}: weight must be None or a floating-point tensor of the classes' weights, got "
                        f"{getattr(weight, 'dtype', type(weight).__name__)}")
    if weight.shape != (v,):
        raise ValueError(f"hkernels.{op}: weight must have shape [V] = [{v}], got {list(weight.shape)}")
    if weight.device != device:
        raise ValueError(f"hkernels.{op}: weight is on {weight.device} but the inputs are on {device}")


def check_loss_args(op: str, target: Any, t: int, device: torch.device, ignore_index: Any, reduction: Any,
                    label_smoothing: Any) -> None:
    """The checks the two losses share."""
    if not isinstance(target, torch.Tensor):
        raise TypeError(f"hkernels.{op}: target must be a torch.Tensor, got {type(target).__name__}")
    if target.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8):
        raise TypeError(f"hkernels.{op}: target must hold class indices (an integer tensor), got {target.dtype}")
    if target.shape != (t,):
        raise ValueError(f"hkernels.{op}: target must have shape [T] = [{t}], got {list(target.shape)}")
    if target.device != device:
        raise ValueError(f"hkernels.{op}: target is on {target.device} but the inputs are on {device}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"hkernels.{op}: reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if not isinstance(ignore_index, int) or isinstance(ignore_index, bool):
        raise TypeError(f"hkernels.{op}: ignore_index must be an int, got {type(ignore_index).__name__}")
    if not isinstance(label_smoothing, (int, float)) or not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"hkernels.{op}: label_smoothing must be a float in [0, 1], got {label_smoothing!r}")


def _check(logits: Any, target: Any, ignore_index: Any, reduction: Any, label_smoothing: Any, lse_square_scale: Any,
           softcap: Any, returns: Any, weight: Any, float32_loss: bool) -> None:
    check_tensor(OP, "logits", logits, (2,))
    check_loss_args(OP, target, logits.shape[0], logits.device, ignore_index, reduction, label_smoothing)
    check_loss_options(OP, lse_square_scale, softcap, returns)
    check_class_weight(OP, weight, logits.shape[1], logits.device)
    if logits.shape[1] == 0:
        raise ValueError("hkernels.cross_entropy: logits has no classes (V = 0)")


def _values(logits: Tensor, target: Tensor, ignore_index: int, reduction: str, label_smoothing: float,
            lse_square_scale: float, softcap: float | None, returns: tuple[bool, ...], weight: Tensor | None,
            float32_loss: bool) -> None:
    check_range(OP, "target", target, 0, logits.shape[1], ignore_index)


def routed(arguments: dict[str, Any]) -> tuple[Tensor, ...]:
    """The tensors the kernels take: the logits and the targets (a class weight reaches them as float32 whatever
    its dtype)."""
    return tuple(t for t in (arguments.get("logits"), arguments.get("target")) if isinstance(t, Tensor))


def _body(request: str, logits: Tensor, target: Tensor, ignore_index: int, reduction: str,
          label_smoothing: float, lse_square_scale: float, softcap: float | None,
          returns: tuple[bool, bool, bool, bool], weight: Tensor | None,
          float32_loss: bool) -> Tensor | CrossEntropyOutput:
    fused = reduction != "none" and logits.requires_grad and torch.is_grad_enabled()
    target = target.to(torch.int64)
    loss, _, z, pred, ent = call(_fwd, logits, target, ignore_index, float(label_smoothing), reduction, fused,
                                 float32_loss, float(softcap or 0.0), float(lse_square_scale), returns[0],
                                 any(returns[1:]), weight, request)
    return loss_output(loss, z, pred, ent, target, ignore_index, reduction, returns)


# ------------------------------------------------------------------------------------------------------ autograd


def loss_scale(target: Tensor, ignore_index: int, reduction: str, weight: Tensor | None = None
               ) -> tuple[Tensor, Tensor]:
    """(valid-token count, the gradient's factor per token [T] float32): 1/count for a mean, else 1. With class
    weights the count is the kept tokens' weights summed, as F.cross_entropy's mean divides by.

    Both stay on the device: no host sync, so a call can be captured in a CUDA graph.
    """
    valid = target != ignore_index
    if weight is not None:
        count = torch.where(valid, weight[torch.where(valid, target, 0).clamp(0, weight.shape[0] - 1)], 0.0).sum()
    else:
        count = valid.sum()
    T = target.shape[0]
    if reduction == "mean":
        return count, (1.0 / count.to(torch.float32)).reshape(1).expand(T)
    return count, torch.ones(1, dtype=torch.float32, device=target.device).expand(T)


def reduce(loss: Tensor, count: Tensor, reduction: str, dtype: torch.dtype) -> Tensor:
    if reduction == "mean":
        return (loss.sum() / count).to(dtype)  # 0/0 = NaN when every target is ignored, as in PyTorch
    if reduction == "sum":
        return loss.sum().to(dtype)
    return loss.to(dtype)


def loss_like(logits: Tensor, t: int, reduction: str, dtype: torch.dtype | None = None) -> Tensor:
    return logits.new_empty(() if reduction != "none" else (t,), dtype=dtype)


def stats_like(x: Tensor) -> tuple[Tensor, Tensor]:
    """Buffers for each row's predicted class (int64) and entropy (float32)."""
    return (x.new_empty(x.shape[0], dtype=torch.int64), x.new_empty(x.shape[0], dtype=torch.float32))


def loss_dtype(logits: Tensor, float32_loss: bool) -> torch.dtype:
    """The loss's dtype: the logits' own, or at least float32 (under autocast: PyTorch's loss there)."""
    return compute_dtype(logits.dtype) if float32_loss else logits.dtype


@torch.library.custom_op("hkernels::cross_entropy_fwd", mutates_args=())
def _fwd(logits: Tensor, target: Tensor, ignore_index: int, label_smoothing: float, reduction: str, fused_grad: bool,
         float32_loss: bool, softcap: float, z_scale: float, want_z: bool, want_stats: bool, weight: Tensor | None,
         backend: str) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    count, scale = loss_scale(target, ignore_index, reduction, weight)
    # Contiguous whatever logits' layout: the Triton kernel writes rows of unit column stride (a transposed
    # logits' empty_like would not have it).
    grad = logits.new_empty(logits.shape) if fused_grad else None
    z = logits.new_zeros(logits.shape[0], dtype=torch.float32) if want_z else None
    stats = stats_like(logits) if want_stats else None
    if logits.numel() == 0:
        loss = logits.new_zeros(logits.shape[0], dtype=torch.float32)
    else:
        loss = dispatch.run(OP, "cross_entropy_fwd", backend, rows(logits), target, scale, ignore_index,
                            label_smoothing, grad, softcap, z_scale, z if z_scale else None, stats, weight)
    dtype = loss_dtype(logits, float32_loss)
    z_loss = reduce(z, count, reduction, dtype) if z is not None else placeholder(logits)
    pred, ent = stats if stats is not None else (placeholder(target), placeholder(logits))
    return (reduce(loss, count, reduction, dtype), grad if grad is not None else placeholder(logits), z_loss, pred,
            ent)


@_fwd.register_fake
def _(logits: Tensor, target: Tensor, ignore_index: int, label_smoothing: float, reduction: str, fused_grad: bool,
      float32_loss: bool, softcap: float, z_scale: float, want_z: bool, want_stats: bool, weight: Tensor | None,
      backend: str) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    grad = logits.new_empty(logits.shape) if fused_grad else placeholder(logits)
    dtype = loss_dtype(logits, float32_loss)
    z = loss_like(logits, logits.shape[0], reduction, dtype) if want_z else placeholder(logits)
    pred, ent = stats_like(logits) if want_stats else (placeholder(target), placeholder(logits))
    return loss_like(logits, logits.shape[0], reduction, dtype), grad, z, pred, ent


@torch.library.custom_op("hkernels::cross_entropy_grad", mutates_args=())
def _grad(dloss: Tensor, logits: Tensor, target: Tensor, ignore_index: int, label_smoothing: float, softcap: float,
          z_scale: float, weight: Tensor | None, backend: str) -> Tensor:
    # reduction="none": the gradient is made in the backward, scaled per token by dloss as it is written.
    grad = logits.new_empty(logits.shape)  # contiguous (see _fwd)
    if logits.numel():
        dispatch.run(OP, "cross_entropy_fwd", backend, rows(logits), target, dloss.float(), ignore_index,
                     label_smoothing, grad, softcap, z_scale, None, None, weight)
    return grad


@_grad.register_fake
def _(dloss: Tensor, logits: Tensor, target: Tensor, ignore_index: int, label_smoothing: float, softcap: float,
      z_scale: float, weight: Tensor | None, backend: str) -> Tensor:
    return logits.new_empty(logits.shape)


@torch.library.custom_op("hkernels::loss_grad_scale_", mutates_args=("grad",))
def loss_grad_scale_(grad: Tensor, dloss: Tensor, op: str, backend: str) -> None:
    """grad *= dloss (a 0-d factor), in place, by ``op``'s backward kernel; nothing moves when the factor is exactly
    1 (a plain loss.backward())."""
    if grad.numel():
        rows2d = grad.reshape(-1, grad.shape[-1]) if grad.dim() > 1 else grad.reshape(1, -1)
        dispatch.run(op, f"{op}_bwd", backend, dloss.float().reshape(1).expand(rows2d.shape[0]), rows2d)


@loss_grad_scale_.register_fake
def _(grad: Tensor, dloss: Tensor, op: str, backend: str) -> None:
    return None


def _setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, ...]) -> None:
    (logits, target, ignore_index, label_smoothing, _reduction, fused_grad, _float32_loss, softcap, z_scale, _want_z,
     _want_stats, weight, backend) = inputs
    ctx.fused, ctx.backend = fused_grad, backend
    ctx.ignore_index, ctx.label_smoothing, ctx.softcap, ctx.z_scale = ignore_index, label_smoothing, softcap, z_scale
    # The fused path keeps only the gradient; the logits can be freed once the loss is known.
    ctx.save_for_backward(*((output[1],) if fused_grad else (logits, target, weight)))
    ctx.mark_non_differentiable(*output[1:])  # (the z term is inside the loss: no gradient of its own)
    ctx.set_materialize_grads(False)


def _backward(ctx: Any, dloss: Tensor | None, *_unused: Tensor | None) -> tuple[Tensor | None, ...]:
    if dloss is None:
        return (None,) * 13
    if ctx.fused:
        (grad,) = ctx.saved_tensors
        call(loss_grad_scale_, grad, dloss, OP, ctx.backend)
    else:
        logits, target, weight = ctx.saved_tensors
        dloss = dloss.expand(target.shape) if dloss.dim() == 0 else dloss
        grad = call(_grad, dloss, logits, target, ctx.ignore_index, ctx.label_smoothing, ctx.softcap, ctx.z_scale,
                    weight, ctx.backend)
    return grad, None, None, None, None, None, None, None, None, None, None, None, None


autograd(_fwd, _backward, _setup)


# ------------------------------------------------------------------------------- reference and the torch backend


def reference(
    logits: Tensor, target: Tensor, ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0,
    *, lse_square_scale: float = 0.0, softcap: float | None = None, return_z_loss: bool = False,
    return_token_accuracy: bool = False, return_predicted_tokens: bool = False, return_entropy: bool = False,
    weight: Tensor | None = None,
) -> Tensor | CrossEntropyOutput:
    """torch.nn.functional.cross_entropy over logits [T, V] (float32 math for 16-bit logits), of the logits capped
    to c·tanh(x / c) with a softcap, plus λ·logsumexp² per token with a z-loss λ; the metrics as the op returns
    them."""
    ct = compute_dtype(logits.dtype)
    y = logits.to(ct)
    if softcap:
        y = softcap * torch.tanh(y / softcap)
    w = weight.to(ct) if weight is not None else None
    loss = torch.nn.functional.cross_entropy(
        y, target, weight=w, ignore_index=ignore_index, reduction="none", label_smoothing=label_smoothing
    )
    valid = target != ignore_index
    z = torch.where(valid, lse_square_scale * torch.logsumexp(y, -1).pow(2), 0.0)
    loss = loss + z
    count = valid.sum() if w is None else torch.where(valid, w[torch.where(valid, target, 0)], 0.0).sum()

    def reduced(rows: Tensor) -> Tensor:
        out = rows.sum() / count if reduction == "mean" else rows.sum() if reduction == "sum" else rows
        return out.to(logits.dtype)

    returns = (return_z_loss, return_token_accuracy, return_predicted_tokens, return_entropy)
    pred = torch.where(valid, y.argmax(-1), -1)
    p = torch.softmax(y, -1)
    ent = torch.where(valid, -(p * torch.where(p > 0, torch.log(p), 0.0)).sum(-1), 0.0)
    return loss_output(reduced(loss), reduced(z), pred, ent, target, ignore_index, reduction, returns)


def cross_entropy_fwd(
    logits: Tensor, target: Tensor, scale: Tensor, ignore_index: int, label_smoothing: float, grad: Tensor | None,
    softcap: float = 0.0, z_scale: float = 0.0, z: Tensor | None = None, stats: tuple[Tensor, Tensor] | None = None,
    weight: Tensor | None = None,
) -> Tensor:
    """logits [T, V], target [T], scale [T] -> loss [T] float32; gradient·scale into ``grad`` (may be logits); the
    logits capped first with ``softcap`` > 0, λ·lse² added with ``z_scale`` λ (and written to ``z`` if given), each
    row's predicted class and softmax entropy written to ``stats`` (−1 and 0 where ignored) if given; the classes'
    ``weight`` [V] as F.cross_entropy's.

    An out-of-range target (not ignore_index) gives a NaN loss and gradient row, as the kernels do.
    """
    ct = compute_dtype(logits.dtype)
    V = logits.shape[1]
    valid = target != ignore_index
    in_range = (target >= 0) & (target < V)
    safe = torch.where(valid & in_range, target, 0)
    y = logits.to(ct)
    if softcap:
        th = torch.tanh(y / softcap)
        y = softcap * th
    logp = torch.log_softmax(y, dim=-1)
    if stats is not None:
        stats[0].copy_(torch.where(valid, y.argmax(-1), -1))
        stats[1].copy_(torch.where(valid, -(logp.exp() * torch.where(logp > -math.inf, logp, 0.0)).sum(-1), 0.0))
    picked = logp.gather(1, safe[:, None])[:, 0]
    w = weight.to(ct) if weight is not None else None
    w_t = w[safe] if w is not None else 1.0
    smooth = (logp * w).sum(-1) / V if w is not None else logp.mean(-1)
    loss = -(1 - label_smoothing) * w_t * picked - label_smoothing * smooth
    bad = valid & ~in_range
    if z_scale:
        lse = torch.logsumexp(y, -1)
        zr = torch.where(valid, torch.where(bad, float("nan"), z_scale * lse * lse), 0.0)
        if z is not None:
            z.copy_(zr)
        loss = loss + zr
    loss = torch.where(valid, torch.where(bad, float("nan"), loss), 0.0).float()
    if grad is None:
        return loss
    g = logp.exp()
    z_factor = 2.0 * z_scale * lse[:, None] if z_scale else 0.0  # the z term's, not weighted
    if w is not None:  # ∂/∂x_k = p_k·((1−ε)·w_t + ε·Σw/V + 2λ·lse) − (1−ε)·w_t·[k = t] − ε·w_k/V
        g = g * (((1 - label_smoothing) * w_t + label_smoothing * w.sum() / V)[:, None] + z_factor) \
            - label_smoothing * w / V
        g.scatter_add_(1, safe[:, None], (-(1 - label_smoothing) * w_t)[:, None])
    else:
        g = g * (1.0 + z_factor) - label_smoothing / V
        g.scatter_add_(1, safe[:, None], torch.full_like(g[:, :1], -(1 - label_smoothing)))
    if softcap:
        g = g * (1.0 - th * th)
    s = torch.where(valid, torch.where(bad, float("nan"), scale.to(ct)), 0.0)
    grad.copy_(g * s[:, None])
    return loss


def cross_entropy_bwd(dloss: Tensor, grad: Tensor) -> Tensor:
    """grad [R, V] *= dloss [R], in place."""
    ct = compute_dtype(grad.dtype)
    return grad.copy_(grad.to(ct) * dloss.to(ct)[:, None])


# ------------------------------------------------------------------------------------------------ under autocast


def _under_autocast(public: Public, args: tuple[Any, ...], dtype: torch.dtype, applies: bool) -> Tensor:
    """As F.cross_entropy under autocast where it computes in float32 (its log_softmax on CUDA, the loss itself on
    the CPU): a float32 loss of the logits as they are (the kernels compute in float32 whatever they read)."""
    return public(*args[:-1], args[-1] or applies)


_CALLS = Public(OP, _check, _body, values=_values, autocast=Autocast(
    "float32", ("aten::cross_entropy_loss", "aten::log_softmax.int"), _under_autocast))
