"""torch.compile(fullgraph=True) traces through every op (custom ops with fake kernels and autograd)."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

import hkernels
from hkernels import references

CALLS = {
    "rms_norm": lambda m, x, w, b: m.rms_norm(x, w),
    "layer_norm": lambda m, x, w, b: m.layer_norm(x, w, b),
    "softmax": lambda m, x, w, b: m.softmax(x * w, dim=-1),
}
CUSTOM_OPS = {
    "rms_norm": lambda x, w, b: (torch.ops.hkernels.rms_norm_fwd.default, (x, w, 1e-6, 0.0, False, "")),
    "layer_norm": lambda x, w, b: (torch.ops.hkernels.layer_norm_fwd.default, (x, w, b, 1e-5, None, "")),
    "softmax": lambda x, w, b: (torch.ops.hkernels.softmax_fwd.default, (x, None, "")),
}


def _inputs(device: torch.device):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 48, generator=g).to(device).requires_grad_()
    w = (torch.randn(48, generator=g) + 1).to(device).requires_grad_()
    b = torch.randn(48, generator=g).to(device).requires_grad_()
    return x, w, b


def _check(op: str, backend: str, compile_backend: str, device: torch.device) -> None:
    torch._dynamo.reset()
    x, w, b = _inputs(device)

    def f(x, w, b):
        return (CALLS[op](hkernels, x, w, b) * 2 + 1).sum(-1)

    compiled = torch.compile(f, fullgraph=True, backend=compile_backend)  # fullgraph: a graph break raises
    with hkernels.use_backend(backend):
        out = compiled(x, w, b)
        out.sum().backward()
    grads = [t.grad.clone() for t in (x, w, b) if t.grad is not None]

    xr, wr, br = (t.detach().clone().requires_grad_() for t in (x, w, b))
    ref = (CALLS[op](references, xr, wr, br) * 2 + 1).sum(-1)
    ref.sum().backward()
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    for got, want in zip(grads, [t.grad for t in (xr, wr, br) if t.grad is not None], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("backend", ["helion", "triton", "torch"])
@pytest.mark.parametrize("op", list(CALLS))
def test_compiled_fullgraph_matches_reference(op, backend, device):
    # aot_eager runs Dynamo and AOTAutograd (fake kernels, autograd registration) without Inductor's codegen
    _check(op, backend, "aot_eager", device)


@pytest.mark.parametrize("op", list(CALLS))
def test_compiled_with_inductor(op, device):
    _check(op, "auto", "inductor", device)


@pytest.mark.parametrize("op", list(CALLS))
def test_custom_op_registration(op, device):
    """torch.library's own checks: schema, fake kernel against the real one, autograd registration."""
    x, w, b = _inputs(device)
    custom_op, args = CUSTOM_OPS[op](x.reshape(-1, 48), w, b)
    torch.library.opcheck(custom_op, args)


# The LLM op set: (inputs maker, call). Inputs that get gradients are the floating tensors created with grad.
def _llm_inputs(op: str, device: torch.device) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(1)

    def t(*shape: int, grad: bool = True, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(shape, generator=g) * scale).to(device).requires_grad_(grad)

    target = torch.randint(0, 40, (6,), generator=g).to(device)
    target[1] = -100
    made = {
        "swiglu": [t(2, 5, 48), t(2, 5, 48)],
        "geglu": [t(2, 5, 48), t(2, 5, 48)],
        "rope": [t(1, 4, 5, 16), t(1, 2, 5, 16), torch.cos(t(5, 16, grad=False)), torch.sin(t(5, 16, grad=False))],
        "qk_norm_rope": [t(1, 4, 5, 16), t(1, 2, 5, 16), t(16, scale=0.5), t(16, scale=0.5),
                         torch.cos(t(5, 16, grad=False)), torch.sin(t(5, 16, grad=False))],
        "add_rms_norm": [t(3, 48), t(3, 48), t(48, scale=0.5)],
        "cross_entropy": [t(6, 40), target],
        "fused_linear_cross_entropy": [t(6, 16), t(40, 16, scale=0.25), target],
        "matmul": [t(2, 19, 16), t(2, 16, 12, scale=0.25), t(12)],  # (M the largest size: a length)
        "attention": [t(1, 4, 9, 16), t(1, 2, 9, 16), t(1, 2, 9, 16)],
        "attention_varlen": [t(11, 4, 16), t(11, 2, 16), t(11, 2, 16),
                             torch.tensor([0, 4, 4, 11], dtype=torch.int32, device=device)],
        "grouped_matmul": [t(9, 16), t(3, 12, 16, scale=0.25), torch.tensor([4, 0, 5], device=device)],
        "moe": [t(7, 16), t(3, 24, 16, scale=0.25), t(3, 16, 12, scale=0.25),
                torch.tensor([[0, 2], [2, 2], [1, 0], [0, 1], [2, 0], [1, 1], [0, 2]], device=device),
                torch.rand(7, 2, generator=g).to(device).requires_grad_()],
    }[op]
    return made, [x for x in made if x.requires_grad]


def _llm_sum(out) -> torch.Tensor:
    outs = out if isinstance(out, tuple) else (out,)
    return sum((o.float() * (i + 2)).sum() for i, o in enumerate(outs))  # every output feeds the loss


def _assert_same(out: torch.Tensor, grads: tuple[torch.Tensor, ...], want: torch.Tensor,
                 want_grads: tuple[torch.Tensor, ...]) -> None:
    """A compiled call's result and gradients against the eager (or reference) call's."""
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)
    for got, ref in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def _graphs(counter: Any) -> int:
    """The graphs Dynamo compiled that compute something: with ``dynamic=True`` it may also compile an empty graph
    (no operation) for a call, which is no recompile of the function."""
    return sum(any(n.op == "call_function" for n in gm.graph.nodes) for gm in counter.graphs)


LLM_OPS = ["swiglu", "geglu", "rope", "qk_norm_rope", "add_rms_norm", "cross_entropy", "fused_linear_cross_entropy",
           "matmul", "attention", "attention_varlen", "grouped_matmul", "moe"]
LLM_KWARGS = {"matmul": {"activation": "gelu_tanh"}, "attention": {"causal": True},
              "attention_varlen": {"causal": True, "window": (3, None), "softcap": 5.0}}


