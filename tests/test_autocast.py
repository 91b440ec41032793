"""Every op under torch.autocast: float32 inputs and parameters (how mixed-precision training holds them), bfloat16
and float16, every backend, forward, backward and inside torch.compile.

An op under autocast behaves as the PyTorch call it stands for does there: the result has that call's dtype under
the same autocast (checked against PyTorch itself, where such a call exists), each gradient has its own input's
dtype, and the values are the op's on the inputs as autocast casts them, within the suite's tolerance of the
float64 truth. "lower" ops (matmuls, attention, the linear loss) compute in autocast's dtype; the others in the
inputs' own float32.
"""

from __future__ import annotations

import importlib
import zlib
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import hkernels
from hkernels import references, registry
from hkernels.runtime import chunked as _chunked
from tests.conftest import FULL
from tests.specs import BACKENDS, CASES_LLM, ON_GPU, Case, _randn, cast_case, max_error
from tests.test_llm_ops import _leaves, _outputs

Tensor = torch.Tensor
AUTOCAST_DTYPES = [torch.bfloat16, torch.float16]
DTYPE_IDS = lambda d: str(d).removeprefix("torch.")

# Ops that compute in autocast's dtype (as matmul, linear and SDPA do); every other op computes in its inputs' dtype.
LOWER = {"matmul", "attention", "attention_varlen", "decode_attention", "grouped_matmul", "moe",
         "fused_linear_cross_entropy"}


def _row_case(op: str, name: str, shape: tuple[int, ...], params: tuple[str, ...], **kwargs: Any) -> Case:
    def make(g: torch.Generator) -> tuple[dict[str, Tensor], dict[str, Any]]:
        x = _randn(g, *shape, scale=2.0, shift=3.0 if op == "layer_norm" else 0.0)
        tensors = {"x": x, **{p: _randn(g, shape[-1], scale=0.5, shift=1.0 if p == "weight" else 0.0)
                              for p in params}}
        return tensors, dict(kwargs)

    return Case(op, name, make, ("x", *params))


_WANTED = {  # one or two small cases per op of the shared LLM set (the fast tier)
    "add_rms_norm-odd-weight", "swiglu-halves", "geglu-odd-approximate=tanh", "rope-gqa", "rope-packed",
    "cross_entropy-odd_v", "cross_entropy-none", "fused_linear_cross_entropy-odd", "matmul-bias_relu",
    "matmul-batched_bias_silu", "attention-causal_odd", "attention-softcap_cross", "attention_varlen-self_causal",
    "decode_attention-lengths_0_1_full", "grouped_matmul-drawn", "moe-drawn",
}
CASES = [
    _row_case("rms_norm", "odd", (7, 37), ("weight",), eps=1e-6),
    _row_case("layer_norm", "3d", (2, 3, 100), ("weight", "bias"), eps=1e-5),
    _row_case("softmax", "odd", (7, 37), (), dim=-1),
    *[c for c in CASES_LLM if c.id in _WANTED],
]
assert len(CASES) == 3 + len(_WANTED), sorted(_WANTED - {c.id for c in CASES_LLM})


# The PyTorch call each op stands for: under the same autocast, its results' dtypes are what hkernels' must be.
def _sdpa(q: Tensor, k: Tensor, v: Tensor, causal: bool = False, scale: float | None = None,
          window: Any = None, softcap: Any = None) -> Tensor | None:
    if window is not None or softcap:
        return None  # SDPA has neither
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


def _matmul(a: Tensor, b: Tensor, bias: Tensor | None = None, activation: str | None = None) -> Tensor:
    y = torch.matmul(a, b) if bias is None else torch.baddbmm(bias, a, b) if a.dim() > 2 else torch.addmm(bias, a, b)
    return y if activation is None else {"relu": F.relu, "silu": F.silu, "gelu": F.gelu}[activation](y)


