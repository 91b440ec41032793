"""softmax: ``exp(x - max(x)) / sum(exp(x - max(x)))`` along any dim.

The public function and its checks, its autograd (custom ops ``hkernels::softmax_fwd`` / ``_bwd``), then the
reference math and the torch backend. Kernels: ``hkernels/ops/softmax.py`` (Helion), ``triton_fallback/softmax.py``.
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
    check_input,
    compute_dtype,
    rows,
    rows_view,
    wants_grad,
)

OP = "softmax"


def softmax(x: Tensor, dim: int = -1, dtype: torch.dtype | None = None) -> Tensor:
    """Softmax along ``dim`` (any dim; the last is fastest: others are moved there and back).

    x: any shape, float16/bfloat16/float32 (float64 on the torch backend). Math in float32; the result has x's
    dtype and shape, or ``dtype``'s: as ``F.softmax``, x is cast to it first (float32 from 16 bits costs no pass:
    the kernel reads 16 bits and writes 32). Differentiable; x's gradient has x's dtype.
    """
    return _CALLS(x, dim, dtype)


def _check(x: Any, dim: Any, dtype: Any) -> None:
    check_input(OP, x, min_dim=0)
    if not isinstance(dim, int) or isinstance(dim, bool):
        raise TypeError(f"hkernels.softmax: dim must be an int, got {type(dim).__name__}")
    ndim = max(x.dim(), 1)
    if not -ndim <= dim < ndim:
        raise IndexError(f"hkernels.softmax: dim {dim} is out of range for a tensor of {x.dim()} dimension(s)")
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise TypeError(f"hkernels.softmax: dtype must be a floating torch.dtype or None, got {dtype!r}")


def _widened(x: Tensor, dtype: torch.dtype | None) -> torch.dtype | None:
    """float32 where the result is float32 and x 16-bit (the kernel writes float32 itself), else None."""
    return dtype if dtype == torch.float32 and x.dtype in SIXTEEN else None


def _body(request: str, x: Tensor, dim: int, dtype: torch.dtype | None) -> Tensor:
    out = _widened(x, dtype)
    if dtype is not None and out is None and dtype != x.dtype:
        x = x.to(dtype)  # as F.softmax: the input in the result's dtype first
    if x.dim() and dim % x.dim() == x.dim() - 1:  # the last dim: no moves
        y = call(_fwd, as_rows(x), out, request)
        return y if y.shape == x.shape else y.reshape(x.shape)
    xt = x.reshape(1) if x.dim() == 0 else x.movedim(dim, -1)
    y = call(_fwd, as_rows(xt), out, request).reshape(xt.shape)
    return y.reshape(()) if x.dim() == 0 else y.movedim(-1, dim)


def routed(arguments: dict[str, Any]) -> tuple[Tensor, ...]:
    """The tensors a call's kernel is routed by (for selected_backend): over dim d, a view with d moved last."""
    x, dim = arguments["x"], arguments["dim"]
    if not isinstance(x, torch.Tensor) or x.dim() == 0 or not isinstance(dim, int):
        return (x,) if isinstance(x, torch.Tensor) else ()
    return (x.movedim(dim, -1),)


# ------------------------------------------------------------------------------------------------------ autograd


# dtype: the result's where it is not x's (float32 from 16-bit x), else None.
@torch.library.custom_op("hkernels::softmax_fwd", mutates_args=())
def _fwd(x: Tensor, dtype: torch.dtype | None, backend: str) -> Tensor:
    if x.numel() == 0:
        return x.new_empty(x.shape, dtype=dtype or x.dtype)
    return dispatch.run(OP, "softmax_fwd", backend, rows(x), dtype)


@_fwd.register_fake
def _(x: Tensor, dtype: torch.dtype | None, backend: str) -> Tensor:
    return x.new_empty(x.shape, dtype=dtype or x.dtype)


# dtype: dx's (x's).
@torch.library.custom_op("hkernels::softmax_bwd", mutates_args=())
def _bwd(dy: Tensor, y: Tensor, dtype: torch.dtype, backend: str) -> Tensor:
    if y.numel() == 0:
        return y.new_zeros(y.shape, dtype=dtype)
    return dispatch.run(OP, "softmax_bwd", backend, rows(dy), rows(y), dtype)


@_bwd.register_fake
def _(dy: Tensor, y: Tensor, dtype: torch.dtype, backend: str) -> Tensor:
    return y.new_empty(y.shape, dtype=dtype)


