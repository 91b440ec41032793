"""Inputs off the main road: empty tensors, strides, mixed dtypes, 0-d softmax, and bad arguments."""

from __future__ import annotations

import pytest
import torch

import hkernels
from hkernels import reference

KERNEL_BACKENDS = ["helion", "triton"]


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("shape", [(0, 8), (3, 0), (2, 0, 4)])
def test_empty_inputs(backend, shape, device):
    x = torch.randn(shape, device=device, requires_grad=True)
    w = torch.randn(shape[-1], device=device, requires_grad=True)
    with hkernels.use_backend(backend):
        outs = [hkernels.rms_norm(x, w), hkernels.layer_norm(x, w, w), hkernels.softmax(x, dim=-1)]
    for out in outs:
        assert out.shape == x.shape
        out.sum().backward()
    assert x.grad.shape == x.shape and w.grad.shape == w.shape
    assert torch.all(w.grad == 0)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_strided_and_transposed_inputs(backend, device):
    base = torch.randn(6, 80, device=device)
    w = torch.randn(40, device=device)
    sliced = base[:, 10:50]  # rows with a stride of 80: read in place
    transposed = torch.randn(40, 6, device=device).t()  # unit stride along rows: copied first
    with hkernels.use_backend(backend):
        for x in (sliced, transposed):
            torch.testing.assert_close(hkernels.rms_norm(x, w), reference.rms_norm(x, w))
            torch.testing.assert_close(hkernels.layer_norm(x, w, w), reference.layer_norm(x, w, w))
            torch.testing.assert_close(hkernels.softmax(x, 0), reference.softmax(x, 0))


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_float32_weight_with_bfloat16_input(backend, device):
    """Mixed precision: y has x's dtype, each gradient its tensor's dtype."""
    x = torch.randn(4, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(64, device=device, dtype=torch.float32, requires_grad=True)
    with hkernels.use_backend(backend):
        y = hkernels.rms_norm(x, w)
    y.float().sum().backward()
    assert y.dtype == torch.bfloat16 and x.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.float32
    torch.testing.assert_close(y, reference.rms_norm(x, w))


def test_softmax_of_a_0d_tensor(device):
    x = torch.tensor(3.0, device=device)
    assert hkernels.softmax(x, 0).item() == 1.0 and hkernels.softmax(x).shape == ()


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda d: hkernels.rms_norm(torch.ones(2, 4, dtype=torch.int64, device=d)), TypeError, r"rms_norm: x .*int64"),
        (lambda d: hkernels.rms_norm([1.0, 2.0]), TypeError, r"rms_norm: x must be a torch.Tensor"),
        (lambda d: hkernels.rms_norm(torch.tensor(1.0, device=d)), ValueError, r"rms_norm: x must have at least 1"),
        (lambda d: hkernels.rms_norm(torch.ones(2, 4, device=d), torch.ones(5, device=d)), ValueError,
         r"rms_norm: weight must have shape \[4\]"),
        (lambda d: hkernels.layer_norm(torch.ones(2, 4, device=d), None, torch.ones(2, 2, device=d)), ValueError,
         r"layer_norm: bias must have shape \[4\]"),
        (lambda d: hkernels.layer_norm(torch.ones(2, 4, device=d), torch.ones(4, dtype=torch.int32, device=d)),
         TypeError, r"layer_norm: weight must be a floating-point tensor"),
        (lambda d: hkernels.rms_norm(torch.ones(2, 4, device=d), torch.ones(4, device="meta")), ValueError,
         r"rms_norm: weight is on meta"),
        (lambda d: hkernels.softmax(torch.ones(2, 4, device=d), dim=2), IndexError, r"softmax: dim 2 is out of range"),
        (lambda d: hkernels.softmax(torch.ones(2, 4, device=d), dim=1.0), TypeError, r"softmax: dim must be an int"),
    ],
)
def test_bad_input_names_the_op_and_the_problem(call, error, match, device):
    with pytest.raises(error, match=match):
        call(device)
