"""Running Helion kernels with shipped configs: never autotune at call time.

Configs live beside the code as data, in ``hkernels/configs/<arch>/<op>.json``: for each kernel a list of buckets
``{"max_n": N or null, "config": {...}}`` (optionally ``"min_n"``, ``"dtypes"``), the first bucket that covers the
row length wins; buckets written by ``python -m hkernels.tune`` in the user cache come first (see
``hkernels/configs``). The arch is ``sm<major><minor>`` of the input's GPU (``sm90`` when no table exists for it)
and ``interpret`` in interpret mode, where large blocks make the interpreter fast.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import re
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import helion
import torch

from hkernels import configs
from hkernels.runtime import interpret as _interpret
from hkernels.runtime import plan as _plan
from hkernels.runtime.device import num_sms
from hkernels.runtime.interpret import interpreting
from hkernels.runtime.launch import bound_launcher, helion_launcher, interpreted

_interpret.prepare_helion()  # interpret mode: Helion's generated code mended for Triton's interpreter


def arch_of(device: torch.device) -> str:
    if device.type != "cuda":
        return "interpret" if interpreting() else configs.DEFAULT_ARCH
    return configs.cuda_arch(device)


def _bucket(arch: str, kernel: str, n: int, dtype: torch.dtype) -> dict[str, Any]:
    buckets = configs.helion_table(arch).get(kernel)
    if not buckets:
        raise KeyError(f"hkernels: no shipped Helion config for kernel {kernel!r} ({arch})")
    name = str(dtype).removeprefix("torch.")
    for bucket in buckets:
        if ((bucket["max_n"] is None or n <= bucket["max_n"]) and n >= bucket.get("min_n", 0)
                and name in bucket.get("dtypes", [name])):
            return bucket
    raise KeyError(f"hkernels: no shipped Helion config for kernel {kernel!r} at N={n}, {name} ({arch})")


@functools.lru_cache(maxsize=256)
def _config(arch: str, kernel: str, n: int, dtype: torch.dtype) -> helion.Config:
    return helion.Config(**_bucket(arch, kernel, n, dtype)["config"])


def config_for(kernel: str, n: int, device: torch.device, dtype: torch.dtype = torch.bfloat16) -> helion.Config:
    """The shipped config of ``kernel`` for rows of ``n`` elements of ``dtype`` on ``device``.

    A bucket may name ``dtypes`` it is for: pipelined configs that fit shared memory for 16-bit rows may not for
    float32 ones (twice the bytes per stage: rms_norm's backward at N = 8192 would ask more than sm90 has).
    A symbolic ``n`` (a graph traced with every size dynamic) becomes a constant of the graph: configs are by it.
    """
    return _config(arch_of(device), kernel, int(n), dtype)


def programs_per_sm(kernel: str, n: int, device: torch.device, dtype: torch.dtype) -> int:
    """For persistent kernels: programs per multiprocessor, a host-side launch setting kept beside the config."""
    return int(_bucket(arch_of(device), kernel, int(n), dtype).get("programs_per_sm", 2))


def _fit(config: helion.Config, default: helion.Config) -> helion.Config:
    # A shipped config is written for the general case; a degenerate input (N = 1 has no reduction loop) has
    # fewer tunables of some kinds, so list-valued entries are cut to the lengths this binding expects. Never
    # padded: a config too short for its kernel is a mistake Helion must report.
    fitted = {}
    for key, value in config.config.items():
        want = default.config.get(key, [])
        if isinstance(value, list) and isinstance(want, list):
            value = value[: len(want)]
            if not value:
                continue
        fitted[key] = value
    return helion.Config(**fitted)


# Compiled kernels by exact call signature: (kernel, n, which tensor arguments are one object, then per argument
# its dtype, device, sizes and strides, or its type and value). Finer than Helion's own binding key (which buckets
# sizes), so a hit is always the compiled function Helion's bind would have given; it skips bind's per-call work
# (locks, key building, guards: more host time than a decode-size kernel; see bench/results/h200/README.md). A call
# traced with symbolic sizes is keyed by their pattern instead (``_symbolic_key``), with the values of the sizes its
# binding specialises on checked apart (``_specialised``).
# Bounded: cleared when full.
_compiled: dict[tuple[Any, ...], Any] = {}
_COMPILED_MAX = 4096


def _arg_key(a: Any) -> Any:
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.device, a.shape, a.stride())
    return (type(a), a)


def _aliases(args: tuple[Any, ...]) -> tuple[int, ...] | None:
    """Which tensor arguments are one object (per tensor, the position of its first occurrence), or None when all
    are distinct: Helion binds an aliased call apart (its code may read and write through one pointer), so the
    key must tell them apart too: the linear-CE chunk loop runs the cross-entropy kernel in place (grad is
    logits), and a cross_entropy call with a separate gradient buffer of the same shapes must not reuse that
    compiled function (it would write the gradient into the caller's logits and leave its own unwritten)."""
    ids = [id(a) for a in args if isinstance(a, torch.Tensor)]
    if len(set(ids)) == len(ids):
        return None
    return tuple(ids.index(i) for i in ids)


# While the tune command records (see record()): every Helion launch of the op it runs, as (kernel, args, n).
_recording: list[tuple[Any, tuple[Any, ...], int]] | None = None


@contextlib.contextmanager
def record() -> Iterator[list[tuple[Any, tuple[Any, ...], int]]]:
    """Collect the (kernel, args, n) of every Helion launch in the scope: which kernels an op runs, with what."""
    global _recording
    previous, _recording = _recording, []
    plans, _plan.enabled = _plan.enabled, False  # every launch decided afresh, so that every one is seen
    try:
        yield _recording
    finally:
        _recording = previous
        _plan.enabled = plans


def run(kernel: helion.Kernel, args: tuple[Any, ...], n: int, device: torch.device,
        rows: tuple[int | tuple[int, int], ...] = ()) -> Any:
    """Compile ``kernel`` for ``args`` with its shipped config (once per binding) and run it. Inside a replayed
    plan (``hkernels/runtime/plan.py``) the compiled function is the one the plan recorded: no key is built.
    ``rows``: see :func:`compiled`."""
    fn = _plan.recall(kernel)
    if fn is None:
        if _recording is not None:
            _recording.append((kernel, args, n))
        fn = compiled(kernel, args, n, device, rows=rows)
        _plan.keep(kernel, fn)
    if device.type == "cuda":  # Triton's per-launch binding skipped after the first launch of a specialisation
        return fn(*args, _launcher=helion_launcher)
    with interpreted():  # interpret mode: one interpreted kernel at a time (see hkernels/runtime/launch.py)
        return fn(*args)


# Helion's compiler writes to torch.fx's process-wide node metadata while it traces and lowers a kernel, so two
# threads compiling at once can corrupt each other's (a KeyError: 'location' inside Helion). Binding and compiling
# take this lock; a call whose kernel is compiled never does.
COMPILING = threading.RLock()


def compiled(kernel: helion.Kernel, args: tuple[Any, ...], n: int, device: torch.device,
             block_sizes: tuple[int, ...] | None = None, rows: tuple[int | tuple[int, int], ...] = ()) -> Any:
    """``kernel`` compiled for ``args`` with its shipped config (its ``block_sizes`` replaced where given: a shape
    the shipped blocks do not suit): Helion's generated host function.

    ``rows``: where the row count is, each the position of an argument (its first dim) or (position, dim). A call
    of one row is bound with those dims at two rows and runs the code of every row count (see :func:`_two_rows`)."""
    # (a traced graph's function is bound on stand-ins with pointer indexing: never an eager call's)
    n = int(n)  # (a static dim: a graph with every size symbolic takes it as a constant)
    symbolic = _plan.TRACING > 0 and _has_symbols(args)
    key: tuple[Any, ...] | None = (kernel, n, block_sizes, _plan.TRACING > 0, _aliases(args),
                                   *(_symbolic_key(args) if symbolic else [_arg_key(a) for a in args]))
    try:
        fn = _compiled.get(key)
    except TypeError:  # an unhashable argument: no fast path for this call
        key, fn = None, None
    if fn is not None and symbolic:  # the code serves this graph too where the sizes it specialises on are the
        # same: made constants of this graph; else (or its record forgotten) it is bound anew
        found = _specialised.get(key)
        if found is None or _specialize(args, found[0]) != found[1]:
            fn = None
    if fn is None:
        dtype = next(a.dtype for a in args if isinstance(a, torch.Tensor))
        config = config_for(kernel.name, n, device, dtype)
        if block_sizes is not None:
            config = helion.Config(**{**config.config, "block_sizes": list(block_sizes)})
        if _plan.TRACING:
            config = _by_pointer(config)
        # Bound on detached views: Helion traces sizes back to a source, and a leaf's ``.grad`` of the same shape can
        # be the one it finds (hl.specialize then rejects it as not an input's size). While a graph is traced the
        # arguments are the tracer's tensors, which Helion cannot bind: it binds stand-ins of their sizes.
        # The tracer's modes are set aside meanwhile: Helion's own tracing must not be recorded into the graph.
        tracing = _plan.TRACING
        # (a kernel Helion has bound in this process binds another row count cheaply, reusing the compiled code of
        # its size class: the disk serves a kernel's first signatures in a process)
        disk = None if tracing or getattr(kernel, "_bound_kernels", None) else _code_key(kernel, config, args, device)
        fn = _code_load(disk) if disk is not None else None
        if fn is None:
            one_row = _one_row(args, rows)  # (a one-row graph may be symbolic in another size: a cache length)
            with COMPILING, _outside_modes() if tracing else contextlib.nullcontext():
                if symbolic or (one_row and tracing):  # (a length that varies, or one row: code for every count)
                    bound = kernel._bind_isolated(_symbolic_stand_ins(args, rows if one_row else ()))
                    if symbolic:
                        specs = _specialised_by(bound)
                        values = _specialize(args, specs)
                        if key is not None:  # (before the function is kept: a hit always finds it)
                            _specialised[key] = (specs, values)
                elif one_row:
                    bound = kernel.bind(_two_rows(args, rows))
                elif tracing:  # (one stand-in per tensor: an argument given twice is bound as one, as it runs)
                    made: dict[int, Any] = {}
                    stand_ins = tuple(made[id(a)] if id(a) in made else made.setdefault(id(a), _stand_in(a))
                                      for a in args)
                    # Bound apart from Helion's shared bindings: Helion takes a fake tensor's sizes as static, so
                    # this binding's code holds these exact sizes, while its binding cache buckets sizes (a binding
                    # made for 1024 rows would serve 8192 rows and write only the first 1024). The exact-signature
                    # key above keeps one binding per traced shape. (``_bind_isolated``: helion 1.5's binding
                    # outside its cache, which it makes itself for a call torch.compile captures.)
                    bound = kernel._bind_isolated(stand_ins)
                else:
                    bound = kernel.bind(tuple(_detached(a) for a in args))
                per_bound = bound.__dict__.setdefault("_hkernels_compiled", {})
                fn = per_bound.get(config)
                if fn is None:
                    fn = bound.compile_config(_fit(config, bound.config_spec.default_config()), allow_print=False)
                    per_bound[config] = fn
                    if disk is not None:  # (written where the code was generated, not for every new row count)
                        _code_store(disk, fn)
        if key is not None:
            if len(_compiled) >= _COMPILED_MAX:
                _compiled.clear()
                _specialised.clear()
                if symbolic:
                    _specialised[key] = (specs, values)
            _compiled[key] = fn
    return fn


# Helion's generated code on disk, for the next process: a call signature's first call there loads the host function
# and its Triton kernels from a file instead of binding the kernel (Helion traces and type-checks it) and generating
# the code, which takes a good part of a second per kernel; Triton's own cache then has the compiled kernels. The key
# holds everything the code follows from: the kernels' sources (every file of this package), the versions of Helion,
# PyTorch and Triton, the GPU arch, the kernel's settings and config, and the call signature as ``compiled`` keys it
# (exact sizes: a row count first seen in a later process binds there, cheaply when Helion's own cache holds its
# size class). Off with ``HKERNELS_CODE_CACHE=0``; in ``<cache dir>/helion-code`` (``hkernels.configs.cache_dir``),
# at most _CODE_FILES_MAX files.
def _sources() -> str:
    """A digest of this package's sources as this process imported them (read once, at import: a file edited
    while the process runs must not give its old code the new sources' key), and of Helion's, PyTorch's and
    Triton's versions."""
    try:
        import hashlib
        from importlib import metadata

        import triton

        digest = hashlib.sha256()
        for path in sorted(Path(__file__).parent.glob("*.py")):
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
        digest.update(f"{metadata.version('helion')} {torch.__version__} {triton.__version__}".encode())
        return digest.hexdigest()
    except Exception:  # (a source or version that cannot be read: no disk cache in this process)
        return ""


_SOURCES = _sources()


def _code_key(kernel: helion.Kernel, config: helion.Config, args: tuple[Any, ...], device: torch.device
              ) -> str | None:
    if os.environ.get("HKERNELS_CODE_CACHE", "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    if not _SOURCES:
        return None
    try:
        # the kernel's settings (an index_dtype twin shares the kernel's name), less the autotuner's (a random seed
        # per process; a function)
        settings = sorted((k, repr(v)) for k, v in kernel.settings.to_dict().items()
                          if not k.startswith("autotune") and " at 0x" not in repr(v))
        signature = repr((kernel.name, kernel.fn.__module__, settings, sorted(config.config.items()),
                          arch_of(device), _aliases(args), [_arg_key(a) for a in args], _SOURCES))
    except Exception:  # an argument or setting that cannot be keyed: no disk cache for this call
        return None
    import hashlib

    return hashlib.sha256(signature.encode()).hexdigest()[:40]


def _code_path(key: str) -> Path:
    return configs.cache_dir() / "helion-code" / key[:2] / f"{key}.py"


def _code_load(key: str) -> Any:
    """The host function stored under ``key``, or None."""
    path = _code_path(key)
    try:
        text = path.read_text()
    except OSError:
        return None
    first = text.split("\n", 1)[0]
    if not first.startswith(_CODE_MARK):
        return None
    name = first[len(_CODE_MARK):].strip()
    try:
        spec = importlib.util.spec_from_file_location(f"hkernels_helion_code_{key}", path)
        module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
        spec.loader.exec_module(module)  # type: ignore[union-attr]
        return getattr(module, name)
    except Exception:  # a damaged or foreign file: generate the code again (and overwrite it)
        return None


def _code_store(key: str, fn: Any) -> None:
    """Write ``fn``'s module (Helion's generated code) under ``key``; a failure to write only costs the next process
    the binding."""
    try:
        root = configs.cache_dir() / "helion-code"
        if sum(1 for _ in root.glob("*/*.py")) >= _CODE_FILES_MAX if root.is_dir() else False:
            return
        text = Path(fn.__code__.co_filename).read_text()
        path = _code_path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(f".{uuid.uuid4().hex}.tmp")
        try:
            temporary.write_text(f"{_CODE_MARK}{fn.__name__}\n{text}")
            os.replace(temporary, path)  # (whole or not at all: another process may be reading it)
        finally:
            temporary.unlink(missing_ok=True)
    except Exception:
        pass


_CODE_MARK = "# hkernels: Helion's generated code; host function "
_CODE_FILES_MAX = 4096  # files of a few kB each; past this, nothing more is written


def _by_pointer(config: helion.Config) -> helion.Config:
    """``config`` with every tensor read and written by pointer: a graph cannot hold a launch that takes TMA
    descriptors (torch's analysis of which arguments a kernel writes does not see stores through one)."""
    indexing = config.config.get("indexing")
    if indexing is None:
        return config
    pointer = ["pointer" if i == "tensor_descriptor" else i for i in indexing] if isinstance(indexing, list) else (
        "pointer" if indexing == "tensor_descriptor" else indexing)
    # (the host-descriptor setting exists only beside descriptor indexing)
    rest = {k: v for k, v in config.config.items() if k not in ("indexing", "host_tensor_descriptors")}
    return helion.Config(**rest, indexing=pointer)


def _outside_modes() -> Any:
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes()


def _has_symbols(args: tuple[Any, ...]) -> bool:
    return any(isinstance(v, torch.SymInt) for a in args if isinstance(a, torch.Tensor)
               for v in (*a.shape, *a.stride())) or any(isinstance(a, torch.SymInt) for a in args)


def _symbolic_stand_ins(args: tuple[Any, ...], rows: tuple[int | tuple[int, int], ...] = ()) -> tuple[Any, ...]:
    """Stand-ins of a traced call whose sizes are symbolic, for Helion to bind code that serves every size they take:
    each symbolic size or stride (one symbol per distinct expression, at least 2, as a graph's symbolic length is)
    a free symbol of a shape environment of its own, static sizes as they are, a SymInt argument its value; the
    row dims of ``rows`` (a call of one row; see :func:`compiled`) one more symbol, its hint 2. Nothing
    Helion decides while it binds reaches the graph's guards, except one decision made here in the graph's own
    terms: whether each tensor has more elements than a 32-bit offset reaches (Helion then indexes it with 64-bit
    offsets), a guard on the length that makes a graph crossing it a second one."""
    from torch._dynamo.source import ConstantSource
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

    env = ShapeEnv()
    mode = FakeTensorMode(shape_env=env)
    made: dict[Any, Any] = {}

    def size(v: Any) -> Any:
        if not isinstance(v, torch.SymInt):
            return v
        expr = v.node.expr
        if expr not in made:
            hint = max(2, int(v.node.hint))
            symbol = env.create_symbol(hint, ConstantSource(f"hkernels_size{len(made)}"),
                                       dynamic_dim=DimDynamic.DYNAMIC)
            made[expr] = env.create_symintnode(symbol, hint=hint)
        return made[expr]

    row: list[Any] = []
    dims = _row_dims(rows)

    def sizes(a: torch.Tensor, i: int) -> list[Any]:
        shape = [size(v) for v in a.shape]
        if i in dims:
            if not row:
                row.append(env.create_symintnode(env.create_symbol(2, ConstantSource("hkernels_rows"),
                                                                   dynamic_dim=DimDynamic.DYNAMIC), hint=2))
            shape[dims[i]] = row[0]
        return shape

    out: list[Any] = []
    tensors: dict[int, Any] = {}  # (an argument given twice is one stand-in, bound as it runs)
    for i, a in enumerate(args):
        if isinstance(a, torch.SymInt):
            out.append(int(a.node.hint))
        elif isinstance(a, torch.Tensor):
            if id(a) not in tensors:
                bool(a.numel() > 2**31 - 1)  # (the guard: Helion's choice of offset width, where the graph sees it)
                with mode:
                    tensors[id(a)] = torch.empty_strided(sizes(a, i), [size(v) for v in a.stride()],
                                                         dtype=a.dtype, device=a.device)
            out.append(tensors[id(a)])
        else:
            out.append(a)
    return tuple(out)


def _symbolic_key(args: tuple[Any, ...]) -> list[Any]:
    """What a binding on :func:`_symbolic_stand_ins` follows from: per tensor its dtype, device, sizes and strides
    with each symbolic one the index of its expression among those of the call (so that the same sizes give the
    same key in every graph, whatever its symbols are named), and whether it spans past 32-bit offsets (a guard,
    as there); a SymInt argument as a symbol (Helion binds an int as one); anything else as itself."""
    seen: dict[Any, int] = {}

    def dim(v: Any) -> Any:
        return ("s", seen.setdefault(v.node.expr, len(seen))) if isinstance(v, torch.SymInt) else v

    key: list[Any] = []
    for a in args:
        if isinstance(a, torch.Tensor):
            key.append((a.dtype, a.device, tuple(dim(v) for v in a.shape), tuple(dim(v) for v in a.stride()),
                        bool(a.numel() > 2**31 - 1)))
        else:
            key.append(dim(a) if isinstance(a, torch.SymInt) else _arg_key(a))
    return key


# Per symbolic key (see compiled): the sizes and strides its binding specialises on, as (argument, size?, dim), and
# their values there.
_specialised: dict[tuple[Any, ...], tuple[tuple[tuple[int, bool, int], ...], tuple[int, ...]]] = {}


def _specialised_by(bound: Any) -> tuple[tuple[int, bool, int], ...]:
    """The sizes and strides the kernel specialises on (``hl.specialize``: a hidden size, a head dim), as (argument,
    size?, dim). Only those: what else Helion keys a binding by (the layouts a TMA descriptor needs) does not
    concern the pointer code a graph runs, and reading it would fix the length."""
    from torch._dynamo.source import LocalSource, TensorProperty, TensorPropertySource

    env = bound.env
    position = {name: i for i, name in enumerate(bound.kernel.signature.parameters)}
    sources = [env.shape_env.var_to_sources[v][0] for v in env.specialized_vars if env.shape_env.var_to_sources.get(v)]
    found = []
    for source in (*sources, *env.specialized_strides):
        if not (isinstance(source, TensorPropertySource) and isinstance(source.base, LocalSource)
                and source.base.local_name in position and source.idx is not None):
            raise RuntimeError(f"{bound.kernel.name}: a specialisation hkernels cannot map to an argument ({source})")
        found.append((position[source.base.local_name], source.prop == TensorProperty.SIZE, source.idx))
    return tuple(found)


def _specialize(args: tuple[Any, ...], specs: tuple[tuple[int, bool, int], ...]) -> tuple[int, ...]:
    """The values of the sizes and strides of ``specs``, each made a constant of the graph where it is symbolic there
    (``dynamic=True`` makes every size so): a guard, so that another value is another graph, never this binding's
    code."""
    return tuple(int(args[i].size(d) if size else args[i].stride(d)) for i, size, d in specs)


def _row_dims(rows: tuple[int | tuple[int, int], ...]) -> dict[int, int]:
    """``rows`` (see :func:`compiled`) as {argument position: dim}."""
    return dict((r, 0) if isinstance(r, int) else r for r in rows)


def _one_row(args: tuple[Any, ...], rows: tuple[int | tuple[int, int], ...]) -> bool:
    """Whether the row count of the arguments (``rows``: see :func:`compiled`) is one."""
    dims = _row_dims(rows)
    return bool(dims) and all(type(args[i].shape[d]) is int and args[i].shape[d] == 1
                              for i, d in dims.items() if isinstance(args[i], torch.Tensor))


def _two_rows(args: tuple[Any, ...], rows: tuple[int | tuple[int, int], ...]) -> tuple[Any, ...]:
    """Arguments to bind a call of one row on: those at ``rows`` (see :func:`compiled`) with two rows (strides kept;
    never read), the rest detached. Helion 1.5.0 specialises a dim of size 1 to a broadcast and then drops the row
    mask of a tile over it: stores of every lane of a row block go to row 0 (masked lanes too), and a sum over the
    tile's rows counts row 0 once per row of the tile. Code bound at two rows reads the row count at run time and
    serves one row as it serves any other count (one binding for every count, and no padding copy per call)."""
    dims = _row_dims(rows)
    made: dict[int, Any] = {}  # (an argument given twice is one stand-in, bound as it runs)
    out = []
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor) and i in dims:
            if id(a) not in made:
                shape = list(a.shape)
                shape[dims[i]] = 2
                made[id(a)] = torch.empty_strided(shape, a.stride(), dtype=a.dtype, device=a.device)
            a = made[id(a)]
        out.append(_detached(a))
    return tuple(out)


def _detached(a: Any) -> Any:
    return a.detach() if isinstance(a, torch.Tensor) else a


_stand_ins: Any = None  # the FakeTensorMode of the stand-ins (made on first use)


def _stand_in(a: Any) -> Any:
    """A tensor of a's sizes, strides, dtype and device, with no storage (a fake tensor of a mode of its own, which
    Helion binds as it binds an outer tracer's)."""
    global _stand_ins
    if not isinstance(a, torch.Tensor):
        return a
    if _stand_ins is None:
        from torch._subclasses.fake_tensor import FakeTensorMode

        _stand_ins = FakeTensorMode()
    with _stand_ins:
        # (static sizes: a call with symbolic ones binds on _symbolic_stand_ins)
        return torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device=a.device)


def bind(kernel: helion.Kernel, args: tuple[Any, ...], n: int, device: torch.device,
         block_sizes: tuple[int, ...] | None = None, rows: tuple[int | tuple[int, int], ...] = ()) -> tuple[Any, Any]:
    """``kernel`` for arguments of this signature (a plan's binding): (Helion's generated host function, a launcher
    for it that goes straight to each compiled Triton kernel after its first launch); call ``fn(*args,
    _launcher=launcher)``. In interpret mode the launcher runs each kernel in the interpreter, one at a time.
    ``rows``: see :func:`compiled`."""
    if _recording is not None:
        _recording.append((kernel, args, n))
    fn = compiled(kernel, args, n, device, block_sizes, rows)
    if _plan.TRACING or not replayable(fn):
        return fn, bound_launcher()
    # one replay per call signature (the compiled function serves a whole size class, a record one signature),
    # kept here: a caller that binds on every call still records once
    try:
        key = (fn, _aliases(args), *[_arg_key(a) for a in args])
        found = _replays.get(key)
    except TypeError:  # an unhashable argument
        return fn, bound_launcher()
    if found is None:
        if len(_replays) >= _COMPILED_MAX:
            _replays.clear()
        found = _replays[key] = replaying(fn)
    return found, bound_launcher()


_replays: dict[tuple[Any, ...], Any] = {}


# A bound Helion function replayed. Helion's generated host function computes, on every call, sizes, strides, grids
# and allocations that for one call signature come out the same each time. Its first call here is recorded (each
# launch's kernel, grid and arguments: which is an input, a new allocation or a constant, and what it returns), and
# later calls run a Python function written from that record: allocate, launch, return. Only for host
# code made of size and stride reads, integer arithmetic, ``torch.empty`` allocations, launches and a return (an
# initialised allocation, or any other step, would be skipped by a replay); anything a record cannot say keeps the
# host function.
_HOST_LINE = re.compile(
    r"\s*(#.*|"  # a comment
    r"[\w, ]+ = \w+\.size\(\d*\)|\w+ = \w+\.stride\(\d+\)|"  # sizes and strides
    r"\w+ = (?!.*\w\()[\w\s+\-*/%()]+|"  # integer arithmetic (no calls)
    r"\w+ = torch\.empty\(\[[\w\s,+\-*/()]*\], dtype=[\w.]+, device=\w+\.device\)|"  # an allocation
    r"_launcher\(.*\)|return .*)?"
)
_REPLAYABLE: dict[Any, bool] = {}


def replayable(fn: Any) -> bool:
    """``fn``'s host code is what :func:`replaying` may replay (see above)."""
    found = _REPLAYABLE.get(fn)
    if found is None:
        try:
            import inspect

            lines = inspect.getsource(fn).splitlines()[1:]  # (after the def line)
            found = any("_launcher(" in line for line in lines) and all(_HOST_LINE.fullmatch(line) for line in lines)
        except Exception:  # (no source to read)
            found = False
        if len(_REPLAYABLE) >= _COMPILED_MAX:
            _REPLAYABLE.clear()
        _REPLAYABLE[fn] = found
    return found


def replaying(fn: Any) -> Any:
    """``fn`` (a replayable host function), called as it is: its first call runs it and records it, later calls
    replay the record (see above)."""
    built: list[Any] = []

    def call(*args: Any, _launcher: Any) -> Any:
        if built:
            return built[0](*args, _launcher=_launcher)
        seen: list[tuple[Any, tuple[int, ...], tuple[Any, ...], dict[str, Any]]] = []

        def recording(kernel: Any, grid: tuple[int, ...], *launch_args: Any, **meta: Any) -> None:
            seen.append((kernel, tuple(grid), launch_args, meta))
            _launcher(kernel, grid, *launch_args, **meta)

        out = fn(*args, _launcher=recording)
        try:
            built.append(_replay_of(seen, args, out))
        except ValueError:  # something a record cannot say: the host function runs every call
            built.append(fn)
        return out

    return call


def _replay_of(seen: list[tuple[Any, ...]], args: tuple[Any, ...], out: Any) -> Any:
    """The replay function of a recorded call (raises ValueError where the record cannot describe it)."""
    names: dict[str, Any] = {"empty": torch.empty}
    body: list[str] = []
    made: list[torch.Tensor] = []  # (alive while this runs: their ids stay theirs)

    def where(a: Any, returned: bool = False) -> str:
        if not isinstance(a, torch.Tensor):
            if returned and a is not None:
                raise ValueError("a returned value that is not a tensor")
            names[f"c{len(names)}"] = a
            return f"c{len(names) - 1}"
        for i, x in enumerate(args):
            if a is x:
                return f"args[{i}]"
        for k, m in enumerate(made):
            if a is m:
                return f"n{k}"
        storage = a.untyped_storage().data_ptr()
        if any(isinstance(t, torch.Tensor) and storage == t.untyped_storage().data_ptr() for t in (*args, *made)):
            raise ValueError("a view of an input or of an allocation")  # (a call's views may lie otherwise)
        if not a.is_contiguous():
            raise ValueError("an allocation that is not contiguous")
        k = len(made)
        made.append(a)
        names[f"s{k}"], names[f"d{k}"], names[f"e{k}"] = tuple(a.shape), a.dtype, a.device
        body.insert(k, f"    n{k} = empty(s{k}, dtype=d{k}, device=e{k})")
        return f"n{k}"

    launches = []
    for j, (kernel, grid, launch_args, meta) in enumerate(seen):
        if set(meta) - {"num_warps", "num_stages"}:
            raise ValueError("a launch option a replay does not pass on")
        names[f"k{j}"], names[f"g{j}"] = kernel, grid
        parts = [where(a) for a in launch_args] + [f"{key}={int(value)}" for key, value in meta.items()]
        launches.append(f"    _launcher(k{j}, g{j}, {', '.join(parts)})")
    returns = (f"({''.join(where(o, True) + ', ' for o in out)})" if type(out) is tuple else where(out, True))
    source = "\n".join(["def replay(*args, _launcher):", *body, *launches, f"    return {returns}", ""])
    exec(compile(source, "<hkernels: a Helion call replayed>", "exec"), names)
    return names["replay"]


def like(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An empty tensor of ``dtype``: the argument a kernel whose result's dtype is not its input's reads it from
    (host code only; never launched with). While a graph is traced, the tracer's own (dead code there)."""
    if _plan.TRACING:
        return torch.empty(0, dtype=dtype, device=device)
    return _like(dtype, device)


@functools.cache
def _like(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty(0, dtype=dtype, device=device)


def forget() -> None:
    """Drop every config and compiled kernel chosen so far (the tables changed): ``configs.reload`` does it."""
    configs.reload()


def _programs(device: torch.device, per_sm: int) -> int:
    if device.type != "cuda":
        return 4  # interpret mode: a few programs, enough to exercise the persistent loop
    return per_sm * num_sms(device)


def persistent(m: int, device: torch.device, per_sm: int = 2) -> tuple[int, int]:
    """(rows each program walks, programs) for a persistent grid over m rows with about ``per_sm`` programs per
    multiprocessor. For a symbolic row count (a compiled graph's varying length) the full count of programs, each
    walking a share of the length: a program past the rows loops zero times and writes a zero partial, and the
    partial's rows are a constant (no guard on m)."""
    most = _programs(device, per_sm)
    if type(m) is not int:
        return -(-m // most), most
    rows = -(-m // max(1, min(m, most)))
    return rows, -(-m // rows)


def row_groups(m: int, n: int, block_n: int, device: torch.device, per_sm: int = 4) -> tuple[int, int]:
    """(rows per group, groups) for a grid of (row groups × column blocks of ``block_n``) filling the GPU; for a
    symbolic row count, a constant count of groups, as :func:`persistent`."""
    most = max(1, _programs(device, per_sm) // -(-n // block_n))
    if type(m) is not int:
        return -(-m // most), most
    rows = -(-m // max(1, min(m, most)))
    return rows, -(-m // rows)
