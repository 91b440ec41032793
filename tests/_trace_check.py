"""Run as a script (``tests/test_compile.py`` does, in a process of its own): every hkernels custom op that an op's
forward and backward call, traced as torch.compile traces it, on each kernel backend, with fake CUDA tensors, so
that a CPU-only machine checks that the kernels' launches are recorded into the graph (Triton's kernel
higher-order op, which Inductor launches itself) and that nothing calls back into Python.

No GPU is used: the CUDA tensors are FakeTensors, the device's properties are an H200's, and Triton's driver is a
stand-in that names an sm90 target (Triton compiles each kernel to TTIR on the host, which is how torch finds which
arguments a kernel writes). Prints one JSON line: {"op custom_op backend": "ok" or the error}. Where a backend
declares it traces a custom op at a symbolic length (``dispatch.takes_symbolic``), the op is traced once more with
its length symbolic ("op custom_op backend symbolic"): launches recorded with no guard on the length.
"""

from __future__ import annotations

import json
import os
import re
import sys
import types
import warnings

assert not os.environ.get("TRITON_INTERPRET") and not os.environ.get("HKERNELS_INTERPRET"), "needs compiled mode"

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

ON_GPU = torch.cuda.is_available()  # (on a GPU the same check runs against the real device)
if not ON_GPU:
    _PROPS = types.SimpleNamespace(multi_processor_count=132, name="NVIDIA H200 (stand-in)",
                                   total_memory=140 * 2**30, shared_memory_per_block_optin=232448, major=9, minor=0,
                                   warp_size=32)
    torch.cuda.get_device_capability = lambda *a: (9, 0)
    torch.cuda.get_device_properties = lambda *a: _PROPS
    torch.cuda.current_device = lambda: 0

    class _Driver:
        def get_current_target(self) -> GPUTarget:
            return GPUTarget("cuda", 90, 32)

        def get_active_torch_device(self) -> torch.device:
            return torch.device("cuda", 0)

        def get_current_device(self) -> int:
            return 0

    triton.runtime.driver.set_active(_Driver())
    # Helion's kernels see an sm90 GPU as on the machine: TMA descriptors available (Helion then keys a binding by the
    # layouts a descriptor needs, which a traced call must not fix in the graph)
    import helion._compat

    helion._compat._supports_tensor_descriptor = lambda: True

from torch._functorch.aot_autograd import aot_export_joint_simple  # noqa: E402
from torch._higher_order_ops import triton_kernel_wrap  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import hkernels  # noqa: E402
from hkernels import dispatch  # noqa: E402
from hkernels.functional import _base  # noqa: E402
from hkernels.runtime import chunked as _chunked  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
import test_compile  # noqa: E402