def _assert_unchanged(op: str, phase: str, inputs: list[torch.Tensor], before: list[torch.Tensor]) -> None:
    """No op writes into its inputs, checked after each phase (forward, backward) so that a failure says which of
    the two wrote."""
    for i, (x, x0) in enumerate(zip(inputs, before, strict=True)):
        assert torch.equal(x.detach(), x0), f"{op}: input {i} changed by the compiled {phase} call"


def _check_llm(op: str, backend: str, compile_backend: str, device: torch.device) -> None:
    torch._dynamo.reset()
    inputs, leaves = _llm_inputs(op, device)

    kwargs = LLM_KWARGS.get(op, {})

    def f(*args):
        return _llm_sum(getattr(hkernels, op)(*args, **kwargs))

    compiled = torch.compile(f, fullgraph=True, backend=compile_backend)
    before = [x.detach().clone() for x in inputs]
    with hkernels.use_backend(backend):
        out = compiled(*inputs)
        _assert_unchanged(op, "forward", inputs, before)
        grads = torch.autograd.grad(out, leaves)
        _assert_unchanged(op, "backward", inputs, before)
    ref_inputs = [x0.clone().requires_grad_(x.requires_grad) for x, x0 in zip(inputs, before, strict=True)]
    ref = _llm_sum(getattr(references, op)(*ref_inputs, **kwargs))
    ref_grads = torch.autograd.grad(ref, [x for x in ref_inputs if x.requires_grad])
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("backend", ["helion", "triton", "torch"])
@pytest.mark.parametrize("op", LLM_OPS)
def test_llm_op_compiled_fullgraph_matches_reference(op, backend, device):
    _check_llm(op, backend, "aot_eager", device)


@pytest.mark.parametrize("op", LLM_OPS)
def test_llm_op_compiled_with_inductor(op, device):
    _check_llm(op, "auto", "inductor", device)


@pytest.mark.parametrize("fused", [False, True], ids=["recompute", "fused_grad"])
@pytest.mark.parametrize("op", LLM_OPS)
def test_llm_custom_op_registration(op, fused, device):
    """torch.library's checks. The losses' fused path hands its gradient buffer to the backward, which scales it in
    place; AOTAutograd's tests that return *every* op output from a compiled graph reject an output the backward
    mutates, so those two are skipped there (the public ops never return the buffer; the fullgraph tests above
    compile that path through forward and backward)."""
    if fused and op not in ("cross_entropy", "fused_linear_cross_entropy"):
        pytest.skip("only the losses have a fused-gradient path")
    inputs, _ = _llm_inputs(op, device)
    ops = torch.ops.hkernels
    custom_op, args = {
        "swiglu": lambda a: (ops.swiglu_fwd.default, (a[0].reshape(-1, 48), a[1].reshape(-1, 48), 1.0, 1.0, "")),
        "geglu": lambda a: (ops.geglu_fwd.default, (a[0].reshape(-1, 48), a[1].reshape(-1, 48), "none", "")),
        "rope": lambda a: (ops.rope_fwd.default, (a[0], a[1], a[2][None], a[3][None], "")),
        "qk_norm_rope": lambda a: (ops.qk_norm_rope_fwd.default, (a[0], a[1], a[2], a[3], a[4][None], a[5][None],
                                                                  1e-6, "")),
        "add_rms_norm": lambda a: (ops.add_rms_norm_fwd.default, (a[0], a[1], a[2], 1e-6, 0.0, False, "")),
        "cross_entropy": lambda a: (ops.cross_entropy_fwd.default,
                                    (a[0], a[1], -100, 0.1, "mean", fused, False, 3.0, 1e-2, True, True,
                                     torch.rand(a[0].shape[1], device=a[0].device) + 0.5, "")),
        "fused_linear_cross_entropy": lambda a: (
            ops.fused_linear_cross_entropy_fwd.default,
            (a[0], a[1], a[2], None, -100, 0.0, "sum", fused, 2.0, 1e-3, True, True, None, 5, "")
        ),
        "matmul": lambda a: (ops.matmul_fwd.default, (a[0], a[1], a[2], "silu", True, "")),
        "attention": lambda a: (ops.attention_fwd.default, (a[0], a[1], a[2], True, 0.25, -1, 0, 0.0, "")),
        "attention_varlen": lambda a: (ops.attention_varlen_fwd.default,
                                       (a[0], a[1], a[2], a[3], a[3], 7, 7, True, 0.25, 3, 0, 5.0, "")),
        "grouped_matmul": lambda a: (ops.grouped_matmul_fwd.default, (a[0], a[1], a[2], "")),
        "moe": lambda a: (ops.moe_fwd.default, (a[0], a[1], a[2], a[3], a[4], True, "")),
    }[op](inputs)
    if fused:
        utils = ("test_schema", "test_autograd_registration", "test_faketensor")
        torch.library.opcheck(custom_op, args, test_utils=utils)
    else:
        torch.library.opcheck(custom_op, args)


# ------------------------------------------------------------------------------- visible to Inductor, every mode

ON_GPU = torch.cuda.is_available()
# Their torch backend reads values on the host (group sizes, sequence bounds): on torch they stay opaque.
SYNCING_TORCH = {"grouped_matmul", "moe", "attention_varlen"}
# Kept opaque on purpose: the installed Inductor fails to compile a graph of attention_varlen's Helion kernels.
OPAQUE_IN_GRAPHS = {("attention_varlen", "helion")}
EVERY_OP = ["rms_norm", "layer_norm", "softmax", *LLM_OPS, "decode_attention"]


def _op_case(op: str, device: torch.device):
    """(inputs, leaves, f) for op: f(*inputs) is a scalar of every output (forward only for decode_attention)."""
    if op in CALLS:
        x, w, b = _inputs(device)
        return [x, w, b], [x, w, b] if op == "layer_norm" else [x, w], lambda m, *a: CALLS[op](m, *a).float().sum()
    if op == "decode_attention":
        g = torch.Generator().manual_seed(2)
        q, k, v = (torch.randn(s, generator=g).to(device) for s in ((2, 4, 1, 16), (2, 2, 12, 16), (2, 2, 12, 16)))
        lengths = torch.tensor([5, 12], dtype=torch.int32, device=device)
        return [q, k, v, lengths], [], lambda m, *a: m.decode_attention(*a).float().sum()
    inputs, leaves = _llm_inputs(op, device)
    kwargs = LLM_KWARGS.get(op, {})
    return inputs, leaves, lambda m, *a: _llm_sum(getattr(m, op)(*a, **kwargs))


