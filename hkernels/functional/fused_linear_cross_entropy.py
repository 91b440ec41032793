"""fused_linear_cross_entropy: ``cross_entropy(hidden @ weight.T + bias, target)`` without the [T, V] logits.

The public function and its checks, its autograd (custom ops ``hkernels::fused_linear_cross_entropy_fwd`` and
``_grad``), then the reference math and the torch backend. The chunk loop every backend shares is
``hkernels/runtime/chunked.py``; the backends supply the cross-entropy kernel (``hkernels/ops/cross_entropy.py``,
``triton_fallback/cross_entropy.py``).
"""

from __future__ import annotations

from typing import Any

import torch

from hkernels import dispatch
from hkernels.functional import cross_entropy as _cross_entropy
from hkernels.functional._base import (
    Autocast,
    Public,
    Tensor,
    autograd,
    call,
    check_range,
    check_same,
    check_tensor,
    compute_dtype,
    placeholder,
    rows,
)
from hkernels.functional.cross_entropy import (
    CrossEntropyOutput,
    check_class_weight,
    check_loss_args,
    check_loss_options,
    loss_grad_scale_,
    loss_like,
    loss_output,
    loss_scale,
    reduce,
    stats_like,
)
from hkernels.functional.cross_entropy import reference as cross_entropy_reference
from hkernels.runtime import chunked as _chunked

OP = "fused_linear_cross_entropy"


def fused_linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    *,
    lse_square_scale: float = 0.0,
    softcap: float | None = None,
    return_z_loss: bool = False,
    return_token_accuracy: bool = False,
    return_predicted_tokens: bool = False,
    return_entropy: bool = False,
    ce_weight: Tensor | None = None,
    chunk_size: int | None = None,
) -> Tensor | CrossEntropyOutput:
    """``cross_entropy(hidden @ weight.T + bias, target)`` without materialising the [T, V] logits.

    hidden: [T, H] (flatten leading dims first), weight: [V, H] (the LM head), bias: [V] or None, one dtype;
    target: [T]. Tokens are processed in chunks: per chunk a cuBLAS matmul makes the logits, the cross-entropy
    kernel overwrites them with their gradient, and two more matmuls accumulate the gradients of hidden, weight
    and bias — computed during the forward when gradients are needed (reduction mean or sum; the backward then
    only scales them), or recomputed chunk by chunk in the backward (reduction none). Extra memory: the gradients
    plus one chunk of logits. The loss is float32 (float64 for float64 input), as Hugging Face's and Liger's
    losses are: a bfloat16 loss near 12 steps by 0.06. Differentiable in hidden, weight and bias. Under autocast
    it behaves as ``cross_entropy(linear(hidden, weight, bias), target)`` does: the matmuls in autocast's dtype, a
    float32 loss, the gradients in the parameters' own dtypes. ``softcap``, ``lse_square_scale`` and the
    ``return_*`` metrics as :func:`hkernels.cross_entropy` has them, computed in the same chunk loop;
    ``ce_weight`` [V] its class ``weight`` (Liger's name: ``weight`` here is the head's). ``chunk_size``: tokens
    per chunk (default :func:`hkernels.runtime.chunked.chunk_rows`, at least 4096): smaller chunks hold fewer
    logits (C·V elements) but read and write the weight's gradient once per chunk (4·V·H bytes each).
    """
    if isinstance(ce_weight, Tensor) and ce_weight.is_floating_point():  # (no gradient, as in PyTorch)
        ce_weight = ce_weight.detach().float()
    return _CALLS(hidden, weight, target, bias, ignore_index, reduction, label_smoothing, lse_square_scale, softcap,
                  (return_z_loss, return_token_accuracy, return_predicted_tokens, return_entropy), ce_weight,
                  chunk_size)


def _check(hidden: Any, weight: Any, target: Any, bias: Any, ignore_index: Any, reduction: Any,
           label_smoothing: Any, lse_square_scale: Any, softcap: Any, returns: Any, ce_weight: Any,
           chunk_size: Any) -> None:
    check_tensor(OP, "hidden", hidden, (2,))
    check_tensor(OP, "weight", weight, (2,))
    T, H = hidden.shape
    if weight.shape[1] != H:
        raise ValueError(f"hkernels.fused_linear_cross_entropy: weight must be [V, H] with H = {H} (hidden's last "
                         f"dim), got {list(weight.shape)}")
    check_same(OP, ("hidden", "weight"), hidden, weight, shape=False)
    if bias is not None:
        check_tensor(OP, "bias", bias, (1,))
        check_same(OP, ("hidden", "bias"), hidden, bias, shape=False)
        if bias.shape[0] != weight.shape[0]:
            raise ValueError(f"hkernels.fused_linear_cross_entropy: bias must be [V] = [{weight.shape[0]}], got "
                             f"{list(bias.shape)}")
    if weight.shape[0] == 0:
        raise ValueError("hkernels.fused_linear_cross_entropy: weight has no classes (V = 0)")
    check_loss_args(OP, target, T, hidden.device, ignore_index, reduction, label_smoothing)
    check_loss_options(OP, lse_square_scale, softcap, returns)
    check_class_weight(OP, ce_weight, weight.shape[0], hidden.device)
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"hkernels.fused_linear_cross_entropy: chunk_size must be a positive int (tokens per "
                         f"chunk) or None, got {chunk_size!r}")


