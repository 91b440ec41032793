"""The shared suite: every op × backend × dtype × shape, forward and every gradient, against float64."""

from __future__ import annotations

import zlib

import pytest
import torch

import hkernels
from hkernels import references
from tests.specs import BACKENDS, DTYPES, SHAPES, VARIANTS, make_inputs, max_error

CASES = [
    pytest.param(v, shape, id=f"{v.id}-{name}")
    for v in VARIANTS
    for name, shape in SHAPES
    if not v.only_3d or len(shape) == 3
]


def _poison(device: torch.device, nbytes: int) -> None:
    """Leave NaN in the memory the caching allocator hands out next, so unwritten outputs show up."""
    if device.type == "cuda":
        torch.full((nbytes // 4 + 1024,), float("nan"), device=device)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("variant", "shape"), CASES)
def test_forward_and_gradients(variant, shape, backend, dtype, device):
    seed = zlib.crc32(f"{variant.id}{shape}{dtype}".encode())
    x, params, dy = make_inputs(variant, shape, dtype, device, seed)

    xs = x.clone().requires_grad_()
    ps = {k: v.clone().requires_grad_() for k, v in params.items()}
    with hkernels.use_backend(backend):
        assert hkernels.selected_backend(variant.op, xs, **ps, **variant.kwargs) == backend
        _poison(device, x.numel() * x.element_size())
        out = variant.call(hkernels, xs, ps)
    _poison(device, x.numel() * x.element_size())
    out.backward(dy)  # outside the scope: the backward follows the forward's backend

    x64 = x.double().requires_grad_()
    p64 = {k: v.double().requires_grad_() for k, v in params.items()}
    ref = variant.call(references, x64, p64)
    ref.backward(dy.double())

    xb = x.clone().requires_grad_()
    pb = {k: v.clone().requires_grad_() for k, v in params.items()}
    base = variant.call(references, xb, pb)
    base.backward(dy)

    assert out.dtype == dtype and out.shape == x.shape
    terms = variant.grad_scale(x64.detach(), {k: v.detach() for k, v in p64.items()}, dy.double())
    problems = [max_error("y", out.detach(), ref.detach(), base.detach(), dtype)]
    problems.append(max_error("dx", xs.grad, x64.grad, xb.grad, dtype, terms))
    for k in params:
        assert ps[k].grad.dtype == params[k].dtype
        problems.append(max_error(f"d{k}", ps[k].grad, p64[k].grad, pb[k].grad, dtype, terms))
    problems = [p for p in problems if p]
    assert not problems, "\n".join(problems)
