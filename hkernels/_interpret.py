"""Interpret mode: run the helion and triton backends on CPU tensors (``HKERNELS_INTERPRET=1``).

Triton decides between compiling and interpreting a kernel when ``triton.jit`` decorates it, so the variable
must be set before any kernel module is imported: :func:`setup` runs when ``hkernels`` is imported and sets
``TRITON_INTERPRET=1`` for the process. Helion kernels then run the Triton code Helion generates, in Triton's
interpreter — the same code path as on a GPU, not Helion's eager reference mode.

Two things stand in the way, and are mended in interpret mode only:
- Helion's generated code calls ``libdevice.*`` (rsqrt, exp, ...), which the interpreter does not implement.
  Helion's ``libdevice`` is replaced by a proxy that, at call time, forwards each function to its
  ``tl.math``/``tl`` twin: the interpreter patches those modules when a kernel launches, so the lookup must
  happen then, not at import.
- Helion's NaN-propagating max/min reductions (for ``torch.amax``/``amin``) are ``tl.reduce`` with a custom
  combine function, which the interpreter runs one element at a time (seconds per row of a few thousand).
  They are replaced by the same reduction written with vectorised ``tl.max``/``tl.min``, NaN kept as NaN.

One more mend makes the interpreter model the GPU faithfully for every kernel: it converts float32 to bfloat16
by truncating the mantissa, where the GPU rounds to nearest even (seen: a bf16 rms_norm of N = 1 one ulp low).
The conversion is routed through PyTorch's, which rounds as the GPU does.
"""

from __future__ import annotations

import os
import types
from collections.abc import Callable
from typing import Any

_TRUE = {"1", "true", "yes", "on"}


def enabled() -> bool:
    """True when ``HKERNELS_INTERPRET`` asks for interpret mode."""
    return os.environ.get("HKERNELS_INTERPRET", "").strip().lower() in _TRUE


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


def _round_bf16_like_the_gpu() -> None:
    import numpy as np
    import torch
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder.cast_impl, "_hkernels", False):
        return
    truncating = builder.cast_impl

    def cast_impl(self: Any, src: Any, dst_type: Any) -> Any:
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            f32 = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32))
            bits = f32.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
            return interpreter.TensorHandle(bits.reshape(src.data.shape), dst_type.scalar)
        return truncating(self, src, dst_type)

    cast_impl._hkernels = True  # type: ignore[attr-defined]
    builder.cast_impl = cast_impl  # type: ignore[method-assign]
    # the lambdas that route integer and float casts through cast_impl look it up on the instance: no change


def _widen_bf16_dots() -> None:
    """Triton's interpreter (3.6-3.9) keeps bfloat16 as raw uint16 bits and ``tl.dot`` multiplies those bits as
    integers (errors ~1e10). A GPU's bf16 MMA multiplies exactly and accumulates in float32: widening both operands
    to float32 (exact: a bf16 is the high half of a float32) gives the same products."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder.create_dot, "_hkernels", False):
        return
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


def setup() -> None:
    """Prepare the process for interpret mode when ``HKERNELS_INTERPRET=1``; do nothing otherwise."""
    if not enabled():
        return
    if os.environ.get("HELION_INTERPRET", "").strip().lower() in _TRUE:
        raise RuntimeError(
            "hkernels: HKERNELS_INTERPRET=1 runs Helion's generated Triton in Triton's interpreter and cannot be "
            "combined with HELION_INTERPRET=1 (Helion refuses both interpreters in one process); unset one"
        )
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import torch._inductor.runtime.triton_compat as triton_compat
    except ImportError:  # no triton: the kernel backends are unavailable anyway
        return
    _round_bf16_like_the_gpu()
    _widen_bf16_dots()
    if not isinstance(triton_compat.libdevice, _LibdeviceProxy):
        triton_compat.libdevice = _LibdeviceProxy("libdevice")
    try:
        from helion.runtime.triton import helpers
    except ImportError:  # no helion: only the triton backend runs
        return
    helpers.max_propagate_nan = _reduce_propagate_nan("max")
    helpers.min_propagate_nan = _reduce_propagate_nan("min")