class _Record(TorchDispatchMode):
    """The hkernels custom ops a call runs, with their arguments."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[object, tuple[object, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "hkernels":
            self.calls.append((func, args))
        return func(*args, **(kwargs or {}))


def _fake(a: object, mode: FakeTensorMode) -> object:
    if not isinstance(a, torch.Tensor):
        return a
    with mode:  # (contiguous: a copy of a fake CUDA tensor needs a CUDA build of torch)
        return torch.empty(a.shape, dtype=a.dtype, device="cuda")


# Ops whose length is their first tensor's first dim (tokens), where a weight's dim may be larger
_LENGTH_FIRST = {"grouped_matmul", "moe"}


def _symbolic_fakes(args: tuple[object, ...], every: bool = False, length: int | None = None
                    ) -> tuple[list[object], object, set[object]]:
    """Fake CUDA tensors as a graph whose length varies has them: the length (``length``, or the largest size past the
    last dim of a tensor of 2 or more dims: rows, or a sequence's tokens), wherever it occurs but in a last dim (a
    per-row statistic's included), is a symbol of a shape environment; the other sizes (heads, hidden sizes) stay
    static. Returns the fakes, the environment and the length's symbol."""
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

    env = ShapeEnv()
    mode = FakeTensorMode(shape_env=env)
    rows = sorted({d for a in args if isinstance(a, torch.Tensor) and a.dim() >= 2 for d in a.shape[:-1] if d >= 2})
    rows = rows[-1:] if length is None else [length]
    sizes = sorted({d for a in args if isinstance(a, torch.Tensor) for d in a.shape if d >= 2}) if every else rows
    symbols = {v: env.create_symintnode(env.create_symbol(v, ConstantSource(f"rows_{v}"),
                                                          dynamic_dim=DimDynamic.DYNAMIC), hint=v) for v in sizes}
    if length is not None:  # (a routed op's slots, T·k rows of 1-D tensors: k times the length's symbol)
        top = max(d for a in args if isinstance(a, torch.Tensor) for d in a.shape)
        symbols.update({c * length: symbols.get(c, c) * symbols[length] for c in range(2, top // length + 1)})
    # (a per-row statistic, whose shape is another tensor's without its last dim, e.g. attention's lse [B, H, S],
    # has the length in its last dim)
    prefixes = {tuple(a.shape[:-1]) for a in args if isinstance(a, torch.Tensor) and a.dim() >= 3}
    fakes: list[object] = []
    for a in args:
        if not isinstance(a, torch.Tensor):
            fakes.append(a)
            continue
        per_row = tuple(a.shape) in prefixes
        last = a.dim() - 1 if a.dim() >= 2 and not every and not per_row else -1
        shape = [symbols.get(d, d) if i != last else d for i, d in enumerate(a.shape)]
        with mode:
            fakes.append(torch.empty(shape, dtype=a.dtype, device="cuda"))
    return fakes, env, {symbols[v].node.expr for v in rows}


def _row_guards(env: object, rows: set[object], op: str) -> list[str]:
    """What tracing decided about the row symbols: a guard on one or a replacement of one (a specialisation), each
    a recompile when the length changes. The size classes an op declares (the length against one of its bounds:
    one graph per class, not per length) are not counted."""
    found = [f"{k} = {v}" for k, v in env.replacements.items() if k in rows]
    bounds = _SIZE_CLASSES.get(op, set())
    return found + [str(g.expr) for g in env.guards if g.expr.free_symbols & rows and not _size_class(g.expr, bounds)
                    and not _int32_class(g.expr)]


# Ops whose kernels serve any size of a last dim: matmul's contraction K (a's last dim, which is the length in the
# weight gradient aᵀ @ dz) runs a masked loop at a symbolic size, N (which sets the tile class) made a constant;
# grouped_matmul's and moe's kernels take their hidden sizes as runtime sizes, their tiles from the dtype alone.
_ANY_CONTRACTION = {"matmul", "grouped_matmul", "moe"}

# The size classes each op's host code may guard a symbolic length on: the linear loss's chunk counts.
_SIZE_CLASSES = {"fused_linear_cross_entropy": {_chunked.MIN_CHUNK * c for c in _chunked.TRACED_CLASSES}}


def _unfixed(env: object, fakes: list[object], rows: set[object]) -> list[str]:
    """With every size symbolic (``dynamic=True``): the last dims of the tensors (hidden sizes, head dims, the
    vocabulary: what the kernels' settings and Helion's bindings specialise on) that tracing left free of a constant
    (a replacement by a number or an equality guard), other than the length: code made for one value would serve
    another with no recompile."""
    import sympy

    fixed = {k for k, v in env.replacements.items() if v.is_Integer}
    fixed |= {s for g in env.guards if isinstance(g.expr, sympy.Eq) for s in g.expr.free_symbols}
    last = {a.shape[-1].node.expr for a in fakes if isinstance(a, torch.Tensor) and a.dim()
            and isinstance(a.shape[-1], torch.SymInt)}
    return sorted(str(s) for s in last if s.is_Symbol and s not in fixed | rows)


def _int32_class(expr: object) -> bool:
    """``expr`` bounds a tensor's element count by int32's largest value (or its negation): Helion indexes a tensor
    with 32-bit offsets below it, 64-bit above, so a length crossing it is one more graph (two in all)."""
    import sympy

    if isinstance(expr, sympy.Not):
        expr = expr.args[0]
    if isinstance(expr, (sympy.LessThan, sympy.StrictGreaterThan)):
        return expr.rhs == 2**31 - 1 if isinstance(expr, sympy.LessThan) else expr.lhs == 2**31 - 1 or \
            expr.rhs == 2**31 - 1
    return False


def _size_class(expr: object, bounds: set[int]) -> bool:
    """``expr`` is the length against one of ``bounds`` (s <= bound, or its negation)."""
    import sympy

    if not isinstance(expr, (sympy.LessThan, sympy.StrictLessThan, sympy.GreaterThan, sympy.StrictGreaterThan)):
        return False
    a, b = expr.lhs, expr.rhs
    number = b if a.is_Symbol else a if b.is_Symbol else None
    return number is not None and number.is_Integer and int(number) in bounds


_CHARS = int(os.environ.get("HKERNELS_TRACE_CHARS", "300"))  # of each error reported

# Inductor's generated launch types a Python float argument as float64 (torch._inductor.codegen.triton_utils
# signature_of), where Triton's own launch types it float32: each kernel recorded into a graph is compiled to TTIR
# a second time with its float arguments typed float64, as Inductor will compile it.
_AS_INDUCTOR: list[str] = []  # the problems of the kernels traced since last cleared
_generate_ttir = triton_kernel_wrap.generate_ttir


def _ttir_both_ways(kernel, kwargs, *rest):
    out = _generate_ttir(kernel, kwargs, *rest)
    mangle = triton.runtime.jit.mangle_type
    triton.runtime.jit.mangle_type = lambda arg, *a: "fp64" if isinstance(arg, float) else mangle(arg, *a)
    try:
        _generate_ttir(kernel, kwargs, *rest)
    except Exception as e:
        first = next((x for x in str(e).splitlines() if x.strip()), "")
        name = getattr(getattr(kernel, "fn", kernel), "__name__", kernel)  # (an Autotuner's)
        _AS_INDUCTOR.append(f"{name} with float64 floats, as Inductor launches it: {type(e).__name__}: {first}")
    finally:
        triton.runtime.jit.mangle_type = mangle
    return out


triton_kernel_wrap.generate_ttir = _ttir_both_ways


def _inductor_copy_problem(kernel: object) -> str | None:
    """Inductor launches a traced kernel from a copy of its source that it writes into its own module (the kernel,
    the jit functions it calls, the constants it reads, under Inductor's standard imports): None when every global
    name the copied kernels read is defined there, else what is missing."""
    import builtins
    import dis

    from torch._inductor.codegen.wrapper import user_defined_triton_kernel_transitive_closure_source_code
    from triton.runtime.jit import JITFunction

    kernel = getattr(kernel, "fn", kernel) if not isinstance(kernel, JITFunction) else kernel  # (an Autotuner's)
    source = user_defined_triton_kernel_transitive_closure_source_code(kernel)
    header = ("import triton\nimport triton.language as tl\nfrom torch._inductor.runtime import triton_helpers\n"
              "from torch._inductor.runtime.triton_helpers import libdevice, math as tl_math\n")
    import importlib.util
    import tempfile

    # (in a file, as Inductor writes it: triton.jit reads a function's source from its file)
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(header + source)
    spec = importlib.util.spec_from_file_location(f"inductor_copy_{kernel.fn.__name__}", f.name)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        return f"Inductor's copy does not define: {type(e).__name__}: {e}"
    finally:
        os.unlink(f.name)
    namespace = vars(module)
    missing = set()
    for value in list(namespace.values()):
        if isinstance(value, JITFunction) and value.fn.__globals__ is namespace:
            for inst in dis.Bytecode(value.fn):
                if inst.opname == "LOAD_GLOBAL" and inst.argval not in namespace and not hasattr(builtins, inst.argval):
                    missing.add(f"{value.fn.__name__} reads {inst.argval}")
    return f"Inductor's copy lacks globals: {sorted(missing)}" if missing else None


def _aligned_cases() -> list[tuple[str, tuple[list[torch.Tensor], list[torch.Tensor], object]]]:
    """16-bit calls of shapes the TMA paths take (aligned rows, whole tiles): in a graph they must run by pointer;
    calls of an op's other kernels; calls of one row."""
    g = torch.Generator().manual_seed(4)

    def t(*shape: int) -> torch.Tensor:
        return (torch.randn(shape, generator=g) * 0.5).to(torch.bfloat16).requires_grad_()

    q, k, v = t(1, 4, 256, 64), t(1, 2, 256, 64), t(1, 2, 256, 64)
    a, b = t(256, 128), t(128, 384)  # (three distinct sizes: with every size symbolic, three symbols)
    # a window and a logit cap: the masked kernels, whose unbounded sides stand for a distance no position reaches
    qm, km, vm = (torch.randn(shape, generator=g).requires_grad_() for shape in ((1, 4, 9, 16), (1, 2, 9, 16),
                                                                                (1, 2, 9, 16)))
    # one row (a decode step, a one-token loss): Helion binds these at two rows (hkernels/ops/_helion.py's
    # _two_rows); in a graph, the row count a symbol of the binding's own
    x1, r1, w1, b1 = t(1, 256), t(1, 256), t(256), t(256)
    logits1, target1 = t(1, 512), torch.tensor([7])
    return [
        ("rms_norm one row", ([x1, w1], [x1, w1], lambda m, *x: m.rms_norm(*x).float().sum())),
        ("add_rms_norm one row", ([x1, r1, w1], [x1, r1, w1],
                                  lambda m, *x: sum(o.float().sum() for o in m.add_rms_norm(*x)))),
        ("layer_norm one row", ([x1, w1, b1], [x1, w1, b1], lambda m, *x: m.layer_norm(*x).float().sum())),
        ("cross_entropy one row", ([logits1, target1], [logits1], lambda m, *x: m.cross_entropy(*x))),
        ("attention bf16", ([q, k, v], [q, k, v], lambda m, *x: m.attention(*x, causal=True).float().sum())),
        ("matmul bf16", ([a, b], [a, b], lambda m, *x: m.matmul(*x).float().sum())),
        ("attention masked", ([qm, km, vm], [qm, km, vm],
                              lambda m, *x: m.attention(*x, window=(12, None), softcap=5.0).float().sum())),
    ]


def main() -> None:
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

    results: dict[str, str] = {}
    only = set(filter(None, os.environ.get("HKERNELS_TRACE_OPS", "").split(",")))  # (a subset, while working)
    for op, (inputs, leaves, f) in [*((op, test_compile._op_case(op, torch.device("cpu")))
                                      for op in test_compile.EVERY_OP if not only or op in only),
                                    *(c for c in _aligned_cases() if not only or c[0] in only)]:
        record = _Record()
        with record, hkernels.use_backend("torch"):
            out = f(hkernels, *inputs)
            if leaves:
                torch.autograd.grad(out, leaves)
        seen = set()
        for func, args in record.calls:
            if func in seen:
                continue
            seen.add(func)
            for backend, symbolic in (("triton", False), ("helion", False), ("triton", True), ("helion", True),
                                      ("triton", "every"), ("helion", "every")):
                key = f"{op} {func.__name__} {backend}" + {False: "", True: " symbolic",
                                                           "every": " every size symbolic"}[symbolic]
                if (op, backend) in _base._OPAQUE_IN_GRAPHS:
                    continue  # kept opaque on purpose (see hkernels/functional/_base.py)
                name = func._schema.name.split("::")[-1]
                if symbolic and not dispatch.takes_symbolic(op.split()[0], backend, name):
                    continue  # (this backend keeps the op opaque at a symbolic length)
                if symbolic:
                    first = next(a for a in args if isinstance(a, torch.Tensor))
                    fakes, env, rows = _symbolic_fakes(args, every=symbolic == "every", length=first.shape[0]
                                                       if op.split()[0] in _LENGTH_FIRST else None)
                else:
                    mode = FakeTensorMode()
                    fakes = [_fake(a, mode) for a in args]
                fakes[-1] = backend  # every custom op takes the backend request last
                written = [i for i, a in enumerate(func._schema.arguments)
                           if a.alias_info is not None and a.alias_info.is_write]

                def traced(*tensors: torch.Tensor, func=func, fakes=fakes, written=written) -> object:
                    it = iter(tensors)
                    call = [next(it) if isinstance(a, torch.Tensor) else a for a in fakes]
                    for i in written:  # an op that writes into an argument: into a copy, returned
                        call[i] = call[i].clone()
                    out = func(*call)
                    outs = out if isinstance(out, tuple) else () if out is None else (out,)
                    return (*outs, *[call[i] for i in written])

                _AS_INDUCTOR.clear()
                _base._warned_untraceable.clear()  # (each trace reports its own failure)
                try:
                    with warnings.catch_warnings(record=True) as caught:
                        warnings.simplefilter("always")
                        gm = aot_export_joint_simple(traced, [a for a in fakes if isinstance(a, torch.Tensor)],
                                                     trace_joint=False)
                    code = gm.code
                    untraced = [str(w.message) for w in caught if "could not be traced" in str(w.message)]
                    if untraced:
                        results[key] = untraced[0]
                    elif "torch.ops.hkernels" in code.replace("torch.ops.hkernels.addmm_into", ""):
                        results[key] = "opaque: the graph calls the custom op"
                    elif symbolic and _row_guards(env, rows, op):
                        results[key] = f"a guard on the row count: {_row_guards(env, rows, op)[:3]}"
                    elif symbolic == "every" and op.split()[0] not in _ANY_CONTRACTION and _unfixed(env, fakes, rows):
                        results[key] = f"a size a kernel specialises on stays symbolic: {_unfixed(env, fakes, rows)}"
                    elif _AS_INDUCTOR:
                        results[key] = _AS_INDUCTOR[0]
                    elif "triton_kernel_wrapper_functional" not in code:
                        results[key] = "no kernel launch in the graph: " + " ".join(code.split())[:600]
                    else:
                        indices = {int(i) for i in re.findall(r"kernel_idx = (\d+)", code)}
                        problems = [p for p in (_inductor_copy_problem(kernel_side_table.get_kernel(i))
                                                for i in sorted(indices)) if p]
                        results[key] = problems[0] if problems else "ok"
                except Exception as e:  # reported, not raised: the test lists every failure at once
                    if os.environ.get("HKERNELS_TRACE_TRACEBACKS"):  # each failure's whole chain, to stderr
                        import traceback

                        print(f"===== {key}", *traceback.format_exception(e), sep="\n", file=sys.stderr)
                    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
                    results[key] = f"{type(e).__name__}: {first[:_CHARS]}"
    print("TRACE_JSON " + json.dumps(results))


if __name__ == "__main__":
    main()
