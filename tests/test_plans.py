"""Plans (hkernels/runtime/plan.py, hkernels/functional/_base.py): a call whose signature was seen before replays what
the first call recorded, or takes the one-step fast path built from it. Either must give bitwise what the first
call gave, forward and every gradient, with and without a gradient wanted, on 2-d and 3-d inputs; and a call whose
signature differs in anything a plan depends on (alignment, strides, grad mode) must not reuse another's plan."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import hkernels
from hkernels import registry

Tensor = torch.Tensor


def _t(g: torch.Generator, *shape: int, scale: float = 1.0) -> Tensor:
    return torch.randn(shape, generator=g) * scale


# Per op: (inputs: tensors that may get gradients, then the rest; a call). Row ops at 2-d and 3-d.
CASES: dict[str, tuple[Callable[[torch.Generator], tuple[list[Tensor], list[Any]]], Callable[..., Any]]] = {
    "rms_norm-2d": (lambda g: ([_t(g, 5, 48), _t(g, 48) + 1], []), lambda x, w: hkernels.rms_norm(x, w)),
    "rms_norm-3d": (lambda g: ([_t(g, 2, 3, 48), _t(g, 48) + 1], []), lambda x, w: hkernels.rms_norm(x, w, 1e-5)),
    "layer_norm-3d": (lambda g: ([_t(g, 2, 3, 48), _t(g, 48) + 1, _t(g, 48)], []),
                      lambda x, w, b: hkernels.layer_norm(x, w, b)),
    "add_rms_norm-3d": (lambda g: ([_t(g, 2, 3, 48), _t(g, 2, 3, 48), _t(g, 48) + 1], []),
                        lambda x, r, w: hkernels.add_rms_norm(x, r, w)),
    "swiglu-3d": (lambda g: ([_t(g, 2, 3, 40), _t(g, 2, 3, 40)], []), hkernels.swiglu),
    "geglu-2d": (lambda g: ([_t(g, 5, 40), _t(g, 5, 40)], ["none"]), hkernels.geglu),
    "softmax-3d": (lambda g: ([_t(g, 2, 3, 40, scale=3.0)], []), lambda x: hkernels.softmax(x)),
    "rope": (lambda g: ([_t(g, 1, 4, 5, 16), _t(g, 1, 2, 5, 16)], [torch.cos(_t(g, 5, 16)), torch.sin(_t(g, 5, 16))]),
             hkernels.rope),
    "cross_entropy": (lambda g: ([_t(g, 6, 40, scale=2.0)], [torch.randint(0, 40, (6,), generator=g)]),
                      hkernels.cross_entropy),
    "matmul": (lambda g: ([_t(g, 5, 16), _t(g, 16, 12, scale=0.25), _t(g, 12)], ["silu"]), hkernels.matmul),
    "grouped_matmul": (lambda g: ([_t(g, 9, 16), _t(g, 3, 12, 16, scale=0.25)], [torch.tensor([4, 0, 5])]),
                       hkernels.grouped_matmul),
    "moe": (lambda g: ([_t(g, 7, 16), _t(g, 3, 24, 16, scale=0.25), _t(g, 3, 16, 12, scale=0.25),
                        torch.rand(7, 2, generator=g)], [torch.randint(0, 3, (7, 2), generator=g)]),
            lambda x, gu, dn, tw, ids: hkernels.moe(x, gu, dn, ids, tw)),
}


def _run(case: str, seed: int, grad: bool, device: torch.device) -> tuple[list[Tensor], list[Tensor]]:
    make, fn = CASES[case]
    tensors, rest = make(torch.Generator().manual_seed(seed))
    tensors = [t.to(device) for t in tensors]
    rest = [r.to(device) if isinstance(r, Tensor) else r for r in rest]
    leaves = [t.requires_grad_(grad) for t in tensors]
    with torch.set_grad_enabled(grad):
        out = fn(*leaves, *rest)
    outs = list(out) if isinstance(out, tuple) else [out]
    if not grad:
        return [o.detach() for o in outs], []
    loss = sum((o.float() * (i + 2)).sum() + o.float().square().mean() for i, o in enumerate(outs))
    return [o.detach() for o in outs], list(torch.autograd.grad(loss, leaves))


def _equal(a: list[Tensor], b: list[Tensor], what: str) -> None:
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        assert torch.equal(x, y), f"{what}: output {i} differs by {(x.float() - y.float()).abs().max().item():.3g}"


def _plans(case: str) -> list[Any]:
    op = case.split("-")[0]
    return list(registry.load(op, "torch")._CALLS.plans.values())


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("backend", ["helion", "triton"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_replayed_calls_equal_the_first(case, backend, grad, device):
    with hkernels.use_backend(backend):
        first = _run(case, 0, grad, device)
        for _ in range(3):  # replays of the recorded plan (or its fast paths: forward, then backward), on equal inputs
            again = _run(case, 0, grad, device)
            _equal(first[0], again[0], f"{case} on {backend}: forward")
            _equal(first[1], again[1], f"{case} on {backend}: gradients")
    plans = _plans(case)
    assert plans and all(p.slots is not None for p in plans)
    # the row ops whose kernel functions bind on this backend (Helion's rope does not: it runs the plan's replay)
    if case.split("-")[0] in ("rms_norm", "layer_norm", "add_rms_norm", "swiglu", "geglu", "softmax") or (
            case == "rope" and backend == "triton"):
        assert any(p.fast is not None for p in plans), "the row op's fast path was not built"


def test_a_plan_is_not_reused_across_alignment_strides_or_grad_mode(device):
    """Calls that differ only in what a compiled kernel is specialised on get plans of their own: an unaligned view,
    a strided one, and grad mode."""
    g = torch.Generator().manual_seed(0)
    full = _t(g, 10, 48).to(device)
    base = full[:9]
    w = (_t(g, 48) + 1).to(device)
    plans = registry.load("rms_norm", "torch")._CALLS.plans
    plans.clear()
    want = hkernels.references.rms_norm
    unaligned = full.view(-1)[1:1 + 9 * 48].view(9, 48)  # one element in: not 16-byte aligned
    for x in (base, unaligned, base[:, ::2], base[:, 1:]):
        torch.testing.assert_close(hkernels.rms_norm(x, w[: x.shape[-1]]), want(x, w[: x.shape[-1]]))
        torch.testing.assert_close(hkernels.rms_norm(x, w[: x.shape[-1]]), want(x, w[: x.shape[-1]]))
    with torch.no_grad():
        hkernels.rms_norm(base, w)
    hkernels.rms_norm(base, w.requires_grad_())
    assert len(plans) == 6


@pytest.mark.parametrize("backend", ["helion", "triton"])
def test_a_backward_plan_per_gradient_layout(backend, device):
    """The same forward, then backwards with gradients of other layouts (contiguous, a column slice of a wider
    tensor, expanded, transposed storage),
    each twice: each right (a backward replayed with another layout's bound kernel reads dy with the wrong row
    stride)."""
    g = torch.Generator().manual_seed(1)
    x = _t(g, 6, 32).to(device).requires_grad_()
    w = (_t(g, 32) + 1).to(device).requires_grad_()
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = hkernels.references.rms_norm(x64, w64)
    for dy in (torch.randn(6, 32, device=device), torch.randn(6, 64, device=device)[:, 16:48],  # row stride 64
               torch.ones(1, 1, device=device).expand(6, 32), torch.randn(32, 6, device=device).t()):
        for _ in range(2):
            with hkernels.use_backend(backend):
                got = torch.autograd.grad(hkernels.rms_norm(x, w), (x, w), dy)
            want = torch.autograd.grad(ref, (x64, w64), dy.double(), retain_graph=True)
            for a, b in zip(got, want, strict=True):
                torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-4)


def test_autocast_gets_plans_of_its_own(device):
    """Autocast changes the dtypes of the PyTorch ops inside a body (the linear loss's matmuls): a call under it and
    the same call without it each get a plan, and each stays right."""
    g = torch.Generator().manual_seed(2)
    hidden, weight = _t(g, 8, 16).to(device), _t(g, 64, 16, scale=0.25).to(device)
    target = torch.randint(0, 64, (8,), generator=g).to(device)
    want = hkernels.references.fused_linear_cross_entropy(hidden.double(), weight.double(), target)
    plans = registry.load("fused_linear_cross_entropy", "torch")._CALLS.plans
    plans.clear()
    for autocast in (False, True, False, True):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            got = hkernels.fused_linear_cross_entropy(hidden, weight, target)
        torch.testing.assert_close(got.double(), want, rtol=2e-2 if autocast else 1e-4, atol=1e-4)
    assert len(plans) == 2


def test_learned_rotary_tables_get_gradients_under_compile_and_modes(device):
    """rope's tables that require grad get their gradients on every path: plain (the plan's replay), under
    torch.compile and under a function mode (the custom op), which decide it from the tables themselves."""
    g = torch.Generator().manual_seed(3)
    q, k = _t(g, 1, 2, 5, 8).to(device).requires_grad_(), _t(g, 1, 1, 5, 8).to(device).requires_grad_()
    cos, sin = _t(g, 5, 8).to(device).requires_grad_(), _t(g, 5, 8).to(device).requires_grad_()
    leaves = (q, k, cos, sin)

    def loss(fn: Callable[..., Any]) -> Tensor:
        return sum(t.float().sum() * (i + 2) for i, t in enumerate(fn(*leaves)))

    want = torch.autograd.grad(loss(hkernels.references.rope), leaves)

    class Mode(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    compiled = torch.compile(lambda *a: hkernels.rope(*a), backend="aot_eager", fullgraph=True)
    for path in ("plain", "plain", "compile", "mode"):
        if path == "mode":
            with Mode():
                got = torch.autograd.grad(loss(hkernels.rope), leaves)
        else:
            got = torch.autograd.grad(loss(compiled if path == "compile" else hkernels.rope), leaves)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