PYTORCH: dict[str, Callable[..., Any]] = {
    "rms_norm": lambda x, weight=None, eps=1e-6: F.rms_norm(x, (x.shape[-1],), weight, eps),
    "layer_norm": lambda x, weight=None, bias=None, eps=1e-5: F.layer_norm(x, (x.shape[-1],), weight, bias, eps),
    "softmax": lambda x, dim=-1: torch.softmax(x, dim),
    "add_rms_norm": lambda x, residual, weight=None, eps=1e-6: (
        F.rms_norm(x + residual, (x.shape[-1],), weight, eps), x + residual),
    "swiglu": lambda gate, up: F.silu(gate) * up,
    "geglu": lambda gate, up, approximate="tanh": F.gelu(gate, approximate=approximate) * up,
    "cross_entropy": lambda logits, target, **kw: F.cross_entropy(logits, target.long(), **kw),
    "fused_linear_cross_entropy": lambda hidden, weight, target, bias=None, **kw: F.cross_entropy(
        F.linear(hidden, weight, bias), target.long(), **kw),
    "matmul": _matmul,
    "attention": _sdpa,
}


def _computed(inputs: dict[str, Tensor], op: str, dtype: torch.dtype) -> dict[str, Tensor]:
    """The inputs as the op computes on them under autocast: a lower op's floating inputs in autocast's dtype."""
    if op not in LOWER:
        return inputs
    return {k: v.to(dtype) if v.is_floating_point() and v.dtype != torch.float64 else v for k, v in inputs.items()}


ACTIVATIONS = ("x", "residual", "logits", "gate", "up")  # the inputs a 16-bit model hands an op (not parameters)


def _run(case: Case, backend: str, dtype: torch.dtype, device: torch.device, monkeypatch: pytest.MonkeyPatch,
         sixteen_bit_activations: bool = False
         ) -> tuple[dict[str, Tensor], dict[str, Any], dict[str, Tensor], tuple[Tensor, ...], list[Tensor]]:
    """The case's float32 inputs (its activations in ``dtype`` with ``sixteen_bit_activations``), its other
    arguments, the leaves, and the op's outputs under autocast."""
    if case.min_chunk is not None:
        monkeypatch.setattr(_chunked, "MIN_CHUNK", case.min_chunk)
    g = torch.Generator().manual_seed(zlib.crc32(f"autocast{case.id}{dtype}".encode()))
    tensors64, kwargs = case.make(g)
    kwargs = {k: v.to(device) if isinstance(v, Tensor) else v for k, v in kwargs.items()}
    inputs = cast_case(tensors64, torch.float32, device)
    if sixteen_bit_activations:
        inputs = {k: v.to(dtype) if k in ACTIVATIONS else v for k, v in inputs.items()}
    ins = _leaves(inputs, case.grads)
    with hkernels.use_backend(backend), torch.autocast(device.type, dtype=dtype):
        outs = _outputs(getattr(hkernels, case.op)(**ins, **kwargs))
    ups = [torch.ones_like(o) if o.dim() == 0 and case.unit_upstream
           else torch.randn(o.shape, generator=g, dtype=torch.float64).to(device=device, dtype=o.dtype) for o in outs]
    return inputs, kwargs, ins, outs, ups


def _skip_refused(case: Case, backend: str) -> None:
    if case.kernels is not None and backend not in (*case.kernels, "torch"):
        pytest.skip(f"{backend} refuses this case (a clear error, tested apart)")


# bfloat16 for every case; float16 for a few in the CPU's fast tier, for every case with HKERNELS_TEST_FULL=1 or on
# a GPU.
_FLOAT16 = {"rms_norm-odd", "cross_entropy-odd_v", "fused_linear_cross_entropy-odd", "matmul-bias_relu",
            "attention-causal_odd", "moe-drawn"}
_MATRIX = [pytest.param(case, dtype, id=f"{case.id}-{DTYPE_IDS(dtype)}") for case in CASES for dtype in AUTOCAST_DTYPES
           if dtype == torch.bfloat16 or FULL or case.id in _FLOAT16]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("case", "dtype"), _MATRIX)
