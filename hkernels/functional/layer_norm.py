"""layer_norm: ``(x - mean) / sqrt(var + eps) * weight + bias`` over the last dim (biased variance).

The public function and its checks, its autograd (custom ops ``hkernels::layer_norm_fwd`` / ``_bwd``), then the
reference math and the torch backend. Kernels: ``hkernels/ops/layer_norm.py`` (Helion),
``triton_fallback/layer_norm.py``.
"""

from __future__ import annotations

from typing import Any

import torch

from hkernels import dispatch
from hkernels.functional._base import (
    SIXTEEN,
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
    check_param,
    compute_dtype,
    placeholder,
    rows,
    rows_view,
    stats,
    wants_grad,
)

OP = "layer_norm"


def layer_norm(x: Tensor, weight: Tensor | None = None, bias: Tensor | None = None, eps: float = 1e-5) -> Tensor:
    """Layer norm over the last dim: ``(x - mean) / sqrt(var + eps) * weight + bias`` (biased variance).

    x: [..., N] float16/bfloat16/float32 (float64 on the torch backend); weight, bias: [N] or None. Math in
    float32; the result has x's dtype and shape. Differentiable in x, weight and bias.
    """
    return _CALLS(x, weight, bias, eps, None)


def _check(x: Any, weight: Any, bias: Any, eps: Any, dtype: Any) -> None:
    check_input(OP, x)
    check_param(OP, "weight", weight, x)
    check_param(OP, "bias", bias, x)
    check_eps(OP, eps)


def _body(request: str, x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float,
          dtype: torch.dtype | None) -> Tensor:
    # (dtype: float32 for a 16-bit x under autocast, the kernel writing it; else None, x's)
    y, _, _ = call(_fwd, as_rows(x), weight, bias, float(eps), dtype, request)
    return y if y.shape == x.shape else y.reshape(x.shape)


# ------------------------------------------------------------------------------------------------------ autograd


# dtype: the result's where it is not x's (float32 from 16-bit x), else None.
@torch.library.custom_op("hkernels::layer_norm_fwd", mutates_args=())
def _fwd(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float, dtype: torch.dtype | None, backend: str
         ) -> tuple[Tensor, Tensor, Tensor]:
    if x.numel() == 0:
        return x.new_empty(x.shape, dtype=dtype or x.dtype), stats(x), stats(x)
    return dispatch.run(OP, "layer_norm_fwd", backend, rows(x), weight, bias, eps, dtype)


@_fwd.register_fake
def _(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float, dtype: torch.dtype | None, backend: str
      ) -> tuple[Tensor, Tensor, Tensor]:
    return x.new_empty(x.shape, dtype=dtype or x.dtype), stats(x), stats(x)


@torch.library.custom_op("hkernels::layer_norm_bwd", mutates_args=())
def _bwd(dy: Tensor, x: Tensor, weight: Tensor | None, bias: Tensor | None, mean: Tensor, rstd: Tensor,
         backend: str) -> tuple[Tensor, Tensor, Tensor]:
    if x.numel() == 0:
        dw = torch.zeros_like(weight) if weight is not None else placeholder(x)
        db = torch.zeros_like(bias) if bias is not None else placeholder(x)
        return x.new_zeros(x.shape), dw, db
    dx, dw, db = dispatch.run(OP, "layer_norm_bwd", backend, rows(dy), rows(x), weight, bias, mean, rstd)
    if x.shape[-1] == 1:
        # Rows of one element: x̂ = 0 and dx = rstd·(w·dy − mean(w·dy)) is exactly 0 (NaN where an input is not
        # finite). The kernels' GPU code fuses w·dy into the subtraction of its own rounded mean, and rstd = 1/√eps
        # scales that rounding up (to ~1e-5 in float32). Written out here.
        wdy = dy.float() if weight is None else dy.float() * weight.float()
        dx = ((wdy - wdy) + (x.float() - x.float())).to(dx.dtype).reshape(dx.shape)
    return dx, dw if dw is not None else placeholder(x), db if db is not None else placeholder(x)


@_bwd.register_fake
def _(dy: Tensor, x: Tensor, weight: Tensor | None, bias: Tensor | None, mean: Tensor, rstd: Tensor,
      backend: str) -> tuple[Tensor, Tensor, Tensor]:
    dw = weight.new_empty(weight.shape) if weight is not None else placeholder(x)
    db = bias.new_empty(bias.shape) if bias is not None else placeholder(x)
    return x.new_empty(x.shape), dw, db


def _setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor, Tensor]) -> None:
    x, weight, bias, _eps, _dtype, backend = inputs
    ctx.save_for_backward(x, weight, bias, output[1], output[2])
    ctx.backend = backend
    ctx.mark_non_differentiable(output[1], output[2])
    ctx.set_materialize_grads(False)  # (no zeros made for the statistics' gradients, which are never used)


def _backward(ctx: Any, dy: Tensor | None, _dmean: Tensor | None, _drstd: Tensor | None) -> tuple[Tensor | None, ...]:
    if dy is None:
        return None, None, None, None, None, None
    x, weight, bias, mean, rstd = ctx.saved_tensors
    dx, dw, db = call(_bwd, dy, x, weight, bias, mean, rstd, ctx.backend)
    return dx, (dw if weight is not None else None), (db if bias is not None else None), None, None, None


autograd(_fwd, _backward, _setup)


