"""fused_linear_cross_entropy under torch.autocast, beyond what tests/test_autocast.py asks of every op: float32
parameters behave as in ``cross_entropy(linear(hidden, weight, bias), target)`` under autocast (the matmuls in
autocast's 16-bit dtype, a float32 loss, gradients in float32), over several chunks, with mixed input dtypes and
with a backward run inside the autocast region."""

from __future__ import annotations

import zlib

import pytest
import torch

import hkernels
from hkernels import references
from hkernels.runtime import chunked as _chunked
from tests.specs import BACKENDS, _torch_chunked_linear_ce, max_error

Tensor = torch.Tensor

AUTOCAST_DTYPES = [torch.bfloat16, torch.float16]
DTYPE_IDS = lambda d: str(d).removeprefix("torch.")
T, H, V = 48, 32, 200
CHUNK = 16  # tokens per chunk: three chunks of the loop


@pytest.fixture(autouse=True)
def _small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_chunked, "MIN_CHUNK", CHUNK)


def _inputs(device: torch.device, bias: bool = False, seed: int = 0, ignore_index: int = -100
            ) -> dict[str, Tensor | None]:
    """float32 hidden [T, H], weight [V, H] (bias [V]) and int64 target [T] with ignored rows, first and last
    included."""
    g = torch.Generator().manual_seed(seed)
    target = torch.randint(0, V, (T,), generator=g)
    target[torch.rand(T, generator=g) < 0.2] = ignore_index
    target[0] = target[-1] = ignore_index
    return {
        "hidden": torch.randn(T, H, generator=g).to(device),
        "weight": (torch.randn(V, H, generator=g) * H**-0.5).to(device),
        "bias": (torch.randn(V, generator=g) * 0.5).to(device) if bias else None,
        "target": target.to(device),
    }


def _params(inputs: dict[str, Tensor | None]) -> list[str]:
    return [n for n in ("hidden", "weight", "bias") if inputs[n] is not None]


def _leaves(inputs: dict[str, Tensor | None], dtype: torch.dtype | None = None) -> dict[str, Tensor | None]:
    """Fresh leaves of the parameters (in ``dtype`` if given), requiring grad; the target as it is."""
    return {n: t if t is None or n == "target" else t.detach().to(dtype or t.dtype).requires_grad_()
            for n, t in inputs.items()}


def _loss_and_grads(fn, leaves: dict[str, Tensor | None], up: Tensor, **kwargs) -> tuple[Tensor, ...]:
    loss = fn(**leaves, **kwargs)
    return loss, *torch.autograd.grad(loss, [leaves[n] for n in _params(leaves)], up.to(loss.dtype))


