"""rms_norm: ``x / sqrt(mean(x²) + eps) * weight`` over the last dim.

The public function and its checks, its autograd (custom ops ``hkernels::rms_norm_fwd`` / ``_bwd``), then the
reference math and the torch backend. Kernels: ``hkernels/ops/rms_norm.py`` (Helion), ``triton_fallback/rms_norm.py``.
"""

from __future__ import annotations

from typing import Any

import torch

from hkernels import dispatch
from hkernels.functional._base import (
    Autocast,
    Lane,
    Public,
    Tensor,
    as_rows,
    autograd,
    bound,
    bound_backward,
    call,
    check_eps,
    check_input,
    check_offset,
    check_param,
    compute_dtype,
    placeholder,
    reusable,
    rows,
    rows_view,
    stats,
    wants_grad,
)

OP = "rms_norm"


def rms_norm(x: Tensor, weight: Tensor | None = None, eps: float = 1e-6, offset: float = 0.0,
             casting: str = "float32", in_place: bool = False) -> Tensor:
    """Root-mean-square norm over the last dim: ``x / sqrt(mean(x²) + eps) * (offset + weight)``.

    x: [..., N] float16/bfloat16/float32 (float64 on the torch backend); weight: [N] or None. ``offset``: Gemma's
    ``1 + weight`` is ``offset=1.0`` (the scale ``offset + weight`` taken in float32, as Gemma does). Math in
    float32; the result has x's dtype and shape. Differentiable in x and weight.

    ``casting``: ``"float32"`` (the above: Gemma's way, the weight applied in float32, one rounding) or ``"llama"``
    (Hugging Face's Llama-form RMSNorm: the normalised x rounded to x's dtype, then times the weight, the result in
    their promoted dtype). They differ only where the weight's dtype is not x's (a float32 weight on a 16-bit x:
    the result is float32; two steps then, the norm and a multiply); with one dtype "llama" is the same fused
    kernel, rounding once where the module rounds twice.

    ``in_place``: the backward writes x's gradient into the buffer of y's gradient, saving an [..., N] buffer,
    where nothing else holds that buffer when the backward runs (the autograd engine's only reference, whole: not a
    slice of a larger gradient; x's dtype and layout); otherwise, and inside torch.compile (whose own planner reuses
    buffers), into a new one. A gradient passed by the caller (``torch.autograd.grad(y, x, dy)``), one a hook kept
    and one another branch has still to read are never overwritten.
    """
    if in_place is not False and in_place is not True:
        raise TypeError(f"hkernels.rms_norm: in_place must be a bool, got {type(in_place).__name__}")
    if casting != "float32":
        if casting != "llama":
            raise ValueError(f"hkernels.rms_norm: casting must be 'float32' or 'llama', got {casting!r}")
        if offset:
            raise ValueError("hkernels.rms_norm: casting='llama' is the form without an offset")
        if isinstance(weight, torch.Tensor) and isinstance(x, torch.Tensor) and weight.dtype != x.dtype:
            return weight * (_IN_PLACE if in_place else _CALLS)(x, None, eps, 0.0)
    return (_IN_PLACE if in_place else _CALLS)(x, weight, eps, offset)


def _check(x: Any, weight: Any, eps: Any, offset: Any) -> None:
    check_input(OP, x)
    check_param(OP, "weight", weight, x)
    check_eps(OP, eps)
    check_offset(OP, offset, weight)


def _body(request: str, x: Tensor, weight: Tensor | None, eps: float, offset: float) -> Tensor:
    y, _ = call(_fwd, as_rows(x), weight, float(eps), float(offset), False, request)
    return y if y.shape == x.shape else y.reshape(x.shape)


def _body_in_place(request: str, x: Tensor, weight: Tensor | None, eps: float, offset: float) -> Tensor:
    # the op on x's own shape: y's gradient reaches the backward as the autograd engine made it, no view between
    # (whether anything else holds it can then be told: see ``reusable``)
    return call(_fwd, x, weight, float(eps), float(offset), True, request)[0]


# ------------------------------------------------------------------------------------------------------ autograd


