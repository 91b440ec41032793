"""The dispatcher: which backend runs a call. The only module that knows several backends exist.

Backends (``hkernels/registry.py`` names each op's module on each): ``helion``, ``triton`` and ``torch``. Each offers
the same functions (``<op>_fwd``, ``<op>_bwd``, ...) with the same signatures.

What a call asks for, strongest first:
  1. ``with hkernels.use_backend(...)`` scopes, innermost first (a context variable: per thread, per task);
  2. ``HKERNELS_BACKEND``: ``auto`` | ``helion`` | ``triton`` | ``torch``, optionally with per-op overrides, e.g.
     ``HKERNELS_BACKEND=helion,softmax=triton``; read at call time, parsed again only when its text changes;
  3. ``auto``.
``auto`` runs CUDA tensors on the backend measured faster for the op and shape bucket on this GPU arch (the
tune command's buckets in the user cache first, then the shipped ``hkernels/configs/auto/<arch>.json``), on helion
where nothing was measured, falling back to triton (one warning per op and reason) when Helion cannot compile or
run the input; CPU tensors run on torch (in interpret mode, CPU tensors take the CUDA path, helion first). A
backend asked for by name that cannot run the call raises :class:`BackendUnavailableError`, naming the op, the
backend, the reason and what can run instead.

Inside a plan (``hkernels/runtime/plan.py``) the route a call took is recorded once per call signature and
replayed: a replayed call neither reads the tables nor builds a route key.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import os
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from hkernels import configs, registry
from hkernels.runtime import interpret as _interpret
from hkernels.runtime import plan as _plan

BACKENDS: tuple[str, ...] = registry.BACKENDS
REQUESTS: tuple[str, ...] = ("auto", *BACKENDS)
KERNEL_DTYPES: frozenset[torch.dtype] = frozenset({torch.float32, torch.bfloat16, torch.float16})


class BackendUnavailableError(RuntimeError):
    """A backend asked for by name cannot run this call."""


class HKernelsFallbackWarning(UserWarning):
    """``auto`` wanted Helion for a call and ran Triton instead."""


def ops() -> list[str]:
    """Names of every op hkernels provides."""
    return sorted(registry.OPS)


def _check_op(op: str) -> None:
    if op not in registry.OPS:
        raise ValueError(f"hkernels: unknown op {op!r}; ops are: {', '.join(ops())}")


def _check_request(value: str, where: str) -> str:
    if value not in REQUESTS:
        raise ValueError(f"hkernels: unknown backend {value!r} in {where}; valid backends are: {', '.join(REQUESTS)}")
    return value


# ------------------------------------------------------------------------------------------- what a call asks for


@dataclass(frozen=True)
class _Layer:
    default: str | None
    per_op: tuple[tuple[str, str], ...]


class _Scope:
    """The ``use_backend`` layers in effect, innermost last, with what they resolve to per ``HKERNELS_BACKEND``
    text (remembered: a call pays two dict lookups, not a parse)."""

    __slots__ = ("layers", "resolved")

    def __init__(self, layers: tuple[_Layer, ...]) -> None:
        self.layers = layers
        self.resolved: dict[bytes | str | None, dict[str, str]] = {}

    def resolve(self, env: bytes | str | None) -> dict[str, str]:
        layers = self.layers
        if env:
            text = env.decode() if isinstance(env, bytes) else env
            layers = (_parse_env(text), *layers)
        out = {}
        for op in registry.OPS:
            out[op] = "auto"
            for layer in reversed(layers):
                choice = dict(layer.per_op).get(op, layer.default)
                if choice is not None:
                    out[op] = choice
                    break
        if len(self.resolved) > 64:  # a process that keeps rewriting the variable
            self.resolved.clear()
        self.resolved[env] = out
        return out


_ROOT = _Scope(())
_SCOPES: dict[tuple[_Layer, ...], _Scope] = {(): _ROOT}


def _scope(layers: tuple[_Layer, ...]) -> _Scope:
    """The scope of these layers: one object per distinct stack, so that entering the same scope again (a scope
    per call) finds what it resolved to already."""
    found = _SCOPES.get(layers)
    if found is None:
        if len(_SCOPES) > 256:
            _SCOPES.clear()
            _SCOPES[()] = _ROOT
        found = _SCOPES[layers] = _Scope(layers)
    return found
_SCOPE: contextvars.ContextVar[_Scope] = contextvars.ContextVar("hkernels_backend_scope", default=_ROOT)
_ENV = "HKERNELS_BACKEND"
try:  # the environment's own mapping: one dict lookup instead of os.environ's encode/decode per read
    _environ_data: dict[Any, Any] = os.environ._data  # type: ignore[attr-defined]
    _env_key: Any = os.environ.encodekey(_ENV)  # type: ignore[attr-defined]
except AttributeError:  # pragma: no cover (an os.environ without them)
    _environ_data, _env_key = None, None  # type: ignore[assignment]


def _env_text() -> bytes | str | None:
    if _environ_data is not None:
        return _environ_data.get(_env_key)
    return os.environ.get(_ENV)  # pragma: no cover


def env_key(name: str) -> Any:
    """The key :func:`env_value` reads ``name`` by."""
    return os.environ.encodekey(name) if _environ_data is not None else name  # type: ignore[attr-defined]


def env_value(key: Any) -> bytes | str | None:
    """The environment's value now of the variable of ``key`` (from :func:`env_key`): one dict lookup."""
    if _environ_data is not None:
        return _environ_data.get(key)
    return os.environ.get(key)  # pragma: no cover


