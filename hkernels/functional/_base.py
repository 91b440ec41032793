"""What every op's functional file shares: the call path (plans, custom ops, autograd) and the argument checks.

A public call ``hkernels.<op>(...)`` runs through :class:`Public`:

- in a plain eager call (no ``torch.compile``, functorch transform, dispatch or function mode, jit tracing or
  tensor subclass) it computes one key of the call's signature: the backend request, grad mode, autocast's state,
  and per argument its dtype, shape, strides, pointer alignment, device and requires_grad (a scalar: its value).
  The first call of a key checks the arguments and records a plan (``hkernels/runtime/plan.py``): which path each
  custom op took, which backend each kernel function ran on (bound to the signature where the backend offers a
  binder), which compiled kernel each launch used. Later calls of the key skip the checks (they are properties of
  the signature) and replay the plan: the op's Python runs, its lookups do not. A row op also builds, from its
  plan, a one-step path (``fast``): its bound kernel function called directly, or inside a :class:`Lane` (one
  autograd node) when a gradient is wanted.
- each op is a pair of ``torch.library`` custom ops (``hkernels::<op>_fwd`` / ``_bwd``) with fake kernels and an
  autograd formula, so ``torch.compile(fullgraph=True)`` traces through it; a plain eager call runs the custom ops'
  Python bodies directly (:func:`call`), through an equivalent ``autograd.Function`` when a gradient is wanted,
  whose backward replays a plan of its own, keyed by the incoming gradients.

The request is read when the op is called and carried to the backward, so ``with use_backend("triton"): y =
op(x)`` runs the backward on Triton too, even when ``backward()`` runs after the scope has closed. Under
``torch.compile`` the custom ops' bodies are traced into the graph (:func:`traced`): the request is read when the
graph is traced.

Under ``torch.autocast`` an op runs as the PyTorch op it stands for runs there (:class:`Autocast`, declared once in
the op's file): its inputs cast as autocast casts that op on the device, then its body with autocast off, so no
PyTorch op inside it (a chunk loop's matmuls, the torch backend's math) is cast a second time. The casts are
differentiable: each gradient comes back in its own input's dtype.
"""

from __future__ import annotations

import contextlib
import math
import sys
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from hkernels import dispatch
from hkernels.runtime import interpret as _interpret
from hkernels.runtime import plan as _plan

Tensor = torch.Tensor
FLOAT = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for 16-bit inputs, the input's own precision for float32 and float64: the references' math."""
    return torch.promote_types(dtype, torch.float32)


# ------------------------------------------------------------------------------------------------- the call path


def _modes() -> bool:
    """A functorch transform (vmap, grad), a dispatch or function mode (FakeTensorMode, ``with torch.device(...)``)
    or ``torch.jit.trace`` is active: these see ops through the custom-op layer."""
    return bool(torch._C._are_functorch_transforms_active() or torch._C._len_torch_dispatch_stack()
                or torch._C._is_torch_function_mode_enabled() or torch._C._get_tracing_state() is not None)


class _NotPlain(Exception):
    pass


_PLAIN_SET = frozenset(_PLAIN)


def _sig(a: Any) -> Any:
    """What a call's plan depends on of one argument."""
    t = type(a)
    if t is Tensor or t is torch.nn.Parameter:
        return (a.dtype, a.shape, a.stride(), a.data_ptr() & 15, a.device, a.requires_grad)
    return _other(a)


