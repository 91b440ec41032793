"""A lean launch path for Triton kernels, used by the hand-written kernels and as Helion's launcher.

``kernel[grid](*args, **meta)`` runs ``JITFunction.run`` on every call: it binds and specialises each argument,
hashes a cache key, checks globals and builds launch metadata before the compiled launcher runs, which costs more
than the kernel at decode shapes. Three ways past it, fastest last:

- :func:`launch`: the first call for a *specialisation key* goes through Triton (which compiles, caches and
  launches), later calls with the same key call the compiled launcher directly;
- inside a replayed plan (``_plan.py``), :func:`launch` takes the compiled kernel the plan recorded, no key built;
- :class:`Bound` (a launch set up once for one call signature, by a backend function's binder) and
  :func:`bound_launcher` (the same for a bound Helion function) call the compiled kernel's C launch function
  directly (:func:`direct`), skipping also the launcher's Python wrapper where the kernel needs no scratch memory.

The key is finer than Triton's own specialisation, so a kernel is never reused where Triton would have compiled
another: a tensor gives (dtype, 16-byte aligned), an int (== 1, divisible by 16, i32 / i64 / u64 range), a float or
bool its type, anything else (constexprs passed by position, None, dtypes) its type and value; keyword arguments
(constexprs, num_warps, num_stages) give (name, value, type of value): True, 1 and 1.0 are equal as dict keys but
may compile to different kernels. ``tests/test_launch.py`` checks the refinement against
Triton's own ``native_specialize_impl``. Slow path (plain Triton) whenever the fast one cannot be exact: a callable
grid, a launch hook installed (profilers), interpret mode, a non-constexpr parameter given by keyword. Not in
the key: Triton's process-wide knobs (debug, instrumentation), which a process is not expected to flip between
launches.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch

from hkernels.runtime import interpret as _interpret
from hkernels.runtime import plan as _plan

_I32 = 2**31
_I64 = 2**63

# Per JITFunction (by id): (the kernel, (params count, positions of constexpr params, names of non-constexpr params,
# param names, defaults)) -- or None when the fast path cannot serve it (interpret mode: not a JITFunction).
_SHAPE: dict[Any, Any] = {}
# (id of the kernel, device, key) -> (compiled kernel, constexpr values appended after the positional args, the
# kernel: checked on a hit, as an id can be reused once its object is gone)
_COMPILED: dict[tuple, tuple[Any, tuple, Any]] = {}
_COMPILED_MAX = 4096  # bounded: cleared when full (the next call of each key goes through Triton once more)


_SLOW = object()  # an argument the key cannot describe (a host tensor descriptor, ...): plain Triton for the call
_VALUES = (int, float, bool, str, type(None), torch.dtype)  # constexprs by position: keyed by value


def _spec(a: Any) -> Any:
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.data_ptr() % 16 == 0)
    if isinstance(a, bool):
        return bool
    if isinstance(a, int):
        return (a == 1, a % 16 == 0, 0 if -_I32 <= a < _I32 else 1 if -_I64 <= a < _I64 else 2)
    if isinstance(a, float):
        return float
    if a is None:
        return None
    return _SLOW


def _shape(kernel: Any) -> Any:
    # Keyed by id: a JITFunction hashes by its cache_key, a Python property computed on every lookup. The entry
    # holds the kernel, so its id is not reused while the entry lives.
    found = _SHAPE.get(id(kernel))
    if found is not None and found[0] is kernel:
        return found[1]
    params = getattr(kernel, "params", None)
    if params is None or not hasattr(kernel, "device_caches"):  # not a compiled-mode JITFunction
        shape = None
    else:
        shape = (
            len(params),
            frozenset(i for i, p in enumerate(params) if p.is_constexpr),
            frozenset(p.name for p in params if not p.is_constexpr),
            [p.name for p in params],
            {p.name: p.default for p in params if p.has_default},
        )
    _SHAPE[id(kernel)] = (kernel, shape)
    return shape


# Triton's interpreter patches triton.language module-wide while a kernel runs, so two threads interpreting kernels
# at once break each other ("Did you forget to add @triton.jit?"): in interpret mode every launch (hand-written
# here, Helion's in hkernels/ops/_helion.py) runs inside interpreted(), which holds this lock.
INTERPRET_LOCK = threading.RLock()
# Fixed for the process (triton.jit decided when the kernels were decorated): a constant, not a lookup per launch.
_INTERPRETED = _interpret.interpreting()
if _INTERPRETED:
    _interpret.mend()  # before the first interpreted launch of either backend (Helion's launches come through here)


def aligned(t: torch.Tensor, to: int = 16) -> bool:
    """t's first element sits on a ``to``-byte boundary. While a graph is traced there is no address: the graph's
    tensors are Inductor's allocations or its inputs, whose bases it keeps aligned (a misaligned input is copied),
    so the storage offset decides."""
    if _plan.TRACING:
        return (t.storage_offset() * t.element_size()) % to == 0
    return t.data_ptr() % to == 0


def descriptors_ok() -> bool:
    """Kernels may take TMA tensor descriptors now: not while a graph is traced, where torch's analysis of which
    arguments a kernel writes does not see stores through a descriptor (the launch would be dropped from the
    graph as writing nothing): the kernels' pointer variants run there."""
    return not _plan.TRACING


