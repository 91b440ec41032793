"""The dispatcher: which backend runs a call. With ``hkernels/fallback.py`` (what can run a call, and what runs when a
backend fails), the only code that knows several backends exist.

Backends (``hkernels/registry.py`` names each op's module on each): ``helion``, ``triton`` and ``torch``. Each offers
the same functions (``<op>_fwd``, ``<op>_bwd``, ...) with the same signatures. What a call asks for is
``hkernels/requests.py``'s (``use_backend`` scopes, then ``HKERNELS_BACKEND``, then ``auto``).

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

import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from hkernels import configs, registry
from hkernels.fallback import (
    BACKENDS,
    KERNEL_DTYPES,
    BackendUnavailableError,
    HKernelsFallbackWarning,
    helion_failed_rows,
    helion_failures,
    row_signature,
    run_helion,
    run_measured_triton,
    signature,
    triton_failures,
    unavailable_reason,
)
from hkernels.fallback import lock as _failures_lock
from hkernels.fallback import warned as _warned
from hkernels.requests import REQUESTS, env_key, env_value, ops, requested, use_backend
from hkernels.runtime import interpret as _interpret
from hkernels.runtime import plan as _plan
from hkernels.runtime.plan import rebind

__all__ = ["BACKENDS", "KERNEL_DTYPES", "REQUESTS", "BackendUnavailableError", "HKernelsFallbackWarning", "env_key",
           "env_value", "forget", "ops", "rebind", "requested", "run", "select", "select_compiled", "takes_symbolic",
           "unavailable_reason", "use_backend"]

_lock = threading.Lock()  # (the routes and bound functions below)


def tensors_of(args: tuple[Any, ...]) -> tuple[torch.Tensor, ...]:
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
        failure = (None if not (helion_failures or helion_failed_rows)
                   else helion_failures.get(signature(fn, tensors)) if fn is not None
                   else helion_failed_rows.get(row_signature(op, tensors)))
        if failure is None:
            measured = measured_choice(op, tensors, fn or bucket_fn) if triton_ok else None
            if measured is not None:
                return measured
            return "helion", "auto: helion (the primary backend; no measurement for this arch and shape)"
        helion_reason = f"helion failed on this input earlier ({failure})"
    if triton_ok:
        return "triton", f"auto: {helion_reason}"
    return "torch", f"auto: {helion_reason}; triton unavailable too"


# op -> which calls its torch backend takes with PyTorch's fused kernel, ``takes(fn, tensors)``, where elsewhere it
# runs the reference math: the table's torch buckets, measured on the fused kernel, hold for those calls only.
_TORCH_FUSED: dict[str, Callable[[str | None, tuple[torch.Tensor, ...]], bool]] = {}


def torch_fused_when(op: str, takes: Callable[[str | None, tuple[torch.Tensor, ...]], bool]) -> None:
    _TORCH_FUSED[op] = takes


def measured_choice(op: str, tensors: tuple[torch.Tensor, ...], fn: str | None = None) -> tuple[str, str] | None:
    found = configs.auto_bucket(op, tensors, fn)
    if found is None:
        return None
    arch, bucket = found
    if bucket["backend"] not in BACKENDS:
        return None
    takes = _TORCH_FUSED.get(op) if bucket["backend"] == "torch" else None
    if takes is not None and not takes(fn, tensors):
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
    with _failures_lock:
        helion_failures.clear()
        helion_failed_rows.clear()
        triton_failures.clear()
        _warned.clear()
    _forget_routes()


def _route(op: str, fn: str, request: str, tensors: tuple[torch.Tensor, ...]) -> tuple[str, ModuleType]:
    # is_cuda first: t.device builds a device object per tensor; other devices still key by their type
    key: tuple[Any, ...] = (op, fn, request, _interpret.enabled(),
                            tuple([(t.is_cuda or t.device.type, t.dtype) for t in tensors]))
    if request == "auto" and tensors:
        routed = tensors[0] if tensors[0].dim() >= 2 else configs.routed_tensor(tensors)
        key = (*key, routed.device, routed.shape)  # (rows, n) follow from the shape
    failed = request == "auto" and bool(helion_failures) and signature(fn, tensors) in helion_failures
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
    tensors = tensors_of(args)
    backend, module = _route(op, fn, request, tensors)
    if backend == "triton" and request == "auto":
        out, module = run_measured_triton(op, fn, module, tensors, args, slot)
    elif backend != "helion":
        out = getattr(module, fn)(*args)
    else:
        out, module = run_helion(op, fn, request, module, tensors, args, slot)
    bound = _plan.bind(module, fn, args, backend == "torch") if (slot >= 0 or key is not None) else None
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
    on_kernels = bool(tensors) and (tensors[0].is_cuda or _interpret.enabled())
    found = configs.auto_bucket(f"compiled:{op}", tensors, fn) if on_kernels else None
    if found is not None and found[1]["backend"] == "torch":
        arch, bucket = found
        return "torch", (f"auto: Inductor's own kernel measured faster inside torch.compile on {arch} "
                         f"({bucket['source']} table; {bucket.get('measured', 'no detail')})")
    backend, why = select(op, request, tensors, fn)
    if backend == "helion" and _symbolic(tensors) and not triton_failures \
            and unavailable_reason(op, "triton", tensors, fn) is None and takes_symbolic(op, "triton", fn, tensors):
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
    tensors = tensors_of(args)
    backend, _ = select_compiled(op, request, tensors, fn)
    module = registry.load(op, backend)
    assert not isinstance(module, str)
    if backend == "helion":
        return run_helion(op, fn, request, module, tensors, args, -1)[0]
    return getattr(module, fn)(*args)


# Bound functions for calls outside a plan, by exact signature (see run); forgotten with the routes.
_bound: dict[tuple[Any, ...], Callable[..., Any]] = {}


def _bound_key(op: str, fn: str, request: str, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """(op, fn, request, per argument its dtype, shape, strides, alignment and device, or its type and value);
    None where that cannot describe the call: an argument passed twice (a kernel may write through one and read
    the other), an unhashable one, or any Helion failure remembered (checked per call on the unbound path)."""
    if helion_failures or triton_failures:
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


def __getattr__(name: str) -> Any:
    """``backends``, ``selected_backend`` and ``Selection``, which live in ``hkernels/introspect.py`` (it imports
    this module), still reachable here."""
    if name in ("backends", "selected_backend", "Selection"):
        from hkernels import introspect

        return getattr(introspect, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