def _autocast() -> tuple[Any, ...]:
    """Autocast's state, where it is on: it changes the dtypes PyTorch ops inside a body produce (the linear loss's
    matmuls), and so what a plan recorded."""
    return tuple((d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cuda", "cpu"))


def _other(a: Any) -> Any:
    """_sig of an argument that is not a plain tensor."""
    if isinstance(a, Tensor):
        raise _NotPlain  # a subclass (DTensor, FakeTensor): the custom-op path
    return (type(a), a)


_MAX_PLANS = 4096  # per op: a caller whose shapes never repeat starts over past this
_publics: list[Public] = []


_OFF = frozenset({"", "0", "false", "no", "off", b"", b"0", b"false", b"no", b"off"})
_CHECK_KEY = dispatch.env_key("HKERNELS_CHECK")


def checking() -> bool:
    """``HKERNELS_CHECK`` asks for checking mode now (set, and not 0/false/no/off in any case): every value the
    kernels take on trust is checked on every eager call, at the cost of a host sync."""
    value = dispatch.env_value(_CHECK_KEY)
    return value is not None and value.strip().lower() not in _OFF


def _requested_when_traced(op: str) -> str:
    """``dispatch.requested(op)``, read once when torch.compile traces a call, and recorded into the graph."""
    return dispatch.requested(op)


# What torch.compiler.assume_constant_result(fn) does (Dynamo calls fn while tracing and records its result),
# without importing torch._dynamo with hkernels.
_requested_when_traced._dynamo_marked_constant = True  # type: ignore[attr-defined]


# ------------------------------------------------------------------------------------------------ under autocast

_AUTOCAST_KEYS = {"cuda": "AutocastCUDA", "cpu": "AutocastCPU", "xpu": "AutocastXPU", "mps": "AutocastMPS",
                  "hpu": "AutocastHPU", "xla": "AutocastXLA", "privateuseone": "AutocastPrivateUse1"}
SIXTEEN = (torch.float16, torch.bfloat16)
# The device types this build of torch has autocast for, read once (Dynamo in torch 2.11 cannot trace the query).
_AUTOCASTABLE = frozenset(d for d in _AUTOCAST_KEYS if torch.amp.is_autocast_available(d))


@dataclass(frozen=True)
class Autocast:
    """How an op runs under ``torch.autocast``: as the PyTorch op it stands for runs there.

    ``policy``: ``"lower"``, every floating input but float64 in autocast's dtype (as matmul, linear and SDPA);
    ``"float32"``, 16-bit inputs computed in float32 with a float32 result (as layer_norm and softmax on CUDA);
    None, autocast changes nothing (elementwise ops, as silu and gelu). ``mirrors``: the aten ops whose autocast
    kernels say on which device types the policy applies; on a device type where none of them has one (layer_norm
    on the CPU) the op runs on its inputs as they are. ``run(public, args, dtype, applies)``, optional, replaces
    the default (cast the floating arguments, then call) for an op that computes its float32 result without
    casting its inputs (cross_entropy: a float32 copy of the logits would cost more than the loss) or promotes
    its inputs first (add_rms_norm, as ``x + residual`` does). Whatever the policy, the op's body runs with
    autocast off for the device."""

    policy: str | None = None
    mirrors: tuple[str, ...] = ()
    run: Callable[..., Any] | None = None

    def applies(self, device: str) -> bool:
        """The policy applies to calls on ``device`` (a device type): one of the mirrored ops has an autocast kernel
        there."""
        key = (self.policy, self.mirrors, device)
        found = _APPLIES.get(key)
        if found is None:
            dispatch_key = _AUTOCAST_KEYS.get(device)
            found = _APPLIES[key] = self.policy is not None and dispatch_key is not None and any(
                torch._C._dispatch_has_kernel_for_dispatch_key(op, dispatch_key) for op in self.mirrors)
        return found

    def cast(self, args: tuple[Any, ...], dtype: torch.dtype) -> tuple[Any, ...]:
        """``args`` with the floating tensors the policy casts in the dtype it casts them to (autocast's ``dtype``
        for "lower", float32 for "float32"); float64 tensors and everything else as they are."""
        if self.policy == "lower":
            return tuple(a.to(dtype) if isinstance(a, Tensor) and a.is_floating_point() and a.dtype != torch.float64
                         and a.dtype != dtype else a for a in args)
        if self.policy == "float32":
            return tuple(a.float() if isinstance(a, Tensor) and a.dtype in SIXTEEN else a for a in args)
        return args

    def call(self, public: Public, device: str, args: tuple[Any, ...]) -> Any:
        """``public(*args)`` under autocast for ``device``: cast as the policy says there, computed with autocast off
        for the device."""
        dtype = torch.get_autocast_dtype(device)
        applies = self.applies(device)
        with autocast_off(device):
            if self.run is not None:
                return self.run(public, args, dtype, applies)
            return public(*(self.cast(args, dtype) if applies else args))


_APPLIES: dict[tuple[Any, ...], bool] = {}


def _autocast_device(args: tuple[Any, ...]) -> str | None:
    """The device type of the call's first tensor argument, where autocast is on for it; else None."""
    for a in args:
        if isinstance(a, Tensor):
            device = a.device.type
            return device if device in _AUTOCASTABLE and torch.is_autocast_enabled(device) else None
    return None


class _Off:
    """Autocast off for one device type, in an eager call (cheaper than ``torch.autocast``'s own context manager,
    which a compiled graph needs)."""

    __slots__ = ("device", "was")

    def __init__(self, device: str) -> None:
        self.device = device

    def __enter__(self) -> None:
        self.was = torch.is_autocast_enabled(self.device)
        torch.set_autocast_enabled(self.device, False)

    def __exit__(self, *exc: object) -> None:
        torch.set_autocast_enabled(self.device, self.was)


def autocast_off(device: str) -> contextlib.AbstractContextManager[None]:
    """Autocast off for ``device`` (a device type) inside the block."""
    if torch.compiler.is_compiling():
        return torch.autocast(device, enabled=False)
    return _Off(device)


@contextlib.contextmanager
def no_autocast() -> Iterator[None]:
    """Autocast off for every device type it is on (a backward run inside an autocast region: the op's gradients
    computed in the dtypes its forward ran in)."""
    with contextlib.ExitStack() as stack:
        for device in _AUTOCASTABLE:
            if torch.is_autocast_enabled(device):
                stack.enter_context(autocast_off(device))
        yield


class Public:
    """The call path of one public op: ``check(*args)`` raises on bad arguments (a property of the call's
    signature: checked once per signature); ``values(*args)``, optional, raises on values the kernels take on trust
    (indices, lengths, positions), on every eager call in checking mode only (:func:`checking`: it syncs with the
    device); ``body(request, *args)`` computes the op (calling its custom ops through :func:`call`);
    ``fast(plan, request, *args)``, optional, returns a function that does what the recorded ``plan`` does for
    calls of this signature in one step (a row op whose kernel function was bound: its forward, through a
    :class:`Lane` when a gradient is wanted), or None. ``autocast``: how the op runs under ``torch.autocast``
    (:class:`Autocast`)."""

    __slots__ = ("autocast", "body", "check", "fast", "op", "plans", "values")

    def __init__(self, op: str, check: Callable[..., None], body: Callable[..., Any],
                 fast: Callable[..., Any] | None = None, values: Callable[..., None] | None = None,
                 autocast: Autocast | None = None) -> None:
        self.op, self.check, self.body, self.fast, self.values = op, check, body, fast, values
        self.autocast = autocast if autocast is not None else Autocast()
        self.plans: dict[Any, _plan.Plan] = {}
        _publics.append(self)

    def __call__(self, *args: Any) -> Any:
        if torch._C._is_any_autocast_enabled():  # (one flag read: a call outside autocast pays nothing more)
            device = _autocast_device(args)
            if device is not None:
                return self.autocast.call(self, device, args)
        if torch.compiler.is_compiling():
            self.check(*args)
            # the request as a constant of the graph: part of what torch.compile's caches key a compiled graph by
            return self.body(_requested_when_traced(self.op), *args)
        if self.values is not None and checking():
            self.check(*args)  # (the values' checks take well-formed arguments)
            self.values(*args)
        request = dispatch.requested(self.op)
        try:
            if (torch._C._are_functorch_transforms_active() or torch._C._len_torch_dispatch_stack()
                    or torch._C._is_torch_function_mode_enabled() or torch._C._get_tracing_state() is not None
                    or not _plan.enabled):  # (_modes, inlined: this runs on every call)
                raise _NotPlain
            # (a list display: one frame for all arguments, per argument what _sig gives)
            key = (request, torch.is_grad_enabled(),
                   _autocast() if torch._C._is_any_autocast_enabled() else None, *[
                       (a.dtype, a.shape, a.stride(), a.data_ptr() & 15, a.device, a.requires_grad)
                       if a.__class__ in _PLAIN_SET else _other(a) for a in args])
            plan = self.plans.get(key)
        except (_NotPlain, TypeError, AttributeError):  # a subclass, an unhashable or odd argument: no plan
            self.check(*args)
            return _plan.outside(self.body, request, *args)
        if plan is not None:
            fast = plan.fast
            if fast is not None:
                return fast(*args)
            return _plan.run(plan, self.body, (request, *args))
        self.check(*args)
        plan = _plan.Plan()
        generation = dispatch.generation()
        out = _plan.run(plan, self.body, (request, *args))
        if generation == dispatch.generation():  # the tables did not change while it recorded
            if self.fast is not None:
                plan.fast = self.fast(plan, request, *args)
                if plan.fast is not None and not (torch.is_grad_enabled() and any(
                        isinstance(a, Tensor) and a.requires_grad for a in args)):
                    # Without a gradient the one-step path may run another variant of the kernel (one that
                    # writes no statistics), which a compiler may round differently in the last bit: every
                    # call of a signature, its first included, gives the same bits.
                    out = plan.fast(*args)
            if len(self.plans) >= _MAX_PLANS:
                self.plans.clear()
            self.plans[key] = plan
        return out


def wants_grad(*tensors: Tensor | None) -> bool:
    """A gradient would be recorded for a call on these tensors."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def bound(plan: _plan.Plan, fn: str) -> Callable[..., Any] | None:
    """The bound kernel function ``fn`` that ``plan`` recorded (see :func:`hkernels.dispatch.run`), or None (not
    recorded, or recorded unbound)."""
    found = plan.find(fn)
    return None if found is None or isinstance(found, types.ModuleType) else found


def bound_backward(plan: _plan.Plan, fn: str, *grads: Tensor | None) -> Callable[..., Any] | None:
    """For a one-step backward (a :class:`Lane`'s ``fast``): the bound kernel function ``fn`` its recorded plan
    ran, where each gradient reached it as it came (present, unit stride along rows: ``rows`` copied nothing)."""
    if any(g is None or g.stride(-1) != 1 for g in grads):
        return None
    return bound(plan, fn)


def rows_view(x: Tensor) -> tuple[int, int] | None:
    """(M, N) when x [..., N] with unit stride along N is viewable as [M, N] rows (the fast paths' condition), else
    None."""
    if x.dim() == 0 or x.stride(-1) != 1 or x.numel() == 0:
        return None
    n = x.shape[-1]
    m = x.numel() // n
    try:
        x.view(m, n)
    except RuntimeError:
        return None
    return m, n


def _forget_plans() -> None:
    for public in _publics:
        public.plans.clear()


dispatch.on_forget(_forget_plans)


def request(op: str) -> str:
    """What a custom-op call passes as its backend: the request now, or "" under torch.compile (read when the op's
    body is traced into the graph)."""
    return "" if torch.compiler.is_compiling() else dispatch.requested(op)


_EAGER: dict[Any, Any] = {}  # custom op -> (equivalent autograd.Function, its apply without the Python wrapper)


def autograd(opdef: Any, backward: Callable[..., Any], setup: Callable[..., None], in_place: bool = False) -> None:
    """Register ``opdef``'s autograd formula, and keep an equivalent ``autograd.Function`` for plain eager calls
    (see :func:`call`): forward(ctx, ...) style, which torch does not bind with ``inspect.signature`` per call.
    ``in_place``: the op's backward may write its input's gradient over the gradient it receives where ``setup``
    set ``ctx.in_place`` (see :func:`reusable`): the eager backward tells whether nothing else holds that gradient
    as it receives it."""
    def backward_without_autocast(ctx: Any, *grads: Any) -> Any:
        if torch._C._is_any_autocast_enabled():  # a backward inside an autocast region: the forward's dtypes
            with no_autocast():
                return backward(ctx, *grads)
        return backward(ctx, *grads)

    opdef.register_autograd(backward_without_autocast, setup_context=setup)
    impl = opdef._init_fn  # the Python body under the custom op

    class _Eager(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, *args: Any) -> Any:
            out = impl(*args)
            setup(ctx, args, out)
            # In a plan, each forward gets a table of backward plans, keyed by the gradients it receives.
            plans = None
            if _plan.active():
                plans = _plan.recall(_Eager)
                if plans is None:
                    plans = {}
                    _plan.keep(_Eager, plans)
            ctx.hk_plans = plans
            return out

        @staticmethod
        def backward(ctx: Any, *grads: Any) -> Any:
            return _planned_backward(ctx.hk_plans, backward, ctx, grads)

    if in_place:
        def backward_in_place(ctx: Any, *grads: Any) -> Any:
            plans = ctx.hk_plans
            if ctx.in_place:
                ctx.hk_sole = sole = _measure(grads[0]) in _SOLE  # (first: each frame holds a reference)
                if plans is not None:  # the choice is part of the backward's plan
                    plans = plans.setdefault(("sole", sole), {})
            return _planned_backward(plans, backward, ctx, grads)

        _Eager.backward = staticmethod(backward_in_place)  # type: ignore[method-assign]

    _Eager.__name__ = _Eager.__qualname__ = f"{impl.__name__}_eager"
    # Function.apply's Python wrapper binds default arguments and unwraps functorch's dead wrappers: neither can be
    # in play on the eager path (checked by Public and _decide), so the C++ apply is called directly.
    _EAGER[opdef] = (_Eager, torch._C._FunctionBase.__dict__["apply"].__get__(None, _Eager))


def _planned_backward(plans: dict[Any, _plan.Plan] | None, backward: Callable[..., Any], ctx: Any,
                      grads: tuple[Any, ...], fast: Callable[..., Any] | None = None) -> Any:
    """``backward(ctx, *grads)``, replaying the plan ``plans`` holds for these gradients' signature (recorded by the
    first backward of it); plainly where there is no table (the custom-op path) or a mode is active. ``fast(plan,
    ctx, *grads)``, optional, builds from a plan just recorded (grad mode off: no double backward) a function that
    does the same backward in one step, or returns None."""
    if torch._C._is_any_autocast_enabled():  # a backward inside an autocast region: the forward's dtypes
        with no_autocast():
            return _planned_backward(plans, backward, ctx, grads, fast)
    if plans is None or not _plan.enabled or _modes():
        return backward(ctx, *grads)
    try:
        grad_mode = torch.is_grad_enabled()
        key = (grad_mode, _autocast() if torch._C._is_any_autocast_enabled() else None, *map(_sig, grads))
        plan = plans.get(key)
    except (_NotPlain, TypeError, AttributeError):
        return _plan.outside(backward, ctx, *grads)
    if plan is not None:
        one_step = plan.fast
        if one_step is not None:
            return one_step(ctx, *grads)
        return _plan.run(plan, backward, (ctx, *grads))
    if len(plans) >= 64:
        plans.clear()
    plan = plans[key] = _plan.Plan()
    out = _plan.run(plan, backward, (ctx, *grads))
    if fast is not None and not grad_mode:
        plan.fast = fast(plan, ctx, *grads)
    return out


class Lane:
    """A row op's forward with autograd, in one step (``Public``'s fast path when a gradient is wanted): the bound
    kernel function its plan recorded, then ``setup`` as the custom op's autograd would; the backward is the op's
    formula, replaying a plan per gradient signature. ``apply(*args)`` takes the custom op's arguments without
    its trailing backend request (``n`` of them), and returns its outputs. With ``shape``, the first ``k``
    arguments are [..., N] tensors of that shape, viewed as ``rows`` [M, N] inside the autograd node (as are the
    first ``outs`` outputs and their gradients, back): no view nodes in the graph around it. ``fast``: the op's
    builder of a one-step backward from a recorded backward plan (see :func:`_planned_backward`). ``tail``: the
    custom op's arguments after those ``n`` (and before the request) that ``setup`` reads, fixed for the lane."""

    __slots__ = ("apply", "backward", "fast", "fwd", "k", "n", "outs", "plans", "request", "rows", "setup",
                 "shape", "tail")

    def __init__(self, fwd: Callable[..., Any], setup: Callable[..., None], backward: Callable[..., Any],
                 request: str, n: int, shape: torch.Size | None = None, rows: tuple[int, int] | None = None,
                 k: int = 0, outs: int = 0, fast: Callable[..., Any] | None = None, tail: tuple[Any, ...] = ()
                 ) -> None:
        self.fwd, self.setup, self.backward, self.request, self.n = fwd, setup, backward, request, n
        self.shape, self.rows, self.k, self.outs, self.fast, self.tail = shape, rows, k, outs, fast, tail
        self.plans: dict[Any, _plan.Plan] = {}
        lane = self
        self.apply = lambda *args: _lane_apply(lane, *args)


class _LaneFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, lane: Lane, *args: Any) -> Any:
        shape = lane.shape
        if shape is not None:
            rows = lane.rows
            args = (*[a.view(rows) for a in args[:lane.k]], *args[lane.k:])
        out = lane.fwd(*args)
        lane.setup(ctx, (*args, *lane.tail, lane.request), out)
        ctx.hk_lane = lane
        if shape is None:
            return out
        if isinstance(out, Tensor):
            return out.view(shape)
        return (*[o.view(shape) for o in out[:lane.outs]], *out[lane.outs:])

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        lane = ctx.hk_lane
        shape = lane.shape
        if shape is not None:
            rows = lane.rows
            grads = (*[g if g is None else g.reshape(rows) for g in grads[:lane.outs]], *grads[lane.outs:])
        out = _planned_backward(lane.plans, lane.backward, ctx, grads, lane.fast)[:lane.n]
        if shape is not None:
            out = (*[g if g is None else g.view(shape) for g in out[:lane.k]], *out[lane.k:])
        return None, *out


_lane_apply = torch._C._FunctionBase.__dict__["apply"].__get__(None, _LaneFunction)


_WRITES: dict[Any, Callable[..., Any] | None] = {}


def _writing_body(opdef: Any) -> Callable[..., Any] | None:
    """For a custom op that writes into some arguments: its body, followed by bumping those arguments' version
    counters as the custom op would (a second backward over a gradient scaled in place must fail, not reuse it).
    None for an op that writes nothing."""
    if opdef not in _WRITES:
        written = [i for i, a in enumerate(opdef._opoverload._schema.arguments)
                   if a.alias_info is not None and a.alias_info.is_write]
        body = opdef._init_fn

        def run(*args: Any) -> Any:
            out = body(*args)
            torch._C._increment_version(tuple(args[i] for i in written))
            return out

        _WRITES[opdef] = run if written else None
    return _WRITES[opdef]


def _decide(opdef: Any, args: tuple[Any, ...]) -> Callable[..., Any]:
    """How a custom op is called outside torch.compile: its Python body when nothing the custom-op layer exists for
    is in play and no gradient is wanted; its autograd.Function when one is; else the custom op itself (which also
    gives a gradient-wanting call of an op without an autograd formula its clear error)."""
    if _modes():
        return opdef
    for a in args:
        if isinstance(a, Tensor) and type(a) not in _PLAIN:
            return opdef
    wants_grad = torch.is_grad_enabled() and any(isinstance(a, Tensor) and a.requires_grad for a in args)
    writing = _writing_body(opdef)
    if writing is not None:
        return opdef if wants_grad else writing
    if wants_grad:
        eager = _EAGER.get(opdef)
        return opdef if eager is None else eager[1]
    return opdef._init_fn


def call(opdef: Any, *args: Any) -> Any:
    """Call custom op ``opdef``, or in a plain eager call its Python body (the custom-op layers cost 30-80 µs per
    call, more than a kernel at decode shapes; the results are the same either way). The choice is part of a
    plan: a replayed call makes it without looking."""
    if torch.compiler.is_compiling():  # first: Dynamo must not trace the lookups below (a schema is untraceable)
        return opdef(*args)
    how = _plan.recall(opdef)
    if how is None:
        how = _decide(opdef, args)
        _plan.keep(opdef, how)
    return how(*args)


# ------------------------------------------------------------------------------------- inside torch.compile

# Ops whose torch backend reads values on the host (group sizes, sequence bounds) on some calls (its fallback loop
# where PyTorch's fused kernel does not take them): op -> whether a custom op's call (its name, its arguments) takes
# the fused kernel, with no host read. A graph cannot trace a host read, so a call that would make one on torch
# stays opaque there (:func:`torch_traces_when`).
_TORCH_TRACES: dict[str, Callable[[str, tuple[Any, ...]], bool]] = {}


def torch_traces_when(op: str, takes: Callable[[str, tuple[Any, ...]], bool]) -> None:
    """Declare that ``op``'s torch backend traces into a graph only on the calls ``takes(custom_op_name, args)``
    accepts (its others read values on the host)."""
    _TORCH_TRACES[op] = takes


def _torch_traces(op: str, name: str, args: tuple[Any, ...]) -> bool:
    takes = _TORCH_TRACES.get(op)
    return takes is None or bool(takes(name, args))


# (op, backend) pairs kept opaque inside a graph: their traced kernels break the installed Inductor, which fails
# the whole compile (attention_varlen's Helion kernels: a KeyError in the scheduler's compute_ancestors, torch 2.11).
_OPAQUE_IN_GRAPHS = frozenset({("attention_varlen", "helion")})


def _op_of(name: str, args: tuple[Any, ...]) -> str:
    """The op a custom op (``hkernels::<name>``) belongs to: the longest op name it starts with (the shared loss
    scaling names its op in its arguments)."""
    if name == "loss_grad_scale_":
        return args[2]
    return max((op for op in dispatch.ops() if name.startswith(op + "_")), key=len)


def traced(opdef: Any) -> None:
    """Make ``opdef`` visible to torch.compile, as ``torch.library.triton_op`` does: when AOTAutograd traces it
    (FunctionalTensorMode), its Python body is traced in its place, so the compiled graph holds what the body
    does: the backend kernels' launches recorded by ``torch.library.wrap_triton`` (``hkernels/runtime/launch.py``),
    which Inductor's generated code launches itself, or, on the torch backend, the reference math, which Inductor
    generates and fuses with its neighbours. The backend is chosen when the graph is traced
    (:func:`hkernels.dispatch.select_compiled`). The op stays opaque (its body called back at run time) under
    ``torch.export``, where a dispatch-time choice cannot be made (no tensors), where the chosen torch backend reads
    values on the host, for the kernel backends in interpret mode (interpreted kernels cannot be traced), where a
    size is symbolic and the chosen backend's launch settings would depend on it (its module does not declare the
    op ``SYMBOLIC``: see :func:`hkernels.dispatch.takes_symbolic`), for the pairs of ``_OPAQUE_IN_GRAPHS``, and
    where the body fails to trace (one warning per op and reason)."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode

    body = opdef._init_fn
    name = opdef._name

    def decompose(mode: Any, func: Any, types: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        from torch.export._trace import custom_triton_ops_decomposition_disabled

        if any(not issubclass(t, FakeTensor) and t not in (Tensor, FunctionalTensor) for t in types):
            return NotImplemented  # another subclass: its own handling first
        if not custom_triton_ops_decomposition_disabled():
            op = _op_of(name, args)
            tensors = tuple(a for a in (*args, *kwargs.values()) if isinstance(a, Tensor))
            backend = args[-1] if isinstance(args[-1], str) and args[-1] else ""
            request = backend or dispatch.requested(op)
            try:
                chosen = dispatch.select_compiled(op, request, tensors, name) if tensors else ("torch", "")
            except dispatch.BackendUnavailableError:
                chosen = ("", "")  # the body raises the error, with its reason, when it runs
            if not ((chosen[0] == "torch" and not _torch_traces(op, name, args)) or (op, chosen[0]) in _OPAQUE_IN_GRAPHS
                    or (chosen[0] != "torch" and (_interpret.interpreting() or (
                        _symbolic(tensors) and not dispatch.takes_symbolic(op, chosen[0], name, tensors))))):
                try:
                    with mode, _plan.tracing():
                        return body(*args, **kwargs)
                except Exception as e:  # what the trace recorded before the failure is dead code, dropped
                    # (a backend asked for by name that cannot run the call raises its error when the opaque op
                    # runs: the same error as in eager, never worked around)
                    _untraceable(name, e)
        return mode.__torch_dispatch__(func, types, args, kwargs)

    opdef.register_torch_dispatch(FunctionalTensorMode, decompose)


def _symbolic(tensors: tuple[Tensor, ...]) -> bool:
    """A size or stride is symbolic (``dynamic=True``, ``mark_dynamic``, or a recompile for a new length): a kernel
    backend traces the op only where it declares it can at any length."""
    return any(isinstance(v, torch.SymInt) for t in tensors for v in (*t.shape, *t.stride()))


_warned_untraceable: set[tuple[str, str]] = set()


def _untraceable(name: str, e: Exception) -> None:
    """One warning per (custom op, reason): the op could not be traced into the graph and is called back instead
    (correct, at the custom-op layer's cost per call)."""
    import logging
    import warnings

    reason = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}"
    if (name, reason) not in _warned_untraceable:
        _warned_untraceable.add((name, reason))
        logging.getLogger("hkernels").debug("hkernels::%s could not be traced", name, exc_info=e)  # the whole chain
        warnings.warn(f"hkernels::{name} could not be traced into the compiled graph ({reason}); it runs as an "
                      "opaque custom op there", dispatch.HKernelsFallbackWarning, stacklevel=2)


def trace_all() -> None:
    """:func:`traced` for every hkernels custom op of an op (once each); a runtime helper of no op
    (``hkernels::addmm_into``) the compiler keeps as it is."""
    from torch._library.custom_ops import OPDEFS

    ops = tuple(op + "_" for op in dispatch.ops())
    for qualname, opdef in OPDEFS.items():
        name = qualname.partition("::")[2]
        if qualname.startswith("hkernels::") and not getattr(opdef, "_hkernels_traced", False) and (
                name == "loss_grad_scale_" or name.startswith(ops)):
            traced(opdef)
            opdef._hkernels_traced = True


# -------------------------------------------------------------------------------------------------- shared shapes


def as_rows(x: Tensor) -> Tensor:
    """[..., N] -> [M, N] (reshape(-1, N) is ambiguous when N = 0); a 2-D x as it is (a reshape costs host time)."""
    return x if x.dim() == 2 else x.reshape(math.prod(x.shape[:-1]), x.shape[-1])


def rows(t: Tensor) -> Tensor:
    """Kernels read rows with any stride but need unit stride along the reduced (last) dim."""
    return t if t.stride(-1) == 1 else t.contiguous()


def stats(x: Tensor) -> Tensor:
    """A per-row float32 statistic of x [M, N]."""
    return x.new_empty(x.shape[0], dtype=torch.float32)


def placeholder(x: Tensor) -> Tensor:
    """Custom ops cannot return None inside a tuple: an absent gradient travels as an empty tensor."""
    return x.new_empty(0)


def reusable(grad: Tensor, like: Tensor, ctx: Any) -> bool:
    """``grad``, a gradient the backward of ``ctx`` received, can take ``like``'s gradient in place: a plain eager
    backward (no create_graph) that received it as the autograd engine's only reference (see :func:`_measure`), a
    contiguous tensor with ``like``'s dtype and shape."""
    return (getattr(ctx, "hk_sole", False) and not torch.is_grad_enabled() and grad.dtype == like.dtype
            and grad.shape == like.shape and grad.is_contiguous())


def _measure(grad: Tensor | None) -> tuple[int, ...] | None:
    """What holds ``grad`` as an ``autograd.Function``'s backward first sees it: its Python references, its
    tensor's references and its memory's (every tensor sharing it: a ``detach()`` or ``.data`` a hook kept, a
    gradient shared with another input of the node before), and for a view (the usual gradient of a norm feeding a
    linear layer: a matmul's result viewed back to [..., N]) the same of its base, which must be one block of the
    same elements. Compared with :data:`_SOLE`, the same measured on gradients nothing else holds: equal, nothing
    else does. None for anything else (never written over)."""
    if grad is None or grad.__class__ is not Tensor:
        return None
    memory = torch._C._storage_Use_Count(grad.untyped_storage()._cdata)
    if not grad._is_view():
        return sys.getrefcount(grad), grad._use_count(), memory
    base = grad._base
    if (base.__class__ is not Tensor or base._is_view() or not base.is_contiguous() or base.numel() != grad.numel()
            or base.data_ptr() != grad.data_ptr()):
        return None
    return sys.getrefcount(grad), grad._use_count(), sys.getrefcount(base), base._use_count(), memory


def _calibrate() -> tuple[tuple[int, ...], ...]:
    """:func:`_measure` of two gradients nothing else holds (a fresh one, and a matmul's viewed back to three dims),
    as an ``autograd.Function``'s backward receives them, on this interpreter and torch: measured once, at import,
    on a CPU."""
    seen: list[tuple[int, ...] | None] = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: Tensor) -> Tensor:
            return x.clone()

        @staticmethod
        def backward(ctx: Any, *grads: Any) -> Any:
            seen.append(_measure(grads[0]))  # (as the ops' eager backward measures its gradient)
            return grads[0]

    try:
        with torch.inference_mode(False), torch.enable_grad(), torch.device("cpu"):
            x = torch.zeros(2, 3, 4, requires_grad=True)
            (Probe.apply(x) * 2).sum().backward()
            (Probe.apply(x) @ torch.ones(4, 2)).sum().backward()
    except Exception:  # (no measure: nothing is ever written over)
        return ()
    return tuple(m for m in seen if m is not None)