def _compiled_step(op: str, backend: str, device: torch.device, **options):
    """Compile op's forward (and backward) with Inductor; returns (generated code, out, grads, reference out,
    reference grads)."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    inputs, leaves, f = _op_case(op, device)
    compiled = torch.compile(lambda *a: f(hkernels, *a), fullgraph=True, **options)

    def step():
        with hkernels.use_backend(backend):
            out = compiled(*inputs)
            return out, torch.autograd.grad(out, leaves) if leaves else ()

    (out, grads), code = run_and_get_code(step)
    return "\n".join(code), out, grads, *_reference(inputs, leaves, f)


def _reference(inputs, leaves, f):
    ref_inputs = [x.detach().clone().requires_grad_(x.requires_grad) for x in inputs]
    ref = f(references, *ref_inputs)
    ref_leaves = [r for r, x in zip(ref_inputs, inputs, strict=True) if any(x is leaf for leaf in leaves)]
    return ref, torch.autograd.grad(ref, ref_leaves) if leaves else ()


@pytest.mark.parametrize(("op", "backend"), [pytest.param(op, backend, id=f"{op}-{backend}") for op in EVERY_OP
                                              for backend in ("helion", "triton", "torch", "auto")])
def test_inside_compile_nothing_calls_back(op, backend, device):
    """Inside a graph compiled by Inductor an op's kernels are launched by Inductor's generated code (or its math
    is Inductor's own): the graph holds no hkernels custom op to call back into Python, forward or backward."""
    if not ON_GPU and backend != "torch":
        pytest.skip("interpreted kernels cannot be traced into a graph: GPU only")
    code, out, grads, ref, ref_grads = _compiled_step(op, backend, device)
    opaque = (backend == "torch" and op in SYNCING_TORCH) or (op, backend) in OPAQUE_IN_GRAPHS
    # (the linear loss's in-place accumulation of the head's gradient, hkernels::addmm_into, is a helper of the
    # graph, one cuBLAS call per chunk: not an op's body called back)
    code = code.replace("torch.ops.hkernels.addmm_into", "")
    assert ("torch.ops.hkernels." in code) == opaque, (
        f"{op} on {backend}: {'an opaque call' if opaque else 'no opaque call'} expected in the compiled code")
    if ON_GPU and backend in ("helion", "triton"):
        assert "triton" in code
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("op", EVERY_OP)
def test_inside_compile_reduce_overhead(op, device):
    """mode="reduce-overhead": the compiled forward and backward are captured in CUDA graphs and replayed."""
    torch._dynamo.reset()
    inputs, leaves, f = _op_case(op, device)
    compiled = torch.compile(lambda *a: f(hkernels, *a), mode="reduce-overhead", fullgraph=True)
    for _ in range(3):  # warm-up, record, replay
        out = compiled(*inputs)
        grads = torch.autograd.grad(out, leaves) if leaves else ()
    ref, ref_grads = _reference(inputs, leaves, f)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mode", ["mark_dynamic", "dynamic"])
@pytest.mark.parametrize("op", ["rms_norm", "add_rms_norm", "swiglu", "cross_entropy"])
def test_inside_compile_one_graph_for_every_length(op, mode, device):
    """A dynamic row count (torch._dynamo.maybe_mark_dynamic on the token dim, or dynamic=True) compiles at the
    first length only, forward and backward, and each length matches the reference."""
    from torch._dynamo.testing import CompileCounterWithBackend

    if not ON_GPU:
        pytest.skip("Inductor's CPU code for the kernels' graph: GPU only")  # (torch traced on CPU: see above)
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    n = 64
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(n, generator=g) + 1).to(device).requires_grad_()

    def f(m, x, r, t):
        if op == "rms_norm":
            return m.rms_norm(x, w).float().sum()
        if op == "add_rms_norm":
            y, s = m.add_rms_norm(x, r, w)
            return y.float().sum() + 2 * s.float().sum()
        if op == "swiglu":
            return m.swiglu(x, r).float().sum()
        return m.cross_entropy(x, t)

    compiled = torch.compile(lambda x, r, t: f(hkernels, x, r, t), backend=counter, fullgraph=True,
                             dynamic=True if mode == "dynamic" else None)
    for rows in (17, 40, 129):
        x, r = (torch.randn(rows, n, generator=g).to(device).requires_grad_() for _ in range(2))
        t = torch.randint(0, n, (rows,), generator=g).to(device)
        if mode == "mark_dynamic":
            for a in (x, r, t):
                torch._dynamo.maybe_mark_dynamic(a, 0)
        wrt = (x, r) if op == "swiglu" else (x,) if op == "cross_entropy" else (x, w)
        out = compiled(x, r, t)
        grads = torch.autograd.grad(out, wrt)
        ref = f(references, x, r, t)
        _assert_same(out, grads, ref, torch.autograd.grad(ref, wrt))
    assert _graphs(counter) == 1, f"{op}: {_graphs(counter)} graphs for three lengths"


# (op, backend) pairs whose forward and backward trace at a symbolic length (their modules' SYMBOLIC)
SYMBOLIC_TRACED = [
    *((op, "triton") for op in ("rms_norm", "add_rms_norm", "layer_norm", "softmax", "swiglu", "geglu", "rope",
                                "qk_norm_rope", "cross_entropy", "fused_linear_cross_entropy", "attention", "matmul",
                                "attention_varlen", "grouped_matmul", "moe")),
    *((op, "helion") for op in ("rms_norm", "add_rms_norm", "layer_norm", "softmax", "swiglu", "geglu", "rope",
                                "qk_norm_rope", "cross_entropy", "fused_linear_cross_entropy", "attention", "matmul",
                                "grouped_matmul", "moe")),
]


@pytest.mark.parametrize(("tokens", "h", "rows", "parts"), [
    (7, 2048, None, 1), (4096, 2048, None, 1), (4097, 2048, None, 4), (16384, 2048, None, 4), (20000, 2048, None, 16),
    (70000, 2048, None, 16), (3000, 64, None, 1), (3000, 2048, 1024, 4), (9000, 2048, 1000, 17),
    (70000, 2048, 2048, 32)])