def _backward_fast(plan: Any, ctx: Any, dy: Tensor | None, _dmean: Tensor | None, _drstd: Tensor | None) -> Any:
    """_backward in one step for gradients of this signature: the kernel function its plan ran (rows of more than
    one element: see _bwd)."""
    run = bound_backward(plan, "layer_norm_bwd", dy)
    if run is None or dy.shape[-1] == 1:  # type: ignore[union-attr]
        return None

    def backward(ctx: Any, dy: Tensor, _dmean: Tensor | None, _drstd: Tensor | None) -> tuple[Tensor | None, ...]:
        x, weight, bias, mean, rstd = ctx.saved_tensors
        dx, dw, db = run(dy, x, weight, bias, mean, rstd)
        return dx, dw, db, None, None
    return backward


# ------------------------------------------------------------------------------- reference and the torch backend


def reference(x: Tensor, weight: Tensor | None = None, bias: Tensor | None = None, eps: float = 1e-5) -> Tensor:
    """y = (x - mean) / sqrt(var + eps) * weight + bias over the last dim (biased variance).  x: [..., N]."""
    xf = x.to(compute_dtype(x.dtype))
    mean = xf.mean(-1, keepdim=True)
    var = (xf - mean).pow(2).mean(-1, keepdim=True)
    y = (xf - mean) * torch.rsqrt(var + eps)
    if weight is not None:
        y = y * weight.to(xf.dtype)
    if bias is not None:
        y = y + bias.to(xf.dtype)
    return y.to(x.dtype)


def layer_norm_fwd(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float,
                   dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """x: [M, N] -> (y [M, N] in ``dtype`` (default x.dtype), mean [M] float32, rstd [M] float32)."""
    xf = x.to(compute_dtype(x.dtype))
    mean = xf.mean(-1)
    rstd = torch.rsqrt((xf - mean[:, None]).pow(2).mean(-1) + eps)
    y = (xf - mean[:, None]) * rstd[:, None]
    if weight is not None:
        y = y * weight.to(xf.dtype)
    if bias is not None:
        y = y + bias.to(xf.dtype)
    return y.to(dtype or x.dtype), mean.float(), rstd.float()


def _bind_layer_norm_fwd(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float,
                         dtype: torch.dtype | None = None, stats: bool = True) -> Any:
    """The torch backend's forward for calls of this signature; without the statistics (no backward follows)
    PyTorch's own ``F.layer_norm``, one pass, where the result and the parameters have x's dtype."""
    if stats:
        return layer_norm_fwd
    if (dtype is not None and dtype != x.dtype) or any(t is not None and t.dtype != x.dtype for t in (weight, bias)):
        return None
    shape = (x.shape[-1],)
    return lambda x, weight, bias, eps, dtype: torch.nn.functional.layer_norm(x, shape, weight, bias, eps)


layer_norm_fwd.bind = _bind_layer_norm_fwd  # type: ignore[attr-defined]


def layer_norm_bwd(dy: Tensor, x: Tensor, weight: Tensor | None, bias: Tensor | None, mean: Tensor, rstd: Tensor
                   ) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """x̂ = (x−mean)·rstd;  dx = rstd·(w·dy − mean(w·dy) − x̂·mean(w·dy·x̂));  dw = Σ dy·x̂;  db = Σ dy."""
    ct = compute_dtype(x.dtype)
    dyf = dy.to(ct)
    xhat = (x.to(ct) - mean.to(ct)[:, None]) * rstd.to(ct)[:, None]
    wdy = dyf * weight.to(ct) if weight is not None else dyf
    dx = (wdy - wdy.mean(-1, keepdim=True) - xhat * (wdy * xhat).mean(-1, keepdim=True)) * rstd.to(ct)[:, None]
    dw = (dyf * xhat).sum(0).to(weight.dtype) if weight is not None else None
    db = dyf.sum(0).to(bias.dtype) if bias is not None else None
    return dx.to(x.dtype), dw, db


def _fast(plan: Any, request: str, x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float,
          dtype: torch.dtype | None) -> Any:
    """Calls of this signature in one step: the kernel function the plan ran, on a view of x's rows; without a
    gradient, bound without the statistics; with one, through a Lane."""
    recorded, rows_of = bound(plan, "layer_norm_fwd"), rows_view(x)
    if recorded is None or rows_of is None or type(eps) is not float:
        return None
    shape, flat = x.shape, x.dim() == 2
    if wants_grad(x, weight, bias):
        apply = Lane(recorded, _setup, _backward, request, 5, None if flat else shape, rows_of, 1, 1,
                     _backward_fast).apply
        return lambda x, weight, bias, eps, dtype: apply(x, weight, bias, eps, dtype)[0]
    run = dispatch.rebind(recorded, "layer_norm_fwd", x if flat else x.view(rows_of), weight, bias, eps, dtype,
                          stats=False)
    if run is None or flat:
        return run
    return lambda x, weight, bias, eps, dtype: run(x.view(rows_of), weight, bias, eps, dtype).view(shape)


def _float32_result(public: Public, args: tuple[Any, ...], dtype: torch.dtype, applies: bool) -> Tensor:
    """Under autocast where PyTorch computes layer_norm in float32 (CUDA): 16-bit x read as it is, the result
    written in float32 (no float32 copy of x); 16-bit parameters are read into float32 by the kernel too."""
    x, weight, bias, eps, want = args
    if applies and isinstance(x, Tensor):
        if x.dtype in SIXTEEN:
            want = torch.float32
        elif x.dtype == torch.float32:  # float32 x, 16-bit parameters: autocast's casts, which are exact
            weight, bias = (p.float() if isinstance(p, Tensor) and p.dtype in SIXTEEN else p for p in (weight, bias))
    return public(x, weight, bias, eps, want)


# Under autocast: as F.layer_norm (float32 where PyTorch computes it in float32: CUDA).
_CALLS = Public(OP, _check, _body, _fast, autocast=Autocast("float32", ("aten::layer_norm",), _float32_result))
