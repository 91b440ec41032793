"""Interpret mode: run the helion and triton backends on CPU tensors (``HKERNELS_INTERPRET=1``).

The variable is read in one place, ``triton_fallback/_interpret.py``, which ``import hkernels`` imports first: in
interpret mode it sets ``TRITON_INTERPRET=1`` for the process before any kernel is decorated. Helion kernels then
run the Triton code Helion generates, in Triton's interpreter: the same code path as on a GPU, not Helion's eager
reference mode. :func:`check` (the dispatcher's slow path) raises when interpret mode is asked for in a process
whose kernels were not decorated for it.

Two things stand in Helion's way, mended by :func:`prepare_helion` in interpret mode only, when the first Helion
kernel module is imported (``import hkernels`` imports neither Helion nor Triton):
- Helion's generated code calls ``libdevice.*`` (rsqrt, exp, ...), which the interpreter does not implement.
  Helion's ``libdevice`` is replaced by a proxy that, at call time, forwards each function to its
  ``tl.math``/``tl`` twin: the interpreter patches those modules when a kernel launches, so the lookup must
  happen then, not at import.
- Helion's NaN-propagating max/min reductions (for ``torch.amax``/``amin``) are ``tl.reduce`` with a custom
  combine function, which the interpreter runs one element at a time (seconds per row of a few thousand).
  They are replaced by the same reduction written with vectorised ``tl.max``/``tl.min``, NaN kept as NaN.
The interpreter's own differences from a GPU (bfloat16 rounding and dots) are mended for both backends in
``triton_fallback/_interpret.py``.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

from triton_fallback import _interpret as _mode


def enabled() -> bool:
    """True when ``HKERNELS_INTERPRET`` asks for interpret mode (read now)."""
    return _mode.requested()


def check() -> None:
    """Raise if interpret mode is asked for now but this process's kernels cannot run in the interpreter
    (``HKERNELS_INTERPRET=1`` set after ``import hkernels``, or ``triton`` imported before it). For the
    dispatcher's slow path: a call's route is decided once per signature."""
    problem = _mode.problem()
    if problem is not None:
        raise RuntimeError(f"hkernels: {problem}")


class _LibdeviceProxy(types.ModuleType):
    """Stands in for ``libdevice`` inside interpreted kernels; resolves each function when it is called."""

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if name.startswith("__"):
            raise AttributeError(name)

        def call(*args: Any, **kwargs: Any) -> Any:
            import triton.language as tl

            for namespace in (tl.math, tl):
                fn = getattr(namespace, name, None)
                if fn is not None:
                    return fn(*args, **kwargs)
            raise NotImplementedError(
                f"hkernels interpret mode: libdevice.{name} has no triton.language twin, so Helion code "
                "that uses it cannot run in Triton's interpreter"
            )

        return call


def _reduce_propagate_nan(kind: str) -> Callable[..., Any]:
    def reduce(x: Any, dim: Any) -> Any:
        import triton.language as tl

        if x.dtype.is_floating():
            if x.dtype.primitive_bitwidth < 32:
                x = x.to(tl.float32)
            found = tl.max((x != x).to(tl.int32), dim) > 0
            value = tl.max(x, dim) if kind == "max" else tl.min(x, dim)
            return tl.where(found, float("nan"), value)
        if x.dtype.primitive_bitwidth < 32:
            x = x.to(tl.int32)
        return tl.max(x, dim) if kind == "max" else tl.min(x, dim)

    return reduce


def setup() -> None:
    """At ``import hkernels``: refuse a combination of interpreters that cannot work; do nothing otherwise."""
    if _mode.requested() and _mode.env_true("HELION_INTERPRET"):
        raise RuntimeError(
            "hkernels: HKERNELS_INTERPRET=1 runs Helion's generated Triton in Triton's interpreter and cannot be "
            "combined with HELION_INTERPRET=1 (Helion refuses both interpreters in one process); unset one"
        )


def prepare_helion() -> None:
    """Mend Helion's generated code for Triton's interpreter (see the module docstring): when the first Helion
    kernel module is imported, in interpret mode only."""
    if not _mode.interpreting():
        return
    import torch._inductor.runtime.triton_compat as triton_compat
    from helion.runtime.triton import helpers

    if not isinstance(triton_compat.libdevice, _LibdeviceProxy):
        triton_compat.libdevice = _LibdeviceProxy("libdevice")
    helpers.max_propagate_nan = _reduce_propagate_nan("max")
    helpers.min_propagate_nan = _reduce_propagate_nan("min")
