"""The public ops: argument checks, ``torch.library`` custom ops, autograd wiring.

Each op is a pair of custom ops (``hkernels::<op>_fwd`` and ``hkernels::<op>_bwd``) with fake implementations,
so ``torch.compile(fullgraph=True)`` traces through them, and an autograd formula that calls the backward op.
The custom ops take 2-D ``[M, N]`` tensors (reduction over N) plus the backend the caller asked for; inside,
:func:`hkernels.dispatch.run` picks the backend. The request is read when the op is called (in eager mode) and
carried to the backward, so ``with use_backend("triton"): y = op(x)`` runs the backward on Triton too, even
when ``backward()`` runs after the scope has closed. Under ``torch.compile`` the request is read when the
compiled code runs (a context variable cannot be traced), by both the forward and the backward.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from hkernels import dispatch

Tensor = torch.Tensor
_FLOAT = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


# ------------------------------------------------------------------------------------------------ helpers


def _request(op: str) -> str:
    if torch.compiler.is_compiling():
        return ""
    dispatch.prepare()
    return dispatch.requested(op)


def _as_rows(x: Tensor) -> Tensor:
    """[..., N] -> [M, N] (reshape(-1, N) is ambiguous when N = 0)."""
    return x.reshape(math.prod(x.shape[:-1]), x.shape[-1])


def _rows(t: Tensor) -> Tensor:
    """Kernels read rows with any stride but need unit stride along the normalised dim."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _check_input(op: str, x: Any, min_dim: int = 1) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"hkernels.{op}: x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOAT:
        raise TypeError(f"hkernels.{op}: x must be float16, bfloat16, float32 or float64, got {x.dtype}")
    if x.dim() < min_dim:
        raise ValueError(f"hkernels.{op}: x must have at least {min_dim} dimension(s), got a 0-d tensor")


def _check_param(op: str, name: str, p: Any, x: Tensor) -> None:
    if p is None:
        return
    if not isinstance(p, torch.Tensor):
        raise TypeError(f"hkernels.{op}: {name} must be a torch.Tensor or None, got {type(p).__name__}")
    if p.dtype not in _FLOAT:
        raise TypeError(f"hkernels.{op}: {name} must be a floating-point tensor, got {p.dtype}")
    if p.shape != (x.shape[-1],):
        raise ValueError(
            f"hkernels.{op}: {name} must have shape [{x.shape[-1]}] (the last dim of x, shape "
            f"{list(x.shape)}), got {list(p.shape)}"
        )
    if p.device != x.device:
        raise ValueError(f"hkernels.{op}: {name} is on {p.device} but x is on {x.device}")


def _stats(x: Tensor) -> Tensor:
    return x.new_empty(x.shape[0], dtype=torch.float32)


def _placeholder(x: Tensor) -> Tensor:
    # Custom ops cannot return None inside a tuple: an absent gradient travels as an empty tensor.
    return x.new_empty(0)


# ----------------------------------------------------------------------------------------------- rms_norm


@torch.library.custom_op("hkernels::rms_norm_fwd", mutates_args=())
def _rms_norm_fwd(x: Tensor, weight: Tensor | None, eps: float, backend: str) -> tuple[Tensor, Tensor]:
    if x.numel() == 0:
        return x.new_empty(x.shape), _stats(x)
    return dispatch.run("rms_norm", "rms_norm_fwd", backend, _rows(x), weight, eps)


@_rms_norm_fwd.register_fake
def _(x: Tensor, weight: Tensor | None, eps: float, backend: str) -> tuple[Tensor, Tensor]:
    return x.new_empty(x.shape), _stats(x)


@torch.library.custom_op("hkernels::rms_norm_bwd", mutates_args=())
def _rms_norm_bwd(dy: Tensor, x: Tensor, weight: Tensor | None, rstd: Tensor, backend: str) -> tuple[Tensor, Tensor]:
    if x.numel() == 0:
        dw = torch.zeros_like(weight) if weight is not None else _placeholder(x)
        return x.new_zeros(x.shape), dw
    dx, dw = dispatch.run("rms_norm", "rms_norm_bwd", backend, _rows(dy), _rows(x), weight, rstd)
    return dx, dw if dw is not None else _placeholder(x)