def test_op_under_autocast(case, backend, dtype, device, monkeypatch):
    """Result dtypes as PyTorch's call under the same autocast, gradients in float32, values within tolerance of
    the float64 truth of the call on the inputs as autocast casts them (the backward run outside autocast)."""
    _skip_refused(case, backend)
    inputs, kwargs, ins, outs, ups = _run(case, backend, dtype, device, monkeypatch)

    if case.op in PYTORCH:
        plain = {k: v.detach() for k, v in inputs.items()}
        with torch.autocast(device.type, dtype=dtype):
            theirs = PYTORCH[case.op](**plain, **kwargs)
        if theirs is not None:
            theirs = _outputs(theirs)
            assert [o.dtype for o in outs] == [t.dtype for t in theirs], f"PyTorch's call gives {theirs[0].dtype}"
    want_dtype = dtype if case.op in LOWER else torch.float32
    if case.op == "cross_entropy" or case.op == "fused_linear_cross_entropy":
        want_dtype = torch.float32  # a loss computes in float32 under autocast, as PyTorch's
    assert all(o.dtype == want_dtype for o in outs), [o.dtype for o in outs]

    grads = torch.autograd.grad(outs, [ins[n] for n in case.grads], ups) if case.grads else ()
    for name, grad in zip(case.grads, grads, strict=True):
        assert grad.dtype == inputs[name].dtype and grad.shape == inputs[name].shape, name

    low = _computed(inputs, case.op, dtype)  # what the op computes on, and PyTorch's own error there
    tol = dtype if case.op in LOWER else torch.float32
    ins64 = {k: v.detach().double().requires_grad_(k in case.grads) for k, v in low.items()}
    refs = _outputs(getattr(references, case.op)(**ins64, **kwargs))
    ref_grads = (torch.autograd.grad(refs, [ins64[n] for n in case.grads], [u.double() for u in ups])
                 if case.grads else ())
    base_ins = _leaves(low, case.grads)
    bases = _outputs((case.base or getattr(references, case.op))(**base_ins, **kwargs))
    base_grads = (torch.autograd.grad(bases, [base_ins[n] for n in case.grads], [u.to(b.dtype) for u, b in
                                                                                  zip(ups, bases, strict=True)])
                  if case.grads else ())
    problems = [max_error(f"out{i}", o.detach(), r.detach(), b.detach(), tol)
                for i, (o, r, b) in enumerate(zip(outs, refs, bases, strict=True))]
    terms = max(u.abs().max().item() for u in ups if u.numel()) * max(
        1.0, *(torch.nan_to_num(t.double().abs(), nan=0.0).max().item() for t in inputs.values() if t.numel()))
    for name, got, want, base in zip(case.grads, grads, ref_grads, base_grads, strict=True):
        problems.append(max_error(f"d{name}", got.to(base.dtype), want, base, tol, terms))
    problems = [p for p in problems if p]
    assert not problems, "\n".join(problems)


@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")  # PyTorch's own rms_norm, unfused
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", [c for c in CASES if c.op in (
    "rms_norm", "layer_norm", "softmax", "add_rms_norm", "cross_entropy")], ids=lambda c: c.id)
def test_sixteen_bit_activations_under_autocast(case, backend, device, monkeypatch):
    """bfloat16 activations with float32 parameters: the result in the dtype PyTorch's call gives under the same
    autocast (float32 where it computes in float32: CUDA; the activations' dtype where autocast leaves the op
    alone: the CPU), each gradient in its input's dtype, the values within tolerance of the float64 truth."""
    dtype = torch.bfloat16
    inputs, kwargs, ins, outs, ups = _run(case, backend, dtype, device, monkeypatch, sixteen_bit_activations=True)
    plain = {k: v.detach() for k, v in inputs.items()}
    with torch.autocast(device.type, dtype=dtype):
        theirs = _outputs(PYTORCH[case.op](**plain, **kwargs))
    assert [o.dtype for o in outs] == [t.dtype for t in theirs]
    grads = torch.autograd.grad(outs, [ins[n] for n in case.grads], ups)
    for name, grad in zip(case.grads, grads, strict=True):
        assert grad.dtype == inputs[name].dtype, name

    # What the op computes on: 16-bit activations read as float32 where the result is float32 (the loss excepted:
    # its float32 result never needs a float32 copy of the logits).
    widened = outs[0].dtype == torch.float32 and case.op not in ("cross_entropy", "add_rms_norm")
    low = {k: v.float() for k, v in inputs.items()} if widened else inputs
    tol = torch.float32 if widened else dtype
    ins64 = {k: v.detach().double().requires_grad_(k in case.grads) for k, v in low.items()}
    refs = _outputs(getattr(references, case.op)(**ins64, **kwargs))
    ref_grads = torch.autograd.grad(refs, [ins64[n] for n in case.grads], [u.double() for u in ups])
    base_ins = _leaves(low, case.grads)
    bases = _outputs(getattr(references, case.op)(**base_ins, **kwargs))
    base_grads = torch.autograd.grad(bases, [base_ins[n] for n in case.grads],
                                     [u.to(b.dtype) for u, b in zip(ups, bases, strict=True)])
    problems = [max_error(f"out{i}", o.detach(), r.detach(), b.detach().to(o.dtype), tol)
                for i, (o, r, b) in enumerate(zip(outs, refs, bases, strict=True))]
    terms = max(u.abs().max().item() for u in ups if u.numel()) * max(
        1.0, *(t.double().abs().max().item() for t in inputs.values() if t.numel()))
    for name, got, want, base in zip(case.grads, grads, ref_grads, base_grads, strict=True):
        # a 16-bit input's gradient is rounded to its dtype (through the cast), as PyTorch's is
        problems.append(max_error(f"d{name}", got.to(base.dtype), want, base, inputs[name].dtype, terms))
    problems = [p for p in problems if p]
    assert not problems, "\n".join(problems)