# in_place: the backward's choice (see rms_norm); the forward is the same either way. An [..., N] x's results are
# reshaped as new tensors, not views (autograd forbids writing in place into a view made inside a Function).
# offset: the scale is offset + weight, applied inside the kernels (no [N] float32 scale made per call).
@torch.library.custom_op("hkernels::rms_norm_fwd", mutates_args=())
def _fwd(x: Tensor, weight: Tensor | None, eps: float, offset: float, in_place: bool, backend: str
         ) -> tuple[Tensor, Tensor]:
    # x: [M, N], or (in_place) [..., N]; y as x, rstd [M]
    if x.numel() == 0:
        return x.new_empty(x.shape), stats(as_rows(x))
    y, rstd = dispatch.run(OP, "rms_norm_fwd", backend, rows(as_rows(x)), weight, eps, offset)
    return (y if y.shape == x.shape else torch.ops.aten._unsafe_view(y, x.shape)), rstd  # (not a view: see below)


@_fwd.register_fake
def _(x: Tensor, weight: Tensor | None, eps: float, offset: float, in_place: bool, backend: str
      ) -> tuple[Tensor, Tensor]:
    return x.new_empty(x.shape), stats(as_rows(x))


@torch.library.custom_op("hkernels::rms_norm_bwd", mutates_args=())
def _bwd(dy: Tensor, x: Tensor, weight: Tensor | None, rstd: Tensor, offset: float, backend: str
         ) -> tuple[Tensor, Tensor]:
    if x.numel() == 0:
        dw = torch.zeros_like(weight) if weight is not None else placeholder(x)
        return x.new_zeros(x.shape), dw
    dx, dw = dispatch.run(OP, "rms_norm_bwd", backend, rows(as_rows(dy)), rows(as_rows(x)), weight, rstd, None,
                          offset)
    return (dx if dx.shape == x.shape else torch.ops.aten._unsafe_view(dx, x.shape)), (dw if dw is not None
                                                                                      else placeholder(x))


@_bwd.register_fake
def _(dy: Tensor, x: Tensor, weight: Tensor | None, rstd: Tensor, offset: float, backend: str
      ) -> tuple[Tensor, Tensor]:
    return x.new_empty(x.shape), (weight.new_empty(weight.shape) if weight is not None else placeholder(x))


@torch.library.custom_op("hkernels::rms_norm_bwd_into", mutates_args=("dy",))
def _bwd_into(dy: Tensor, x: Tensor, weight: Tensor | None, rstd: Tensor, offset: float, backend: str) -> Tensor:
    """The backward writing dx over dy (contiguous, x's dtype and shape); returns dw."""
    if x.numel() == 0:
        return torch.zeros_like(weight) if weight is not None else placeholder(x)
    grad = as_rows(dy)
    _dx, dw = dispatch.run(OP, "rms_norm_bwd", backend, grad, rows(as_rows(x)), weight, rstd, grad, offset)
    return dw if dw is not None else placeholder(x)


@_bwd_into.register_fake
def _(dy: Tensor, x: Tensor, weight: Tensor | None, rstd: Tensor, offset: float, backend: str) -> Tensor:
    return weight.new_empty(weight.shape) if weight is not None else placeholder(x)


def _setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
    x, weight, _eps, offset, in_place, backend = inputs
    ctx.save_for_backward(x, weight, output[1])
    ctx.backend, ctx.in_place, ctx.offset = backend, in_place, offset
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)  # (no zeros made for rstd's gradient, which is never used)


def _backward(ctx: Any, dy: Tensor | None, _drstd: Tensor | None) -> tuple[Tensor | None, ...]:
    if dy is None:
        return None, None, None, None, None, None
    x, weight, rstd = ctx.saved_tensors
    if ctx.in_place and reusable(dy, x, ctx):
        dw = call(_bwd_into, dy, x, weight, rstd, ctx.offset, ctx.backend)
        return dy, (dw if weight is not None else None), None, None, None, None
    dx, dw = call(_bwd, dy, x, weight, rstd, ctx.offset, ctx.backend)
    return dx, (dw if weight is not None else None), None, None, None, None


autograd(_fwd, _backward, _setup, in_place=True)


def _backward_fast(plan: Any, ctx: Any, dy: Tensor | None, _drstd: Tensor | None) -> Any:
    """_backward in one step for gradients of this signature: the kernel function its plan ran."""
    run = bound_backward(plan, "rms_norm_bwd", dy)
    if run is None:
        return None

    def backward(ctx: Any, dy: Tensor, _drstd: Tensor | None) -> tuple[Tensor | None, ...]:
        x, weight, rstd = ctx.saved_tensors
        dx, dw = run(dy, x, weight, rstd, None, ctx.offset)
        return dx, dw, None, None
    return backward


