"""add_rms_norm: a Llama block's residual add and RMS norm in one pass, ``(rms_norm(x + r) * w, x + r)``.

The public function and its checks, its autograd (custom ops ``hkernels::add_rms_norm_fwd`` / ``_bwd``), then the
reference math and the torch backend. Kernels: ``hkernels/ops/add_rms_norm.py`` (Helion),
``triton_fallback/add_rms_norm.py`` (both the rms_norm kernels with a residual).
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
    check_same,
    check_tensor,
    compute_dtype,
    placeholder,
    reusable,
    rows,
    rows_view,
    stats,
    wants_grad,
    zeros_if_none,
)
from hkernels.functional.rms_norm import reference as rms_norm_reference
from hkernels.functional.rms_norm import rms_norm, rms_norm_fwd

OP = "add_rms_norm"


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor | None = None, eps: float = 1e-6, offset: float = 0.0,
                 in_place: bool = False) -> tuple[Tensor, Tensor]:
    """The residual add and RMS norm of a Llama block in one pass: ``(rms_norm(x + residual) * weight, x + residual)``.

    x, residual: [..., N], one shape and dtype; weight: [N] or None. The sum is rounded to x's dtype before the
    norm (as the unfused ``h = x + residual; rms_norm(h)`` does) and returned as the next residual. Math in
    float32. ``offset``: the scale is ``offset + weight`` (Gemma's ``1 + weight`` is ``offset=1.0``, in float32).
    Differentiable in x, residual and weight, through both outputs. ``in_place``: as :func:`hkernels.rms_norm`'s,
    the sum's gradient written over y's where nothing else holds that buffer.
    """
    if in_place is not False and in_place is not True:
        raise TypeError(f"hkernels.add_rms_norm: in_place must be a bool, got {type(in_place).__name__}")
    return (_IN_PLACE if in_place else _CALLS)(x, residual, weight, eps, offset)


def _check(x: Any, residual: Any, weight: Any, eps: Any, offset: Any) -> None:
    check_input(OP, x)
    check_tensor(OP, "residual", residual, None)
    check_same(OP, ("x", "residual"), x, residual)
    check_param(OP, "weight", weight, x)
    check_eps(OP, eps)
    check_offset(OP, offset, weight)


def _body(request: str, x: Tensor, residual: Tensor, weight: Tensor | None, eps: float, offset: float
          ) -> tuple[Tensor, Tensor]:
    y, s, _ = call(_fwd, as_rows(x), as_rows(residual), weight, float(eps), float(offset), False, request)
    if y.shape == x.shape:
        return y, s
    return y.reshape(x.shape), s.reshape(x.shape)


def _body_in_place(request: str, x: Tensor, residual: Tensor, weight: Tensor | None, eps: float, offset: float
                   ) -> tuple[Tensor, Tensor]:
    # the op on x's own shape, as rms_norm's in place (y's gradient reaches the backward with no view between)
    y, s, _ = call(_fwd, x, residual, weight, float(eps), float(offset), True, request)
    return y, s


# ------------------------------------------------------------------------------------------------------ autograd


# x, residual: [M, N], or (in_place: the backward's choice) [..., N]; y and s as x, rstd [M]; the scale is
# offset + weight (see rms_norm)
@torch.library.custom_op("hkernels::add_rms_norm_fwd", mutates_args=())
def _fwd(x: Tensor, residual: Tensor, weight: Tensor | None, eps: float, offset: float, in_place: bool, backend: str
         ) -> tuple[Tensor, Tensor, Tensor]:
    if x.numel() == 0:
        return x.new_empty(x.shape), x.new_empty(x.shape), stats(as_rows(x))
    y, s, rstd = dispatch.run(OP, "add_rms_norm_fwd", backend, rows(as_rows(x)), rows(as_rows(residual)), weight,
                              eps, offset)
    if y.shape == x.shape:
        return y, s, rstd
    # (new tensors, not views: autograd forbids writing in place into a view made inside a Function)
    return torch.ops.aten._unsafe_view(y, x.shape), torch.ops.aten._unsafe_view(s, x.shape), rstd


@_fwd.register_fake
def _(x: Tensor, residual: Tensor, weight: Tensor | None, eps: float, offset: float, in_place: bool, backend: str
      ) -> tuple[Tensor, Tensor, Tensor]:
    return x.new_empty(x.shape), x.new_empty(x.shape), stats(as_rows(x))


@torch.library.custom_op("hkernels::add_rms_norm_bwd", mutates_args=())
def _bwd(dy: Tensor, ds: Tensor | None, s: Tensor, weight: Tensor | None, rstd: Tensor, offset: float, backend: str
         ) -> tuple[Tensor, Tensor]:
    if s.numel() == 0:
        dw = torch.zeros_like(weight) if weight is not None else placeholder(s)
        return s.new_zeros(s.shape), dw
    ds = rows(as_rows(ds)) if ds is not None else None
    dx, dw = dispatch.run(OP, "add_rms_norm_bwd", backend, rows(as_rows(dy)), ds, as_rows(s), weight, rstd, None,
                          offset)
    return (dx if dx.shape == s.shape else torch.ops.aten._unsafe_view(dx, s.shape)), (dw if dw is not None
                                                                                      else placeholder(s))


@_bwd.register_fake
def _(dy: Tensor, ds: Tensor | None, s: Tensor, weight: Tensor | None, rstd: Tensor, offset: float, backend: str
      ) -> tuple[Tensor, Tensor]:
    return s.new_empty(s.shape), (weight.new_empty(weight.shape) if weight is not None else placeholder(s))


@torch.library.custom_op("hkernels::add_rms_norm_bwd_into", mutates_args=("dy",))
def _bwd_into(dy: Tensor, ds: Tensor | None, s: Tensor, weight: Tensor | None, rstd: Tensor, offset: float,
              backend: str) -> Tensor:
    """The backward writing the sum's gradient over dy (contiguous, s's dtype and shape); returns dw."""
    if s.numel() == 0:
        return torch.zeros_like(weight) if weight is not None else placeholder(s)
    grad = as_rows(dy)
    ds = rows(as_rows(ds)) if ds is not None else None
    _dx, dw = dispatch.run(OP, "add_rms_norm_bwd", backend, grad, ds, as_rows(s), weight, rstd, grad, offset)
    return dw if dw is not None else placeholder(s)


@_bwd_into.register_fake
def _(dy: Tensor, ds: Tensor | None, s: Tensor, weight: Tensor | None, rstd: Tensor, offset: float, backend: str
      ) -> Tensor:
    return weight.new_empty(weight.shape) if weight is not None else placeholder(s)


def _setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor, Tensor]) -> None:
    _x, _residual, weight, _eps, offset, in_place, backend = inputs
    ctx.save_for_backward(output[1], weight, output[2])
    ctx.backend, ctx.in_place, ctx.offset = backend, in_place, offset
    ctx.set_materialize_grads(False)


def _backward(ctx: Any, dy: Tensor | None, ds: Tensor | None, _drstd: Tensor | None) -> tuple[Tensor | None, ...]:
    s, weight, rstd = ctx.saved_tensors
    if ctx.in_place and dy is not None and reusable(dy, s, ctx):
        dw = call(_bwd_into, dy, ds, s, weight, rstd, ctx.offset, ctx.backend)
        return dy, dy, (dw if weight is not None else None), None, None, None, None
    dy = zeros_if_none(dy, s)
    dsum, dw = call(_bwd, dy, ds, s, weight, rstd, ctx.offset, ctx.backend)
    return dsum, dsum, (dw if weight is not None else None), None, None, None, None


autograd(_fwd, _backward, _setup, in_place=True)


def _backward_fast(plan: Any, ctx: Any, dy: Tensor | None, ds: Tensor | None, _drstd: Tensor | None) -> Any:
    """_backward in one step for gradients of this signature: the kernel function its plan ran."""
    run = bound_backward(plan, "add_rms_norm_bwd", dy, *(() if ds is None else (ds,)))
    if run is None:
        return None

    def backward(ctx: Any, dy: Tensor, ds: Tensor | None, _drstd: Tensor | None) -> tuple[Tensor | None, ...]:
        s, weight, rstd = ctx.saved_tensors
        dsum, dw = run(dy, ds, s, weight, rstd, None, ctx.offset)
        return dsum, dsum, dw, None, None
    return backward


# ------------------------------------------------------------------------------- reference and the torch backend


def reference(x: Tensor, residual: Tensor, weight: Tensor | None = None, eps: float = 1e-6, offset: float = 0.0
              ) -> tuple[Tensor, Tensor]:
    """(rms_norm(x + residual) · (offset + weight), x + residual): the residual sum rounded to x's dtype, as in a
    model."""
    s = x + residual
    return rms_norm_reference(s, weight, eps, offset), s


def add_rms_norm_fwd(x: Tensor, residual: Tensor, weight: Tensor | None, eps: float, offset: float = 0.0
                     ) -> tuple[Tensor, Tensor, Tensor]:
    """x, residual: [M, N] -> (y, s = x + residual, rstd [M] float32 of s); the scale is ``offset + weight``."""
    s = x + residual
    y, rstd = rms_norm_fwd(s, weight, eps, offset)
    return y, s, rstd


def _bind_add_rms_norm_fwd(x: Tensor, residual: Tensor, weight: Tensor | None, eps: float, offset: float = 0.0,
                           stats: bool = True) -> Any:
    """The torch backend's forward for calls of this signature; without the statistics (no backward follows) the
    add, then PyTorch's own ``F.rms_norm``, where the weight has x's dtype and there is no offset:
    ``run(...) -> (y, s)``."""
    if stats:
        return add_rms_norm_fwd
    if (weight is not None and weight.dtype != x.dtype) or offset:
        return None
    shape = (x.shape[-1],)

    def run(x: Tensor, residual: Tensor, weight: Tensor | None, eps: float, offset: float = 0.0
            ) -> tuple[Tensor, Tensor]:
        s = x + residual
        return torch.nn.functional.rms_norm(s, shape, weight, eps), s
    return run


add_rms_norm_fwd.bind = _bind_add_rms_norm_fwd  # type: ignore[attr-defined]


def add_rms_norm_bwd(dy: Tensor, ds: Tensor | None, s: Tensor, weight: Tensor | None, rstd: Tensor,
                     dx: Tensor | None = None, offset: float = 0.0) -> tuple[Tensor, Tensor | None]:
    """dsum = rms_norm's dx at s + ds (the gradient of x and of residual), written into ``dx`` where given (it may
    be dy); dw."""
    ct = compute_dtype(s.dtype)
    sf, dyf, r = s.to(ct), dy.to(ct), rstd.to(ct)[:, None]
    wdy = dyf * (weight.to(ct) + offset) if weight is not None else dyf
    grad = r * wdy - sf * r.pow(3) * (wdy * sf).mean(-1, keepdim=True)
    if ds is not None:
        grad = grad + ds.to(ct)
    dw = (dyf * sf * r).sum(0).to(weight.dtype) if weight is not None else None
    return (grad.to(s.dtype) if dx is None else dx.copy_(grad)), dw


def _fast(plan: Any, request: str, x: Tensor, residual: Tensor, weight: Tensor | None, eps: float, offset: float
          ) -> Any:
    """Calls of this signature in one step: the kernel function the plan ran, on views of the rows; without a
    gradient, bound without rstd; with one, through a Lane."""
    recorded, rows_of = bound(plan, "add_rms_norm_fwd"), rows_view(x)
    if recorded is None or rows_of is None or rows_view(residual) is None or type(eps) is not float \
            or type(offset) is not float:
        return None
    shape, flat = x.shape, x.dim() == 2
    if wants_grad(x, residual, weight):
        apply = Lane(recorded, _setup, _backward, request, 5, None if flat else shape, rows_of, 2, 2,
                     _backward_fast, (False,)).apply  # (in_place: False)
        return lambda x, residual, weight, eps, offset: apply(x, residual, weight, eps, offset)[:2]
    x2, r2 = (x, residual) if flat else (x.view(rows_of), residual.view(rows_of))
    run = dispatch.rebind(recorded, "add_rms_norm_fwd", x2, r2, weight, eps, offset, stats=False)
    if run is None or flat:
        return run

    def fast(x: Tensor, residual: Tensor, weight: Tensor | None, eps: float, offset: float
             ) -> tuple[Tensor, Tensor]:
        y, s = run(x.view(rows_of), residual.view(rows_of), weight, eps, offset)
        return y.view(shape), s.view(shape)
    return fast


# ------------------------------------------------------------------------------------------------ under autocast


def _under_autocast(public: Public, args: tuple[Any, ...], dtype: torch.dtype, applies: bool) -> Any:
    """As ``h = x + residual; F.rms_norm(h, weight)`` under autocast: the add promotes mixed dtypes (a 16-bit
    branch output onto a float32 residual stream) and rounds h to them; where PyTorch's rms_norm computes in
    float32 (CUDA) the norm's result is float32, of h as rounded."""
    x, residual, weight, eps, offset = args
    if isinstance(x, Tensor) and isinstance(residual, Tensor) and x.dtype != residual.dtype \
            and x.is_floating_point() and residual.is_floating_point():
        common = torch.promote_types(x.dtype, residual.dtype)
        x, residual = x.to(common), residual.to(common)
    if not applies or not isinstance(x, Tensor):
        return public(x, residual, weight, eps, offset)
    if isinstance(weight, Tensor) and weight.dtype in (torch.float16, torch.bfloat16):
        weight = weight.float()
    if x.dtype in (torch.float16, torch.bfloat16):  # a 16-bit sum, normed in float32: unfused
        h = x + residual
        return rms_norm(h.float(), weight, eps, offset), h
    return public(x, residual, weight, eps, offset)


_AUTOCAST = Autocast("float32", ("aten::rms_norm",), _under_autocast)
_CALLS = Public(OP, _check, _body, _fast, autocast=_AUTOCAST)
_IN_PLACE = Public(OP, _check, _body_in_place, autocast=_AUTOCAST)
