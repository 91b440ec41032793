"""The dispatcher: which backend runs a call. The only module that knows several backends exist.

Backends: ``helion`` (``hkernels/ops/<op>.py``), ``triton`` (``triton_fallback/<op>.py``) and ``torch``
(``hkernels/reference.py``). Each backend module offers the same functions (``<op>_fwd``, ``<op>_bwd``) with
the same signatures; the dispatcher imports a backend module only when a call first needs it.

What a call asks for, strongest first:
  1. ``with hkernels.use_backend(...)`` scopes, innermost first (a context variable: per thread, per task);
  2. ``HKERNELS_BACKEND``, read at every call: ``auto`` | ``helion`` | ``triton`` | ``torch``, optionally with
     per-op overrides, e.g. ``HKERNELS_BACKEND=helion,softmax=triton``;
  3. ``auto``.
``auto`` runs CUDA tensors on the backend measured faster for the op and shape bucket on this GPU arch (the
tune command's buckets in the user cache first, then the shipped ``hkernels/configs/auto/<arch>.json``), on helion where
nothing was measured, falling back to triton (one warning per op and reason) when Helion cannot compile or run
the input; CPU tensors run on torch (in interpret mode, CPU tensors take the CUDA path, helion first). A
backend asked for by name that cannot run the call raises :class:`BackendUnavailableError`, naming the op, the
backend, the reason and what can run instead.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import inspect
import os
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from hkernels import _interpret, configs

BACKENDS: tuple[str, ...] = ("helion", "triton", "torch")
REQUESTS: tuple[str, ...] = ("auto", *BACKENDS)
KERNEL_DTYPES: frozenset[torch.dtype] = frozenset({torch.float32, torch.bfloat16, torch.float16})

_MODULES = {"helion": "hkernels.ops.{op}", "triton": "triton_fallback.{op}", "torch": "hkernels.reference"}


class BackendUnavailableError(RuntimeError):
    """A backend asked for by name cannot run this call."""


class HKernelsFallbackWarning(UserWarning):
    """``auto`` wanted Helion for a call and ran Triton instead."""


@dataclass(frozen=True)
class _Layer:
    default: str | None
    per_op: Mapping[str, str]


_SCOPE: contextvars.ContextVar[tuple[_Layer, ...]] = contextvars.ContextVar("hkernels_backend_scope", default=())
_OPS: dict[str, Callable[..., Any]] = {}
# Per op, where the public function reshapes its input before the kernel call: the tensors the call is routed by
# (selected_backend must bucket what the kernel will see, e.g. softmax over dim 0 runs on a moved view).
_ROUTED: dict[str, Callable[[dict[str, Any]], tuple[torch.Tensor, ...]]] = {}
_lock = threading.Lock()
_import_lock = threading.RLock()
_module_cache: dict[tuple[str, str], ModuleType | str] = {}
_helion_failures: dict[tuple[Any, ...], str] = {}
# The same failures by (op, dtype and last dim of the routed tensor): what selected_backend can see from a public
# call's arguments (a kernel's own tensors differ: a loss's kernel also takes per-row scales and a gradient buffer).
# Approximate, for reporting only (routing uses _helion_failures): a failure of one kernel of the op (a backward,
# a variant with a weight) counts for every call of that dtype and row length; matmul's epilogue backward is keyed
# by N where the public call is keyed by K.
_helion_failed_rows: dict[tuple[Any, ...], str] = {}
_triton_failures: dict[tuple[Any, ...], str] = {}  # under auto where the table chose Triton (see run)
_warned: set[tuple[str, str]] = set()


def register_op(
    name: str, public_fn: Callable[..., Any], routed: Callable[[dict[str, Any]], tuple[torch.Tensor, ...]] | None = None
) -> None:
    """Make ``name`` known to the dispatcher; ``public_fn`` is the user-facing function (for its signature);
    ``routed`` maps its bound arguments to the tensors its kernel call is routed by, where they differ."""
    _OPS[name] = public_fn
    if routed is not None:
        _ROUTED[name] = routed


def ops() -> list[str]:
    """Names of every op hkernels provides."""
    return sorted(_OPS)


def _check_op(op: str) -> None:
    if op not in _OPS:
        raise ValueError(f"hkernels: unknown op {op!r}; ops are: {', '.join(ops())}")


def _check_request(value: str, where: str) -> str:
    if value not in REQUESTS:
        raise ValueError(f"hkernels: unknown backend {value!r} in {where}; valid backends are: {', '.join(REQUESTS)}")
    return value


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
            per_op[op] = _check_request(value.lower(), f"HKERNELS_BACKEND={text!r}")
        else:
            default = _check_request(item.lower(), f"HKERNELS_BACKEND={text!r}")
    return _Layer(default, per_op)


def requested(op: str) -> str:
    """What the current scope and ``HKERNELS_BACKEND`` ask for ``op``: auto, helion, triton or torch."""
    layers = _SCOPE.get()
    env = os.environ.get("HKERNELS_BACKEND")
    if env:
        layers = (_parse_env(env), *layers)
    for layer in reversed(layers):
        choice = layer.per_op.get(op, layer.default)
        if choice is not None:
            return choice
    return "auto"


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
    token = _SCOPE.set((*_SCOPE.get(), _Layer(default, dict(per_op))))
    try:
        yield
    finally:
        _SCOPE.reset(token)


_prepared = False


def prepare() -> None:
    """Import, once and under the import lock, what a first op call would otherwise import lazily.

    A custom op's first call imports torch._dynamo; Helion's import pulls in torch._inductor, which imports
    torch._dynamo too. Done from two threads at once, the two chains wait on each other's module locks and
    Python breaks the cycle by handing out half-initialised modules (seen on the H200: "partially initialized
    module 'torch._dynamo'", after which every op failed in that process).
    """
    global _prepared
    if _prepared:
        return
    with _import_lock:
        if not _prepared:
            import torch._dynamo  # noqa: F401

            _prepared = True


def _module(backend: str, op: str) -> ModuleType | str:
    """The backend's module for ``op``, or the reason it cannot be imported."""
    key = (backend, op)
    found = _module_cache.get(key)
    if found is None:
        # One import at a time (see prepare).
        with _import_lock:
            prepare()
            found = _module_cache.get(key)
            if found is None:
                try:
                    found = importlib.import_module(_MODULES[backend].format(op=op))
                except Exception as e:  # an import error of any kind means: this backend is not available here
                    found = f"{backend} cannot be imported here ({type(e).__name__}: {e})"
                _module_cache[key] = found
    return found


def _device_reason(backend: str, tensors: tuple[torch.Tensor, ...]) -> str | None:
    if backend == "torch":
        return None
    devices = {t.device.type for t in tensors}
    if devices == {"cuda"}:
        return None
    if devices == {"cpu"} and _interpret.enabled():
        return None
    if len(devices) > 1:
        return f"its tensors are on several devices ({', '.join(sorted(devices))})"
    return (
        f"its tensors are on {next(iter(devices), 'no device')}; {backend} kernels need CUDA tensors "
        "(or HKERNELS_INTERPRET=1 for CPU tensors)"
    )


def unavailable_reason(op: str, backend: str, tensors: tuple[torch.Tensor, ...]) -> str | None:
    """Why ``backend`` cannot run ``op`` on these tensors, or None if it can."""
    reason = _device_reason(backend, tensors)
    if reason is not None:
        return reason
    if backend != "torch":
        bad = sorted({str(t.dtype) for t in tensors if t.is_floating_point() and t.dtype not in KERNEL_DTYPES})
        if bad:
            return f"its kernels take float32, bfloat16 and float16, not {', '.join(bad)}"
    module = _module(backend, op)
    return module if isinstance(module, str) else None


def _signature(fn: str, tensors: tuple[torch.Tensor, ...]) -> tuple[Any, ...]:
    # Helion compiles per dtype and last-dim size (row counts are dynamic), so that is what a failure is keyed by;
    # a 1-D tensor's length is a row count (targets, per-row scales, stats): keyed by its rank only, or every new
    # token count would retry a failing compile.
    return (fn, tuple((t.dtype, t.dim(), t.shape[-1] if t.dim() > 1 or (i == 0 and t.dim()) else 0)
                      for i, t in enumerate(tensors)))


def _row_signature(op: str, tensors: tuple[torch.Tensor, ...]) -> tuple[Any, ...]:
    t = _routed_tensor(tensors)
    return (op, t.dtype, t.shape[-1] if t.dim() else 1)


def _tensors(args: tuple[Any, ...]) -> tuple[torch.Tensor, ...]:
    return tuple(a for a in args if isinstance(a, torch.Tensor))


def select(op: str, request: str, tensors: tuple[torch.Tensor, ...], fn: str | None = None) -> tuple[str, str]:
    """(backend, why) for a call of ``op`` that asks for ``request``; raises if a named backend cannot run."""
    if request != "auto":
        reason = unavailable_reason(op, request, tensors)
        if reason is None:
            return request, "asked for by name"
        can = [b for b in BACKENDS if unavailable_reason(op, b, tensors) is None]
        raise BackendUnavailableError(
            f"hkernels.{op}: backend {request!r} cannot run this call: {reason}. "
            f"Backends that can: {', '.join(can)}"
        )
    if not tensors or (all(t.device.type == "cpu" for t in tensors) and not _interpret.enabled()):
        return "torch", "auto: CPU tensors run on torch"
    helion_reason = unavailable_reason(op, "helion", tensors)
    triton_ok = unavailable_reason(op, "triton", tensors) is None
    if helion_reason is None:
        failure = (_helion_failures.get(_signature(fn, tensors)) if fn is not None
                   else _helion_failed_rows.get(_row_signature(op, tensors)))
        if failure is None:
            measured = _measured_choice(op, tensors) if triton_ok else None
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
    [T] before the gradient [T, V]: bucketed by [T], it ran on the backend measured for rows of T elements, not the
    forward's (seen on the H200: auto's cross_entropy fwd+bwd 5-13% slower than Triton's at V = 8192-65536)."""
    t = _routed_tensor(tensors)
    n = t.shape[-1] if t.dim() else 1
    return (t.numel() // n if n else 0), n


def _routed_tensor(tensors: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The first tensor of 2 or more dims (the first tensor when none has 2): what a call is bucketed by."""
    for t in tensors:
        if t.dim() >= 2:
            return t
    return tensors[0]


def _bucket(op: str, tensors: tuple[torch.Tensor, ...]) -> tuple[str, dict[str, Any]] | None:
    """(arch, the auto-table bucket covering this call) or None (CPU tensors, or nothing measured)."""
    t = tensors[0]
    if t.is_cuda:
        arch = configs.cuda_arch(t.device)
    elif _interpret.enabled():
        arch = "interpret"  # nothing shipped; a user table there lets the tests exercise this path on a CPU
    else:
        return None
    buckets = configs.auto_table(arch).get(op)
    if not buckets:
        return None
    rows, n = _shape_key(tensors)
    for bucket in buckets:
        if (bucket["max_rows"] is None or rows <= bucket["max_rows"]) and (
                bucket["max_n"] is None or n <= bucket["max_n"]) and n >= bucket.get("min_n", 0):
            return arch, bucket
    return None


def _measured_choice(op: str, tensors: tuple[torch.Tensor, ...]) -> tuple[str, str] | None:
    found = _bucket(op, tensors)
    if found is None:
        return None
    arch, bucket = found
    if bucket["backend"] not in ("helion", "triton"):
        return None
    return bucket["backend"], (f"auto: {bucket['backend']} measured faster on {arch} ({bucket['source']} table; "
                               f"{bucket.get('measured', 'no detail')})")


# Routes already chosen: (op, fn, request, interpret mode, (CUDA or device type, dtype) of each tensor) -> (backend,
# the backend's module; the function is looked up per call, so a replaced module attribute takes effect); under
# auto the key also holds the device and shape of the tensor the auto table buckets by, so a call of a
# shape seen before skips the table lookup (auto's route took 3.6 µs against 1.9 for a named backend on the
# development CPU; 2.5 with this key; on the H200's slower host auto was 4-5 µs slower per call than the backend
# it chose). Everything select() decides on is in the key, except Helion failures, which are keyed
# by shape and checked apart, and the tables, whose reload (configs.reload) empties this (code that replaces
# what select() reads, e.g. a test patching _bucket, calls _forget_routes). Only successful selections are kept:
# a call that raises is retried in full.
_routes: dict[tuple[Any, ...], tuple[str, ModuleType]] = {}
_MAX_ROUTES = 4096  # auto's keys grow with the row counts a caller uses: past this, start over
_routes_generation = 0  # bumped by every reload: a route chosen from the old tables is not stored after it


def _forget_routes() -> None:
    """After the tables are re-read (or a test replaced what select() reads): every route is chosen again."""
    global _routes_generation
    with _lock:
        _routes_generation += 1
        _routes.clear()


def _route(op: str, fn: str, request: str, tensors: tuple[torch.Tensor, ...]) -> tuple[str, ModuleType]:
    # is_cuda first: t.device builds a device object per tensor (0.6 µs of a 2-tensor call's key on the development
    # CPU); other devices still key by their type
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
    module = _module(backend, op)
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
    Triton, or from Triton (where the measured table chose it) to Helion."""
    request = request or requested(op)
    tensors = _tensors(args)
    backend, module = _route(op, fn, request, tensors)
    if backend == "triton" and request == "auto":
        return _run_measured_triton(op, fn, module, tensors, args)
    if backend != "helion":
        return getattr(module, fn)(*args)
    try:
        return getattr(module, fn)(*args)
    except torch.OutOfMemoryError:
        raise  # not a property of the input's signature: no fallback remembered for it
    except Exception as e:
        reason = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"
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
                stacklevel=2,
            )
        return getattr(_module("triton", op), fn)(*args)


def _run_measured_triton(op: str, fn: str, module: ModuleType, tensors: tuple[torch.Tensor, ...],
                         args: tuple[Any, ...]) -> Any:
    """Under auto, Triton runs where the measured table chose it (Helion is there too, else auto would not pick
    Triton from a table): if Triton cannot run the input, Helion does, with one warning per (op, reason); if
    Helion fails too, Triton's error is raised."""
    # failed before for this signature: straight to Helion (the signature is built only once something failed)
    if _triton_failures and _signature(fn, tensors) in _triton_failures:
        return getattr(_module("helion", op), fn)(*args)
    try:
        return getattr(module, fn)(*args)
    except torch.OutOfMemoryError:
        raise  # not a property of the input's signature: nothing to remember or retry
    except Exception as e:
        if unavailable_reason(op, "helion", tensors) is not None:
            raise
        reason = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"
        try:
            result = getattr(_module("helion", op), fn)(*args)
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
                stacklevel=3,
            )
        return result


def backends(op: str) -> list[str]:
    """Backends that can run ``op`` on this machine (CUDA present, or interpret mode), best first."""
    _check_op(op)
    kernels_here = torch.cuda.is_available() or _interpret.enabled()
    out = [b for b in ("helion", "triton") if kernels_here and not isinstance(_module(b, op), str)]
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
    """The backend a call ``hkernels.<op>(*args, **kwargs)`` would run on now; ``.reason`` says why (asked for by
    name, measured faster on this arch for this shape bucket, a Helion failure, CPU tensors)."""
    _check_op(op)
    bound = inspect.signature(_OPS[op]).bind(*args, **kwargs)
    bound.apply_defaults()
    routed = _ROUTED.get(op)
    tensors = routed(bound.arguments) if routed is not None else _tensors(tuple(bound.arguments.values()))
    return Selection(*select(op, requested(op), tensors))
