"""Interpret mode: ``HKERNELS_INTERPRET=1`` runs the kernels on CPU tensors in Triton's interpreter.

The one reader of the variable (:func:`enabled`, :func:`requested`). ``triton.jit`` decides between compiling and
interpreting when it decorates a function: Triton's own ``triton.language`` helpers when ``triton`` is imported,
each kernel when its module is imported. So the mode is fixed when this module is first imported (``import
hkernels`` imports it first): in interpret mode it sets ``TRITON_INTERPRET=1`` for the process then, and
:func:`interpreting` gives that decision from then on; :func:`check` raises where the two disagree. Where
``triton`` was imported first (by transformers, trl or helion), the functions it decorated then are made
interpreted at that moment. A process that asks for interpret mode only after this module was imported cannot
interpret its kernels: :func:`problem` says why, for the caller to raise.

The interpreter differs from a GPU in two places that change results, both mended by :func:`mend` (interpret mode
only, before the first interpreted launch):
- it converts float32 to bfloat16 by truncating the mantissa, where the GPU rounds to nearest even: the
  conversion is routed through PyTorch's, which rounds as the GPU does;
- it keeps bfloat16 as raw uint16 bits and ``tl.dot`` multiplies those bits as integers: both operands are widened
  to float32 first (exact: a bfloat16 is the high half of a float32), which gives the GPU's products (a bf16 MMA
  multiplies exactly and accumulates in float32).

Two things stand in Helion's way, mended by :func:`prepare_helion` in interpret mode only, when the first Helion
kernel module is imported (``import hkernels`` imports neither Helion nor Triton):
- Helion's generated code calls ``libdevice.*`` (rsqrt, exp, ...), which the interpreter does not implement.
  Helion's ``libdevice`` is replaced by a proxy that, at call time, forwards each function to its
  ``tl.math``/``tl`` twin: the interpreter patches those modules when a kernel launches, so the lookup must
  happen then, not at import.
- Helion's NaN-propagating max/min reductions (for ``torch.amax``/``amin``) are ``tl.reduce`` with a custom
  combine function, which the interpreter runs one element at a time (seconds per row of a few thousand).
  They are replaced by the same reduction written with vectorised ``tl.max``/``tl.min``, NaN kept as NaN.

Torch-free at import: importable by every layer.
"""

from __future__ import annotations

import os
import sys
import types
from collections.abc import Callable
from typing import Any


def env_true(name: str) -> bool:
    """The environment variable ``name`` says yes (1, true, yes, on; any case)."""
    return os.environ.get(name, "").strip().lower() in {"1", "true", "yes", "on"}


def requested() -> bool:
    """``HKERNELS_INTERPRET`` asks for interpret mode now (read at each call)."""
    return env_true("HKERNELS_INTERPRET")


def _interpret_imported_triton() -> bool:
    """Interpret mode when ``triton`` was imported first (by transformers, trl, torch's inductor): the
    ``@triton.jit`` functions already decorated (Triton's own ``tl.sum``, ``tl.cdiv`` and their helpers, and any
    other module's) are compiled-mode functions, which an interpreted kernel cannot call. Each is replaced, in
    every loaded module and as a method of ``tl.tensor``, by its interpreted twin (the same Python function), as if
    it had been decorated with ``TRITON_INTERPRET=1``. True when done."""
    try:
        from triton.language import core
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction
    except Exception:  # a triton without these (another release): the caller reports the mode cannot be had
        return False
    made: dict[int, Any] = {}

    def interpreted(f: Any) -> Any:
        twin = made.get(id(f))
        if twin is None:
            twin = made[id(f)] = InterpretedFunction(f.fn)
        return twin

    for module in list(sys.modules.values()):
        names = getattr(module, "__dict__", None)
        if not isinstance(names, dict):
            continue
        for name, value in list(names.items()):
            if isinstance(value, JITFunction):
                names[name] = interpreted(value)
    for name, value in list(vars(core.tensor).items()):
        if isinstance(value, JITFunction):
            setattr(core.tensor, name, interpreted(value))
    return True