_SOLE = _calibrate()


def zeros_if_none(grad: Tensor | None, like: Tensor) -> Tensor:
    return grad if grad is not None else torch.zeros_like(like)


# ------------------------------------------------------------------------------------------------------- checks


def check_input(op: str, x: Any, min_dim: int = 1) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"hkernels.{op}: x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT:
        raise TypeError(f"hkernels.{op}: x must be float16, bfloat16, float32 or float64, got {x.dtype}")
    if x.dim() < min_dim:
        raise ValueError(f"hkernels.{op}: x must have at least {min_dim} dimension(s), got a 0-d tensor")


def check_param(op: str, name: str, p: Any, x: Tensor) -> None:
    if p is None:
        return
    if not isinstance(p, torch.Tensor):
        raise TypeError(f"hkernels.{op}: {name} must be a torch.Tensor or None, got {type(p).__name__}")
    if p.dtype not in FLOAT:
        raise TypeError(f"hkernels.{op}: {name} must be a floating-point tensor, got {p.dtype}")
    if p.shape != (x.shape[-1],):
        raise ValueError(
            f"hkernels.{op}: {name} must have shape [{x.shape[-1]}] (the last dim of x, shape "
            f"{list(x.shape)}), got {list(p.shape)}"
        )
    if p.device != x.device:
        raise ValueError(f"hkernels.{op}: {name} is on {p.device} but x is on {x.device}")