def same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """a and b are views of one storage (a kernel writing one overwrites the other)."""
    if _plan.TRACING:
        return a is b or torch._C._is_alias_of(a, b)
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


# Generated kernels (Helion's) recompiled with float32 scalars for a traced graph, by (kernel id, float params).
_FLOAT32: dict[tuple[int, tuple[str, ...]], Any] = {}


def float32_scalars(kernel: Any, args: tuple[Any, ...]) -> Any:
    """A twin of ``kernel`` (a Helion-generated JITFunction) for a traced graph, launched by Inductor's generated
    code from a copy of its source: its body first casts the parameters given Python floats to float32 (Triton
    types a float argument float32; Inductor's launch types it float64, which turns the kernel's arithmetic
    float64 and breaks its typing: a loop-carried float32 sum, a dot's float32 accumulator), and the helper
    modules it calls through (``helion_triton_helpers.x``) are called by their own names, which Inductor's copy
    carries (it copies the jit functions and constants a kernel reads, not the modules it imports). The
    hand-written kernels cast their float parameters themselves and call no module's helpers."""
    names = tuple(n for n, a in zip(kernel.arg_names, args, strict=False) if type(a) is float)
    key = (id(kernel), names)
    twin = _FLOAT32.get(key)
    if twin is None:
        twin = _FLOAT32[key] = _float32_twin(kernel, names)
    return twin


# The modules Inductor's generated code imports under these names, in which a kernel's copy runs.
_INDUCTOR_MODULES = frozenset({"tl", "triton", "libdevice", "triton_helpers", "tl_math", "math"})