# What this process was at import, which decides how its kernels are decorated.
_ASKED_AT_IMPORT = requested()
_TRITON_BEFORE = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET", "") != "1"
if _ASKED_AT_IMPORT:
    os.environ["TRITON_INTERPRET"] = "1"
    if _TRITON_BEFORE and _interpret_imported_triton():
        _TRITON_BEFORE = False  # triton imported first, its jit functions made interpreted: nothing stands in the way
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "") == "1"


def interpreting() -> bool:
    """The kernels of this process run in Triton's interpreter (``TRITON_INTERPRET=1`` when this package was
    imported)."""
    return _INTERPRETED


def problem() -> str | None:
    """Why interpret mode, asked for now, cannot run in this process; None when it can or is not asked for."""
    if not requested():
        return None
    if not _ASKED_AT_IMPORT:
        what = "HKERNELS_INTERPRET=1 was set after hkernels (or triton_fallback) was imported"
    elif _TRITON_BEFORE:
        what = ("triton was imported before HKERNELS_INTERPRET=1 took effect, and its already-decorated functions "
                "could not be made interpreted")
    else:
        return None
    return (
        f"{what}: Triton decides between compiling and interpreting a kernel when it is imported, so this "
        "process's kernels cannot run in the interpreter. Set TRITON_INTERPRET=1 as well as HKERNELS_INTERPRET=1 "
        "in the environment before starting Python (then every Triton function is decorated for the interpreter "
        "whoever imports triton first), or unset HKERNELS_INTERPRET to run CPU tensors on the torch backend"
    )


def mend() -> None:
    """Make Triton's interpreter round and multiply bfloat16 as the GPU does (see the module docstring). Idempotent;
    for interpret mode only."""
    import numpy as np
    import torch
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if not getattr(builder.cast_impl, "_hkernels", False):
        truncating = builder.cast_impl

        def cast_impl(self: Any, src: Any, dst_type: Any) -> Any:
            if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
                f32 = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32))
                bits = f32.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
                return interpreter.TensorHandle(bits.reshape(src.data.shape), dst_type.scalar)
            return truncating(self, src, dst_type)

        cast_impl._hkernels = True  # type: ignore[attr-defined]
        # the lambdas that route integer and float casts through cast_impl look it up on the instance: no change
        builder.cast_impl = cast_impl  # type: ignore[method-assign]

    if not getattr(builder.create_dot, "_hkernels", False):
        integer_dot = builder.create_dot

        def widen(x: Any) -> Any:
            if x.dtype.scalar != tl.bfloat16:
                return x
            bits = np.ascontiguousarray(x.data).astype(np.uint32) << 16
            return interpreter.TensorHandle(bits.view(np.float32), tl.float32)

        def create_dot(self: Any, a: Any, b: Any, d: Any, *args: Any) -> Any:
            return integer_dot(self, widen(a), widen(b), d, *args)

        create_dot._hkernels = True  # type: ignore[attr-defined]
        builder.create_dot = create_dot  # type: ignore[method-assign]


def enabled() -> bool:
    """True when ``HKERNELS_INTERPRET`` asks for interpret mode (read now)."""
    return requested()


def check() -> None:
    """Raise if interpret mode is asked for now but this process's kernels cannot run in the interpreter
    (``HKERNELS_INTERPRET=1`` set after ``import hkernels``, or ``triton`` imported before it). For the
    dispatcher's slow path: a call's route is decided once per signature."""
    found = problem()
    if found is not None:
        raise RuntimeError(f"hkernels: {found}")


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
    if requested() and env_true("HELION_INTERPRET"):
        raise RuntimeError(
            "hkernels: HKERNELS_INTERPRET=1 runs Helion's generated Triton in Triton's interpreter and cannot be "
            "combined with HELION_INTERPRET=1 (Helion refuses both interpreters in one process); unset one"
        )


def prepare_helion() -> None:
    """Mend Helion's generated code for Triton's interpreter (see the module docstring): when the first Helion
    kernel module is imported, in interpret mode only."""
    if not interpreting():
        return
    import torch._inductor.runtime.triton_compat as triton_compat
    from helion.runtime.triton import helpers

    if not isinstance(triton_compat.libdevice, _LibdeviceProxy):
        triton_compat.libdevice = _LibdeviceProxy("libdevice")
    helpers.max_propagate_nan = _reduce_propagate_nan("max")
    helpers.min_propagate_nan = _reduce_propagate_nan("min")
