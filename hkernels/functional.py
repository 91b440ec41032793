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


_PLAIN = (torch.Tensor, torch.nn.Parameter)
_MUTATES: dict[Any, bool] = {}  # custom op -> whether it mutates an argument (those are always called as custom ops)
_EAGER: dict[Any, type[torch.autograd.Function]] = {}


def _autograd(opdef: Any, backward: Any, setup: Any) -> None:
    """Register ``opdef``'s autograd formula, and keep an equivalent ``autograd.Function`` for the eager fast
    path (see :func:`_call`)."""
    opdef.register_autograd(backward, setup_context=setup)
    impl = opdef._init_fn  # the Python body under the custom op

    class _Eager(torch.autograd.Function):
        @staticmethod
        def forward(*args: Any) -> Any:
            return impl(*args)

        @staticmethod
        def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
            setup(ctx, inputs, output)

        @staticmethod
        def backward(ctx: Any, *grads: Any) -> Any:
            return backward(ctx, *grads)

    _Eager.__name__ = _Eager.__qualname__ = f"{impl.__name__}_eager"
    _EAGER[opdef] = _Eager


def _plain(args: tuple[Any, ...]) -> bool:
    """True when nothing the custom-op layer exists for is in play (the caller has ruled out compiling): no
    functorch transform (vmap, grad), no dispatch or function mode (FakeTensorMode, ``with torch.device(...)``), no
    ``torch.jit.trace``, no tensor subclass (DTensor, FakeTensor)."""
    if (torch._C._are_functorch_transforms_active() or torch._C._len_torch_dispatch_stack()
            or torch._C._is_torch_function_mode_enabled() or torch._C._get_tracing_state() is not None):
        return False  # (torch.jit.trace records custom ops, not what runs inside them)
    for a in args:  # noqa: SIM110 (a loop, not all(...): no generator per call; host time counts at decode shapes)
        if isinstance(a, torch.Tensor) and type(a) not in _PLAIN:
            return False
    return True


def _wants_grad(args: tuple[Any, ...]) -> bool:
    if not torch.is_grad_enabled():
        return False
    for a in args:  # noqa: SIM110 (as in _plain)
        if isinstance(a, torch.Tensor) and a.requires_grad:
            return True
    return False


def _call(opdef: Any, *args: Any) -> Any:
    """Call custom op ``opdef``; in plain eager calls (:func:`_plain`) its Python body directly, through the
    equivalent ``autograd.Function`` when a gradient is wanted. The custom-op layers cost 30-80 µs per call on a
    CPU (measured), more than a kernel at decode shapes; the results are the same either way. A call that wants a
    gradient of an op without an autograd formula (a backward op under ``create_graph=True``) takes the custom
    op, which raises its clear error; so does an op that mutates an input, whose version counter the custom op
    bumps (a kernel writing through a pointer would not: a second backward over a gradient scaled in place must
    fail, not reuse it)."""
    if torch.compiler.is_compiling():  # first: Dynamo must not trace the lookups below (a schema is untraceable)
        return opdef(*args)
    mutates = _MUTATES.get(opdef)
    if mutates is None:
        mutates = _MUTATES[opdef] = bool(opdef._opoverload._schema.is_mutable)
    if not mutates and _plain(args):
        if not _wants_grad(args):
            return opdef._init_fn(*args)
        eager = _EAGER.get(opdef)
        if eager is not None:
            return eager.apply(*args)
    return opdef(*args)


def _as_rows(x: Tensor) -> Tensor:
    """[..., N] -> [M, N] (reshape(-1, N) is ambiguous when N = 0); a 2-D x as it is (a reshape costs host time)."""
    return x if x.dim() == 2 else x.reshape(math.prod(x.shape[:-1]), x.shape[-1])


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
    dx, dw = _call(_rms_norm_bwd, dy, x, weight, rstd, ctx.backend)
    return dx, (dw if weight is not None else None), None, None


_autograd(_rms_norm_fwd, _rms_norm_backward, _rms_norm_setup)


def rms_norm(x: Tensor, weight: Tensor | None = None, eps: float = 1e-6) -> Tensor:
    """Root-mean-square norm over the last dim: ``x / sqrt(mean(x²) + eps) * weight``.

    x: [..., N] float16/bfloat16/float32 (float64 on the torch backend); weight: [N] or None. Math in float32;
    the result has x's dtype and shape. Differentiable in x and weight.
    """
    _check_input("rms_norm", x)
    _check_param("rms_norm", "weight", weight, x)
    y, _ = _call(_rms_norm_fwd, _as_rows(x), weight, float(eps), _request("rms_norm"))
    return y if y.shape == x.shape else y.reshape(x.shape)


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
    if x.shape[-1] == 1:
        # Rows of one element: x̂ = 0 and dx = rstd·(w·dy − mean(w·dy)) is exactly 0 (NaN where an input is not
        # finite). The kernels' GPU code fuses w·dy into the subtraction of its own rounded mean, and rstd = 1/√eps
        # scales that rounding: 3.6e-5 in float32 on the H200 (found by the fuzz, session 8). Written out here.
        wdy = dy.float() if weight is None else dy.float() * weight.float()
        dx = ((wdy - wdy) + (x.float() - x.float())).to(dx.dtype).reshape(dx.shape)
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
    dx, dw, db = _call(_layer_norm_bwd, dy, x, weight, bias, mean, rstd, ctx.backend)
    return dx, (dw if weight is not None else None), (db if bias is not None else None), None, None


_autograd(_layer_norm_fwd, _layer_norm_backward, _layer_norm_setup)