@functools.lru_cache(maxsize=64)
def _parse_env(text: str) -> _Layer:
    default: str | None = None
    per_op: dict[str, str] = {}
    for raw in text.split(","):
        item = raw.strip()
        if not item:
            continue
        if "=" in item:
            op, _, value = (s.strip() for s in item.partition("="))
            _check_op(op)
            value = _check_request(value.lower(), f"HKERNELS_BACKEND={text!r}")
            if per_op.get(op, value) != value:
                raise ValueError(f"hkernels: HKERNELS_BACKEND={text!r} asks for two backends for {op} "
                                 f"({per_op[op]} and {value}); give one")
            per_op[op] = value
        else:
            value = _check_request(item.lower(), f"HKERNELS_BACKEND={text!r}")
            if default is not None and default != value:
                raise ValueError(f"hkernels: HKERNELS_BACKEND={text!r} names two default backends ({default} and "
                                 f"{value}); give one, and per-op choices as op=backend (e.g. helion,softmax=triton)")
            default = value
    return _Layer(default, tuple(per_op.items()))


def requested(op: str) -> str:
    """What the current scope and ``HKERNELS_BACKEND`` ask for ``op``: auto, helion, triton or torch."""
    scope = _SCOPE.get()
    env = _env_text()
    found = scope.resolved.get(env)
    if found is None:
        found = scope.resolve(env)
    return found[op]


@contextlib.contextmanager
def use_backend(default: str | None = None, /, **per_op: str) -> Iterator[None]:
    """Run the enclosed calls on a backend: ``use_backend("triton")``, ``use_backend(softmax="torch")``.

    Beats ``HKERNELS_BACKEND``; an inner scope beats an outer one; scopes are per thread (context variables).
    """
    if default is not None:
        _check_request(default, "use_backend()")
    for op, value in per_op.items():
        _check_op(op)
        _check_request(value, f"use_backend({op}=...)")
    token = _SCOPE.set(_scope((*_SCOPE.get().layers, _Layer(default, tuple(per_op.items())))))
    try:
        yield
    finally:
        _SCOPE.reset(token)


# ------------------------------------------------------------------------------------------------- availability


def _device_reason(backend: str, tensors: tuple[torch.Tensor, ...]) -> str | None:
    if backend == "torch":
        return None
    devices = {t.device.type for t in tensors}
    if devices == {"cuda"}:
        return None
    if devices == {"cpu"} and _interpret.enabled():
        _interpret.check()  # asked for after import: one clear error, not a kernel failing in the interpreter
        return None
    if len(devices) > 1:
        return f"its tensors are on several devices ({', '.join(sorted(devices))})"
    return (
        f"its tensors are on {next(iter(devices), 'no device')}; {backend} kernels need CUDA tensors "
        "(or HKERNELS_INTERPRET=1 for CPU tensors)"
    )