def _setup(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    ctx.save_for_backward(output)
    ctx.dtype = inputs[0].dtype
    ctx.backend = inputs[2]


def _backward(ctx: Any, dy: Tensor) -> tuple[Tensor | None, None, None]:
    (y,) = ctx.saved_tensors
    return call(_bwd, dy, y, ctx.dtype, ctx.backend), None, None


autograd(_fwd, _backward, _setup)


def _backward_fast(plan: Any, ctx: Any, dy: Tensor | None) -> Any:
    """_backward in one step for gradients of this signature: the kernel function its plan ran."""
    run = bound_backward(plan, "softmax_bwd", dy)
    if run is None:
        return None

    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor | None, ...]:
        (y,) = ctx.saved_tensors
        return run(dy, y, ctx.dtype), None
    return backward


# ------------------------------------------------------------------------------- reference and the torch backend


def reference(x: Tensor, dim: int = -1, dtype: torch.dtype | None = None) -> Tensor:
    """y = exp(x - max(x)) / sum(exp(x - max(x))) along ``dim`` (x cast to ``dtype`` first, as F.softmax)."""
    x = x if dtype is None else x.to(dtype)
    xf = x.to(compute_dtype(x.dtype))
    e = torch.exp(xf - xf.amax(dim, keepdim=True))
    return (e / e.sum(dim, keepdim=True)).to(x.dtype)


def softmax_fwd(x: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """x: [M, N] -> softmax over N, in ``dtype`` (default x.dtype). PyTorch's own softmax (one pass, float32 math for
    16-bit x) where the result's dtype is x's or wider (x cast up first is exact); the math below otherwise."""
    if dtype is None or dtype == x.dtype:
        return torch.softmax(x, -1)
    if dtype.itemsize > x.dtype.itemsize and dtype.is_floating_point:
        return torch.softmax(x, -1, dtype=dtype)
    xf = x.to(compute_dtype(x.dtype))
    e = torch.exp(xf - xf.amax(-1, keepdim=True))
    return (e / e.sum(-1, keepdim=True)).to(dtype or x.dtype)


def softmax_bwd(dy: Tensor, y: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """dx = y·(dy − Σ dy·y), in ``dtype`` (default y.dtype): PyTorch's own softmax backward (float32 math for 16-bit
    y), rounded to ``dtype`` once where it is not y's."""
    if dy.dtype == y.dtype:
        return torch._softmax_backward_data(dy, y, -1, y.dtype).to(dtype or y.dtype)
    ct = compute_dtype(y.dtype)
    yf, dyf = y.to(ct), dy.to(ct)
    return (yf * (dyf - (dyf * yf).sum(-1, keepdim=True))).to(dtype or y.dtype)


def _fast(plan: Any, request: str, x: Tensor, dim: int, dtype: torch.dtype | None) -> Any:
    """Calls over the last dim in one step: the kernel function the plan ran, on a view of x's rows (through a Lane
    when a gradient is wanted)."""
    run, rows_of = bound(plan, "softmax_fwd"), rows_view(x)
    out = _widened(x, dtype)
    if (run is None or rows_of is None or dim % x.dim() != x.dim() - 1
            or (dtype is not None and out is None and dtype != x.dtype)):
        return None
    flat = x.dim() == 2
    if wants_grad(x):
        apply = Lane(run, _setup, _backward, request, 2, None if flat else x.shape, rows_of, 1, 1,
                     _backward_fast).apply
        return lambda x, dim, dtype: apply(x, out)
    if flat:
        return lambda x, dim, dtype: run(x, out)
    shape = x.shape
    return lambda x, dim, dtype: run(x.view(rows_of), out).view(shape)


def _float32_result(public: Public, args: tuple[Any, ...], dtype: torch.dtype, applies: bool) -> Tensor:
    """Under autocast where PyTorch computes softmax in float32 (CUDA): 16-bit x read as it is, the result written
    in float32 (no float32 copy of x)."""
    x, dim, want = args
    if applies and want is None and isinstance(x, Tensor) and x.dtype in SIXTEEN:
        want = torch.float32
    return public(x, dim, want)


# Under autocast: as torch.softmax (a float32 result where PyTorch gives one: CUDA).
_CALLS = Public(OP, _check, _body, _fast, autocast=Autocast("float32", ("aten::softmax.int",), _float32_result))