def layer_norm(x: Tensor, weight: Tensor | None = None, bias: Tensor | None = None, eps: float = 1e-5) -> Tensor:
    """Layer norm over the last dim: ``(x - mean) / sqrt(var + eps) * weight + bias`` (biased variance).

    x: [..., N] float16/bfloat16/float32 (float64 on the torch backend); weight, bias: [N] or None. Math in
    float32; the result has x's dtype and shape. Differentiable in x, weight and bias.
    """
    _check_input("layer_norm", x)
    _check_param("layer_norm", "weight", weight, x)
    _check_param("layer_norm", "bias", bias, x)
    y, _, _ = _call(_layer_norm_fwd, _as_rows(x), weight, bias, float(eps), _request("layer_norm"))
    return y if y.shape == x.shape else y.reshape(x.shape)


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
    return _call(_softmax_bwd, dy, y, ctx.backend), None


_autograd(_softmax_fwd, _softmax_backward, _softmax_setup)


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
    y = _call(_softmax_fwd, _as_rows(xt), _request("softmax")).reshape(xt.shape)
    return y.reshape(()) if x.dim() == 0 else y.movedim(-1, dim)



# ------------------------------------------------------------------------------------- checks of the LLM ops


def _check_tensor(op: str, name: str, t: Any, dims: tuple[int, ...] | None = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"hkernels.{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _FLOAT:
        raise TypeError(f"hkernels.{op}: {name} must be float16, bfloat16, float32 or float64, got {t.dtype}")
    if dims is not None and t.dim() not in dims:
        want = " or ".join(f"{d}-d" for d in dims)
        raise ValueError(f"hkernels.{op}: {name} must be {want}, got shape {list(t.shape)}")


def _check_same(op: str, names: tuple[str, ...], *ts: Tensor, shape: bool = True) -> None:
    first = ts[0]
    for name, t in zip(names[1:], ts[1:], strict=True):
        if shape and t.shape != first.shape:
            raise ValueError(
                f"hkernels.{op}: {names[0]} and {name} must have the same shape, got {list(first.shape)} and "
                f"{list(t.shape)}"
            )
        if t.dtype != first.dtype:
            raise TypeError(f"hkernels.{op}: {names[0]} and {name} must have the same dtype, got {first.dtype} and "
                            f"{t.dtype}")
        if t.device != first.device:
            raise ValueError(f"hkernels.{op}: {name} is on {t.device} but {names[0]} is on {first.device}")


def _none_to_zeros(grad: Tensor | None, like: Tensor) -> Tensor:
    return grad if grad is not None else torch.zeros_like(like)


# ------------------------------------------------------------------------------------------ swiglu, geglu


@torch.library.custom_op("hkernels::swiglu_fwd", mutates_args=())
def _swiglu_fwd(gate: Tensor, up: Tensor, backend: str) -> Tensor:
    if gate.numel() == 0:
        return gate.new_empty(gate.shape)
    return dispatch.run("swiglu", "swiglu_fwd", backend, _rows(gate), _rows(up))


@_swiglu_fwd.register_fake
def _(gate: Tensor, up: Tensor, backend: str) -> Tensor:
    return gate.new_empty(gate.shape)


@torch.library.custom_op("hkernels::swiglu_bwd", mutates_args=())
def _swiglu_bwd(dy: Tensor, gate: Tensor, up: Tensor, backend: str) -> tuple[Tensor, Tensor]:
    if gate.numel() == 0:
        return gate.new_zeros(gate.shape), up.new_zeros(up.shape)
    return dispatch.run("swiglu", "swiglu_bwd", backend, _rows(dy), _rows(gate), _rows(up))


@_swiglu_bwd.register_fake
def _(dy: Tensor, gate: Tensor, up: Tensor, backend: str) -> tuple[Tensor, Tensor]:
    return gate.new_empty(gate.shape), up.new_empty(up.shape)


def _swiglu_setup(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    gate, up, backend = inputs
    ctx.save_for_backward(gate, up)
    ctx.backend = backend


def _swiglu_backward(ctx: Any, dy: Tensor) -> tuple[Tensor | None, ...]:
    gate, up = ctx.saved_tensors
    dgate, dup = _call(_swiglu_bwd, dy, gate, up, ctx.backend)
    return dgate, dup, None


_autograd(_swiglu_fwd, _swiglu_backward, _swiglu_setup)


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """The SwiGLU gate of a Llama MLP: ``silu(gate) * up``.

    gate, up: [..., N], one shape and dtype (float16/bfloat16/float32; float64 on the torch backend). Either may
    be a column slice of a wider tensor (e.g. the halves of a fused gate-up projection): read in place. Math in
    float32; the result has gate's dtype. Differentiable in both.
    """
    _check_tensor("swiglu", "gate", gate, None)
    _check_tensor("swiglu", "up", up, None)
    _check_same("swiglu", ("gate", "up"), gate, up)
    if gate.dim() == 0:
        return swiglu(gate.reshape(1), up.reshape(1)).reshape(())
    y = _call(_swiglu_fwd, _as_rows(gate), _as_rows(up), _request("swiglu"))
    return y if y.shape == gate.shape else y.reshape(gate.shape)


_GELU_FORMS = ("tanh", "none")


@torch.library.custom_op("hkernels::geglu_fwd", mutates_args=())
def _geglu_fwd(gate: Tensor, up: Tensor, approximate: str, backend: str) -> Tensor:
    if gate.numel() == 0:
        return gate.new_empty(gate.shape)
    return dispatch.run("geglu", "geglu_fwd", backend, _rows(gate), _rows(up), approximate)


@_geglu_fwd.register_fake
def _(gate: Tensor, up: Tensor, approximate: str, backend: str) -> Tensor:
    return gate.new_empty(gate.shape)


@torch.library.custom_op("hkernels::geglu_bwd", mutates_args=())
def _geglu_bwd(dy: Tensor, gate: Tensor, up: Tensor, approximate: str, backend: str) -> tuple[Tensor, Tensor]:
    if gate.numel() == 0:
        return gate.new_zeros(gate.shape), up.new_zeros(up.shape)
    return dispatch.run("geglu", "geglu_bwd", backend, _rows(dy), _rows(gate), _rows(up), approximate)


@_geglu_bwd.register_fake
def _(dy: Tensor, gate: Tensor, up: Tensor, approximate: str, backend: str) -> tuple[Tensor, Tensor]:
    return gate.new_empty(gate.shape), up.new_empty(up.shape)


def _geglu_setup(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    gate, up, approximate, backend = inputs
    ctx.save_for_backward(gate, up)
    ctx.approximate, ctx.backend = approximate, backend


def _geglu_backward(ctx: Any, dy: Tensor) -> tuple[Tensor | None, ...]:
    gate, up = ctx.saved_tensors
    dgate, dup = _call(_geglu_bwd, dy, gate, up, ctx.approximate, ctx.backend)
    return dgate, dup, None, None


_autograd(_geglu_fwd, _geglu_backward, _geglu_setup)


def geglu(gate: Tensor, up: Tensor, approximate: str = "tanh") -> Tensor:
    """The GeGLU gate: ``gelu(gate, approximate) * up``; ``approximate`` is "tanh" (default) or "none" (erf).

    gate, up: [..., N], one shape and dtype; column slices are read in place. Math in float32; the result has
    gate's dtype. Differentiable in both.
    """
    _check_tensor("geglu", "gate", gate, None)
    _check_tensor("geglu", "up", up, None)
    _check_same("geglu", ("gate", "up"), gate, up)
    if approximate not in _GELU_FORMS:
        raise ValueError(f"hkernels.geglu: approximate must be 'tanh' or 'none', got {approximate!r}")
    if gate.dim() == 0:
        return geglu(gate.reshape(1), up.reshape(1), approximate).reshape(())
    y = _call(_geglu_fwd, _as_rows(gate), _as_rows(up), approximate, _request("geglu"))
    return y if y.shape == gate.shape else y.reshape(gate.shape)


# ------------------------------------------------------------------------------------------------------ rope


def _d_unit(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


@torch.library.custom_op("hkernels::rope_fwd", mutates_args=())
def _rope_fwd(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, backend: str) -> tuple[Tensor, Tensor]:
    if q.numel() == 0 or k.numel() == 0:  # nothing for a kernel to do (the other tensor is tiny then too)
        return dispatch.run("rope", "rope_fwd", "torch", q, k, cos, sin)
    return dispatch.run("rope", "rope_fwd", backend, _d_unit(q), _d_unit(k), cos, sin)


@_rope_fwd.register_fake
def _(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, backend: str) -> tuple[Tensor, Tensor]:
    return q.new_empty(q.shape), k.new_empty(k.shape)


@torch.library.custom_op("hkernels::rope_bwd", mutates_args=())
def _rope_bwd(dq: Tensor, dk: Tensor, cos: Tensor, sin: Tensor, backend: str) -> tuple[Tensor, Tensor]:
    if dq.numel() == 0 or dk.numel() == 0:
        return dispatch.run("rope", "rope_bwd", "torch", dq, dk, cos, sin)
    return dispatch.run("rope", "rope_bwd", backend, _d_unit(dq), _d_unit(dk), cos, sin)


@_rope_bwd.register_fake
def _(dq: Tensor, dk: Tensor, cos: Tensor, sin: Tensor, backend: str) -> tuple[Tensor, Tensor]:
    return dq.new_empty(dq.shape), dk.new_empty(dk.shape)


def _rope_setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
    q, k, cos, sin, backend = inputs
    tables_need_grad = any(ctx.needs_input_grad[2:4])
    ctx.save_for_backward(cos, sin, *((q, k) if tables_need_grad else ()))
    ctx.backend = backend


def _rope_backward(ctx: Any, dq_rot: Tensor | None, dk_rot: Tensor | None) -> tuple[Tensor | None, ...]:
    cos, sin, *qk = ctx.saved_tensors
    q_shape, k_shape = ctx.q_shape, ctx.k_shape
    dq_rot = dq_rot if dq_rot is not None else cos.new_zeros(q_shape, dtype=ctx.q_dtype)
    dk_rot = dk_rot if dk_rot is not None else cos.new_zeros(k_shape, dtype=ctx.q_dtype)
    dq, dk = _call(_rope_bwd, dq_rot, dk_rot, cos, sin, ctx.backend)
    dcos = dsin = None
    if qk:
        # Learned rotary tables (rare): their gradients by PyTorch ops, summed over heads (and the batch when shared).
        q, k = qk
        dcos, dsin = _rope_table_grads(q, k, dq_rot, dk_rot, cos)
    return dq, dk, dcos, dsin, None


def _rope_table_grads(q: Tensor, k: Tensor, dq: Tensor, dk: Tensor, cos: Tensor) -> tuple[Tensor, Tensor]:
    ct = torch.promote_types(cos.dtype, torch.float32)
    half = q.shape[-1] // 2

    def rot(x: Tensor) -> Tensor:
        return torch.cat([-x[..., half:], x[..., :half]], dim=-1)

    qf, kf, dqf, dkf = (t.to(ct) for t in (q, k, dq, dk))
    dcos = (dqf * qf).sum(1) + (dkf * kf).sum(1)  # [B, S, D]
    dsin = (dqf * rot(qf)).sum(1) + (dkf * rot(kf)).sum(1)
    if cos.shape[0] == 1:
        dcos, dsin = dcos.sum(0, keepdim=True), dsin.sum(0, keepdim=True)
    return dcos.to(cos.dtype), dsin.to(cos.dtype)


def _rope_setup_shapes(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
    _rope_setup(ctx, inputs, output)
    ctx.q_shape, ctx.k_shape, ctx.q_dtype = inputs[0].shape, inputs[1].shape, inputs[0].dtype
    ctx.set_materialize_grads(False)


_autograd(_rope_fwd, _rope_backward, _rope_setup_shapes)


def rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """Rotary position embedding in Hugging Face's rotate_half convention: ``x·cos + rotate_half(x)·sin``.

    q: [B, Hq, S, D], k: [B, Hk, S, D] (Hk may differ from Hq: GQA), one dtype, D even; any strides with unit
    stride along D (e.g. ``x.view(B, S, H, D).transpose(1, 2)``) are read in place. cos, sin: [S, D] or [B, S, D]
    (any float dtype: float32 tables with bfloat16 q are fine). Returns (q_rot, k_rot), contiguous, in q's dtype.
    Differentiable in q and k (and in cos/sin, by PyTorch ops, when they require grad).
    """
    for name, t in (("q", q), ("k", k)):
        _check_tensor("rope", name, t, (4,))
    _check_same("rope", ("q", "k"), q, k, shape=False)
    B, _, S, D = q.shape
    if k.shape[0] != B or k.shape[2] != S or k.shape[3] != D:
        raise ValueError(f"hkernels.rope: q [B, Hq, S, D] = {list(q.shape)} and k [B, Hk, S, D] = {list(k.shape)} "
                         "must agree on B, S and D")
    if D % 2:
        raise ValueError(f"hkernels.rope: the head dim D must be even (rotate_half splits it), got {D}")
    tables = []
    for name, t in (("cos", cos), ("sin", sin)):
        _check_tensor("rope", name, t, (2, 3))
        if t.shape[-2:] != (S, D) or (t.dim() == 3 and t.shape[0] not in (1, B)):
            raise ValueError(f"hkernels.rope: {name} must be [S, D] = [{S}, {D}] or [B, S, D] = [{B}, {S}, {D}], "
                             f"got {list(t.shape)}")
        if t.device != q.device:
            raise ValueError(f"hkernels.rope: {name} is on {t.device} but q is on {q.device}")
        tables.append((t if t.dim() == 3 else t.unsqueeze(0)).contiguous())
    if tables[0].shape != tables[1].shape:
        raise ValueError(f"hkernels.rope: cos and sin must have the same shape, got {list(cos.shape)} and "
                         f"{list(sin.shape)}")
    return _call(_rope_fwd, q, k, tables[0], tables[1], _request("rope"))


# -------------------------------------------------------------------------------------------- add_rms_norm


@torch.library.custom_op("hkernels::add_rms_norm_fwd", mutates_args=())
def _add_rms_norm_fwd(
    x: Tensor, residual: Tensor, weight: Tensor | None, eps: float, backend: str
) -> tuple[Tensor, Tensor, Tensor]:
    if x.numel() == 0:
        return x.new_empty(x.shape), x.new_empty(x.shape), _stats(x)
    return dispatch.run("add_rms_norm", "add_rms_norm_fwd", backend, _rows(x), _rows(residual), weight, eps)


@_add_rms_norm_fwd.register_fake
def _(x: Tensor, residual: Tensor, weight: Tensor | None, eps: float, backend: str) -> tuple[Tensor, Tensor, Tensor]:
    return x.new_empty(x.shape), x.new_empty(x.shape), _stats(x)


@torch.library.custom_op("hkernels::add_rms_norm_bwd", mutates_args=())
def _add_rms_norm_bwd(
    dy: Tensor, ds: Tensor | None, s: Tensor, weight: Tensor | None, rstd: Tensor, backend: str
) -> tuple[Tensor, Tensor]:
    if s.numel() == 0:
        dw = torch.zeros_like(weight) if weight is not None else _placeholder(s)
        return s.new_zeros(s.shape), dw
    ds = _rows(ds) if ds is not None else None
    dx, dw = dispatch.run("add_rms_norm", "add_rms_norm_bwd", backend, _rows(dy), ds, s, weight, rstd)
    return dx, dw if dw is not None else _placeholder(s)


@_add_rms_norm_bwd.register_fake
def _(
    dy: Tensor, ds: Tensor | None, s: Tensor, weight: Tensor | None, rstd: Tensor, backend: str
) -> tuple[Tensor, Tensor]:
    return s.new_empty(s.shape), (weight.new_empty(weight.shape) if weight is not None else _placeholder(s))


def _add_rms_norm_setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor, Tensor]) -> None:
    _x, _residual, weight, _eps, backend = inputs
    ctx.save_for_backward(output[1], weight, output[2])
    ctx.backend = backend
    ctx.set_materialize_grads(False)


def _add_rms_norm_backward(
    ctx: Any, dy: Tensor | None, ds: Tensor | None, _drstd: Tensor | None
) -> tuple[Tensor | None, ...]:
    s, weight, rstd = ctx.saved_tensors
    dy = _none_to_zeros(dy, s)
    dsum, dw = _call(_add_rms_norm_bwd, dy, ds, s, weight, rstd, ctx.backend)
    return dsum, dsum, (dw if weight is not None else None), None, None


_autograd(_add_rms_norm_fwd, _add_rms_norm_backward, _add_rms_norm_setup)


def add_rms_norm(
    x: Tensor, residual: Tensor, weight: Tensor | None = None, eps: float = 1e-6
) -> tuple[Tensor, Tensor]:
    """The residual add and RMS norm of a Llama block in one pass: ``(rms_norm(x + residual) * weight, x + residual)``.

    x, residual: [..., N], one shape and dtype; weight: [N] or None. The sum is rounded to x's dtype before the
    norm (as the unfused ``h = x + residual; rms_norm(h)`` does) and returned as the next residual. Math in
    float32. Differentiable in x, residual and weight, through both outputs.
    """
    _check_input("add_rms_norm", x)
    _check_tensor("add_rms_norm", "residual", residual, None)
    _check_same("add_rms_norm", ("x", "residual"), x, residual)
    _check_param("add_rms_norm", "weight", weight, x)
    y, s, _ = _call(_add_rms_norm_fwd, _as_rows(x), _as_rows(residual), weight, float(eps), _request("add_rms_norm"))
    if y.shape == x.shape:
        return y, s
    return y.reshape(x.shape), s.reshape(x.shape)


# ------------------------------------------------------------------------------------------- cross_entropy

_REDUCTIONS = ("mean", "sum", "none")


def _loss_scale(target: Tensor, ignore_index: int, reduction: str) -> tuple[Tensor, Tensor]:
    """(valid-token count, the gradient's factor per token [T] float32): 1/count for a mean, else 1.

    Both stay on the device: no host sync, so a call can be captured in a CUDA graph.
    """
    count = (target != ignore_index).sum()
    T = target.shape[0]
    if reduction == "mean":
        return count, (1.0 / count.to(torch.float32)).reshape(1).expand(T)
    return count, torch.ones(1, dtype=torch.float32, device=target.device).expand(T)


def _reduce(loss: Tensor, count: Tensor, reduction: str, dtype: torch.dtype) -> Tensor:
    if reduction == "mean":
        return (loss.sum() / count).to(dtype)  # 0/0 = NaN when every target is ignored, as in PyTorch
    if reduction == "sum":
        return loss.sum().to(dtype)
    return loss.to(dtype)


def _loss_like(logits: Tensor, t: int, reduction: str) -> Tensor:
    return logits.new_empty(() if reduction != "none" else (t,))


@torch.library.custom_op("hkernels::cross_entropy_fwd", mutates_args=())
def _cross_entropy_fwd(
    logits: Tensor,
    target: Tensor,
    ignore_index: int,
    label_smoothing: float,
    reduction: str,
    fused_grad: bool,
    backend: str,
) -> tuple[Tensor, Tensor]:
    count, scale = _loss_scale(target, ignore_index, reduction)
    # Contiguous whatever logits' layout: the Triton kernel writes rows of unit column stride (a transposed
    # logits' empty_like would not have it: found by the fuzz tests).
    grad = logits.new_empty(logits.shape) if fused_grad else None
    if logits.numel() == 0:
        loss = logits.new_zeros(logits.shape[0], dtype=torch.float32)
    else:
        loss = dispatch.run("cross_entropy", "cross_entropy_fwd", backend, _rows(logits), target, scale,
                            ignore_index, label_smoothing, grad)
    return _reduce(loss, count, reduction, logits.dtype), grad if grad is not None else _placeholder(logits)


@_cross_entropy_fwd.register_fake
def _(logits: Tensor, target: Tensor, ignore_index: int, label_smoothing: float, reduction: str, fused_grad: bool,
      backend: str) -> tuple[Tensor, Tensor]:
    grad = logits.new_empty(logits.shape) if fused_grad else _placeholder(logits)
    return _loss_like(logits, logits.shape[0], reduction), grad


@torch.library.custom_op("hkernels::cross_entropy_grad", mutates_args=())
def _cross_entropy_grad(
    dloss: Tensor, logits: Tensor, target: Tensor, ignore_index: int, label_smoothing: float, backend: str
) -> Tensor:
    # reduction="none": the gradient is made in the backward, scaled per token by dloss as it is written.
    grad = logits.new_empty(logits.shape)  # contiguous (see _cross_entropy_fwd)
    if logits.numel():
        dispatch.run("cross_entropy", "cross_entropy_fwd", backend, _rows(logits), target, dloss.float(),
                     ignore_index, label_smoothing, grad)
    return grad


@_cross_entropy_grad.register_fake
def _(dloss: Tensor, logits: Tensor, target: Tensor, ignore_index: int, label_smoothing: float,
      backend: str) -> Tensor:
    return logits.new_empty(logits.shape)


@torch.library.custom_op("hkernels::loss_grad_scale_", mutates_args=("grad",))
def _loss_grad_scale_(grad: Tensor, dloss: Tensor, op: str, backend: str) -> None:
    # grad *= dloss (a 0-d factor), in place, by ``op``'s backward kernel; nothing moves when the factor is exactly
    # 1 (a plain loss.backward()).
    if grad.numel():
        rows = grad.reshape(-1, grad.shape[-1]) if grad.dim() > 1 else grad.reshape(1, -1)
        dispatch.run(op, f"{op}_bwd", backend, dloss.float().reshape(1).expand(rows.shape[0]), rows)


@_loss_grad_scale_.register_fake
def _(grad: Tensor, dloss: Tensor, op: str, backend: str) -> None:
    return None


def _cross_entropy_setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
    logits, target, ignore_index, label_smoothing, _reduction, fused_grad, backend = inputs
    ctx.fused, ctx.backend = fused_grad, backend
    ctx.ignore_index, ctx.label_smoothing = ignore_index, label_smoothing
    # The fused path keeps only the gradient; the logits can be freed once the loss is known.
    ctx.save_for_backward(*((output[1],) if fused_grad else (logits, target)))
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)


def _cross_entropy_backward(ctx: Any, dloss: Tensor | None, _dgrad: Tensor | None) -> tuple[Tensor | None, ...]:
    if dloss is None:
        return (None,) * 7
    if ctx.fused:
        (grad,) = ctx.saved_tensors
        _call(_loss_grad_scale_, grad, dloss, "cross_entropy", ctx.backend)
    else:
        logits, target = ctx.saved_tensors
        dloss = dloss.expand(target.shape) if dloss.dim() == 0 else dloss
        grad = _call(_cross_entropy_grad, dloss, logits, target, ctx.ignore_index, ctx.label_smoothing, ctx.backend)
    return grad, None, None, None, None, None, None


_autograd(_cross_entropy_fwd, _cross_entropy_backward, _cross_entropy_setup)


def _check_loss_args(op: str, target: Any, t: int, device: torch.device, ignore_index: Any, reduction: Any,
                     label_smoothing: Any) -> Tensor:
    if not isinstance(target, torch.Tensor):
        raise TypeError(f"hkernels.{op}: target must be a torch.Tensor, got {type(target).__name__}")
    if target.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8):
        raise TypeError(f"hkernels.{op}: target must hold class indices (an integer tensor), got {target.dtype}")
    if target.shape != (t,):
        raise ValueError(f"hkernels.{op}: target must have shape [T] = [{t}], got {list(target.shape)}")
    if target.device != device:
        raise ValueError(f"hkernels.{op}: target is on {target.device} but the inputs are on {device}")
    if reduction not in _REDUCTIONS:
        raise ValueError(f"hkernels.{op}: reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if not isinstance(ignore_index, int) or isinstance(ignore_index, bool):
        raise TypeError(f"hkernels.{op}: ignore_index must be an int, got {type(ignore_index).__name__}")
    if not isinstance(label_smoothing, (int, float)) or not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"hkernels.{op}: label_smoothing must be a float in [0, 1], got {label_smoothing!r}")
    return target.to(torch.int64)


def cross_entropy(
    logits: Tensor, target: Tensor, ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0
) -> Tensor:
    """``torch.nn.functional.cross_entropy`` for language-model logits, loss and gradient in one pass.

    logits: [T, V] (tokens × vocabulary; flatten leading dims first), float16/bfloat16/float32; target: [T] class
    indices; ``ignore_index`` tokens contribute nothing (a mean divides by the others; NaN when there are none, as
    PyTorch). A target outside [0, V) that is not ignore_index gives NaN (PyTorch raises; checking would cost a
    host sync). Math in float32; the loss has logits' dtype. Differentiable in logits: with reduction mean or sum
    the gradient is written by the forward kernel while the logits are read (the logits need not be kept), and the
    backward only scales it, in place, when the upstream gradient is not 1.
    """
    _check_tensor("cross_entropy", "logits", logits, (2,))
    T, V = logits.shape
    target = _check_loss_args("cross_entropy", target, T, logits.device, ignore_index, reduction, label_smoothing)
    if V == 0:
        raise ValueError("hkernels.cross_entropy: logits has no classes (V = 0)")
    fused = reduction != "none" and logits.requires_grad and torch.is_grad_enabled()
    loss, _ = _call(_cross_entropy_fwd, logits, target, ignore_index, float(label_smoothing), reduction, fused,
                                 _request("cross_entropy"))
    return loss


# ------------------------------------------------------------------------------ fused_linear_cross_entropy


@torch.library.custom_op("hkernels::fused_linear_cross_entropy_fwd", mutates_args=())
def _flce_fwd(
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Tensor | None,
    ignore_index: int,
    label_smoothing: float,
    reduction: str,
    fused_grad: bool,
    backend: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    count, scale = _loss_scale(target, ignore_index, reduction)
    loss, dh, dw, db = dispatch.run("fused_linear_cross_entropy", "fused_linear_cross_entropy_fwd", backend,
                                    _rows(hidden), weight, target, bias, scale, ignore_index, label_smoothing,
                                    fused_grad)
    loss = _reduce(loss, count, reduction, torch.promote_types(hidden.dtype, torch.float32))
    return loss, *(g if g is not None else _placeholder(hidden) for g in (dh, dw, db))


@_flce_fwd.register_fake
def _(hidden: Tensor, weight: Tensor, target: Tensor, bias: Tensor | None, ignore_index: int, label_smoothing: float,
      reduction: str, fused_grad: bool, backend: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    grads = (
        (torch.empty_like(hidden), torch.empty_like(weight),
         torch.empty_like(bias) if bias is not None else _placeholder(hidden))
        if fused_grad else tuple(_placeholder(hidden) for _ in range(3))
    )
    loss = _loss_like(hidden, hidden.shape[0], reduction).to(torch.promote_types(hidden.dtype, torch.float32))
    return loss, *grads


@torch.library.custom_op("hkernels::fused_linear_cross_entropy_grad", mutates_args=())
def _flce_grad(
    dloss: Tensor, hidden: Tensor, weight: Tensor, target: Tensor, bias: Tensor | None, ignore_index: int,
    label_smoothing: float, backend: str,
) -> tuple[Tensor, Tensor, Tensor]:
    # reduction="none": recompute each chunk's logits in the backward, with the gradient scaled per token.
    _, dh, dw, db = dispatch.run("fused_linear_cross_entropy", "fused_linear_cross_entropy_fwd", backend,
                                 _rows(hidden), weight, target, bias, dloss.float(), ignore_index, label_smoothing,
                                 True)
    return dh, dw, db if db is not None else _placeholder(hidden)


@_flce_grad.register_fake
def _(dloss: Tensor, hidden: Tensor, weight: Tensor, target: Tensor, bias: Tensor | None, ignore_index: int,
      label_smoothing: float, backend: str) -> tuple[Tensor, Tensor, Tensor]:
    return (torch.empty_like(hidden), torch.empty_like(weight),
            torch.empty_like(bias) if bias is not None else _placeholder(hidden))


def _flce_setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, ...]) -> None:
    hidden, weight, target, bias, ignore_index, label_smoothing, _reduction, fused_grad, backend = inputs
    ctx.fused, ctx.backend, ctx.has_bias = fused_grad, backend, bias is not None
    ctx.ignore_index, ctx.label_smoothing = ignore_index, label_smoothing
    ctx.save_for_backward(*(output[1:] if fused_grad else (hidden, weight, target, bias)))
    ctx.mark_non_differentiable(*output[1:])
    ctx.set_materialize_grads(False)


def _flce_backward(ctx: Any, dloss: Tensor | None, *_unused: Tensor | None) -> tuple[Tensor | None, ...]:
    if dloss is None:
        return (None,) * 9
    if ctx.fused:
        dh, dw, db = ctx.saved_tensors
        for g in (dh, dw, db) if ctx.has_bias else (dh, dw):
            _call(_loss_grad_scale_, g, dloss, "fused_linear_cross_entropy", ctx.backend)
    else:
        hidden, weight, target, bias = ctx.saved_tensors
        dloss = dloss.expand(target.shape) if dloss.dim() == 0 else dloss
        dh, dw, db = _call(_flce_grad, dloss, hidden, weight, target, bias, ctx.ignore_index, ctx.label_smoothing,
                                ctx.backend)
    return dh, dw, None, (db if ctx.has_bias else None), None, None, None, None, None


_autograd(_flce_fwd, _flce_backward, _flce_setup)


def fused_linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
) -> Tensor:
    """``cross_entropy(hidden @ weight.T + bias, target)`` without materialising the [T, V] logits.

    hidden: [T, H] (flatten leading dims first), weight: [V, H] (the LM head), bias: [V] or None, one dtype;
    target: [T]. Tokens are processed in chunks: per chunk a cuBLAS matmul makes the logits, the cross-entropy
    kernel overwrites them with their gradient, and two more matmuls accumulate the gradients of hidden, weight
    and bias — computed during the forward when gradients are needed (reduction mean or sum; the backward then
    only scales them), or recomputed chunk by chunk in the backward (reduction none). Extra memory: the gradients
    plus one chunk of logits. The loss is float32 (float64 for float64 input), as Hugging Face's and Liger's
    losses are: a bfloat16 loss near 12 steps by 0.06. Differentiable in hidden, weight and bias.
    """
    _check_tensor("fused_linear_cross_entropy", "hidden", hidden, (2,))
    _check_tensor("fused_linear_cross_entropy", "weight", weight, (2,))
    T, H = hidden.shape
    if weight.shape[1] != H:
        raise ValueError(f"hkernels.fused_linear_cross_entropy: weight must be [V, H] with H = {H} (hidden's last "
                         f"dim), got {list(weight.shape)}")
    _check_same("fused_linear_cross_entropy", ("hidden", "weight"), hidden, weight, shape=False)
    if bias is not None:
        _check_tensor("fused_linear_cross_entropy", "bias", bias, (1,))
        _check_same("fused_linear_cross_entropy", ("hidden", "bias"), hidden, bias, shape=False)
        if bias.shape[0] != weight.shape[0]:
            raise ValueError(f"hkernels.fused_linear_cross_entropy: bias must be [V] = [{weight.shape[0]}], got "
                             f"{list(bias.shape)}")
    if weight.shape[0] == 0:
        raise ValueError("hkernels.fused_linear_cross_entropy: weight has no classes (V = 0)")
    target = _check_loss_args("fused_linear_cross_entropy", target, T, hidden.device, ignore_index, reduction,
                              label_smoothing)
    wants_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (hidden, weight, bias)
    )
    loss, *_ = _call(_flce_fwd, hidden, weight, target, bias, ignore_index, float(label_smoothing), reduction,
                         wants_grad and reduction != "none", _request("fused_linear_cross_entropy"))
    return loss