def _float32_twin(kernel: Any, names: tuple[str, ...]) -> Any:
    import ast
    import linecache
    import re
    import types

    import triton

    namespace = dict(kernel.fn.__globals__)  # the generated module's names, without redefining its kernel
    namespace.setdefault("tl", triton.language)
    src = kernel.src  # the function's source from its ``def``

    def by_function(m: re.Match[str]) -> str:
        module, attr = m.group(1), m.group(2)
        if not isinstance(namespace.get(module), types.ModuleType) or module in _INDUCTOR_MODULES:
            return m.group(0)
        value = getattr(namespace[module], attr)
        name = getattr(getattr(value, "fn", value), "__name__", attr)  # (a copied jit function keeps its own name)
        if namespace.setdefault(name, value) is not value:
            return m.group(0)  # the name means something else here: left as it is
        return name

    src = re.sub(r"\b([A-Za-z_]\w*)\.([A-Za-z_]\w*)\b", by_function, src)
    fn = ast.parse(src).body[0]
    assert isinstance(fn, ast.FunctionDef), src[:200]
    first = fn.body[0]
    lines = src.splitlines(keepends=True)
    indent = " " * first.col_offset
    casts = [f"{indent}{n} = tl.cast({n}, tl.float32)\n" for n in names]
    name = f"{fn.name}_f32"
    lines[0] = lines[0].replace(f"def {fn.name}(", f"def {name}(", 1)
    text = "".join(lines[: first.lineno - 1] + casts + lines[first.lineno - 1:])
    filename = f"<hkernels: {name}>"  # triton.jit reads the source back through linecache
    linecache.cache[filename] = (len(text), None, text.splitlines(keepends=True), filename)
    exec(compile(text, filename, "exec"), namespace)  # the generated kernel's own source, with the casts
    return triton.jit(namespace[name])


def traced(kernel: Any, grid: Any, args: tuple[Any, ...], meta: dict[str, Any]) -> None:
    """``kernel[grid](*args, **meta)`` recorded into the graph being traced."""
    from torch.library import wrap_triton

    if any(type(a).__name__ == "TensorDescriptor" for a in args):  # (see descriptors_ok)
        raise RuntimeError(f"{getattr(kernel, '__name__', kernel)} takes a TMA descriptor, which a graph cannot "
                           "hold: its pointer variant runs there")

    wrap_triton(kernel)[grid](*args, **meta)


@contextlib.contextmanager
def interpreted() -> Iterator[None]:
    """Around a launch in Triton's interpreter: one at a time (``INTERPRET_LOCK``), and NumPy's floating-point
    warnings off. The interpreter computes every lane of a block with NumPy, masked ones too (log(0), 0·inf on
    lanes past a row's end), whose results are never stored: their warnings say nothing about the call."""
    import numpy as np

    with INTERPRET_LOCK, np.errstate(all="ignore"):
        yield


def launch(kernel: Any, grid: Any, *args: Any, **meta: Any) -> None:
    """``kernel[grid](*args, **meta)``, with Triton's per-call binding skipped after the first call for a key.
    Runtime (non-constexpr) arguments must come by position; constexprs and launch options by keyword.

    Inside a replayed plan (``hkernels/runtime/plan.py``) the compiled kernel is the one the plan recorded for
    this launch: no key is built at all."""
    if _plan.TRACING:
        traced(kernel, grid, args, meta)
        return
    if _INTERPRETED:
        with interpreted():
            kernel[grid](*args, **meta)
        return
    cursor = _plan._cursor
    if cursor.slots is not None and not cursor.recording:
        go = _plan.recall(kernel)
        if go is not None:
            go(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1, *args)
            return
    found = _launch_once(kernel, grid, args, meta)
    _plan.keep(kernel, None if found is None else direct(*found))