def check_eps(op: str, eps: Any) -> None:
    """eps keeps 1/sqrt(variance + eps) finite on a constant (or zero) row: it must be a finite number > 0."""
    if not isinstance(eps, (int, float)) or isinstance(eps, bool):
        raise TypeError(f"hkernels.{op}: eps must be a float, got {type(eps).__name__}")
    if not (0 < eps < math.inf):  # (NaN fails every comparison)
        raise ValueError(f"hkernels.{op}: eps must be a finite number greater than 0, got {eps!r}")


def check_offset(op: str, offset: Any, weight: Any) -> None:
    """The norms' ``offset`` (Gemma's ``x̂ · (offset + w)``, offset 1): a finite float, with a weight to add it to.
    The kernels apply ``offset + w`` in float32 as they load w (Gemma's float32 ``1 + w``: in 16 bits it would
    round w's small values away); w's gradient is the same for any offset."""
    if not isinstance(offset, (int, float)) or isinstance(offset, bool) or not math.isfinite(offset):
        raise TypeError(f"hkernels.{op}: offset must be a finite float, got {offset!r}")
    if offset and not isinstance(weight, torch.Tensor):
        raise ValueError(f"hkernels.{op}: offset {offset!r} scales by offset + weight, so it needs a weight tensor, "
                         f"got {type(weight).__name__}")