def test_linear_loss_chunks_at_a_symbolic_length_follow_its_size_class(tokens, h, rows, parts):
    """The linear loss's chunk loop at a symbolic T (Llama 3's vocabulary): as many equal parts as a concrete T at
    the top of T's size class makes (with the default chunk size or the caller's ``rows``), decided by a guard on
    the class alone (T against a constant), so one graph serves every length of the class; the parts cover T, none
    empty."""
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

    from hkernels.runtime import chunked as _chunked

    env = ShapeEnv()
    t = env.create_symintnode(env.create_symbol(tokens, ConstantSource("t"), dynamic_dim=DimDynamic.DYNAMIC),
                              hint=tokens)
    bounds = _chunked.chunk_bounds(t, h, 128256, rows)
    assert len(bounds) == parts
    top = next((c * _chunked.MIN_CHUNK for c in _chunked.TRACED_CLASSES if tokens <= c * _chunked.MIN_CHUNK), None)
    if top is not None:
        assert parts == len(_chunked.chunk_bounds(top, h, 128256, rows))
    hint = [int(v.node.hint) if isinstance(v, torch.SymInt) else v for bound in bounds for v in bound]
    assert hint[0] == 0 and hint[-1] == tokens and hint == sorted(hint)
    assert all(hint[i] == hint[i + 1] for i in range(1, len(hint) - 1, 2)), hint  # adjacent parts
    assert all(hint[i] < hint[i + 1] for i in range(0, len(hint), 2)), hint  # none empty
    # the guards tracing made: T against a constant (a size class), none pinning T itself
    for g in env.guards:
        assert g.expr.is_Relational and not g.expr.is_Equality, g.expr
        assert all(a.is_Symbol or a.is_Integer for a in g.expr.args), g.expr
    assert not env.replacements


# A fake CUDA tensor cannot be viewed or sliced in a CPU-only build of torch: what the trace check cannot reach.
_CPU_LIMIT = "PyTorch is not linked with support for cuda devices"