def _launch_once(kernel: Any, grid: Any, args: tuple[Any, ...], meta: dict[str, Any],
                 bound: bool = False) -> tuple[Any, tuple, int] | None:
    """Launch through the keyed cache (compiling on a key's first call). Returns (compiled kernel, the constexpr
    values that follow the positional arguments, device index) for launching it directly again with arguments of
    the same specialisation; None where the launch had to go through Triton's own path. ``bound``: the caller
    fixes the specialisation itself (a :class:`Bound`), so arguments the key cannot describe (tensor descriptors)
    still give the compiled kernel."""
    shape = _shape(kernel)
    if shape is None or callable(grid) or _hooks():
        kernel[grid](*args, **meta)
        return None
    n_params, constexpr_pos, runtime_names, names, defaults = shape
    key = [id(kernel), torch.cuda.current_device()]
    for i, a in enumerate(args):
        s = ((a.__class__, a) if isinstance(a, _VALUES) else _SLOW) if i in constexpr_pos else _spec(a)
        if s is _SLOW:
            compiled = kernel[grid](*args, **meta)
            if not bound or compiled is None or not hasattr(compiled, "packed_metadata") or any(
                    n in runtime_names for n in meta):
                return None
            return compiled, tuple(meta[n] if n in meta else defaults[n] for n in names[len(args):n_params]), key[1]
        key.append(s)
    for item in meta.items():
        if item[0] in runtime_names or not isinstance(item[1], _VALUES):  # not described by the key
            kernel[grid](*args, **meta)
            return None
        key.append((item, item[1].__class__))  # the type too: True == 1 == 1.0 are one dict key, not one kernel
    key_t = tuple(key)
    hit = _COMPILED.get(key_t)
    if hit is not None and hit[2] is not kernel:  # another kernel object under a reused id
        hit = None
    if hit is None:
        compiled = kernel[grid](*args, **meta)
        if compiled is None or not hasattr(compiled, "packed_metadata"):
            return None
        # The launcher takes every parameter in order (constexprs too, which it skips): the ones after the
        # positional arguments are constant under this key.
        tail = tuple(meta[n] if n in meta else defaults[n] for n in names[len(args):n_params])
        if len(_COMPILED) >= _COMPILED_MAX:
            _COMPILED.clear()
        _COMPILED[key_t] = (compiled, tail, kernel)
        return compiled, tail, key[1]
    compiled, tail, _ = hit
    g0 = grid[0]
    g1 = grid[1] if len(grid) > 1 else 1
    g2 = grid[2] if len(grid) > 2 else 1
    stream = torch._C._cuda_getCurrentRawStream(key[1])
    compiled.run(g0, g1, g2, stream, compiled.function, compiled.packed_metadata, None, None, None, *args, *tail)
    return compiled, tail, key[1]


# Launcher classes whose __call__ is (self, gridX, gridY, gridZ, stream, function, *args) and forwards to a C
# ``launch(gridX, gridY, gridZ, stream, function, cooperative, pdl, global_scratch, profile_scratch, *args)``
# (Triton 3.6's CudaLauncher): for kernels that need no scratch memory, the C function is called directly.
_DIRECT_OK: dict[type, bool] = {}


def _c_launch(run: Any) -> Any:
    cls = type(run)
    ok = _DIRECT_OK.get(cls)
    if ok is None:
        import inspect

        try:
            params = list(inspect.signature(cls.__call__).parameters)
        except (TypeError, ValueError):
            params = []
        ok = _DIRECT_OK[cls] = params == ["self", "gridX", "gridY", "gridZ", "stream", "function", "args"] and all(
            hasattr(run, a) for a in ("launch", "launch_cooperative_grid", "launch_pdl"))
    if ok and getattr(run, "global_scratch_size", 1) == 0 and getattr(run, "profile_scratch_size", 1) == 0:
        return run.launch
    return None


def direct(compiled: Any, tail: tuple, device: int, grid: tuple[int, ...] | None = None) -> Any:
    """A function launching ``compiled`` again: ``go(g0, g1, g2, *args)``, or ``go(*args)`` for a fixed ``grid``.
    Only for arguments of the specialisation it was compiled for (a plan's)."""
    stream = torch._C._cuda_getCurrentRawStream
    fn, meta = compiled.function, compiled.packed_metadata
    c = _c_launch(compiled.run)
    if c is not None:
        coop, pdl = compiled.run.launch_cooperative_grid, compiled.run.launch_pdl
        if grid is None:
            def go(g0: int, g1: int, g2: int, *args: Any) -> None:
                c(g0, g1, g2, stream(device), fn, coop, pdl, None, None, meta, None, None, None, *args, *tail)
            return go
        g0, g1, g2 = (*grid, 1, 1)[:3]

        def go_fixed(*args: Any) -> None:
            c(g0, g1, g2, stream(device), fn, coop, pdl, None, None, meta, None, None, None, *args, *tail)
        return go_fixed
    run = compiled.run
    if grid is None:
        def go_run(g0: int, g1: int, g2: int, *args: Any) -> None:
            run(g0, g1, g2, stream(device), fn, meta, None, None, None, *args, *tail)
        return go_run
    f0, f1, f2 = (*grid, 1, 1)[:3]

    def go_run_fixed(*args: Any) -> None:
        run(f0, f1, f2, stream(device), fn, meta, None, None, None, *args, *tail)
    return go_run_fixed