def _values(hidden: Tensor, weight: Tensor, target: Tensor, bias: Tensor | None, ignore_index: int, reduction: str,
            label_smoothing: float, lse_square_scale: float, softcap: float | None, returns: tuple[bool, ...],
            ce_weight: Tensor | None, chunk_size: int | None) -> None:
    check_range(OP, "target", target, 0, weight.shape[0], ignore_index)


def routed(arguments: dict[str, Any]) -> tuple[Tensor, ...]:
    """The tensors the kernels take (a class weight reaches them as float32 whatever its dtype)."""
    names = ("hidden", "weight", "target", "bias")
    return tuple(t for t in (arguments.get(n) for n in names) if isinstance(t, Tensor))


def _body(request: str, hidden: Tensor, weight: Tensor, target: Tensor, bias: Tensor | None, ignore_index: int,
          reduction: str, label_smoothing: float, lse_square_scale: float, softcap: float | None,
          returns: tuple[bool, bool, bool, bool], ce_weight: Tensor | None, chunk_size: int | None
          ) -> Tensor | CrossEntropyOutput:
    wants_grad = torch.is_grad_enabled() and (
        hidden.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad))
    target = target.to(torch.int64)
    loss, _, _, _, z, pred, ent = call(_fwd, hidden, weight, target, bias, ignore_index, float(label_smoothing),
                                       reduction, wants_grad and reduction != "none", float(softcap or 0.0),
                                       float(lse_square_scale), returns[0], any(returns[1:]), ce_weight,
                                       chunk_size or 0, request)
    return loss_output(loss, z, pred, ent, target, ignore_index, reduction, returns)


# ------------------------------------------------------------------------------------------------------ autograd


@torch.library.custom_op("hkernels::fused_linear_cross_entropy_fwd", mutates_args=())
def _fwd(hidden: Tensor, weight: Tensor, target: Tensor, bias: Tensor | None, ignore_index: int,
         label_smoothing: float, reduction: str, fused_grad: bool, softcap: float, z_scale: float, want_z: bool,
         want_stats: bool, ce_weight: Tensor | None, chunk_size: int, backend: str
         ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    count, scale = loss_scale(target, ignore_index, reduction, ce_weight)
    z = hidden.new_zeros(hidden.shape[0], dtype=torch.float32) if want_z else None
    stats = stats_like(hidden) if want_stats else None
    loss, dh, dw, db = dispatch.run(OP, "fused_linear_cross_entropy_fwd", backend, rows(hidden), weight, target,
                                    bias, scale, ignore_index, label_smoothing, fused_grad, softcap, z_scale,
                                    z if z_scale else None, stats, ce_weight, chunk_size or None)
    dtype = compute_dtype(hidden.dtype)
    z_loss = reduce(z, count, reduction, dtype) if z is not None else placeholder(hidden)
    pred, ent = stats if stats is not None else (placeholder(target), placeholder(hidden))
    return (reduce(loss, count, reduction, dtype), *(g if g is not None else placeholder(hidden)
                                                     for g in (dh, dw, db)), z_loss, pred, ent)


@_fwd.register_fake
def _(hidden: Tensor, weight: Tensor, target: Tensor, bias: Tensor | None, ignore_index: int, label_smoothing: float,
      reduction: str, fused_grad: bool, softcap: float, z_scale: float, want_z: bool, want_stats: bool,
      ce_weight: Tensor | None, chunk_size: int, backend: str
      ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    grads = (
        (torch.empty_like(hidden), torch.empty_like(weight),
         torch.empty_like(bias) if bias is not None else placeholder(hidden))
        if fused_grad else tuple(placeholder(hidden) for _ in range(3))
    )
    dtype = compute_dtype(hidden.dtype)
    z = loss_like(hidden, hidden.shape[0], reduction, dtype) if want_z else placeholder(hidden)
    pred, ent = stats_like(hidden) if want_stats else (placeholder(target), placeholder(hidden))
    return loss_like(hidden, hidden.shape[0], reduction, dtype), *grads, z, pred, ent


@torch.library.custom_op("hkernels::fused_linear_cross_entropy_grad", mutates_args=())
def _grad(dloss: Tensor, hidden: Tensor, weight: Tensor, target: Tensor, bias: Tensor | None, ignore_index: int,
          label_smoothing: float, softcap: float, z_scale: float, ce_weight: Tensor | None, chunk_size: int,
          backend: str) -> tuple[Tensor, Tensor, Tensor]:
    # reduction="none": recompute each chunk's logits in the backward, with the gradient scaled per token.
    _, dh, dw, db = dispatch.run(OP, "fused_linear_cross_entropy_fwd", backend, rows(hidden), weight, target, bias,
                                 dloss.float(), ignore_index, label_smoothing, True, softcap, z_scale, None, None,
                                 ce_weight, chunk_size or None)
    return dh, dw, db if db is not None else placeholder(hidden)


@_grad.register_fake
def _(dloss: Tensor, hidden: Tensor, weight: Tensor, target: Tensor, bias: Tensor | None, ignore_index: int,
      label_smoothing: float, softcap: float, z_scale: float, ce_weight: Tensor | None, chunk_size: int,
      backend: str) -> tuple[Tensor, Tensor, Tensor]:
    return (torch.empty_like(hidden), torch.empty_like(weight),
            torch.empty_like(bias) if bias is not None else placeholder(hidden))


def _setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, ...]) -> None:
    (hidden, weight, target, bias, ignore_index, label_smoothing, _reduction, fused_grad, softcap, z_scale, _want_z,
     _want_stats, ce_weight, chunk_size, backend) = inputs
    ctx.fused, ctx.backend, ctx.has_bias, ctx.chunk_size = fused_grad, backend, bias is not None, chunk_size
    ctx.ignore_index, ctx.label_smoothing, ctx.softcap, ctx.z_scale = ignore_index, label_smoothing, softcap, z_scale
    ctx.save_for_backward(*(output[1:4] if fused_grad else (hidden, weight, target, bias, ce_weight)))
    ctx.mark_non_differentiable(*output[1:])  # (the z term is inside the loss: no gradient of its own)
    ctx.set_materialize_grads(False)