@pytest.mark.skipif(ON_GPU, reason="on a GPU the Inductor tests above compile and run the same graphs")
def test_every_kernel_launch_is_traced_into_the_graph():
    """Without a GPU: every custom op the ops' forward and backward call, traced as torch.compile traces it, on the
    triton and helion backends, with fake CUDA tensors (tests/_trace_check.py, in a process of its own: the
    kernels must be compiled-mode Triton, not interpreted). Each must become kernel launches recorded in the graph
    (Triton's kernel higher-order op), with no call back into the custom op, and write none of its inputs."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k not in ("HKERNELS_INTERPRET", "TRITON_INTERPRET")}
    script = Path(__file__).with_name("_trace_check.py")
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=900)
    line = next((x for x in done.stdout.splitlines() if x.startswith("TRACE_JSON ")), None)
    assert line is not None, done.stderr[-3000:]
    results = json.loads(line.removeprefix("TRACE_JSON "))
    failed = {k: v for k, v in results.items() if v != "ok" and _CPU_LIMIT not in v}
    assert not failed, "\n".join(f"{k}: {v}" for k, v in failed.items())
    ok = [k for k, v in results.items() if v == "ok"]
    # what a CPU can check: most of them (the rest slice a fake CUDA tensor)
    assert len(ok) >= 40, f"only {len(ok)} of {len(results)} traced here"
    for op in ("rms_norm", "softmax", "swiglu", "rope", "add_rms_norm", "cross_entropy", "matmul", "attention",
               "attention bf16", "matmul bf16", "attention masked"):  # (bf16: shapes whose eager calls take TMA
        # descriptors; masked: a window and a cap)
        for backend in ("triton", "helion"):
            assert any(k.startswith(f"{op} ") and k.endswith(f" {backend}") for k in ok), (op, backend)
    # one row: Helion's binding at two rows serves it in a graph too
    for op, fns in (("rms_norm", ("fwd", "bwd")), ("add_rms_norm", ("fwd", "bwd")), ("layer_norm", ("fwd", "bwd")),
                    ("cross_entropy", ("fwd",))):
        for fn in fns:
            for backend in ("triton", "helion"):
                assert f"{op} one row {op}_{fn}.default {backend}" in ok, (op, fn, backend)
    # at a symbolic length (a graph whose length varies): traced with no guard on the row count where declared
    for op, backend in SYMBOLIC_TRACED:
        assert any(k.startswith(f"{op} ") and k.endswith(f" {backend} symbolic") for k in ok), (op, backend)
    for op in ("rms_norm", "add_rms_norm", "layer_norm", "softmax", "swiglu", "geglu", "rope",
               "qk_norm_rope", "attention", "attention masked"):  # (a CPU reaches)
        for fn in ("fwd", "bwd"):
            for backend in ("triton", "helion"):
                # with the length symbolic, and with every size symbolic (dynamic=True: the sizes the kernels are
                # specialised to become constants of the graph)
                name = f"{op} {op.split()[0]}_{fn}.default {backend}"
                assert f"{name} symbolic" in ok, (op, fn, backend)
                assert f"{name} every size symbolic" in ok, (op, fn, backend)
    for name in ("grouped_matmul grouped_matmul_fwd.default triton", "grouped_matmul grouped_matmul_bwd.default triton",
                 "moe moe_fwd.default triton", "moe moe_bwd.default triton", "matmul matmul_fwd.default helion",
                 "grouped_matmul grouped_matmul_fwd.default helion", "grouped_matmul grouped_matmul_bwd.default helion",
                 "moe moe_fwd.default helion", "moe moe_bwd.default helion",
                 "attention_varlen attention_varlen_bwd.default triton",
                 "decode_attention decode_attention_fwd.default triton",  # (the cache length, for decoding)
                 "decode_attention decode_attention_fwd.default helion"):
        assert f"{name} symbolic" in ok and f"{name} every size symbolic" in ok, name


def _torch_backend_called_back(op: str, dtype: torch.dtype, device: torch.device) -> list[str]:
    """The hkernels ops left in the AOTAutograd graphs (forward and backward) of ``op`` on the torch backend,
    compiled with every size dynamic and called at two lengths, each checked against the eager call."""
    from torch._functorch.aot_autograd import aot_module_simplified

    torch._dynamo.reset()
    graphs: list[torch.fx.GraphModule] = []

    def keep(gm: torch.fx.GraphModule, _inputs: list[Any]) -> Any:
        graphs.append(gm)
        return gm.forward

    def capture(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        return aot_module_simplified(gm, example_inputs, fw_compiler=keep, bw_compiler=keep)

    fn = getattr(hkernels, op)
    compiled = torch.compile(lambda *a: fn(*a).float().sum(), backend=capture, dynamic=True)
    g = torch.Generator().manual_seed(5)

    def t(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(shape, generator=g) * scale).to(device, dtype).requires_grad_()

    for n in (24, 40):
        if op == "grouped_matmul":
            args = [t(n, 16), t(3, 32, 16, scale=0.25), torch.tensor([n // 3, 0, n - n // 3], device=device)]
        else:
            args = [t(n, 16), t(3, 32, 16, scale=0.25), t(3, 16, 16, scale=0.25),
                    torch.randint(0, 3, (n, 2), generator=g).to(device), t(n, 2)]
        leaves = [a for a in args if a.requires_grad]
        with hkernels.use_backend("torch"):
            out = compiled(*args)
            grads = torch.autograd.grad(out, leaves)
            want = fn(*args).float().sum()
            want_grads = torch.autograd.grad(want, leaves)
        torch.testing.assert_close(out, want, rtol=2e-2, atol=2e-2)
        for a, b in zip(grads, want_grads, strict=True):
            torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)
    assert graphs
    return [str(n.target) for gm in graphs for n in gm.graph.nodes
            if n.op == "call_function" and str(n.target).startswith("hkernels.")]


@pytest.mark.parametrize("op", ["grouped_matmul", "moe"])
def test_the_torch_backend_traces_where_grouped_mm_takes_the_call(op, device):
    """The torch backend of grouped_matmul and moe inside a compiled graph whose length varies: on bfloat16 operands
    ``torch._grouped_mm`` takes (no host read), their math is in the graph, no hkernels op is called back; on
    float32 its loop over the groups reads their sizes on the host, so the op stays opaque."""
    assert _torch_backend_called_back(op, torch.bfloat16, device) == []
    assert _torch_backend_called_back(op, torch.float32, device)


def test_a_body_that_cannot_be_traced_runs_opaque_with_one_warning(monkeypatch, device):
    """Where tracing an op's body into the graph fails, the op is called back instead (one warning), and the
    result is still right: what the failed trace recorded is dead code."""
    from hkernels.functional import rms_norm as module
    from hkernels.runtime import plan as _plan

    real = module.rms_norm_fwd

    def fails_when_traced(x, weight, eps, offset=0.0):
        _ = x * 2  # recorded into the graph, then dead
        if _plan.TRACING:
            raise RuntimeError("not traceable here")
        return real(x, weight, eps, offset)

    monkeypatch.setattr(module, "rms_norm_fwd", fails_when_traced)
    torch._dynamo.reset()
    x, w, _ = _inputs(device)
    compiled = torch.compile(lambda x, w: hkernels.rms_norm(x, w).sum(), fullgraph=True, backend="aot_eager")
    with hkernels.use_backend("torch"), pytest.warns(hkernels.HKernelsFallbackWarning, match="not traceable here"):
        out = compiled(x, w)
    torch.testing.assert_close(out, references.rms_norm(x.detach(), w.detach()).sum(), rtol=1e-5, atol=1e-5)


def test_the_request_is_recorded_into_the_graph(device):
    """The backend asked for when a call is traced is a constant of the graph torch.compile caches: a graph compiled
    under one request is never served from the cache for another."""
    seen: list[str] = []

    def capture(gm, example_inputs):
        seen.append(gm.code)
        return gm

    x, w, _ = _inputs(device)
    for request in ("torch", "triton"):
        torch._dynamo.reset()
        with hkernels.use_backend(request):
            torch.compile(lambda x, w: hkernels.rms_norm(x, w), fullgraph=True, backend=capture)(x.detach(), w.detach())
        assert f"'{request}'" in seen[-1], seen[-1]


@pytest.mark.parametrize("backend", ["helion", "triton"])
@pytest.mark.parametrize("op", ["rms_norm", "add_rms_norm", "swiglu"])
def test_inside_compile_each_length_is_its_own_graph(op, backend, device):
    """Static shapes (dynamic=False): a second row count of the same width recompiles, and every length's graph
    launches its kernels for its own rows (a binding made for one length must not serve another)."""
    torch._dynamo.reset()
    n = 64
    g = torch.Generator().manual_seed(4)
    w = (torch.randn(n, generator=g) + 1).to(device)

    def f(m, x, r):
        if op == "rms_norm":
            return m.rms_norm(x, w)
        if op == "add_rms_norm":
            return torch.cat(m.add_rms_norm(x, r, w))
        return m.swiglu(x, r)

    compiled = torch.compile(lambda x, r: f(hkernels, x, r), fullgraph=True, dynamic=False)
    for rows in (32, 256, 32):
        x, r = (torch.randn(rows, n, generator=g).to(device) for _ in range(2))
        with hkernels.use_backend(backend):
            out = compiled(x, r)
        torch.testing.assert_close(out, f(references, x, r), rtol=1e-4, atol=1e-4)


def test_a_traced_helion_launch_covers_the_rows_of_its_call(monkeypatch):
    """While a graph is traced, Helion's kernels are bound on stand-ins of the traced sizes, which Helion takes
    as static: every traced shape gets its own binding, so a launch's grid covers its own rows (Helion's binding
    cache buckets row counts: one binding for 64 rows would otherwise serve 512 and launch for 64)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from hkernels.ops import rms_norm as helion_rms_norm
    from hkernels.runtime import launch as _launch
    from hkernels.runtime import plan as _plan

    grids: list[tuple[int, ...]] = []
    monkeypatch.setattr(_launch, "traced", lambda kernel, grid, args, meta: grids.append(tuple(grid)))
    monkeypatch.setattr(_launch, "float32_scalars", lambda kernel, args: kernel)  # (interpreted kernels: no twin)
    fake = FakeTensorMode()
    for rows in (64, 512, 64):
        with fake:
            x, w = torch.empty(rows, 128, dtype=torch.float32), torch.empty(128, dtype=torch.float32)
        with _plan.tracing():
            helion_rms_norm.rms_norm_fwd(x, w, 1e-6)
    assert grids[1][0] == 8 * grids[0][0] and grids[2] == grids[0], grids