def unavailable_reason(op: str, backend: str, tensors: tuple[torch.Tensor, ...], fn: str | None = None) -> str | None:
    """Why ``backend`` cannot run ``op`` (its function ``fn``) on these tensors, or None if it can: the device, the
    dtypes, an import failure, or what the backend module's ``refuses(fn, tensors)`` says it does not take (a
    property of the signature it declares, such as Helion attention's head dims)."""
    reason = _device_reason(backend, tensors)
    if reason is not None:
        return reason
    if backend != "torch":
        bad = sorted({str(t.dtype) for t in tensors if t.is_floating_point() and t.dtype not in KERNEL_DTYPES})
        if bad:
            return f"its kernels take float32, bfloat16 and float16, not {', '.join(bad)}"
    module = registry.load(op, backend)
    if isinstance(module, str):
        return module
    refuses = getattr(module, "refuses", None)
    return refuses(fn or f"{op}_fwd", tensors) if refuses is not None else None


# --------------------------------------------------------------------------------------------- failure memory

_lock = threading.Lock()
_helion_failures: dict[tuple[Any, ...], str] = {}
# The same failures by (op, dtype and last dim of the routed tensor): what selected_backend can see from a public
# call's arguments (a kernel's own tensors differ: a loss's kernel also takes per-row scales and a gradient buffer).
# Approximate, for reporting only (routing uses _helion_failures): a failure of one kernel of the op (a backward,
# a variant with a weight) counts for every call of that dtype and row length; matmul's epilogue backward is keyed
# by N where the public call is keyed by K.
_helion_failed_rows: dict[tuple[Any, ...], str] = {}
_triton_failures: dict[tuple[Any, ...], str] = {}  # under auto where the table chose Triton (see run)
_warned: set[tuple[str, str]] = set()


def _signature(fn: str, tensors: tuple[torch.Tensor, ...]) -> tuple[Any, ...]:
    # Helion compiles per dtype and last-dim size (row counts are dynamic), so that is what a failure is keyed by;
    # a 1-D tensor's length is a row count (targets, per-row scales, stats): keyed by its rank only, or every new
    # token count would retry a failing compile.
    # (int(): a traced call's symbolic last dim is specialised, as its kernels specialise it)
    return (fn, tuple((t.dtype, t.dim(), int(t.shape[-1]) if t.dim() > 1 or (i == 0 and t.dim()) else 0)
                      for i, t in enumerate(tensors)))


def _row_signature(op: str, tensors: tuple[torch.Tensor, ...]) -> tuple[Any, ...]:
    t = _routed_tensor(tensors)
    return (op, t.dtype, int(t.shape[-1]) if t.dim() else 1)


def _tensors(args: tuple[Any, ...]) -> tuple[torch.Tensor, ...]:
    return tuple(a for a in args if isinstance(a, torch.Tensor))


# ----------------------------------------------------------------------------------------------------- choosing


def select(op: str, request: str, tensors: tuple[torch.Tensor, ...], fn: str | None = None,
           bucket_fn: str | None = None) -> tuple[str, str]:
    """(backend, why) for a call of ``op``'s function ``fn`` that asks for ``request``; raises if a named backend
    cannot run. ``bucket_fn``: the function whose auto buckets decide when ``fn`` is not given."""
    which = fn or bucket_fn
    if request != "auto":
        reason = unavailable_reason(op, request, tensors, which)
        if reason is None:
            return request, "asked for by name"
        can = [b for b in BACKENDS if unavailable_reason(op, b, tensors, which) is None]
        raise BackendUnavailableError(
            f"hkernels.{op}: backend {request!r} cannot run this call: {reason}. "
            f"Backends that can: {', '.join(can)}"
        )
    if not tensors or (all(t.device.type == "cpu" for t in tensors) and not _interpret.enabled()):
        return "torch", "auto: CPU tensors run on torch"
    helion_reason = unavailable_reason(op, "helion", tensors, which)
    triton_ok = unavailable_reason(op, "triton", tensors, which) is None
    if helion_reason is None:
        failure = (None if not (_helion_failures or _helion_failed_rows)
                   else _helion_failures.get(_signature(fn, tensors)) if fn is not None
                   else _helion_failed_rows.get(_row_signature(op, tensors)))
        if failure is None:
            measured = _measured_choice(op, tensors, fn or bucket_fn) if triton_ok else None
            if measured is not None:
                return measured
            return "helion", "auto: helion (the primary backend; no measurement for this arch and shape)"
        helion_reason = f"helion failed on this input earlier ({failure})"
    if triton_ok:
        return "triton", f"auto: {helion_reason}"
    return "torch", f"auto: {helion_reason}; triton unavailable too"