# -------------------------------------------------------------------------------------------------- matmul

_ACTIVATIONS = (None, "relu", "gelu", "gelu_tanh", "silu")


def _mm_out_shape(a: Tensor, b: Tensor) -> list[int]:
    return [*a.shape[:-1], b.shape[-1]]


@torch.library.custom_op("hkernels::matmul_fwd", mutates_args=())
def _matmul_fwd(
    a: Tensor, b: Tensor, bias: Tensor | None, activation: str, keep_pre: bool, backend: str
) -> tuple[Tensor, Tensor]:
    act = activation or None
    if a.numel() == 0 or b.numel() == 0:  # nothing for a kernel to do (K = 0 leaves act(bias))
        backend = "torch"
    y, pre = dispatch.run("matmul", "matmul_fwd", backend, a, b, bias, act, keep_pre)
    return y, pre if pre is not None else _placeholder(a)


@_matmul_fwd.register_fake
def _(
    a: Tensor, b: Tensor, bias: Tensor | None, activation: str, keep_pre: bool, backend: str
) -> tuple[Tensor, Tensor]:
    y = a.new_empty(_mm_out_shape(a, b))
    return y, (a.new_empty(y.shape) if keep_pre and activation else _placeholder(a))


@torch.library.custom_op("hkernels::matmul_act_bwd", mutates_args=())
def _matmul_act_bwd(dy: Tensor, pre: Tensor, activation: str, backend: str) -> Tensor:
    if dy.numel() == 0:
        return dy.new_zeros(dy.shape)
    return dispatch.run("matmul", "matmul_act_bwd", backend, dy.contiguous(), pre, activation)