def test_a_traced_helion_launch_at_a_symbolic_length_is_bound_once(monkeypatch):
    """At a symbolic row count Helion binds code that serves every length, once per shape pattern: a second graph
    (its own shape environment, its own symbols) reuses it, its launch's grid follows that graph's length, and
    nothing is guarded on the length but whether a tensor spans past 32-bit offsets. Where the values of the sizes
    the code specialises on are not known to match (forgotten, or others), it is bound again."""
    from torch._dynamo.source import ConstantSource
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

    from hkernels.ops import _helion
    from hkernels.ops import rms_norm as helion_rms_norm
    from hkernels.runtime import launch as _launch
    from hkernels.runtime import plan as _plan

    grids: list[tuple[object, ...]] = []
    monkeypatch.setattr(_launch, "traced", lambda kernel, grid, args, meta: grids.append(tuple(grid)))
    monkeypatch.setattr(_launch, "float32_scalars", lambda kernel, args: kernel)  # (interpreted kernels: no twin)
    bindings = []
    real = _helion._symbolic_stand_ins
    monkeypatch.setattr(_helion, "_symbolic_stand_ins", lambda *a: bindings.append(1) or real(*a))
    symbols = []

    def forget_the_specialisations() -> None:
        _helion._specialised.clear()

    def other_values() -> None:  # as if the code were specialised on x's row length, to another value
        for key in list(_helion._specialised):
            _helion._specialised[key] = (((0, True, 1),), (129,))

    for hint, before in ((64, None), (512, None), (96, forget_the_specialisations), (128, other_values)):
        if before is not None:
            before()
        env = ShapeEnv()
        rows = env.create_symintnode(env.create_symbol(hint, ConstantSource(f"rows{hint}"),
                                                       dynamic_dim=DimDynamic.DYNAMIC), hint=hint)
        with FakeTensorMode(shape_env=env):
            x, w = torch.empty(rows, 128, dtype=torch.float32), torch.empty(128, dtype=torch.float32)
            with _plan.tracing():
                helion_rms_norm.rms_norm_fwd(x, w, 1e-6)
        symbols.append(rows.node.expr)
        guards = [str(g.expr) for g in env.guards if g.expr.free_symbols]
        assert all("2147483647" in g for g in guards), guards
        assert not env.replacements, env.replacements
    # once for the first two graphs; again where the record of what it specialises on was forgotten, or differs
    assert len(bindings) == 3, f"{len(bindings)} bindings"
    assert [g[0].node.expr.free_symbols for g in grids] == [{s} for s in symbols], grids