def _shape_key(tensors: tuple[torch.Tensor, ...]) -> tuple[int, int]:
    """(rows, n) of a call as the auto table buckets it: the last dim of its first tensor of 2 or more dims (of its
    first tensor when none has 2) and that tensor's other elements. A loss's backward passes its per-row factors
    [T] before the gradient [T, V]: it is bucketed by [T, V], as its forward is, not by rows of T elements."""
    t = _routed_tensor(tensors)
    n = t.shape[-1] if t.dim() else 1
    rows = t.numel() // n if n else 0
    # (a symbolic row count: the buckets for any number of rows, with no guard on it)
    return (rows if type(rows) is int else sys.maxsize), n


def _routed_tensor(tensors: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The first tensor of 2 or more dims (the first tensor when none has 2): what a call is bucketed by."""
    for t in tensors:
        if t.dim() >= 2:
            return t
    return tensors[0]


def _bucket(op: str, tensors: tuple[torch.Tensor, ...], fn: str | None = None) -> tuple[str, dict[str, Any]] | None:
    """(arch, the auto-table bucket covering this call) or None (CPU tensors, or nothing measured). A table may
    give one of an op's functions buckets of its own (key ``"<op>:<fn>"``, e.g. attention's forward, measured
    alone, where the op's buckets sum forward and forward+backward); the user's tuned buckets still come first."""
    t = tensors[0]
    if t.is_cuda:
        arch = configs.cuda_arch(t.device)
    elif _interpret.enabled():
        arch = "interpret"  # nothing shipped; a user table there lets the tests exercise this path on a CPU
    else:
        return None
    table = configs.auto_table(arch)
    buckets = table.get(op, ())
    own = table.get(f"{op}:{fn}", ()) if fn is not None else ()
    if own:
        buckets = tuple(b for source in ("tuned", "shipped") for b in (*own, *buckets) if b["source"] == source)
    if not buckets:
        return None
    rows, n = _shape_key(tensors)
    for bucket in buckets:
        if (bucket["max_rows"] is None or rows <= bucket["max_rows"]) and (
                bucket["max_n"] is None or n <= bucket["max_n"]) and n >= bucket.get("min_n", 0):
            return arch, bucket
    return None


def _measured_choice(op: str, tensors: tuple[torch.Tensor, ...], fn: str | None = None) -> tuple[str, str] | None:
    found = _bucket(op, tensors, fn)
    if found is None:
        return None
    arch, bucket = found
    if bucket["backend"] not in BACKENDS:
        return None
    return bucket["backend"], (f"auto: {bucket['backend']} measured faster on {arch} ({bucket['source']} table; "
                               f"{bucket.get('measured', 'no detail')})")


# Routes already chosen, for calls outside a plan (the custom-op path: torch.compile, modes, subclasses): (op, fn,
# request, interpret mode, (CUDA or device type, dtype) of each tensor) -> (backend, the backend's module; the
# function is looked up per call, so a replaced module attribute takes effect); under auto the key also holds the
# device and shape of the tensor the auto table buckets by. Everything select() decides on is in the key, except
# Helion failures, which are keyed by shape and checked apart, and the tables, whose reload (configs.reload)
# empties this. Only successful selections are kept: a call that raises is retried in full.
_routes: dict[tuple[Any, ...], tuple[str, ModuleType]] = {}
_MAX_ROUTES = 4096  # auto's keys grow with the row counts a caller uses: past this, start over
_routes_generation = 0  # bumped by every reload: a route chosen from the old tables is not stored after it
_forget_hooks: list[Callable[[], None]] = []


def on_forget(hook: Callable[[], None]) -> None:
    """Call ``hook`` whenever the routes are forgotten (the public calls' plans recorded routes too)."""
    _forget_hooks.append(hook)


def _forget_routes() -> None:
    """After the tables are re-read (or a test replaced what select() reads): every route is chosen again, and
    every plan that recorded one is dropped."""
    global _routes_generation
    with _lock:
        _routes_generation += 1
        _routes.clear()
        _bound.clear()
    for hook in _forget_hooks:
        hook()


def generation() -> int:
    """Bumped whenever the routes are forgotten: a plan recorded while that happened is not kept."""
    return _routes_generation


def forget() -> None:
    """Forget every route, plan, remembered failure and given warning: the next call of each signature decides
    afresh."""
    with _lock:
        _helion_failures.clear()
        _helion_failed_rows.clear()
        _triton_failures.clear()
        _warned.clear()
    _forget_routes()


def _route(op: str, fn: str, request: str, tensors: tuple[torch.Tensor, ...]) -> tuple[str, ModuleType]:
    # is_cuda first: t.device builds a device object per tensor; other devices still key by their type
    key: tuple[Any, ...] = (op, fn, request, _interpret.enabled(),
                            tuple([(t.is_cuda or t.device.type, t.dtype) for t in tensors]))
    if request == "auto" and tensors:
        routed = tensors[0] if tensors[0].dim() >= 2 else _routed_tensor(tensors)
        key = (*key, routed.device, routed.shape)  # (rows, n) follow from the shape
    failed = request == "auto" and bool(_helion_failures) and _signature(fn, tensors) in _helion_failures
    found = None if failed else _routes.get(key)
    if found is not None:
        return found
    generation = _routes_generation
    backend, _ = select(op, request, tensors, fn)
    module = registry.load(op, backend)
    assert not isinstance(module, str)
    found = (backend, module)
    # A fallback chosen for one failing shape is not kept: other inputs of this key may still run on Helion.
    if not failed:
        with _lock:
            if generation == _routes_generation:  # no reload while select() read the tables
                if len(_routes) >= _MAX_ROUTES:
                    _routes.clear()
                _routes[key] = found
    return found


configs.on_reload(_forget_routes)  # a new table may choose other backends for shapes routed before


def run(op: str, fn: str, request: str, *args: Any) -> Any:
    """Run ``<fn>`` (e.g. ``rms_norm_fwd``) of the backend chosen for ``op``; under auto, fall back from Helion to
    Triton, or from Triton (where the measured table chose it) to Helion.

    A backend function may offer a binder (``fn.bind(*args)``: the same function for every call of this
    signature, its settings, grids and compiled kernels found once). Inside a plan, the first call records the
    bound function and replays call it directly; outside one (the custom-op path that torch.compile runs), bound
    functions are kept per exact signature."""
    if _plan.TRACING:
        return _run_traced(op, fn, request, args)
    entry = _plan.recall(fn)
    if entry is not None:
        if entry.__class__ is ModuleType:  # not bound: the function's own slots follow in the plan
            return getattr(entry, fn)(*args)
        return entry(*args)
    slot = _plan.reserve(fn)  # recording: what to replay is known once the call has run
    request = request or requested(op)
    key = None
    if slot < 0 and not _plan.active():
        key = _bound_key(op, fn, request, args)
        if key is not None:
            found = _bound.get(key)
            if found is not None:
                return found(*args)
    tensors = _tensors(args)
    backend, module = _route(op, fn, request, tensors)
    if backend == "triton" and request == "auto":
        out, module = _run_measured_triton(op, fn, module, tensors, args, slot)
    elif backend != "helion":
        out = getattr(module, fn)(*args)
    else:
        out, module = _run_helion(op, fn, request, module, tensors, args, slot)
    bound = _bind(module, fn, args, backend == "torch") if (slot >= 0 or key is not None) else None
    if bound is None:
        _plan.fill(slot, module)
    elif slot >= 0:
        _plan.rewind(slot)  # the bound function replaces what the call recorded inside it
        _plan.fill(slot, bound)
    else:
        with _lock:
            if len(_bound) >= _MAX_ROUTES:
                _bound.clear()
            _bound[key] = bound
    return out


def select_compiled(op: str, request: str, tensors: tuple[torch.Tensor, ...], fn: str) -> tuple[str, str]:
    """(backend, why) for ``op``'s function ``fn`` traced into a compiled graph. A named request runs as in eager.
    Under auto: torch (Inductor's own generated kernel) where the table's ``compiled:<op>`` buckets measured it
    faster inside a graph (``python -m bench auto-table`` over ``auto_compile`` and ``torch_compile`` rows), or for
    CPU tensors; else the kernel auto runs eagerly, its launches traced for Inductor to make; at a symbolic length,
    Triton where it traces there, then Helion where it does (``takes_symbolic``). In interpret mode
    only torch is traced (interpreted kernels cannot be); the other backends keep the op opaque
    (see :func:`hkernels.functional._base.traced`)."""
    if request != "auto":
        return select(op, request, tensors, fn)
    found = _bucket(f"compiled:{op}", tensors, fn) if tensors and (tensors[0].is_cuda or _interpret.enabled()) \
        else None
    if found is not None and found[1]["backend"] == "torch":
        arch, bucket = found
        return "torch", (f"auto: Inductor's own kernel measured faster inside torch.compile on {arch} "
                         f"({bucket['source']} table; {bucket.get('measured', 'no detail')})")
    backend, why = select(op, request, tensors, fn)
    if backend == "helion" and _symbolic(tensors) and unavailable_reason(op, "triton", tensors, fn) is None \
            and takes_symbolic(op, "triton", fn, tensors):
        # a length that varies: Triton's traced kernels, the ones the results measure at a symbolic length
        return "triton", "auto: triton traces at a symbolic length (its traced kernels are the measured ones)"
    if backend == "triton" and _symbolic(tensors) and not takes_symbolic(op, backend, fn, tensors) \
            and unavailable_reason(op, "helion", tensors, fn) is None and takes_symbolic(op, "helion", fn, tensors):
        return "helion", "auto: helion traces at a symbolic length (triton would stay opaque)"
    return backend, why


def takes_symbolic(op: str, backend: str, name: str, tensors: tuple[torch.Tensor, ...] = ()) -> bool:
    """``backend``'s host functions for ``op`` record the launches of custom op ``name`` (``hkernels::<name>``) on
    ``tensors`` into a compiled graph with a symbolic row count (its module's ``SYMBOLIC``, and its
    ``symbolic_ok(name, tensors)`` where it has one): the torch backend always does."""
    if backend == "torch":
        return True
    if backend not in ("helion", "triton"):
        return False
    module = registry.load(op, backend)
    if isinstance(module, str) or name not in getattr(module, "SYMBOLIC", ()):
        return False
    ok = getattr(module, "symbolic_ok", None)
    return ok is None or not tensors or bool(ok(name, tensors))


def _symbolic(tensors: tuple[torch.Tensor, ...]) -> bool:
    """A row count (a size or stride past the last dim) is symbolic: ``dynamic=True``, ``mark_dynamic``, or a
    recompile for a new length."""
    return any(type(v) is not int for t in tensors for v in (*t.shape[:-1], *t.stride()[:-1]))


def _run_traced(op: str, fn: str, request: str, args: tuple[Any, ...]) -> Any:
    """``run`` while a custom op's body is traced into a compiled graph: routed afresh (the shapes may be
    symbolic: nothing is keyed by them), launches recorded by the backend's launcher (``_plan.tracing``)."""
    request = request or requested(op)
    tensors = _tensors(args)
    backend, _ = select_compiled(op, request, tensors, fn)
    module = registry.load(op, backend)
    assert not isinstance(module, str)
    if backend == "helion":
        return _run_helion(op, fn, request, module, tensors, args, -1)[0]
    return getattr(module, fn)(*args)


# Bound functions for calls outside a plan, by exact signature (see run); forgotten with the routes.
_bound: dict[tuple[Any, ...], Callable[..., Any]] = {}


def _bound_key(op: str, fn: str, request: str, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """(op, fn, request, per argument its dtype, shape, strides, alignment and device, or its type and value);
    None where that cannot describe the call: an argument passed twice (a kernel may write through one and read
    the other), an unhashable one, or any Helion failure remembered (checked per call on the unbound path)."""
    if _helion_failures or _triton_failures:
        return None
    key: list[Any] = [op, fn, request]
    seen: set[int] = set()
    for a in args:
        if isinstance(a, torch.Tensor):
            if id(a) in seen or type(a) is not torch.Tensor:
                return None
            seen.add(id(a))
            key.append((a.dtype, a.shape, a.stride(), a.data_ptr() & 15, a.device))
        else:
            key.append((type(a), a))
    try:
        hash(tuple(key))
    except TypeError:
        return None
    return tuple(key)


def _bind(module: ModuleType, fn: str, args: tuple[Any, ...], plain: bool = False) -> Callable[..., Any] | None:
    """The backend function's binding for these arguments, or None (no binder: a replaced function, such as a test's
    spy, has none; or binding failed, which the unbound function does not). ``plain``: a backend whose functions
    keep nothing per signature (torch): the function is its own binding, so the one-step paths take it too."""
    function = getattr(module, fn)
    binder = getattr(function, "bind", None)
    if binder is None:
        if not plain:
            return None
        binder = lambda *_: function
    try:
        bound = binder(*args)
    except Exception:  # the call itself ran: keep running it unbound
        return None
    try:
        bound.hk_module = module  # which backend it is of (a caller may bind the same function with other options)
    except AttributeError:
        return None
    return bound


def rebind(bound: Callable[..., Any], fn: str, *args: Any, **options: Any) -> Callable[..., Any] | None:
    """``fn`` of the backend ``bound`` (a bound function of :func:`run`'s) bound again for ``args`` with ``options``
    (e.g. ``stats=False``), or None where its binder does not take them."""
    module = getattr(bound, "hk_module", None)
    binder = getattr(getattr(module, fn, None), "bind", None)
    if binder is None:
        return None
    try:
        return binder(*args, **options)
    except Exception:
        return None


def _reason(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"


def _run_helion(op: str, fn: str, request: str, module: ModuleType, tensors: tuple[torch.Tensor, ...],
                args: tuple[Any, ...], slot: int) -> tuple[Any, ModuleType]:
    try:
        return getattr(module, fn)(*args), module
    except torch.OutOfMemoryError:
        raise  # not a property of the input's signature: no fallback remembered for it
    except _plan.PlanDivergedError:
        raise
    except Exception as e:
        reason = _reason(e)
        if request != "auto":
            can = [b for b in BACKENDS if b != "helion" and unavailable_reason(op, b, tensors) is None]
            raise BackendUnavailableError(
                f"hkernels.{op}: backend 'helion' failed on this call ({fn}): {reason}. "
                f"Backends that can run it: {', '.join(can)}"
            ) from e
        if unavailable_reason(op, "triton", tensors) is not None:
            raise
        with _lock:
            _helion_failures[_signature(fn, tensors)] = reason
            _helion_failed_rows[_row_signature(op, tensors)] = reason
            first = (op, reason) not in _warned
            _warned.add((op, reason))
        if first:
            warnings.warn(
                f"hkernels.{op}: Helion could not run this input ({reason}); using the Triton kernel instead",
                HKernelsFallbackWarning,
                stacklevel=4,
            )
        _plan.rewind(slot)  # what the failed attempt recorded
        triton = registry.load(op, "triton")
        assert not isinstance(triton, str)
        return getattr(triton, fn)(*args), triton


def _run_measured_triton(op: str, fn: str, module: ModuleType, tensors: tuple[torch.Tensor, ...],
                         args: tuple[Any, ...], slot: int) -> tuple[Any, ModuleType]:
    """Under auto, Triton runs where the measured table chose it (Helion is there too, else auto would not pick
    Triton from a table): if Triton cannot run the input, Helion does, with one warning per (op, reason); if
    Helion fails too, Triton's error is raised."""
    # failed before for this signature: straight to Helion (the signature is built only once something failed)
    if _triton_failures and _signature(fn, tensors) in _triton_failures:
        helion = registry.load(op, "helion")
        assert not isinstance(helion, str)
        return getattr(helion, fn)(*args), helion
    try:
        return getattr(module, fn)(*args), module
    except torch.OutOfMemoryError:
        raise  # not a property of the input's signature: nothing to remember or retry
    except _plan.PlanDivergedError:
        raise
    except Exception as e:
        if unavailable_reason(op, "helion", tensors) is not None:
            raise
        reason = _reason(e)
        _plan.rewind(slot)
        helion = registry.load(op, "helion")
        assert not isinstance(helion, str)
        try:
            result = getattr(helion, fn)(*args)
        except Exception:
            raise e from None
        with _lock:
            _triton_failures[_signature(fn, tensors)] = reason
            first = (op, reason) not in _warned
            _warned.add((op, reason))
        if first:
            warnings.warn(
                f"hkernels.{op}: the Triton kernel (measured faster here) could not run this input ({reason}); "
                "using the Helion kernel instead",
                HKernelsFallbackWarning,
                stacklevel=4,
            )
        return result, helion


# ------------------------------------------------------------------------------------------------ introspection


def backends(op: str | None = None) -> list[str] | dict[str, list[str]]:
    """Backends that can run ``op`` on this machine (CUDA present, or interpret mode), best first; without an op,
    {op: its backends} for every op."""
    if op is None:
        return {name: backends(name) for name in ops()}  # type: ignore[misc]
    _check_op(op)
    kernels_here = torch.cuda.is_available()
    if not kernels_here and _interpret.enabled():
        _interpret.check()
        kernels_here = True
    out = [b for b in ("helion", "triton") if kernels_here and not isinstance(registry.load(op, b), str)]
    return [*out, "torch"]


class Selection(str):
    """A backend name (compares equal to it) that also says why it was chosen: ``.reason``."""

    reason: str

    def __new__(cls, backend: str, reason: str) -> Selection:
        self = super().__new__(cls, backend)
        self.reason = reason
        return self

    def __getnewargs__(self) -> tuple[str, str]:  # pickle and copy rebuild it with its reason
        return str(self), self.reason


def selected_backend(op: str, *args: Any, **kwargs: Any) -> Selection:
    """The backend a call ``hkernels.<op>(*args, **kwargs)`` would run its forward on now; ``.reason`` says why
    (asked for by name, measured faster on this arch for this shape bucket, a Helion failure, CPU tensors) and,
    where auto routes the backward elsewhere (attention's forward has buckets of its own), the backward's."""
    _check_op(op)
    module = registry.load(op, "torch")
    assert not isinstance(module, str)
    bound = inspect.signature(getattr(module, op)).bind(*args, **kwargs)
    bound.apply_defaults()
    routed = getattr(module, "routed", None)  # where the kernel sees other tensors than the call's arguments
    tensors = routed(bound.arguments) if routed is not None else _tensors(tuple(bound.arguments.values()))
    request = requested(op)
    forward_fn = getattr(module, "forward_fn", None)  # where the call's options pick the function it runs
    fwd = forward_fn(bound.arguments) if forward_fn is not None else f"{op}_fwd"
    backend, reason = select(op, request, tensors, bucket_fn=fwd)
    if request == "auto" and (backend, reason) == _measured_choice(op, tensors, fwd):
        # the backward's buckets: the op's own, or, for a function routed apart, its backward's before them
        bwd = None if fwd == f"{op}_fwd" else fwd.removesuffix("_fwd") + "_bwd"
        backward = _measured_choice(op, tensors, bwd)
        if backward is not None and backward[0] != backend:
            reason = f"{reason}; the backward: {backward[1]}"
    return Selection(backend, reason)
