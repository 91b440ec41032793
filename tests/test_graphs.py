"""CUDA graphs, the second answer to host time: every op, forward and forward+backward, captures in
``torch.cuda.graph`` and replays with the results of the eager call; and runs under
``torch.compile(mode="reduce-overhead")`` (CUDA-graph trees) with the eager results. GPU only."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import hkernels
from tests.conftest import ON_GPU

pytestmark = pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")

Tensor = torch.Tensor


def _t(g: torch.Generator, *shape: int, scale: float = 1.0) -> Tensor:
    return torch.randn(shape, generator=g) * scale


# Per op: (inputs drawn from a generator: tensors that get gradients first, then the rest; how to call).
MAKERS: dict[str, tuple[Callable[[torch.Generator], tuple[list[Tensor], list[Tensor]]], Callable[..., Any]]] = {
    "rms_norm": (lambda g: ([_t(g, 2, 19, 512), _t(g, 512) + 1], []), lambda x, w: hkernels.rms_norm(x, w)),
    "layer_norm": (lambda g: ([_t(g, 37, 512), _t(g, 512) + 1, _t(g, 512)], []),
                   lambda x, w, b: hkernels.layer_norm(x, w, b)),
    "softmax": (lambda g: ([_t(g, 37, 1000, scale=3.0)], []), lambda x: hkernels.softmax(x)),
    "add_rms_norm": (lambda g: ([_t(g, 2, 19, 512), _t(g, 2, 19, 512), _t(g, 512) + 1], []),
                     lambda x, r, w: hkernels.add_rms_norm(x, r, w)),
    "swiglu": (lambda g: ([_t(g, 37, 1024), _t(g, 37, 1024)], []), hkernels.swiglu),
    "geglu": (lambda g: ([_t(g, 37, 1024), _t(g, 37, 1024)], []), hkernels.geglu),
    "rope": (lambda g: ([_t(g, 2, 8, 33, 64), _t(g, 2, 2, 33, 64)], [torch.cos(_t(g, 33, 64)),
                                                                      torch.sin(_t(g, 33, 64))]), hkernels.rope),
    "qk_norm_rope": (lambda g: ([_t(g, 2, 8, 33, 128), _t(g, 2, 2, 33, 128), _t(g, 128, scale=0.3) + 1,
                                 _t(g, 128, scale=0.3) + 1], [torch.cos(_t(g, 33, 128)), torch.sin(_t(g, 33, 128))]),
                     hkernels.qk_norm_rope),
    "cross_entropy": (lambda g: ([_t(g, 37, 1000, scale=2.0)], [torch.randint(0, 1000, (37,), generator=g)]),
                      hkernels.cross_entropy),
    "fused_linear_cross_entropy": (
        lambda g: ([_t(g, 37, 64), _t(g, 1000, 64, scale=0.125)], [torch.randint(0, 1000, (37,), generator=g)]),
        hkernels.fused_linear_cross_entropy),
    "matmul": (lambda g: ([_t(g, 37, 256), _t(g, 256, 192, scale=0.0625), _t(g, 192)], []),
               lambda a, b, bias: hkernels.matmul(a, b, bias, "gelu_tanh")),
    "attention": (lambda g: ([_t(g, 1, 8, 100, 64), _t(g, 1, 2, 100, 64), _t(g, 1, 2, 100, 64)], []),
                  lambda q, k, v: hkernels.attention(q, k, v, causal=True)),
    # packed: an empty sequence, one of one token, a window (the bounds on the device, read there by every replay)
    "attention_varlen": (lambda g: ([_t(g, 150, 8, 64), _t(g, 150, 2, 64), _t(g, 150, 2, 64)],
                                    [torch.tensor([0, 60, 60, 61, 150], dtype=torch.int32)]),
                         lambda q, k, v, cu: hkernels.attention_varlen(q, k, v, cu, max_seqlen_q=89, max_seqlen_k=89,
                                                                       causal=True, window=(31, 0))),
    # forward only: no tensor gets a gradient; a long cache, one sequence empty
    "decode_attention": (lambda g: ([], [_t(g, 4, 32, 1, 128), _t(g, 4, 8, 8192, 128), _t(g, 4, 8, 8192, 128),
                                         torch.tensor([8192, 5000, 0, 1], dtype=torch.int32)]),
                         hkernels.decode_attention),
    "grouped_matmul": (lambda g: ([_t(g, 300, 128), _t(g, 8, 96, 128, scale=0.09)],
                                  [torch.tensor([40, 0, 100, 60, 30, 20, 50, 0])]), hkernels.grouped_matmul),
    "moe": (lambda g: ([_t(g, 100, 128), _t(g, 8, 192, 128, scale=0.09), _t(g, 8, 128, 96, scale=0.1),
                        torch.rand(100, 2, generator=g)], [torch.randint(0, 8, (100, 2), generator=g)]),
            lambda x, gu, dn, tw, ids: hkernels.moe(x, gu, dn, ids, tw)),
}


def test_every_op_is_here():
    assert sorted(MAKERS) == hkernels.ops()


def _inputs(op: str, seed: int, dtype: torch.dtype) -> tuple[list[Tensor], list[Tensor]]:
    grads, rest = MAKERS[op][0](torch.Generator().manual_seed(seed))
    cast = [t.to("cuda", dtype).requires_grad_() for t in grads]
    return cast, [t.to("cuda", dtype) if t.is_floating_point() else t.to("cuda") for t in rest]


def _loss(out: Any) -> Tensor:
    outs = out if isinstance(out, tuple) else (out,)
    return sum((o.float() * (i + 2)).sum() for i, o in enumerate(outs))  # every output feeds the loss


def _step(op: str, leaves: list[Tensor], rest: list[Tensor], backward: bool) -> list[Tensor]:
    out = MAKERS[op][1](*leaves, *rest)
    outs = list(out) if isinstance(out, tuple) else [out]
    if not backward:
        return outs
    return [*outs, *torch.autograd.grad(_loss(out), leaves)]


def _same(got: list[Tensor], want: list[Tensor], what: str) -> None:
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a.nan_to_num(), b.nan_to_num()) and torch.equal(a.isnan(), b.isnan()), (
            f"{what}: output {i} differs from the eager call's by {(a.float() - b.float()).abs().max().item():.3g}")


@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "fwd_bwd"])
@pytest.mark.parametrize("backend", ["helion", "triton"])
@pytest.mark.parametrize("op", sorted(MAKERS))
def test_captures_in_a_cuda_graph(op, backend, backward):
    """Capture once, then replay on new values written into the captured inputs: bitwise the eager results (the
    same kernels; the backward too)."""
    leaves, rest = _inputs(op, 0, torch.bfloat16)
    if backward and not leaves:
        pytest.skip("a forward-only op")
    with hkernels.use_backend(backend):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up: compiles, records the plans
            for _ in range(2):
                _step(op, leaves, rest, backward)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static = _step(op, leaves, rest, backward)
        for seed in (1, 2):
            new_leaves, new_rest = _inputs(op, seed, torch.bfloat16)
            with torch.no_grad():
                for t, n in zip([*leaves, *rest], [*new_leaves, *new_rest], strict=True):
                    t.copy_(n)
            graph.replay()
            want = _step(op, new_leaves, new_rest, backward)
            _same([s.detach() for s in static], [w.detach() for w in want], f"{op} on {backend}, replay {seed}")


@pytest.mark.parametrize("op", sorted(MAKERS))
def test_runs_under_reduce_overhead_compile(op):
    """torch.compile(mode="reduce-overhead") replays CUDA graphs of the compiled forward and backward: the loss
    and every gradient as in eager, call after call on new values."""
    torch._dynamo.reset()
    fn = MAKERS[op][1]
    compiled = torch.compile(lambda *a: _loss(fn(*a)), mode="reduce-overhead", fullgraph=True)
    for seed in range(4):  # warm-up, recording, then replays
        leaves, rest = _inputs(op, seed, torch.float32)
        loss = compiled(*leaves, *rest)
        grads = torch.autograd.grad(loss, leaves) if leaves else ()
        got = [loss.detach().clone(), *(g.clone() for g in grads)]
        ref_leaves = [t.detach().clone().requires_grad_() for t in leaves]
        ref = _loss(fn(*ref_leaves, *rest))
        want = [ref.detach(), *(torch.autograd.grad(ref, ref_leaves) if ref_leaves else ())]
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=lambda m, i=i: f"{op} output {i}: {m}")