@_matmul_act_bwd.register_fake
def _(dy: Tensor, pre: Tensor, activation: str, backend: str) -> Tensor:
    return dy.new_empty(dy.shape)


def _matmul_setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
    a, b, bias, activation, _keep_pre, backend = inputs
    ctx.save_for_backward(a, b, output[1] if activation else None)
    ctx.activation, ctx.backend, ctx.has_bias = activation, backend, bias is not None
    ctx.bias_dtype = bias.dtype if bias is not None else None
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)


def _matmul_backward(ctx: Any, dy: Tensor | None, _dpre: Tensor | None) -> tuple[Tensor | None, ...]:
    # z = a @ b + bias, y = act(z):  dz = dy · act'(z);  da = dz @ bᵀ;  db = aᵀ @ dz;  dbias = Σ_rows dz.
    # The gradient matmuls run on the same backend's matmul (no epilogue).
    if dy is None:
        return (None,) * 6
    a, b, pre = ctx.saved_tensors
    dz = _call(_matmul_act_bwd, dy, pre, ctx.activation, ctx.backend) if ctx.activation else dy
    need_a, need_b, need_bias = ctx.needs_input_grad[:3]
    da = _call(_matmul_fwd, dz, b.transpose(-1, -2), None, "", False, ctx.backend)[0] if need_a else None
    db = _call(_matmul_fwd, a.transpose(-1, -2), dz, None, "", False, ctx.backend)[0] if need_b else None
    dbias = None
    if ctx.has_bias and need_bias:
        dbias = dz.reshape(-1, dz.shape[-1]).sum(0, dtype=torch.float32).to(ctx.bias_dtype)
    return da, db, dbias, None, None, None