class Bound:
    """One launch of ``kernel`` with a fixed grid and constexprs, for one call signature (a plan's binding): call
    ``.go(*args)``. The first call compiles through :func:`launch`'s keyed path; later calls go straight to the
    compiled kernel's launcher (no key, no binding). A launch hook installed after the first call is not seen."""

    __slots__ = ("go", "grid", "kernel", "meta")

    def __init__(self, kernel: Any, grid: tuple[int, ...], **meta: Any) -> None:
        self.kernel, self.grid, self.meta = kernel, grid, meta
        self.go: Any = self._traced if _plan.TRACING else self._first

    def _traced(self, *args: Any) -> None:
        traced(self.kernel, self.grid, args, self.meta)

    def _first(self, *args: Any) -> None:
        if _INTERPRETED:
            with interpreted():
                self.kernel[self.grid](*args, **self.meta)
            return
        found = _launch_once(self.kernel, self.grid, args, self.meta, bound=True)
        if found is not None:
            self.go = direct(*found, grid=self.grid)


def bound_launcher() -> Any:
    """A Helion ``_launcher`` for one bound Helion function (one call signature): each Triton kernel it launches is
    compiled through :func:`launch`'s keyed path on its first launch, then launched directly. While a graph is
    traced: :func:`helion_launcher`, whose launches are recorded."""
    if _plan.TRACING:
        return helion_launcher
    gos: dict[int, Any] = {}  # by id (a JITFunction hashes slowly); the function's kernels outlive it

    def launcher(triton_kernel: Any, grid: tuple[int, ...], *args: Any, num_warps: int, num_stages: int,
                 **kwargs: Any) -> None:
        go = gos.get(id(triton_kernel))
        if go is not None:
            go(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1, *args)
            return
        if kwargs or _INTERPRETED:
            helion_launcher(triton_kernel, grid, *args, num_warps=num_warps, num_stages=num_stages, **kwargs)
            return
        found = _launch_once(triton_kernel, grid, args, {"num_warps": num_warps, "num_stages": num_stages})
        if found is not None:
            gos[id(triton_kernel)] = direct(*found)

    return launcher


def _hooks() -> bool:
    """A launch hook is installed (a profiler's): Triton 3.6 keeps them in HookChain objects, never None, so an
    empty chain means none; an older-style plain callable counts as one."""
    from triton import knobs

    rt = knobs.runtime
    for hook in (rt.launch_enter_hook, rt.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return True
    return False


def helion_launcher(triton_kernel: Any, grid: tuple[int, ...], *args: Any, num_warps: int, num_stages: int,
                    **kwargs: Any) -> None:
    """Helion's ``_launcher`` hook (the generated host code calls it for each kernel launch), through
    :func:`launch`; Helion's own launcher for its extra launch features (remote copies, persistent state, ...)."""
    if _plan.TRACING:
        traced(float32_scalars(triton_kernel, args), grid, args, {"num_warps": num_warps, "num_stages": num_stages,
                                                                  **kwargs})
        return
    if kwargs:
        from helion.runtime import default_launcher

        with interpreted() if _INTERPRETED else contextlib.nullcontext():
            default_launcher(triton_kernel, grid, *args, num_warps=num_warps, num_stages=num_stages, **kwargs)
        return
    launch(triton_kernel, grid, *args, num_warps=num_warps, num_stages=num_stages)