def check_tensor(op: str, name: str, t: Any, dims: tuple[int, ...] | None = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"hkernels.{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in FLOAT:
        raise TypeError(f"hkernels.{op}: {name} must be float16, bfloat16, float32 or float64, got {t.dtype}")
    if dims is not None and t.dim() not in dims:
        want = " or ".join(f"{d}-d" for d in dims)
        raise ValueError(f"hkernels.{op}: {name} must be {want}, got shape {list(t.shape)}")


def check_same(op: str, names: tuple[str, ...], *ts: Tensor, shape: bool = True) -> None:
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


def check_range(op: str, name: str, t: Tensor, low: int, high: int, ignore: int | None = None,
                why: str = "") -> None:
    """Checking mode: every value of the integer tensor ``t`` lies in [low, high) (``ignore`` excepted); else a
    ValueError naming the first value outside (one host sync)."""
    bad = (t < low) | (t >= high)
    if ignore is not None:
        bad &= t != ignore
    if bool(bad.any()):
        at = [int(i) for i in bad.nonzero()[0]]
        index = ", ".join(map(str, at))
        except_ = f" and is not ignore_index ({ignore})" if ignore is not None else ""
        raise ValueError(f"hkernels.{op}: {name}[{index}] = {int(t[tuple(at)])} is outside [{low}, {high})"
                         f"{except_}{why}")