_autograd(_matmul_fwd, _matmul_backward, _matmul_setup)


def matmul(a: Tensor, b: Tensor, bias: Tensor | None = None, activation: str | None = None) -> Tensor:
    """``activation(a @ b + bias)`` with the bias and activation fused into the matmul's epilogue.

    a: [M, K] or [B, M, K]; b: [K, N] or [B, K, N] (a transposed view such as ``weight.t()`` is read in place);
    one dtype (bfloat16/float16 with float32 accumulation, or float32); bias: [N] or None; activation: None,
    "relu", "gelu" (erf), "gelu_tanh" or "silu". The epilogue is float32 with one rounding. Differentiable in a,
    b and bias (the backward's matmuls run on the same backend).
    """
    _check_tensor("matmul", "a", a, (2, 3))
    _check_tensor("matmul", "b", b, (2, 3))
    _check_same("matmul", ("a", "b"), a, b, shape=False)
    if a.dim() != b.dim():
        raise ValueError(f"hkernels.matmul: a and b must both be 2-d or both 3-d (batched), got shapes "
                         f"{list(a.shape)} and {list(b.shape)}")
    if a.shape[-1] != b.shape[-2] or (a.dim() == 3 and a.shape[0] != b.shape[0]):
        raise ValueError(f"hkernels.matmul: cannot multiply a {list(a.shape)} by b {list(b.shape)}: a's last dim "
                         "must equal b's second-to-last (and batch sizes must agree)")
    if bias is not None:
        _check_tensor("matmul", "bias", bias, (1,))
        if bias.shape[0] != b.shape[-1] or bias.device != a.device:
            raise ValueError(f"hkernels.matmul: bias must be [N] = [{b.shape[-1]}] on {a.device}, got "
                             f"{list(bias.shape)} on {bias.device}")
    if activation not in _ACTIVATIONS:
        raise ValueError(f"hkernels.matmul: activation must be one of None, 'relu', 'gelu', 'gelu_tanh', 'silu'; "
                         f"got {activation!r}")
    keep_pre = activation is not None and torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (a, b, bias)
    )
    y, _ = _call(_matmul_fwd, a, b, bias, activation or "", keep_pre, _request("matmul"))
    return y