# ------------------------------------------------------------------------------- reference and the torch backend


def reference(x: Tensor, weight: Tensor | None = None, eps: float = 1e-6, offset: float = 0.0) -> Tensor:
    """y = x / sqrt(mean(x², last dim) + eps) * (offset + weight).  x: [..., N], weight: [N]. Math in float32 for
    16-bit inputs, in x's own precision otherwise (so float64 inputs give the float64 truth)."""
    xf = x.to(compute_dtype(x.dtype))
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * (weight.to(xf.dtype) + offset)
    return y.to(x.dtype)


def rms_norm_fwd(x: Tensor, weight: Tensor | None, eps: float, offset: float = 0.0) -> tuple[Tensor, Tensor]:
    """x: [M, N] -> (y [M, N] in x.dtype, rstd [M] float32); the scale is ``offset + weight``."""
    xf = x.to(compute_dtype(x.dtype))
    rstd = torch.rsqrt(xf.pow(2).mean(-1) + eps)
    y = xf * rstd[:, None]
    if weight is not None:
        y = y * (weight.to(xf.dtype) + offset)
    return y.to(x.dtype), rstd.float()


def _bind_rms_norm_fwd(x: Tensor, weight: Tensor | None, eps: float, offset: float = 0.0, stats: bool = True
                       ) -> Any:
    """The torch backend's forward for calls of this signature; without the statistics (a forward no backward
    follows) PyTorch's own ``F.rms_norm``, one pass, where the weight has x's dtype and there is no offset (the
    result's dtype then follows x's, as the op's does)."""
    if stats:
        return rms_norm_fwd
    if (weight is not None and weight.dtype != x.dtype) or offset:
        return None
    shape = (x.shape[-1],)
    return lambda x, weight, eps, offset=0.0: torch.nn.functional.rms_norm(x, shape, weight, eps)


rms_norm_fwd.bind = _bind_rms_norm_fwd  # type: ignore[attr-defined]


def rms_norm_bwd(dy: Tensor, x: Tensor, weight: Tensor | None, rstd: Tensor, dx: Tensor | None = None,
                 offset: float = 0.0) -> tuple[Tensor, Tensor | None]:
    """dx = rstd·(w'·dy) − x·rstd³·mean(w'·dy·x), w' = offset + w;  dw = Σ_rows dy·x·rstd. With ``dx`` given (it
    may be dy), the result is written there."""
    ct = compute_dtype(x.dtype)
    xf, dyf, r = x.to(ct), dy.to(ct), rstd.to(ct)[:, None]
    wdy = dyf * (weight.to(ct) + offset) if weight is not None else dyf
    grad = r * wdy - xf * r.pow(3) * (wdy * xf).mean(-1, keepdim=True)
    dw = (dyf * xf * r).sum(0).to(weight.dtype) if weight is not None else None
    return (grad.to(x.dtype) if dx is None else dx.copy_(grad)), dw


def _fast(plan: Any, request: str, x: Tensor, weight: Tensor | None, eps: float, offset: float) -> Any:
    """Calls of this signature in one step: the kernel function the plan ran, on a view of x's rows; without a
    gradient, bound without rstd; with one, through a Lane."""
    recorded, rows_of = bound(plan, "rms_norm_fwd"), rows_view(x)
    if recorded is None or rows_of is None or type(eps) is not float or type(offset) is not float:
        return None
    shape, flat = x.shape, x.dim() == 2
    if wants_grad(x, weight):
        apply = Lane(recorded, _setup, _backward, request, 4, None if flat else shape, rows_of, 1, 1,
                     _backward_fast, (False,)).apply  # (in_place: False)
        return lambda x, weight, eps, offset: apply(x, weight, eps, offset)[0]
    run = dispatch.rebind(recorded, "rms_norm_fwd", x if flat else x.view(rows_of), weight, eps, offset,
                          stats=False)
    if run is None or flat:
        return run
    return lambda x, weight, eps, offset: run(x.view(rows_of), weight, eps, offset).view(shape)


# Under autocast: as F.rms_norm (float32 where PyTorch computes it in float32: CUDA).
_AUTOCAST = Autocast("float32", ("aten::rms_norm",))
_CALLS = Public(OP, _check, _body, _fast, autocast=_AUTOCAST)
_IN_PLACE = Public(OP, _check, _body_in_place, autocast=_AUTOCAST)