@_rms_norm_bwd.register_fake
def _(dy: Tensor, x: Tensor, weight: Tensor | None, rstd: Tensor, backend: str) -> tuple[Tensor, Tensor]:
    return x.new_empty(x.shape), (weight.new_empty(weight.shape) if weight is not None else _placeholder(x))


def _rms_norm_setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
    x, weight, _eps, backend = inputs
    ctx.save_for_backward(x, weight, output[1])
    ctx.backend = backend


def _rms_norm_backward(ctx: Any, dy: Tensor, _drstd: Tensor) -> tuple[Tensor | None, ...]:
    x, weight, rstd = ctx.saved_tensors
    dx, dw = _rms_norm_bwd(dy, x, weight, rstd, ctx.backend)
    return dx, (dw if weight is not None else None), None, None


_rms_norm_fwd.register_autograd(_rms_norm_backward, setup_context=_rms_norm_setup)


def rms_norm(x: Tensor, weight: Tensor | None = None, eps: float = 1e-6) -> Tensor:
    """Root-mean-square norm over the last dim: ``x / sqrt(mean(x²) + eps) * weight``.

    x: [..., N] float16/bfloat16/float32 (float64 on the torch backend); weight: [N] or None. Math in float32;
    the result has x's dtype and shape. Differentiable in x and weight.
    """
    _check_input("rms_norm", x)
    _check_param("rms_norm", "weight", weight, x)
    y, _ = _rms_norm_fwd(_as_rows(x), weight, float(eps), _request("rms_norm"))
    return y.reshape(x.shape)


# --------------------------------------------------------------------------------------------- layer_norm


@torch.library.custom_op("hkernels::layer_norm_fwd", mutates_args=())
def _layer_norm_fwd(
    x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float, backend: str
) -> tuple[Tensor, Tensor, Tensor]:
    if x.numel() == 0:
        return x.new_empty(x.shape), _stats(x), _stats(x)
    return dispatch.run("layer_norm", "layer_norm_fwd", backend, _rows(x), weight, bias, eps)


@_layer_norm_fwd.register_fake
def _(
    x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float, backend: str
) -> tuple[Tensor, Tensor, Tensor]:
    return x.new_empty(x.shape), _stats(x), _stats(x)


@torch.library.custom_op("hkernels::layer_norm_bwd", mutates_args=())
def _layer_norm_bwd(
    dy: Tensor, x: Tensor, weight: Tensor | None, bias: Tensor | None, mean: Tensor, rstd: Tensor, backend: str
) -> tuple[Tensor, Tensor, Tensor]:
    if x.numel() == 0:
        dw = torch.zeros_like(weight) if weight is not None else _placeholder(x)
        db = torch.zeros_like(bias) if bias is not None else _placeholder(x)
        return x.new_zeros(x.shape), dw, db
    dx, dw, db = dispatch.run("layer_norm", "layer_norm_bwd", backend, _rows(dy), _rows(x), weight, bias, mean, rstd)
    return dx, dw if dw is not None else _placeholder(x), db if db is not None else _placeholder(x)


@_layer_norm_bwd.register_fake
def _(
    dy: Tensor, x: Tensor, weight: Tensor | None, bias: Tensor | None, mean: Tensor, rstd: Tensor, backend: str
) -> tuple[Tensor, Tensor, Tensor]:
    dw = weight.new_empty(weight.shape) if weight is not None else _placeholder(x)
    db = bias.new_empty(bias.shape) if bias is not None else _placeholder(x)
    return x.new_empty(x.shape), dw, db


def _layer_norm_setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor, Tensor]) -> None:
    x, weight, bias, _eps, backend = inputs
    ctx.save_for_backward(x, weight, bias, output[1], output[2])
    ctx.backend = backend