# ----------------------------------------------------------------------------------------------- attention

ATTENTION_HEAD_DIMS = (16, 32, 64, 128)


@torch.library.custom_op("hkernels::attention_fwd", mutates_args=())
def _attention_fwd(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, backend: str) -> tuple[Tensor, Tensor]:
    if q.numel() == 0 or k.numel() == 0:
        backend = "torch"
    return dispatch.run("attention", "attention_fwd", backend, _d_unit(q), _d_unit(k), _d_unit(v), causal, scale)


@_attention_fwd.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, backend: str) -> tuple[Tensor, Tensor]:
    return q.new_empty(q.shape), q.new_empty(q.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("hkernels::attention_bwd", mutates_args=())
def _attention_bwd(
    do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, causal: bool, scale: float, backend: str
) -> tuple[Tensor, Tensor, Tensor]:
    if q.numel() == 0 or k.numel() == 0:
        backend = "torch"
    return dispatch.run("attention", "attention_bwd", backend, _d_unit(do), _d_unit(q), _d_unit(k), _d_unit(v), o,
                        lse, causal, scale)


@_attention_bwd.register_fake
def _(
    do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, causal: bool, scale: float, backend: str
) -> tuple[Tensor, Tensor, Tensor]:
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _attention_setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
    q, k, v, causal, scale, backend = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.causal, ctx.scale, ctx.backend = causal, scale, backend
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)