def _backward(ctx: Any, dloss: Tensor | None, *_unused: Tensor | None) -> tuple[Tensor | None, ...]:
    if dloss is None:
        return (None,) * 15
    if ctx.fused:
        dh, dw, db = ctx.saved_tensors
        for g in (dh, dw, db) if ctx.has_bias else (dh, dw):
            call(loss_grad_scale_, g, dloss, OP, ctx.backend)
    else:
        hidden, weight, target, bias, ce_weight = ctx.saved_tensors
        dloss = dloss.expand(target.shape) if dloss.dim() == 0 else dloss
        dh, dw, db = call(_grad, dloss, hidden, weight, target, bias, ctx.ignore_index, ctx.label_smoothing,
                          ctx.softcap, ctx.z_scale, ce_weight, ctx.chunk_size, ctx.backend)
    return dh, dw, None, (db if ctx.has_bias else None), *(None,) * 11


autograd(_fwd, _backward, _setup)


# ------------------------------------------------------------------------------- reference and the torch backend


def reference(
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    *,
    ce_weight: Tensor | None = None,
    chunk_size: int | None = None,
    **options: Any,
) -> Tensor | CrossEntropyOutput:
    """cross_entropy(hidden @ weight.T + bias, target): hidden [T, H], weight [V, H], bias [V]. The logits are
    rounded to hidden's dtype (they come from a matmul in it); the loss is float32 (float64 for float64 input),
    as in Hugging Face's and Liger's losses: no logits are returned whose dtype the loss should follow. The loss
    options (``softcap``, ``lse_square_scale``, the ``return_*`` flags) as
    :func:`hkernels.functional.cross_entropy.reference` takes them; ``ce_weight`` is its class ``weight``;
    ``chunk_size`` changes no math (the whole [T, V] at once here)."""
    logits = torch.nn.functional.linear(hidden, weight, bias)
    return cross_entropy_reference(logits.to(compute_dtype(logits.dtype)), target, ignore_index, reduction,
                                   label_smoothing, weight=ce_weight, **options)


# The torch backend: the shared chunk loop around the reference cross-entropy (the [T, V] logits never exist at once).
fused_linear_cross_entropy_fwd, fused_linear_cross_entropy_bwd = _chunked.backend_functions(_cross_entropy)


# Under autocast: as cross_entropy(linear(hidden, weight, bias)): the matmuls in autocast's dtype, the loss
# float32 (as it always is), each gradient in its own input's dtype.
_CALLS = Public(OP, _check, _body, values=_values, autocast=Autocast("lower", ("aten::linear",)))
