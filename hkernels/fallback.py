"""What can run a call, and what runs when a kernel backend fails on it.

:func:`unavailable_reason` says why a backend cannot run a call (the device, the dtypes, an import failure, what its
module refuses). Under auto, a Helion failure falls back to Triton and a failure of Triton where the measured table
chose it falls back to Helion, each with one warning per (op, reason); the failure is remembered by the signature
Helion compiles for (dtype and last-dim size), so the next call of it goes straight to the other backend. A backend
asked for by name that fails raises :class:`BackendUnavailableError`, naming the op, the backend, the reason and what
can run instead. Part of the dispatcher (``hkernels/dispatch.py``), the only code that chooses among backends.
"""

from __future__ import annotations

import threading
import warnings
from types import ModuleType
from typing import Any

import torch

from hkernels import configs, registry
from hkernels.runtime import interpret as _interpret
from hkernels.runtime import plan as _plan

BACKENDS: tuple[str, ...] = registry.BACKENDS
KERNEL_DTYPES: frozenset[torch.dtype] = frozenset({torch.float32, torch.bfloat16, torch.float16})


class BackendUnavailableError(RuntimeError):
    """A backend asked for by name cannot run this call."""


class HKernelsFallbackWarning(UserWarning):
    """``auto`` wanted Helion for a call and ran Triton instead."""


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


lock = threading.Lock()
helion_failures: dict[tuple[Any, ...], str] = {}
# The same failures by (op, dtype and last dim of the routed tensor): what selected_backend can see from a public
# call's arguments (a kernel's own tensors differ: a loss's kernel also takes per-row scales and a gradient buffer).
# Approximate, for reporting only (routing uses helion_failures): a failure of one kernel of the op (a backward,
# a variant with a weight) counts for every call of that dtype and row length; matmul's epilogue backward is keyed
# by N where the public call is keyed by K.
helion_failed_rows: dict[tuple[Any, ...], str] = {}
triton_failures: dict[tuple[Any, ...], str] = {}  # under auto where the table chose Triton (see run)
warned: set[tuple[str, str]] = set()


def signature(fn: str, tensors: tuple[torch.Tensor, ...]) -> tuple[Any, ...]:
    # Helion compiles per dtype and last-dim size (row counts are dynamic), so that is what a failure is keyed by;
    # a 1-D tensor's length is a row count (targets, per-row scales, stats): keyed by its rank only, or every new
    # token count would retry a failing compile.
    # (int(): a traced call's symbolic last dim is specialised, as its kernels specialise it)
    return (fn, tuple((t.dtype, t.dim(), int(t.shape[-1]) if t.dim() > 1 or (i == 0 and t.dim()) else 0)
                      for i, t in enumerate(tensors)))


def row_signature(op: str, tensors: tuple[torch.Tensor, ...]) -> tuple[Any, ...]:
    t = configs.routed_tensor(tensors)
    return (op, t.dtype, int(t.shape[-1]) if t.dim() else 1)


def reason_of(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"


def _remember(op: str, reason: str, where: tuple[tuple[dict[tuple[Any, ...], str], tuple[Any, ...]], ...],
              message: str) -> None:
    """A fallback's failure kept (``reason`` under each (table, key) of ``where``), and its warning given once per
    (op, reason)."""
    with lock:
        for table, key in where:
            table[key] = reason
        first = (op, reason) not in warned
        warned.add((op, reason))
    if first:
        warnings.warn(message, HKernelsFallbackWarning, stacklevel=5)


def run_helion(op: str, fn: str, request: str, module: ModuleType, tensors: tuple[torch.Tensor, ...],
               args: tuple[Any, ...], slot: int) -> tuple[Any, ModuleType]:
    """Helion runs the call; under auto, if it cannot, Triton does (the failure remembered, one warning per (op,
    reason)); a request for Helion by name raises :class:`BackendUnavailableError` instead."""
    try:
        return getattr(module, fn)(*args), module
    except torch.OutOfMemoryError:
        raise  # not a property of the input's signature: no fallback remembered for it
    except _plan.PlanDivergedError:
        raise
    except Exception as e:
        reason = reason_of(e)
        if request != "auto":
            can = [b for b in BACKENDS if b != "helion" and unavailable_reason(op, b, tensors) is None]
            raise BackendUnavailableError(
                f"hkernels.{op}: backend 'helion' failed on this call ({fn}): {reason}. "
                f"Backends that can run it: {', '.join(can)}"
            ) from e
        if unavailable_reason(op, "triton", tensors) is not None:
            raise
        where = ((helion_failures, signature(fn, tensors)), (helion_failed_rows, row_signature(op, tensors)))
        _remember(op, reason, where,
                  f"hkernels.{op}: Helion could not run this input ({reason}); using the Triton kernel instead")
        _plan.rewind(slot)  # what the failed attempt recorded
        triton = registry.load(op, "triton")
        assert not isinstance(triton, str)
        return getattr(triton, fn)(*args), triton


def run_measured_triton(op: str, fn: str, module: ModuleType, tensors: tuple[torch.Tensor, ...],
                        args: tuple[Any, ...], slot: int) -> tuple[Any, ModuleType]:
    """Under auto, Triton runs where the measured table chose it (Helion is there too, else auto would not pick
    Triton from a table): if Triton cannot run the input, Helion does, with one warning per (op, reason); if
    Helion fails too, Triton's error is raised."""
    # failed before for this signature: straight to Helion (the signature is built only once something failed)
    if triton_failures and signature(fn, tensors) in triton_failures:
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
        reason = reason_of(e)
        _plan.rewind(slot)
        helion = registry.load(op, "helion")
        assert not isinstance(helion, str)
        try:
            result = getattr(helion, fn)(*args)
        except Exception:
            raise e from None
        _remember(op, reason, ((triton_failures, signature(fn, tensors)),),
                  f"hkernels.{op}: the Triton kernel (measured faster here) could not run this input ({reason}); "
                  "using the Helion kernel instead")
        return result, helion