def _attention_backward(ctx: Any, do: Tensor | None, _dlse: Tensor | None) -> tuple[Tensor | None, ...]:
    if do is None:
        return (None,) * 6
    q, k, v, o, lse = ctx.saved_tensors
    dq, dk, dv = _call(_attention_bwd, do, q, k, v, o, lse, ctx.causal, ctx.scale, ctx.backend)
    return dq, dk, dv, None, None, None


_autograd(_attention_fwd, _attention_backward, _attention_setup)


def attention(q: Tensor, k: Tensor, v: Tensor, causal: bool = False, scale: float | None = None) -> Tensor:
    """Scaled dot-product attention, flash algorithm: ``softmax(scale · q kᵀ [causal mask]) v``.

    q: [B, Hq, S, D]; k, v: [B, Hk, Skv, D] with Hq a multiple of Hk (grouped-query attention); D in 16, 32, 64,
    128; one dtype (bfloat16/float16; float32 too); any strides with unit stride along D (transposed views of
    [B, S, H, D] projections are read in place). ``scale`` defaults to D^-0.5. ``causal`` masks key j > query i
    and needs S == Skv (with different lengths, whether the mask aligns top-left or bottom-right is ambiguous:
    build the mask yourself). Returns [B, Hq, S, D] in q's dtype. Differentiable in q, k, v; the backward never
    materialises the S × Skv matrix.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor("attention", name, t, (4,))
    _check_same("attention", ("q", "k", "v"), q, k, v, shape=False)
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
    if D not in ATTENTION_HEAD_DIMS:
        raise ValueError(f"hkernels.attention: head dim D must be one of {ATTENTION_HEAD_DIMS}, got {D}")
    if causal and k.shape[2] != S:
        raise ValueError(f"hkernels.attention: causal=True needs as many queries as keys (S = {S}, Skv = "
                         f"{k.shape[2]}): with different lengths the mask's alignment is ambiguous")
    scale = D**-0.5 if scale is None else float(scale)
    o, _ = _call(_attention_fwd, q, k, v, bool(causal), scale, _request("attention"))
    return o


for _name, _fn in (
    ("rms_norm", rms_norm),
    ("layer_norm", layer_norm),
    ("softmax", softmax),
    ("swiglu", swiglu),
    ("geglu", geglu),
    ("rope", rope),
    ("add_rms_norm", add_rms_norm),
    ("cross_entropy", cross_entropy),
    ("fused_linear_cross_entropy", fused_linear_cross_entropy),
    ("matmul", matmul),
    ("attention", attention),
):
    dispatch.register_op(_name, _fn)


def _softmax_routed(args: dict[str, Any]) -> tuple[Tensor, ...]:
    x, dim = args["x"], args["dim"]
    if not isinstance(x, torch.Tensor) or x.dim() == 0 or not isinstance(dim, int):
        return (x,) if isinstance(x, torch.Tensor) else ()
    return (x.movedim(dim, -1),)


dispatch.register_op("softmax", softmax, routed=_softmax_routed)
