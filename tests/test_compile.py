"""torch.compile(fullgraph=True) traces through every op (custom ops with fake kernels and autograd)."""

from __future__ import annotations

import pytest
import torch

import hkernels
from hkernels import reference

CALLS = {
    "rms_norm": lambda m, x, w, b: m.rms_norm(x, w),
    "layer_norm": lambda m, x, w, b: m.layer_norm(x, w, b),
    "softmax": lambda m, x, w, b: m.softmax(x * w, dim=-1),
}
CUSTOM_OPS = {
    "rms_norm": lambda x, w, b: (torch.ops.hkernels.rms_norm_fwd.default, (x, w, 1e-6, "")),
    "layer_norm": lambda x, w, b: (torch.ops.hkernels.layer_norm_fwd.default, (x, w, b, 1e-5, "")),
    "softmax": lambda x, w, b: (torch.ops.hkernels.softmax_fwd.default, (x, "")),
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
    ref = (CALLS[op](reference, xr, wr, br) * 2 + 1).sum(-1)
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