def _layer_norm_backward(ctx: Any, dy: Tensor, _dmean: Tensor, _drstd: Tensor) -> tuple[Tensor | None, ...]:
    x, weight, bias, mean, rstd = ctx.saved_tensors
    dx, dw, db = _layer_norm_bwd(dy, x, weight, bias, mean, rstd, ctx.backend)
    return dx, (dw if weight is not None else None), (db if bias is not None else None), None, None


_layer_norm_fwd.register_autograd(_layer_norm_backward, setup_context=_layer_norm_setup)


def layer_norm(x: Tensor, weight: Tensor | None = None, bias: Tensor | None = None, eps: float = 1e-5) -> Tensor:
    """Layer norm over the last dim: ``(x - mean) / sqrt(var + eps) * weight + bias`` (biased variance).

    x: [..., N] float16/bfloat16/float32 (float64 on the torch backend); weight, bias: [N] or None. Math in
    float32; the result has x's dtype and shape. Differentiable in x, weight and bias.
    """
    _check_input("layer_norm", x)
    _check_param("layer_norm", "weight", weight, x)
    _check_param("layer_norm", "bias", bias, x)
    y, _, _ = _layer_norm_fwd(_as_rows(x), weight, bias, float(eps), _request("layer_norm"))
    return y.reshape(x.shape)


# ------------------------------------------------------------------------------------------------ softmax


@torch.library.custom_op("hkernels::softmax_fwd", mutates_args=())
def _softmax_fwd(x: Tensor, backend: str) -> Tensor:
    if x.numel() == 0:
        return x.new_empty(x.shape)
    return dispatch.run("softmax", "softmax_fwd", backend, _rows(x))


@_softmax_fwd.register_fake
def _(x: Tensor, backend: str) -> Tensor:
    return x.new_empty(x.shape)


@torch.library.custom_op("hkernels::softmax_bwd", mutates_args=())
def _softmax_bwd(dy: Tensor, y: Tensor, backend: str) -> Tensor:
    if y.numel() == 0:
        return y.new_zeros(y.shape)
    return dispatch.run("softmax", "softmax_bwd", backend, _rows(dy), _rows(y))


@_softmax_bwd.register_fake
def _(dy: Tensor, y: Tensor, backend: str) -> Tensor:
    return y.new_empty(y.shape)


def _softmax_setup(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    ctx.save_for_backward(output)
    ctx.backend = inputs[1]


def _softmax_backward(ctx: Any, dy: Tensor) -> tuple[Tensor | None, None]:
    (y,) = ctx.saved_tensors
    return _softmax_bwd(dy, y, ctx.backend), None


_softmax_fwd.register_autograd(_softmax_backward, setup_context=_softmax_setup)


def softmax(x: Tensor, dim: int = -1) -> Tensor:
    """Softmax along ``dim`` (any dim; the last is fastest: others are moved there and back).

    x: any shape, float16/bfloat16/float32 (float64 on the torch backend). Math in float32; the result has x's
    dtype and shape. Differentiable.
    """
    _check_input("softmax", x, min_dim=0)
    if not isinstance(dim, int) or isinstance(dim, bool):
        raise TypeError(f"hkernels.softmax: dim must be an int, got {type(dim).__name__}")
    ndim = max(x.dim(), 1)
    if not -ndim <= dim < ndim:
        raise IndexError(f"hkernels.softmax: dim {dim} is out of range for a tensor of {x.dim()} dimension(s)")
    xt = x.reshape(1) if x.dim() == 0 else x.movedim(dim, -1)
    y = _softmax_fwd(_as_rows(xt), _request("softmax")).reshape(xt.shape)
    return y.reshape(()) if x.dim() == 0 else y.movedim(-1, dim)


for _name, _fn in (("rms_norm", rms_norm), ("layer_norm", layer_norm), ("softmax", softmax)):
    dispatch.register_op(_name, _fn)