@pytest.mark.parametrize("op,n", [("rms_norm", 96), ("rms_norm", 8200), ("layer_norm", 96), ("add_rms_norm", 96)])
def test_a_persistent_helion_backward_with_programs_past_the_rows(op, n, monkeypatch, device):
    """At a symbolic length the norms' persistent Helion backwards launch a constant count of programs (the dw
    partial's rows then do not follow the length): programs past the last row loop zero times and write zero
    partials. Here the eager calls take that grid too (5 rows over 4 or more programs): every gradient as with the
    grid that fits the rows."""
    from hkernels.ops import _helion

    def as_traced(m, n_, block_n, device_, per_sm=4):
        most = max(1, _helion._programs(device_, per_sm) // -(-n_ // block_n))
        return -(-m // most), most

    g = torch.Generator().manual_seed(7)
    x, r, w = (torch.randn(s, generator=g).to(device) for s in ((5, n), (5, n), (n,)))

    def grads() -> list[torch.Tensor]:
        leaves = [t.clone().requires_grad_() for t in (x, r, w)]
        with hkernels.use_backend("helion"):
            if op == "add_rms_norm":
                y, s = hkernels.add_rms_norm(leaves[0], leaves[1], leaves[2])
                out = (y * y).sum() + (s * torch.linspace(-1, 1, n, device=device)).sum()
            else:
                fn = hkernels.layer_norm if op == "layer_norm" else hkernels.rms_norm
                out = (fn(leaves[0], leaves[2]) ** 2).sum()
                leaves.pop(1)
            return list(torch.autograd.grad(out, leaves))

    fitted = grads()
    hkernels.dispatch.forget()
    def persistent_as_traced(m, device_, per_sm=2):
        most = _helion._programs(device_, per_sm)
        return -(-m // most), most

    monkeypatch.setattr(_helion, "persistent", persistent_as_traced)
    monkeypatch.setattr(_helion, "row_groups", as_traced)
    assert _helion.persistent(5, device)[1] * _helion.persistent(5, device)[0] > 5  # (a program past the rows)
    for got, want in zip(grads(), fitted, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_auto_inside_compile_follows_the_compiled_table(device, monkeypatch, tmp_path):
    """Under auto a compiled graph takes Inductor's own math where the table's ``compiled:<op>`` buckets measured
    it faster inside torch.compile (rows ≤ 8 here), and hkernels' kernel elsewhere."""
    from torch._dynamo.backends.common import aot_autograd

    from hkernels import configs

    monkeypatch.setenv("HKERNELS_CACHE_DIR", str(tmp_path))
    arch = configs.cuda_arch(device) if device.type == "cuda" else "interpret"
    (tmp_path / "auto").mkdir()
    (tmp_path / "auto" / f"{arch}.json").write_text(
        '{"compiled:rms_norm": [{"max_rows": 8, "max_n": null, "backend": "torch", "measured": "rows=8: i"},'
        ' {"max_rows": null, "max_n": null, "backend": "kernel", "measured": "rows=64: k"}]}')
    configs.reload()
    try:
        w = torch.randn(16, device=device)
        for rows, inductor in ((4, True), (64, False)):
            graphs: list[str] = []

            def capture(gm, example_inputs, graphs=graphs):
                graphs.append(gm.code)
                return gm

            torch._dynamo.reset()
            compiled = torch.compile(lambda x: hkernels.rms_norm(x, w), fullgraph=True,
                                     backend=aot_autograd(fw_compiler=capture))
            x = torch.randn(rows, 16, device=device)
            torch.testing.assert_close(compiled(x), references.rms_norm(x, w), rtol=1e-4, atol=1e-4)
            kernel = "torch.ops.hkernels" in graphs[0] or "triton_kernel_wrapper" in graphs[0]
            assert kernel != inductor, (rows, graphs[0])
    finally:
        monkeypatch.undo()
        configs.reload()



def _lengthed(op: str, n: int, g: torch.Generator, device: torch.device) -> tuple[list[torch.Tensor], dict]:
    """Inputs of ``op`` with ``n`` tokens (rows, sequence positions or packed tokens), the rest fixed."""
    def t(*shape: int, grad: bool = True, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(shape, generator=g) * scale).to(device).requires_grad_(grad)

    w = lambda: t(48, scale=0.5)
    made: dict[str, Any] = {
        "rms_norm": lambda: [t(n, 48), w()],
        "layer_norm": lambda: [t(n, 48), w(), w()],
        "softmax": lambda: [t(n, 48)],
        "add_rms_norm": lambda: [t(n, 48), t(n, 48), w()],
        "swiglu": lambda: [t(n, 48), t(n, 48)],
        "geglu": lambda: [t(n, 48), t(n, 48)],
        "rope": lambda: [t(1, 4, n, 16), t(1, 2, n, 16), torch.cos(t(n, 16, grad=False)),
                         torch.sin(t(n, 16, grad=False))],
        "qk_norm_rope": lambda: [t(1, 4, n, 16), t(1, 2, n, 16), t(16, scale=0.5), t(16, scale=0.5),
                                 torch.cos(t(n, 16, grad=False)), torch.sin(t(n, 16, grad=False))],
        "cross_entropy": lambda: [t(n, 40), torch.randint(0, 40, (n,), generator=g).to(device)],
        "fused_linear_cross_entropy": lambda: [t(n, 16), t(40, 16, scale=0.25),
                                               torch.randint(0, 40, (n,), generator=g).to(device)],
        "matmul": lambda: [t(n, 16), t(16, 12, scale=0.25), t(12)],
        "attention": lambda: [t(1, 4, n, 16), t(1, 2, n, 16), t(1, 2, n, 16)],
        "attention_varlen": lambda: [t(n, 4, 16), t(n, 2, 16), t(n, 2, 16),
                                     torch.tensor([0, n // 3, n], dtype=torch.int32, device=device)],
        "grouped_matmul": lambda: [t(n, 16), t(3, 12, 16, scale=0.25),
                                   torch.tensor([n // 3, 0, n - n // 3], device=device)],
        "moe": lambda: [t(n, 16), t(3, 24, 16, scale=0.25), t(3, 16, 12, scale=0.25),
                        torch.randint(0, 3, (n, 2), generator=g).to(device),
                        torch.rand(n, 2, generator=g).to(device).requires_grad_()],
    }
    kwargs = {"matmul": {"activation": "silu"}, "attention": {"causal": True},
              "attention_varlen": {"causal": True}}.get(op, {})
    return made[op](), kwargs


LENGTHS = (7, 12, 19, 33, 50)


def _same_as_eager_at(compiled: Any, op: str, lengths: tuple[int, ...], seed: int, device: torch.device) -> None:
    """``compiled`` (``_llm_sum`` of hkernels' ``op``) called at each length in turn: its result and gradients as
    the eager call's (taken before the next call, which may replay into the same CUDA-graph memory)."""
    fn = getattr(hkernels, op)
    g = torch.Generator().manual_seed(seed)
    for n in lengths:
        inputs, kwargs = _lengthed(op, n, g, device)
        leaves = [x for x in inputs if x.requires_grad]
        out = compiled(*inputs, **kwargs)
        grads = torch.autograd.grad(out, leaves)
        want = _llm_sum(fn(*inputs, **kwargs))
        _assert_same(out, grads, want, torch.autograd.grad(want, leaves))


# On a CPU the kernel backends' custom ops stay opaque in a graph (interpreted kernels are not traced): Triton's
# stands for both there; on a GPU each kernel backend is traced.
_FIVE_LENGTHS = [
    pytest.param(op, backend, id=f"{op}-{backend}")
    for op in ["rms_norm", "layer_norm", "softmax", *LLM_OPS]
    for backend in (["helion", "triton", "torch"] if ON_GPU else ["triton", "torch"])
]


@pytest.mark.parametrize(("op", "backend"), _FIVE_LENGTHS)
def test_compiled_at_five_lengths_compiles_twice(op, backend, device):
    """One compiled function (torch.compile's default dynamic=None, aot_eager) called at five lengths: a graph for
    the first, one with the length symbolic from the second on, and no more (a loop over the length's chunks or a
    size read on the host would recompile at every length); each length as the eager call gives it, forward and
    backward."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    fn = getattr(hkernels, op)
    compiled = torch.compile(lambda *a, **k: _llm_sum(fn(*a, **k)), backend=counter)
    with hkernels.use_backend(backend):
        _same_as_eager_at(compiled, op, LENGTHS, 4, device)
    assert counter.frame_count <= 2, f"{op} on {backend}: {counter.frame_count} graphs for {len(LENGTHS)} lengths"


@pytest.mark.skipif(not ON_GPU, reason="Inductor launching the traced kernels: GPU only")
@pytest.mark.parametrize("backend", ["helion", "triton"])
@pytest.mark.parametrize("op", ["rms_norm", "add_rms_norm", "layer_norm", "cross_entropy"])
def test_one_row_traced_into_inductors_graph(op, backend, device):
    """One row (a decode step's norm, a one-token loss) compiled with Inductor: the kernels traced into the graph
    (Helion's bound at two rows, the row count read as it runs), nothing called back, forward and backward as the
    eager call gives them, twice."""
    import warnings

    torch._dynamo.reset()
    fn = getattr(hkernels, op)
    compiled = torch.compile(lambda *a, **k: _llm_sum(fn(*a, **k)), fullgraph=True)
    with hkernels.use_backend(backend), warnings.catch_warnings():
        warnings.simplefilter("error", hkernels.HKernelsFallbackWarning)
        _same_as_eager_at(compiled, op, (1, 1), 5, device)


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs and Inductor's autotuning: GPU only")
@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune-no-cudagraphs"])
@pytest.mark.parametrize(("op", "backend"), SYMBOLIC_TRACED, ids=lambda v: str(v))
def test_compile_modes_with_the_length_varying(op, backend, mode, device):
    """torch.compile's other modes with the length varying: ``reduce-overhead`` over a bucketed set of lengths, each
    bucket's CUDA graphs recorded once and replayed when the length comes back; ``max-autotune-no-cudagraphs`` over
    five lengths. Two graphs (the first length, then the length symbolic), each call as the eager one gives it,
    forward and backward."""
    from torch._inductor.compile_fx import compile_fx

    torch._dynamo.reset()
    options = torch._inductor.list_mode_options(mode)
    graphs: list[Any] = []

    def inductor(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        graphs.append(gm)
        return compile_fx(gm, example_inputs, config_patches=options)

    fn = getattr(hkernels, op)
    compiled = torch.compile(lambda *a, **k: _llm_sum(fn(*a, **k)), backend=inductor)
    lengths = (16, 32, 16, 64, 32, 64, 16) if mode == "reduce-overhead" else LENGTHS
    with hkernels.use_backend(backend):
        _same_as_eager_at(compiled, op, lengths, 12, device)
    computing = sum(any(n.op == "call_function" for n in gm.graph.nodes) for gm in graphs)
    assert computing == 2, f"{op} under {mode}: {computing} graphs for the lengths {lengths}"


def _watch_dispatch(monkeypatch: Any) -> tuple[list[bool], list[str]]:
    """(watching, called): while ``watching[0]`` is set, each backend function ``hkernels.dispatch.run`` is asked to
    run (a call back into hkernels' Python) is appended to ``called``."""
    watching: list[bool] = [False]
    called: list[str] = []
    real = hkernels.dispatch.run

    def spy(op_: str, fn_: str, *args: Any) -> Any:
        if watching[0]:
            called.append(fn_)
        return real(op_, fn_, *args)

    monkeypatch.setattr(hkernels.dispatch, "run", spy)
    return watching, called


@pytest.mark.skipif(not ON_GPU, reason="Inductor launching the traced kernels: GPU only (the trace itself is checked "
                    "on a CPU by test_every_kernel_launch_is_traced_into_the_graph)")
@pytest.mark.parametrize("dynamic", [None, True, "mark_dynamic"], ids=["automatic", "dynamic", "mark_dynamic"])
@pytest.mark.parametrize(("op", "backend"),
                         [*SYMBOLIC_TRACED, *dict.fromkeys((op, "auto") for op, _ in SYMBOLIC_TRACED)],
                         ids=lambda v: str(v))
def test_symbolic_length_runs_traced_kernels(op, backend, dynamic, device, monkeypatch):
    """Inside torch.compile (Inductor), one function called at five lengths (automatic dynamic shapes,
    ``dynamic=True``, or the length's dims marked dynamic): two graphs with automatic dynamic shapes, one
    otherwise, none after the second length; from the third length on the kernels run from the graph at the new
    length, with no call back into hkernels' Python (an opaque op would call its body); each length as the eager
    call gives it."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    fn = getattr(hkernels, op)
    marked = dynamic == "mark_dynamic"
    compiled = torch.compile(lambda *a, **k: _llm_sum(fn(*a, **k)), backend=counter,
                             dynamic=None if marked else dynamic)
    watching, called = _watch_dispatch(monkeypatch)
    g = torch.Generator().manual_seed(8)
    graphs = []
    with hkernels.use_backend(backend):
        for i, n in enumerate(LENGTHS):
            inputs, kwargs = _lengthed(op, n, g, device)
            if marked:  # every dim of the length's size (no other size of these inputs equals a length)
                for x in (*inputs, *(v for v in kwargs.values() if isinstance(v, torch.Tensor))):
                    for d, size in enumerate(x.shape):
                        if size == n:
                            torch._dynamo.maybe_mark_dynamic(x, d)
            leaves = [x for x in inputs if x.requires_grad]
            watching[0] = i >= 2
            out = compiled(*inputs, **kwargs)
            grads = torch.autograd.grad(out, leaves)
            watching[0] = False
            assert not called, f"{op} at {n} tokens called back into Python: {called}"
            want = _llm_sum(fn(*inputs, **kwargs))
            _assert_same(out, grads, want, torch.autograd.grad(want, leaves))
            graphs.append(_graphs(counter))
    # automatic: a static graph for the first length, a symbolic one from the second; dynamic=True and marked
    # dims: symbolic from the first
    assert graphs[-1] == graphs[1] == (2 if dynamic is None else 1), f"{op}: graphs after each length: {graphs}"


@pytest.mark.parametrize("backend", ["helion", "triton", "torch"] if ON_GPU else ["triton", "torch"])
def test_multimodal_rope_at_five_lengths_traces_once_symbolic(backend, device, monkeypatch):
    """rope with mrope_section (three streams' tables) in one compiled function at five lengths (Inductor on a GPU,
    aot_eager on a CPU): a graph for the first length, one with the length symbolic from the second, no more; on a
    GPU nothing calls back into hkernels' Python from the third length on; forward and backward as eager's."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor" if ON_GPU else "aot_eager")
    section = [2, 3, 3]
    compiled = torch.compile(lambda q, k, c, s: _llm_sum(hkernels.rope(q, k, c, s, mrope_section=section)),
                             backend=counter)
    watching, called = _watch_dispatch(monkeypatch)
    g = torch.Generator().manual_seed(11)
    with hkernels.use_backend(backend):
        for i, n in enumerate(LENGTHS):
            q, k = (torch.randn(1, h, n, 16, generator=g).to(device).requires_grad_() for h in (4, 2))
            angles = torch.randn(3, 1, n, 16, generator=g).to(device)
            cos, sin = angles.cos(), angles.sin()
            watching[0] = ON_GPU and i >= 2
            out = compiled(q, k, cos, sin)
            grads = torch.autograd.grad(out, (q, k))
            watching[0] = False
            assert not called, f"multimodal rope at {n} tokens called back into Python: {called}"
            want = _llm_sum(hkernels.rope(q, k, cos, sin, mrope_section=section))
            _assert_same(out, grads, want, torch.autograd.grad(want, (q, k)))
    assert _graphs(counter) == 2, f"{_graphs(counter)} graphs for five lengths"