_COMPILED = [c for c in CASES if c.id in {
    "rms_norm-odd", "layer_norm-3d", "softmax-odd", "add_rms_norm-odd-weight", "swiglu-halves",
    "geglu-odd-approximate=tanh", "rope-gqa", "cross_entropy-odd_v", "fused_linear_cross_entropy-odd",
    "matmul-bias_relu", "attention-causal_odd", "attention_varlen-self_causal", "decode_attention-lengths_0_1_full",
    "grouped_matmul-drawn", "moe-drawn"}]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", _COMPILED, ids=lambda c: c.id)
def test_op_under_autocast_compiled(case, backend, device, monkeypatch):
    """torch.compile(fullgraph=True) of the op under autocast (bfloat16): the results and gradients the eager call
    under autocast gives, in the same dtypes (aot_eager on the CPU, Inductor on a GPU)."""
    _skip_refused(case, backend)
    torch._dynamo.reset()
    inputs, kwargs, ins, outs, ups = _run(case, backend, torch.bfloat16, device, monkeypatch)
    want = (*outs, *(torch.autograd.grad(outs, [ins[n] for n in case.grads], ups) if case.grads else ()))

    fn = getattr(hkernels, case.op)

    def f(**args: Any) -> Any:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            return fn(**args)

    compiled = torch.compile(f, fullgraph=True, backend="inductor" if ON_GPU else "aot_eager")
    leaves = _leaves(inputs, case.grads)
    with hkernels.use_backend(backend):
        got_outs = _outputs(compiled(**leaves, **kwargs))
    got = (*got_outs, *(torch.autograd.grad(got_outs, [leaves[n] for n in case.grads], ups) if case.grads else ()))
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.dtype == b.dtype, (i, a.dtype, b.dtype)
        scale = max(1.0, torch.nan_to_num(b.detach().double().abs(), nan=0.0).max().item())
        torch.testing.assert_close(a, b, rtol=2e-2, atol=1e-2 * scale, equal_nan=True,
                                   msg=lambda m, i=i: f"output {i}: {m}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_add_rms_norm_promotes_a_mixed_residual_under_autocast(backend, device):
    """A 16-bit branch output added onto a float32 residual stream (mixed-precision training): under autocast the
    sum is promoted to float32 as ``x + residual`` promotes it, and each gradient comes back in its input's
    dtype; the values are the op's on the promoted inputs."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(6, 40, generator=g).to(device=device, dtype=torch.bfloat16).requires_grad_()
    residual = torch.randn(6, 40, generator=g).to(device).requires_grad_()
    weight = (torch.rand(40, generator=g) + 0.5).to(device).requires_grad_()
    with hkernels.use_backend(backend):
        with torch.autocast(device.type, dtype=torch.bfloat16):
            y, h = hkernels.add_rms_norm(x, residual, weight)
        assert (y.dtype, h.dtype) == (torch.float32, torch.float32)
        dx, dr, dw = torch.autograd.grad((y, h), (x, residual, weight), (torch.ones_like(y), torch.ones_like(h)))
        assert (dx.dtype, dr.dtype, dw.dtype) == (torch.bfloat16, torch.float32, torch.float32)
        leaves = [t.detach().float().requires_grad_() for t in (x, residual, weight)]
        y2, h2 = hkernels.add_rms_norm(*leaves)
        want = torch.autograd.grad((y2, h2), leaves, (torch.ones_like(y2), torch.ones_like(h2)))
    torch.testing.assert_close((y, h), (y2, h2), rtol=0, atol=0)
    torch.testing.assert_close((dx, dr, dw), (want[0].bfloat16(), *want[1:]), rtol=0, atol=0)


def test_autocast_on_another_device_changes_nothing(device):
    """Autocast on for another device type, or off, leaves a float32 call as it is (same bits)."""
    g = torch.Generator().manual_seed(3)
    a, b = (torch.randn(9, 16, generator=g).to(device) for _ in range(2))
    want = hkernels.matmul(a, b.T)
    other = "cpu" if device.type != "cpu" else "cuda"
    regions = [torch.autocast(device.type, dtype=torch.bfloat16, enabled=False)]
    if other == "cpu" or torch.cuda.is_available():
        regions.append(torch.autocast(other, dtype=torch.bfloat16))
    for region in regions:
        with region:
            got = hkernels.matmul(a, b.T)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", ["layer_norm", "softmax"])
def test_float32_rule_reads_sixteen_bits(op, backend, device, monkeypatch):
    """Where autocast computes layer_norm and softmax in float32 (CUDA; forced here on any device), the kernel reads
    the 16-bit activations as they are and writes the float32 result itself: no float32 copy of x is made. The
    result, and x's 16-bit gradient, are the op's on x read in float32, to the last bit of what the same backend
    gives for a float32 x (the cast is exact)."""
    applies = hkernels.functional._base.Autocast.applies
    monkeypatch.setattr(hkernels.functional._base.Autocast, "applies",
                        lambda self, d: self.policy == "float32" or applies(self, d))
    module = importlib.import_module(registry.OPS[op].module_name(backend))
    seen: list[tuple[torch.dtype, Any]] = []
    real = getattr(module, f"{op}_fwd")

    def spy(x: Tensor, *args: Any) -> Any:
        seen.append((x.dtype, args[-1]))
        return real(x, *args)

    monkeypatch.setattr(module, f"{op}_fwd", spy)
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(3, 5, 48, generator=g) * 2 + 1).to(device=device, dtype=torch.bfloat16).requires_grad_()
    params = [(torch.rand(48, generator=g) + 0.5).to(device).requires_grad_(),
              torch.randn(48, generator=g).to(device).requires_grad_()] if op == "layer_norm" else []
    fn = getattr(hkernels, op)
    dy = torch.randn(3, 5, 48, generator=g).to(device)
    with hkernels.use_backend(backend):
        with torch.autocast(device.type, dtype=torch.bfloat16):
            y = fn(x, *params)
        assert y.dtype == torch.float32
        assert seen == [(torch.bfloat16, torch.float32)]
        grads = torch.autograd.grad(y, (x, *params), dy)
        assert [g.dtype for g in grads] == [torch.bfloat16, *(torch.float32 for _ in params)]
        wide = [x.detach().float().requires_grad_(), *(p.detach().clone().requires_grad_() for p in params)]
        y32 = fn(*wide)
        want = torch.autograd.grad(y32, wide, dy)
    torch.testing.assert_close(y, y32, rtol=0, atol=0)
    torch.testing.assert_close(grads, (want[0].bfloat16(), *want[1:]), rtol=1e-5, atol=1e-5)


def test_softmax_dtype_argument(device):
    """``dtype`` as F.softmax's: x cast to it first (a 16-bit x widened to float32 is read as it is)."""
    g = torch.Generator().manual_seed(6)
    x = torch.randn(4, 33, generator=g).to(device)
    for backend in BACKENDS:
        with hkernels.use_backend(backend):
            for x_dtype, dtype in [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16),
                                   (torch.float16, torch.float16)]:
                got = hkernels.softmax(x.to(x_dtype), 0, dtype=dtype)
                want = torch.softmax(x.to(x_dtype), 0, dtype=dtype)
                assert got.dtype == dtype
                torch.testing.assert_close(got, want, **({} if dtype == torch.float32 else
                                                         {"rtol": 1e-2, "atol": 1e-3}))
    with pytest.raises(TypeError, match=r"hkernels\.softmax: dtype"):
        hkernels.softmax(x, -1, dtype=torch.int32)