@pytest.mark.parametrize(("dtype", "reduction"), [(torch.bfloat16, "sum"), (torch.float16, "none")],
                         ids=["bfloat16-sum", "float16-none"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_forward_and_gradients_under_autocast(backend, dtype, reduction, device):
    """Loss and gradients against the float64 reference on the same 16-bit-rounded inputs, within the suite's
    16-bit tolerances of PyTorch's own 16-bit computation over the same chunks; the loss float32, the gradients
    float32."""
    inputs = _inputs(device, bias=reduction == "mean", seed=zlib.crc32(f"{backend}{dtype}{reduction}".encode()))
    kwargs = {"reduction": reduction}
    g = torch.Generator().manual_seed(7)
    up = torch.randn(T if reduction == "none" else (), generator=g, dtype=torch.float64).to(device)

    leaves = _leaves(inputs)
    with hkernels.use_backend(backend):
        assert hkernels.selected_backend("fused_linear_cross_entropy", **leaves, **kwargs) == backend
        with torch.autocast(device.type, dtype=dtype):
            got = _loss_and_grads(hkernels.fused_linear_cross_entropy, leaves, up, **kwargs)
    assert got[0].dtype == torch.float32
    for name, grad in zip(_params(inputs), got[1:], strict=True):
        assert grad.dtype == torch.float32 and grad.shape == inputs[name].shape, name

    rounded = {n: t if t is None or n == "target" else t.to(dtype) for n, t in inputs.items()}
    want = _loss_and_grads(references.fused_linear_cross_entropy, _leaves(rounded, torch.float64), up, **kwargs)
    base = _loss_and_grads(_torch_chunked_linear_ce, _leaves(rounded), up, **kwargs)

    terms = up.abs().max().item() * max(1.0, *(inputs[n].abs().max().item() for n in _params(inputs)))
    problems = [max_error("loss", got[0].detach(), want[0].detach(), base[0].detach(), dtype)]
    for name, o, r, b in zip(_params(inputs), got[1:], want[1:], base[1:], strict=True):
        problems.append(max_error(f"d{name}", o, r, b, dtype, terms))
    problems = [p for p in problems if p]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("dtype", [torch.bfloat16], ids=DTYPE_IDS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_autocast_is_the_call_on_16_bit_inputs(backend, dtype, device):
    """Under autocast the op is the call on the inputs cast to autocast's dtype, bit for bit: the gradients are its
    gradients cast back to float32. A custom ignore_index, label smoothing and a bias ride along."""
    inputs = _inputs(device, bias=True, seed=3, ignore_index=7)
    kwargs = {"ignore_index": 7, "label_smoothing": 0.1}
    up = torch.tensor(0.75, device=device)
    with hkernels.use_backend(backend):
        with torch.autocast(device.type, dtype=dtype):
            got = _loss_and_grads(hkernels.fused_linear_cross_entropy, _leaves(inputs), up, **kwargs)
        want = _loss_and_grads(hkernels.fused_linear_cross_entropy, _leaves(inputs, dtype), up, **kwargs)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(a, b.float(), rtol=0, atol=0, msg=lambda m, i=i: f"output {i}: {m}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_mixed_dtypes_under_autocast(backend, device):
    """As with linear under autocast, a bfloat16 hidden beside a float32 weight is accepted (both run in
    autocast's dtype) and each gradient comes back in its own tensor's dtype."""
    inputs = _inputs(device)
    inputs["hidden"] = inputs["hidden"].to(torch.bfloat16)
    leaves = _leaves(inputs)
    up = torch.tensor(1.0, device=device)
    with hkernels.use_backend(backend), torch.autocast(device.type, dtype=torch.bfloat16):
        loss, dh, dw = _loss_and_grads(hkernels.fused_linear_cross_entropy, leaves, up)
    assert (loss.dtype, dh.dtype, dw.dtype) == (torch.float32, torch.bfloat16, torch.float32)
    with hkernels.use_backend(backend):
        want = _loss_and_grads(hkernels.fused_linear_cross_entropy, _leaves(inputs, torch.bfloat16), up)
    for i, (a, b) in enumerate(zip((loss, dh, dw), want, strict=True)):
        torch.testing.assert_close(a, b.to(a.dtype), rtol=0, atol=0, msg=lambda m, i=i: f"output {i}: {m}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_backward_under_autocast_recomputes_in_the_forward_dtypes(backend, device):
    """reduction='none' recomputes the logits in the backward: a backward run under autocast after a float32
    forward outside it keeps float32 (the buffers the loop writes into are float32), giving the same bits."""
    inputs = _inputs(device, bias=True)
    up = torch.randn(T, generator=torch.Generator().manual_seed(1)).to(device)
    with hkernels.use_backend(backend):
        want = _loss_and_grads(hkernels.fused_linear_cross_entropy, _leaves(inputs), up, reduction="none")
        leaves = _leaves(inputs)
        loss = hkernels.fused_linear_cross_entropy(**leaves, reduction="none")
        with torch.autocast(device.type, dtype=torch.bfloat16):
            grads = torch.autograd.grad(loss, [leaves[n] for n in _params(leaves)], up)
    for i, (a, b) in enumerate(zip((loss, *grads), want, strict=True)):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m, i=i: f"output {i}: {m}")
