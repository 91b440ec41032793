"""Inputs off the main road: empty tensors, strides, mixed dtypes, 0-d softmax, and bad arguments."""

from __future__ import annotations

import pytest
import torch

import hkernels
from hkernels import references

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
            torch.testing.assert_close(hkernels.rms_norm(x, w), references.rms_norm(x, w))
            torch.testing.assert_close(hkernels.layer_norm(x, w, w), references.layer_norm(x, w, w))
            torch.testing.assert_close(hkernels.softmax(x, 0), references.softmax(x, 0))


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_float32_weight_with_bfloat16_input(backend, device):
    """Mixed precision: y has x's dtype, each gradient its tensor's dtype."""
    x = torch.randn(4, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(64, device=device, dtype=torch.float32, requires_grad=True)
    with hkernels.use_backend(backend):
        y = hkernels.rms_norm(x, w)
    y.float().sum().backward()
    assert y.dtype == torch.bfloat16 and x.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.float32
    torch.testing.assert_close(y, references.rms_norm(x, w))


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


# ------------------------------------------------------------------------------------------- the LLM op set


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_llm_ops_on_empty_inputs(backend, device):
    with hkernels.use_backend(backend):
        g = torch.randn(0, 8, device=device, requires_grad=True)
        hkernels.swiglu(g, g).sum().backward()
        assert g.grad.shape == (0, 8)
        x = torch.randn(3, 0, device=device, requires_grad=True)
        assert hkernels.geglu(x, x).shape == (3, 0)
        y, s = hkernels.add_rms_norm(torch.randn(0, 8, device=device), torch.randn(0, 8, device=device))
        assert y.shape == s.shape == (0, 8)
        q = torch.randn(1, 2, 0, 16, device=device, requires_grad=True)
        qr, kr = hkernels.rope(q, q[:, :1], torch.randn(0, 16, device=device), torch.randn(0, 16, device=device))
        assert qr.shape == (1, 2, 0, 16) and kr.shape == (1, 1, 0, 16)
        logits = torch.randn(0, 10, device=device, requires_grad=True)
        target = torch.zeros(0, dtype=torch.int64, device=device)
        assert torch.isnan(hkernels.cross_entropy(logits, target))  # a mean over no tokens, as in PyTorch
        assert hkernels.cross_entropy(logits, target, reduction="sum").item() == 0.0
        assert hkernels.cross_entropy(logits, target, reduction="none").shape == (0,)
        hkernels.cross_entropy(logits, target, reduction="sum").backward()
        assert logits.grad.shape == (0, 10)
        h = torch.randn(0, 4, device=device, requires_grad=True)
        w = torch.randn(10, 4, device=device, requires_grad=True)
        hkernels.fused_linear_cross_entropy(h, w, target, reduction="sum").backward()
        assert h.grad.shape == (0, 4) and torch.all(w.grad == 0)


@pytest.mark.parametrize("backend", [*KERNEL_BACKENDS, "torch"])
def test_cross_entropy_out_of_range_target_gives_nan_not_a_number(backend, device):
    """PyTorch raises; the kernels would need a host sync to check, so the row's loss and gradient are NaN."""
    logits = torch.randn(3, 10, device=device, requires_grad=True)
    target = torch.tensor([1, 10, -100], device=device)
    with hkernels.use_backend(backend):
        loss = hkernels.cross_entropy(logits, target, reduction="none")
        loss.sum().backward()
    assert torch.isnan(loss[1]) and torch.isfinite(loss[0]) and loss[2] == 0
    assert torch.isnan(logits.grad[1]).all() and torch.isfinite(logits.grad[0]).all() and (logits.grad[2] == 0).all()


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_cross_entropy_without_grad_and_second_backward(backend, device):
    logits = torch.randn(5, 30, device=device)
    target = torch.randint(0, 30, (5,), device=device)
    with hkernels.use_backend(backend):
        torch.testing.assert_close(hkernels.cross_entropy(logits, target), references.cross_entropy(logits, target))
        leaf = logits.clone().requires_grad_()
        loss = hkernels.cross_entropy(leaf, target)
    loss.backward(retain_graph=True)
    # the gradient made by the forward was scaled in place; a second backward must not reuse it silently
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


@pytest.mark.parametrize("packed", [False, True], ids=["rows_in_order", "packed_positions"])
@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_rope_gradients_for_learned_tables(backend, packed, device):
    """Learned tables get their gradients: [S, D] read row by row, or [P, D] read at packed positions (a row read
    by several tokens sums their gradients)."""
    q = torch.randn(2, 3, 5, 8, device=device, requires_grad=True)
    k = torch.randn(2, 1, 5, 8, device=device, requires_grad=True)
    cos = torch.randn(9 if packed else 5, 8, device=device, requires_grad=True)
    sin = torch.randn(9 if packed else 5, 8, device=device, requires_grad=True)
    positions = [torch.tensor([[0, 1, 2, 0, 1], [4, 5, 6, 7, 8]], device=device)] if packed else []
    with hkernels.use_backend(backend):
        qr, kr = hkernels.rope(q, k, cos, sin, *positions)
    (qr.sum() * 2 + (kr * kr).sum()).backward()
    got = [t.grad.clone() for t in (q, k, cos, sin)]
    for t in (q, k, cos, sin):
        t.grad = None
    qr, kr = references.rope(q, k, cos, sin, *positions)
    (qr.sum() * 2 + (kr * kr).sum()).backward()
    for g, t in zip(got, (q, k, cos, sin), strict=True):
        torch.testing.assert_close(g, t.grad, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64], ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("backend", [*KERNEL_BACKENDS, "torch"])
def test_rope_positions_outside_the_table_give_nan_rows(backend, ids_dtype, device):
    """No host sync checks the positions: a token whose position is outside [0, P) gets NaN q_rot, k_rot and
    gradients (never a row read out of bounds, nor a negative position wrapping to the table's end); every other
    token is finite and right."""
    q = torch.randn(2, 3, 6, 8, device=device, requires_grad=True)
    k = torch.randn(2, 1, 6, 8, device=device, requires_grad=True)
    angles = torch.randn(10, 8, device=device)
    cos, sin = torch.cos(angles), torch.sin(angles)
    position_ids = torch.tensor([[0, 3, -1, 9, 10, 2], [1000, 0, 1, 2, 3, -7]], device=device, dtype=ids_dtype)
    outside = torch.tensor([[0, 0, 1, 0, 1, 0], [1, 0, 0, 0, 0, 1]], device=device, dtype=torch.bool)
    with hkernels.use_backend(backend):
        qr, kr = hkernels.rope(q, k, cos, sin, position_ids)
    (qr.sum() + kr.sum()).backward()
    want_q, want_k = references.rope(q.detach(), k.detach(), cos, sin, position_ids)
    for name, got, want in (("q_rot", qr, want_q), ("k_rot", kr, want_k), ("dq", q.grad, None),
                            ("dk", k.grad, None)):
        nan_tokens = torch.isnan(got).all(-1)  # [B, H, S]
        finite_tokens = torch.isfinite(got).all(-1)
        assert torch.equal(nan_tokens, outside[:, None].expand_as(nan_tokens)), name
        assert torch.equal(finite_tokens, ~nan_tokens), name
        if want is not None:
            assert torch.equal(torch.isnan(want), torch.isnan(got)), name
            torch.testing.assert_close(got.detach(), want, rtol=1e-5, atol=1e-5, equal_nan=True)


def _t(d, *shape, dtype=torch.float32):
    return torch.ones(shape, device=d, dtype=dtype)


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda d: hkernels.swiglu(_t(d, 2, 4), _t(d, 2, 5)), ValueError,
         r"swiglu: gate and up must have the same shape"),
        (lambda d: hkernels.swiglu(_t(d, 2, 4), _t(d, 2, 4, dtype=torch.float16)), TypeError,
         r"swiglu: gate and up must have the same dtype"),
        (lambda d: hkernels.geglu(_t(d, 2, 4), _t(d, 2, 4), approximate="erf"), ValueError,
         r"geglu: approximate must be 'tanh' or 'none'"),
        (lambda d: hkernels.rope(_t(d, 1, 2, 3, 5), _t(d, 1, 1, 3, 5), _t(d, 3, 5), _t(d, 3, 5)), ValueError,
         r"rope: the head dim D must be even"),
        (lambda d: hkernels.rope(_t(d, 2, 3, 4), _t(d, 2, 3, 4), _t(d, 3, 4), _t(d, 3, 4)), ValueError,
         r"rope: q must be 4-d"),
        (lambda d: hkernels.rope(_t(d, 1, 2, 3, 4), _t(d, 1, 1, 3, 4), _t(d, 4, 4), _t(d, 4, 4)), ValueError,
         r"rope: cos must be \[S, D\]"),
        (lambda d: hkernels.rope(_t(d, 1, 2, 3, 4), _t(d, 2, 1, 3, 4), _t(d, 3, 4), _t(d, 3, 4)), ValueError,
         r"rope: q .* and k .* must agree on B, S and D"),
        (lambda d: hkernels.add_rms_norm(_t(d, 2, 4), _t(d, 3, 4)), ValueError,
         r"add_rms_norm: x and residual must have the same shape"),
        (lambda d: hkernels.cross_entropy(_t(d, 2, 3, 4), _t(d, 2, 3, dtype=torch.int64)), ValueError,
         r"cross_entropy: logits must be 2-d"),
        (lambda d: hkernels.cross_entropy(_t(d, 2, 4), _t(d, 3, dtype=torch.int64)), ValueError,
         r"cross_entropy: target must have shape \[T\] = \[2\]"),
        (lambda d: hkernels.cross_entropy(_t(d, 2, 4), _t(d, 2)), TypeError,
         r"cross_entropy: target must hold class indices"),
        (lambda d: hkernels.cross_entropy(_t(d, 2, 4), _t(d, 2, dtype=torch.int64), reduction="avg"), ValueError,
         r"cross_entropy: reduction must be 'mean', 'sum' or 'none'"),
        (lambda d: hkernels.cross_entropy(_t(d, 2, 4), _t(d, 2, dtype=torch.int64), label_smoothing=1.5), ValueError,
         r"cross_entropy: label_smoothing must be a float in \[0, 1\]"),
        (lambda d: hkernels.fused_linear_cross_entropy(_t(d, 2, 4), _t(d, 10, 5), _t(d, 2, dtype=torch.int64)),
         ValueError, r"fused_linear_cross_entropy: weight must be \[V, H\] with H = 4"),
        (lambda d: hkernels.fused_linear_cross_entropy(_t(d, 2, 4), _t(d, 10, 4, dtype=torch.float16),
                                                       _t(d, 2, dtype=torch.int64)),
         TypeError, r"fused_linear_cross_entropy: hidden and weight must have the same dtype"),
        (lambda d: hkernels.fused_linear_cross_entropy(_t(d, 2, 4), _t(d, 10, 4), _t(d, 2, dtype=torch.int64),
                                                       bias=_t(d, 9)),
         ValueError, r"fused_linear_cross_entropy: bias must be \[V\] = \[10\]"),
    ],
)
def test_llm_bad_input_names_the_op_and_the_problem(call, error, match, device):
    with pytest.raises(error, match=match):
        call(device)


def _attention_grads(backend: str, causal: bool, device: str):
    """Two backward runs of one GQA attention (4 query heads on 2 kv heads, S = 37, D = 64) and the float64
    reference's gradients."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 4, 37, 64, generator=g).to(device) for _ in range(3))
    k, v = k[:, :2], v[:, :2]  # grouped queries: 2 per kv head
    do = torch.randn(1, 4, 37, 64, generator=g).to(device)
    runs = []
    for _ in range(2):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        with hkernels.use_backend(backend):
            out = hkernels.attention(*leaves, causal=causal)
        runs.append(torch.autograd.grad(out, leaves, do))
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    want = torch.autograd.grad(references.attention(*leaves, causal=causal), leaves, do.double())
    return runs, want


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("causal", [False, True])
def test_attention_backward_is_deterministic(backend, causal, device):
    """Both backends' attention backward (Triton's separate dq kernel, Helion's dq kernel) is bitwise equal run to
    run, with gradients close to the float64 reference."""
    runs, want = _attention_grads(backend, causal, device)
    for a, b, w in zip(*runs, want, strict=True):
        assert torch.equal(a, b)
        torch.testing.assert_close(a.double(), w, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("causal", [False, True])
def test_attention_triton_dq_atomics(causal, device, monkeypatch):
    """Triton's other backward (dq by float32 atomics from the dk/dv kernel, a launch option kept for sweeps and
    tuning): gradients close to the float64 reference."""
    import dataclasses

    from triton_fallback import attention as t_attention

    shipped = t_attention.attention_settings

    def with_atomics(head_dim, dtype, causal, kernel, tma=True):
        s = shipped(head_dim, dtype, causal, kernel, tma)
        return dataclasses.replace(s, dq_atomic=True) if kernel == "dkdv" else s

    monkeypatch.setattr(t_attention, "attention_settings", with_atomics)
    runs, want = _attention_grads("triton", causal, device)
    for got in runs:
        for a, w in zip(got, want, strict=True):
            torch.testing.assert_close(a.double(), w, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("order", ["reduce", "barrier"])
def test_triton_linear_loss_in_place_x_target(order, device, monkeypatch):
    """The linear loss's chunks let the cross-entropy kernel write the gradient over the logits; x[target] must be
    read before any of it is overwritten. Both orderings of the Triton kernel (one load and a barrier, shipped; or
    picked out in pass 1's reductions) against float64, float32 so that a stale x[target] shows (an unordered load
    gives loss errors far above float32's rounding at this size on the GPU, varying run to run)."""
    from triton_fallback import cross_entropy as t_ce

    monkeypatch.setattr(t_ce, "GRAD_XT", order)
    g = torch.Generator().manual_seed(5)
    big = device.type == "cuda"
    t, h, v = (2048, 512, 32000) if big else (40, 16, 300)
    hidden = torch.randn(t, h, generator=g).to(device)
    weight = (torch.randn(v, h, generator=g) * h**-0.5).to(device)
    target = torch.randint(0, v, (t,), generator=g).to(device)
    want = torch.nn.functional.cross_entropy(hidden.double() @ weight.double().T, target)
    for _ in range(3 if big else 1):  # the race was intermittent: a few tries
        leaves = [hidden.clone().requires_grad_(), weight.clone().requires_grad_()]
        with hkernels.use_backend("triton"):
            loss = hkernels.fused_linear_cross_entropy(*leaves, target)
        torch.testing.assert_close(loss.double(), want, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("backend", ["helion", "triton"])
def test_losses_of_leaves_that_hold_a_gradient(backend, device):
    """A leaf whose ``.grad`` is already set (a second step without zero_grad) on the custom-op path (a device
    mode is active): Helion's binding must trace sizes to the input, never to its ``.grad`` of the same shape."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(6, 40, generator=g).to(device).requires_grad_()
    logits.grad = torch.zeros_like(logits)
    target = torch.randint(0, 40, (6,), generator=g).to(device)
    with hkernels.use_backend(backend), torch.device(device):
        loss = hkernels.cross_entropy(logits, target)
        loss.backward()
    ref = logits.detach().clone().requires_grad_()
    want = torch.nn.functional.cross_entropy(ref, target)
    want.backward()
    torch.testing.assert_close(loss.detach(), want.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(logits.grad, ref.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", ["helion", "triton"])
@pytest.mark.parametrize("linear", [False, True], ids=["logits", "linear_loss"])
def test_long_rows_kept_in_l2_give_the_same_loss_and_gradients(backend, linear, device, monkeypatch):
    """Rows of 16384 logits or more take the forward whose loads carry eviction hints (the gradient written in the
    same pass; in the linear loss, over each chunk's logits): a partial last block of the row, the loss and every
    gradient bit for bit as the path without the hints, and against float64."""
    import hkernels.ops.cross_entropy as helion_ce
    import triton_fallback.cross_entropy as triton_ce

    if linear and backend == "helion" and device.type == "cpu":
        pytest.skip("Helion's linear loss binds its chunk kernels for 90 s in interpret mode (a GPU runs it)")
    g = torch.Generator().manual_seed(11)
    v = 16500
    target = torch.randint(0, v, (3,), generator=g).to(device)
    inputs = [torch.randn(3, 8, generator=g), torch.randn(v, 8, generator=g) * 0.5] if linear else \
        [torch.randn(3, v, generator=g) * 2]
    inputs = [t.to(device, torch.bfloat16) for t in inputs]
    fn = hkernels.fused_linear_cross_entropy if linear else hkernels.cross_entropy
    results = []
    for start in (16384, 1 << 62):  # with the hints, then without
        monkeypatch.setattr(helion_ce, "KEEP_IN_L2_FROM", start)
        monkeypatch.setattr(triton_ce, "KEEP_IN_L2_FROM", start)
        leaves = [t.clone().requires_grad_() for t in inputs]
        with hkernels.use_backend(backend):
            loss = fn(*leaves, target)
            results.append((loss.detach(), *torch.autograd.grad(loss, leaves)))
    for got, want in zip(*results, strict=True):
        assert torch.equal(got, want), backend
    refs = [t.detach().double().requires_grad_() for t in inputs]
    ref_fn = references.fused_linear_cross_entropy if linear else references.cross_entropy
    want = ref_fn(*refs, target)
    torch.testing.assert_close(results[0][0].double(), want.detach(), rtol=2e-2, atol=2e-2)
    for got, ref in zip(results[0][1:], torch.autograd.grad(want, refs), strict=True):
        torch.testing.assert_close(got.double(), ref, rtol=2e-2, atol=2e-3 * float(ref.abs().max()))


_COMPILE_FOR_HOPPER = """
import re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import triton_fallback.cross_entropy as ce

names = ["logits_ptr", "target_ptr", "scale_ptr", "loss_ptr", "grad_ptr", "z_ptr", "pred_ptr", "ent_ptr", "w_ptr",
         "T", "V", "stride_logits", "stride_scale", "stride_grad", "ignore_index", "smoothing", "softcap", "z_scale"]
kinds = ["*bf16", "*i64", "*fp32", "*fp32", "*bf16", "*fp32", "*i64", "*fp32", "*fp32"] + ["i32"] * 2 + ["i64"] * 4 \\
    + ["fp32"] * 3
for fast in (True, False):
    constants = dict(HAS_GRAD=True, BLOCK_V=1024, NUM_STAGES=1, XT_BARRIER=True, SOFTCAP=True, Z_LOSS=False,
                     STATS=False, WEIGHTED=False, SMOOTH=False, KEEP_IN_L2=False, FAST_TANH=fast)
    signature = dict(zip(names, kinds)) | dict.fromkeys(constants, "constexpr")
    kernel = triton.compile(ASTSource(ce._cross_entropy_fwd_kernel, signature, constants),
                            target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    ptx = kernel.asm["ptx"]
    print(*(len(re.findall(p, ptx)) for p in (r"tanh[.]approx[.]f32", r"\\bdiv[.]", r"\\bex2[.]")))
"""

# Helion's generated Triton for the capped forward with a gradient, bf16 logits: the host function's arguments
# caught at its launch, then the kernel's code with the switch on and off (count of the instruction's sites).
_HELION_CODE = """
import torch
import hkernels.ops.cross_entropy as ce
from hkernels.ops import _helion

class Caught(Exception):
    pass

def catch(kernel, args, n, device, rows=()):
    raise Caught(args)

_helion.run = catch
ce.interpreting = lambda: False  # (the switch as on a GPU)
x = torch.randn(4, 64, dtype=torch.bfloat16)
try:
    ce.cross_entropy_fwd(x, torch.randint(0, 64, (4,)), torch.ones(4), -100, 0.0, x.clone(), 30.0)
except Caught as caught:
    args = list(caught.args[0])
assert args[-1] is True
for fast in (True, False):
    args[-1] = fast
    bound = ce._cross_entropy_fwd.bind(tuple(args))
    print(bound.to_triton_code(bound.config_spec.default_config()).count("tanh.approx.f32"))
"""


@pytest.mark.parametrize("backend", ["helion", "triton"])
def test_capped_loss_with_the_gpus_tanh(backend, device, monkeypatch):
    """16-bit logits under a cap take the GPU's tanh instruction (relative error 2^-11): the loss and the gradient
    against float64 as close as the exact form's, and not the exact form's bits (the switch took effect)."""
    import hkernels.ops.cross_entropy as helion_ce
    import triton_fallback.cross_entropy as triton_ce
    from hkernels import dispatch

    if device.type != "cuda":
        pytest.skip("the GPU's tanh instruction: no interpreter runs it")
    g = torch.Generator().manual_seed(12)
    logits = (torch.randn(64, 32000, generator=g) * 12).to(device, torch.bfloat16)  # x / c over ±4
    target = torch.randint(0, 32000, (64,), generator=g).to(device)
    options = {"softcap": 10.0, "lse_square_scale": 1e-3}
    results = []
    for dtypes in ((torch.bfloat16, torch.float16), ()):  # the instruction, then the exact form
        monkeypatch.setattr(helion_ce, "FAST_TANH_DTYPES", dtypes)
        monkeypatch.setattr(triton_ce, "FAST_TANH_DTYPES", dtypes)
        dispatch.forget()
        x = logits.clone().requires_grad_()
        with hkernels.use_backend(backend):
            loss = hkernels.cross_entropy(x, target, **options)
            results.append((loss.detach().double(), torch.autograd.grad(loss, x)[0].double()))
    ref = logits.double().requires_grad_()
    want = references.cross_entropy(ref, target, **options)
    (want_grad,) = torch.autograd.grad(want, ref)
    (_, fast_grad), (_, exact_grad) = results
    assert not torch.equal(fast_grad, exact_grad)
    for loss, grad in results:
        torch.testing.assert_close(loss, want.detach(), rtol=2e-3, atol=1e-3)
        torch.testing.assert_close(grad, want_grad, rtol=2e-2, atol=2e-3 * float(want_grad.abs().max()))
    assert (fast_grad - want_grad).abs().max() <= 2 * (exact_grad - want_grad).abs().max() + 1e-6


def test_capped_loss_kernel_compiles_for_hopper_with_the_tanh_instruction():
    """The Triton kernel for 16-bit capped logits, compiled for sm90 down to the cubin (Triton's ptxas; no GPU
    needed), in a process outside interpret mode: the tanh instruction for each logit of both passes (and x[t]),
    against the exact form's division and second exp2; Helion's generated code with the instruction at its three
    sites, and without it when the switch is off."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "HKERNELS_INTERPRET")}
    done = subprocess.run([sys.executable, "-c", _COMPILE_FOR_HOPPER], env=env, capture_output=True, text=True,
                          timeout=600, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if done.returncode != 0 and "ptxas" in done.stderr and "not found" in done.stderr.lower():
        pytest.skip("no ptxas here")
    assert done.returncode == 0, done.stderr[-2000:]
    (fast_tanh, fast_div, fast_ex2), (exact_tanh, exact_div, exact_ex2) = (
        [int(n) for n in line.split()] for line in done.stdout.strip().splitlines())
    assert fast_tanh >= 3 and exact_tanh == 0, done.stdout
    # per logit: no division (the scalars' few remain) and one exp2 where the exact form takes two
    assert fast_div < exact_div and 1.5 * fast_ex2 < exact_ex2, done.stdout
    # Helion's twin: the instruction at each of its three sites (x[t], both passes) when on, none when off
    done = subprocess.run([sys.executable, "-c", _HELION_CODE], env=env, capture_output=True, text=True,
                          timeout=600, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["3", "0"], done.stdout


@pytest.mark.parametrize("backend", ["helion", "triton"])
def test_long_rows_kept_in_l2_in_place(backend, device, monkeypatch):
    """The kernel as the linear loss runs it, the gradient written over the logits it reads, on rows of 16384
    logits or more (eviction hints, x[target] picked out in pass 1): bit for bit as without the hints."""
    import importlib

    module = importlib.import_module("hkernels.ops.cross_entropy" if backend == "helion"
                                     else "triton_fallback.cross_entropy")
    g = torch.Generator().manual_seed(12)
    v = 16500
    logits = (torch.randn(3, v, generator=g) * 2).to(device, torch.bfloat16)
    target = torch.randint(0, v, (3,), generator=g).to(device)
    scale = torch.full((3,), 1 / 3, device=device)
    results = []
    for start in (16384, 1 << 62):  # with the hints, then without
        monkeypatch.setattr(module, "KEEP_IN_L2_FROM", start)
        x = logits.clone()
        loss = module.cross_entropy_fwd(x, target, scale, -100, 0.0, x)
        results.append((loss, x))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    ref = logits.double().requires_grad_()
    want = torch.nn.functional.cross_entropy(ref, target, reduction="none")
    torch.testing.assert_close(results[0][0].double(), want.detach(), rtol=1e-4, atol=1e-4)
    (grad,) = torch.autograd.grad(want.sum() / 3, ref)
    torch.testing.assert_close(results[0][1].double(), grad, rtol=2e-2, atol=2e-3 * float(grad.abs().max()))


@pytest.mark.parametrize("backend", ["helion", "triton"])
def test_cross_entropy_after_the_linear_loss_keeps_its_logits(backend, device):
    """The linear-CE chunk path runs the cross-entropy kernel in place (its gradient written over the chunk's
    logits); a later cross_entropy call of the same shapes must not reuse that compiled Helion function (a cache
    keyed by shapes, not by which arguments are one tensor, would): it would write the gradient into the caller's
    logits and leave its own gradient unwritten."""
    g = torch.Generator().manual_seed(3)
    target = torch.randint(0, 40, (6,), generator=g).to(device)
    hidden, weight = (torch.randn(*s, generator=g).to(device).requires_grad_() for s in ((6, 16), (40, 16)))
    logits = torch.randn(6, 40, generator=g).to(device).requires_grad_()
    before = logits.detach().clone()
    with hkernels.use_backend(backend):
        hkernels.fused_linear_cross_entropy(hidden, weight, target).backward()  # [6, 40] logits, in place
        loss = hkernels.cross_entropy(logits, target)
        (grad,) = torch.autograd.grad(loss, logits)
    assert torch.equal(logits.detach(), before), f"{backend}: cross_entropy wrote into its logits"
    want = torch.nn.functional.softmax(before.double(), -1)
    want[torch.arange(6), target] -= 1
    torch.testing.assert_close(grad.double(), want / 6, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", ["helion", "triton"])
def test_layer_norm_of_one_element_rows_has_zero_input_gradient(backend, device):
    """N = 1: x̂ = 0, so dx is exactly 0 (NaN in a row whose x is not finite). A GPU kernel that fuses w·dy into the
    subtraction of its rounded mean leaves a float32 rounding times rstd = 1/√eps; the CPU interpreter never fuses,
    so only a GPU run can fail this."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(5, 1, generator=g)
    x[3, 0] = float("nan")
    x = x.to(device).requires_grad_()
    w, b = (torch.randn(1, generator=g).to(device).requires_grad_() for _ in range(2))
    dy = torch.randn(5, 1, generator=g).to(device)
    with hkernels.use_backend(backend):
        dx, _, db = torch.autograd.grad(hkernels.layer_norm(x, w, b), (x, w, b), dy)  # dw: NaN from row 3
    finite = torch.ones(5, dtype=torch.bool, device=device)
    finite[3] = False
    assert torch.equal(dx[finite], torch.zeros_like(dx[finite])), f"{backend}: dx {dx[finite].tolist()}"
    assert torch.isnan(dx[3]).all()
    torch.testing.assert_close(db, dy.sum(0))


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_softmax_split_rows_with_non_finite_values(backend, device):
    # Rows longer than a block of registers are split across programs that exchange per-chunk statistics: a NaN, an
    # +inf or a row of -inf in one chunk must give PyTorch's answer (and never stall the wait for that chunk).
    n = 70001
    x = torch.randn(5, n, device=device)
    x[0, 40000] = float("nan")
    x[1, 123] = float("inf")
    x[2] = float("-inf")
    x[3, 50000:] = float("-inf")
    want = torch.softmax(x.double(), -1)
    with hkernels.use_backend(backend):
        got = hkernels.softmax(x, -1)
    torch.testing.assert_close(got.double(), want, equal_nan=True, atol=1e-6, rtol=1e-5)
    dy = torch.randn_like(x)
    xr = x[3:].clone().requires_grad_()
    with hkernels.use_backend(backend):
        (g,) = torch.autograd.grad(hkernels.softmax(xr, -1), xr, dy[3:])
    (want_g,) = torch.autograd.grad(torch.softmax(xr.double(), -1), xr, dy[3:].double())
    torch.testing.assert_close(g.double(), want_g.double(), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("n", [300, 40000])
def test_helion_softmax_takes_64_bit_indices_for_rows_reaching_past_int32(n, device, monkeypatch):
    # Helion picks 32-bit indices by a tensor's element count; a row-strided view can reach further than that.
    # With the limit lowered, every softmax kernel (resident and split rows) must run its 64-bit twin, correctly.
    from hkernels.ops import _helion, swiglu
    from hkernels.ops import softmax as h_sm

    monkeypatch.setattr(swiglu, "_INT32_MAX", 1000)
    monkeypatch.setattr(_helion, "_compiled", {})  # the kernels this test compiles, and only those
    x, dy, y = (torch.empty(6, n, device=device)[::2] for _ in range(3))
    x.copy_(torch.randn(3, n, device=device))
    dy.copy_(torch.randn(3, n, device=device))
    y.copy_(h_sm.softmax_fwd(x))
    dx = h_sm.softmax_bwd(dy, y)
    want = torch.softmax(x.double(), -1)
    torch.testing.assert_close(y.double(), want, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(dx.double(), want * (dy.double() - (dy.double() * want).sum(-1, keepdim=True)),
                               atol=1e-6, rtol=1e-5)
    used = {key[0] for key in _helion._compiled}
    assert len(used) == 2 and used <= set(h_sm._WIDE.values())


@pytest.mark.parametrize("backend", [*KERNEL_BACKENDS, "torch"])
def test_attention_varlen_keeps_each_sequence_to_itself(backend, device):
    """A NaN in one packed sequence's q, k or v reaches no other sequence, forward or backward, and bounds past the
    rows that exist are clamped (rows of no sequence: zeros, and zero gradients)."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(40, 2, 16, generator=g).to(device) for _ in range(3))
    cu = torch.tensor([0, 13, 30, 55], dtype=torch.int32, device=device)  # the last ends past the 40 rows
    clean = [t.clone().requires_grad_() for t in (q, k, v)]
    poisoned = [t.clone() for t in (q, k, v)]
    for t in poisoned:
        t[20] = float("nan")  # inside the second sequence, rows 13..29
    poisoned = [t.requires_grad_() for t in poisoned]
    outs = []
    for ins in (clean, poisoned):
        with hkernels.use_backend(backend):
            o = hkernels.attention_varlen(*ins, cu, max_seqlen_q=25, causal=True, window=(6, 0), softcap=4.0)
        o.backward(torch.ones_like(o))
        outs.append(o.detach())
    ref = references.attention_varlen(*(t.detach().double() for t in clean), cu, causal=True, window=(6, 0),
                                      softcap=4.0)
    others = torch.cat([torch.arange(0, 13), torch.arange(30, 40)]).to(device)
    torch.testing.assert_close(outs[0].double(), ref, atol=1e-4, rtol=1e-4)
    assert torch.equal(outs[1][others], outs[0][others])
    assert not torch.isfinite(outs[1][20]).any()
    for c, p in zip(clean, poisoned, strict=True):
        assert torch.isfinite(p.grad[others]).all()
        torch.testing.assert_close(p.grad[others], c.grad[others], atol=0, rtol=0)


@pytest.mark.parametrize("backend", [*KERNEL_BACKENDS, "torch"])
def test_attention_varlen_rows_of_no_sequence_are_zero(backend, device):
    """Rows before the first sequence and after the last get o = 0 and zero gradients, even where the memory the
    outputs land in held NaN before (no attention program writes those rows)."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(24, 2, 16, generator=g).to(device).requires_grad_() for _ in range(3))
    cu = torch.tensor([3, 10, 18], dtype=torch.int32, device=device)
    for _ in range(2):
        del_me = [torch.full((24, 2, 16), float("nan"), device=device) for _ in range(8)]
        del del_me  # freed blocks of the outputs' size, full of NaN, for the allocator to hand out again
        with hkernels.use_backend(backend):
            o = hkernels.attention_varlen(q, k, v, cu, max_seqlen_q=8, causal=True)
        o.backward(torch.randn(o.shape, generator=g).to(device))
        outside = torch.cat([torch.arange(0, 3), torch.arange(18, 24)]).to(device)
        assert torch.equal(o.detach()[outside], torch.zeros_like(o[outside]))
        for t in (q, k, v):
            assert torch.equal(t.grad[outside], torch.zeros_like(t.grad[outside]))
            t.grad = None
        ref = references.attention_varlen(*(t.detach().double() for t in (q, k, v)), cu, causal=True)
        torch.testing.assert_close(o.detach().double(), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("op", ["attention", "attention_varlen"])
def test_attention_head_dim_256_runs_on_triton(op, device, monkeypatch):
    """D = 256 (Gemma): Helion's kernels declare that they refuse it, so auto runs Triton without trying Helion
    and without a warning (forward and backward), and selected_backend says so before the call, even where no
    measured table picks Triton; Helion asked for by name raises naming the reason and what can run it."""
    import warnings

    from hkernels import configs

    monkeypatch.setattr(configs, "auto_table", lambda arch: {})
    g = torch.Generator().manual_seed(6)
    if op == "attention":
        q, k, v = (torch.randn(1, 2, 20, 256, generator=g).to(device).requires_grad_() for _ in range(3))
        args, kwargs = (q, k, v), {"causal": True}
    else:
        q, k, v = (torch.randn(20, 2, 256, generator=g).to(device).requires_grad_() for _ in range(3))
        args, kwargs = (q, k, v, torch.tensor([0, 7, 20], dtype=torch.int32, device=device)), {"causal": True}
    run = getattr(hkernels, op)
    with hkernels.use_backend("helion"), pytest.raises(hkernels.BackendUnavailableError,
                                                       match=rf"{op}.*head dims up to 128, got 256.*triton"):
        run(*args, **kwargs)
    chosen = hkernels.selected_backend(op, *args, **kwargs)
    assert chosen == "triton" and "head dims up to 128, got 256" in chosen.reason
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        o = run(*args, **kwargs)
        o.sum().backward()
    ref = getattr(references, op)(*(a.detach().double() if a.is_floating_point() else a for a in args), **kwargs)
    torch.testing.assert_close(o.double(), ref, atol=1e-4, rtol=1e-4)
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (q, k, v))


@pytest.mark.parametrize("backend", ["helion", "triton", "torch"])
def test_layer_norm_parameter_gradients_sum_many_rows_accurately(backend, device):
    """dw and db in float32 over 1536 rows whose mean is far from zero: within twice the error of PyTorch's own
    float32 computation (each column's sum over the rows is not one long serial chain)."""
    g = torch.Generator().manual_seed(0)
    M, N = 3 * 512, 128
    x = (torch.randn(M, N, generator=g) * 2 + 3).to(device)
    w, b = ((torch.randn(N, generator=g) * 0.5 + s).to(device) for s in (1.0, 0.0))
    dy = torch.randn(M, N, generator=g).to(device)
    x64, w64, b64 = (t.double().requires_grad_() for t in (x, w, b))
    references.layer_norm(x64, w64, b64, 1e-5).backward(dy.double())
    xt, wt, bt = (t.clone().requires_grad_() for t in (x, w, b))
    references.layer_norm(xt, wt, bt, 1e-5).backward(dy)  # PyTorch's own float32 error
    xs, ws, bs = (t.clone().requires_grad_() for t in (x, w, b))
    with hkernels.use_backend(backend):
        hkernels.layer_norm(xs, ws, bs, 1e-5).backward(dy)
    for name, got, base, want in (("dw", ws.grad, wt.grad, w64.grad), ("db", bs.grad, bt.grad, b64.grad)):
        err = (got.double() - want).abs().max().item()
        base_err = (base.double() - want).abs().max().item()
        assert err <= 2 * base_err, f"{name}: max error {err:.3g}, PyTorch's float32 {base_err:.3g}"


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize(("S", "options"), [(1, {}), (9, {"causal": True, "window": (0, None)}),
                                            (9, {"causal": True, "window": (0, 0), "softcap": 5.0})],
                         ids=["one_token", "self_only", "self_only_softcap"])
def test_attention_gradients_are_exactly_zero_where_each_query_keeps_one_key(backend, S, options, device):
    """A one-hot softmax (each query sees one key) has dq = dk = 0 in exact arithmetic: dS = P ∘ (dP − δ) with
    δ = rowsum(dO ∘ O) = dP of that key. In float32 the kernels compute δ with the same dot as dP, so the
    cancellation is exact: not rounding noise, which a relative check of a zero gradient cannot tell from a wrong
    one. dv = dO to float32 rounding (with a cap, the one probability is 1 within an ulp on a GPU)."""
    g = torch.Generator().manual_seed(S)
    q, k, v, do = (torch.randn(2, 4, S, 64, generator=g).to(device) for _ in range(4))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    with hkernels.use_backend(backend):
        o = hkernels.attention(*leaves, **options)
        dq, dk, dv = torch.autograd.grad(o, leaves, do)
    torch.testing.assert_close(o, v, rtol=0, atol=0)
    assert dq.abs().max().item() == 0 and dk.abs().max().item() == 0, (dq.abs().max(), dk.abs().max())
    torch.testing.assert_close(dv, do, rtol=1e-6, atol=0)


@pytest.mark.parametrize("op", ["rms_norm", "add_rms_norm"])
def test_norm_offset_needs_a_weight_and_a_finite_value(op, device):
    x = torch.randn(3, 16, device=device)
    args = (x, x.clone()) if op == "add_rms_norm" else (x,)
    fn = getattr(hkernels, op)
    with pytest.raises(ValueError, match=rf"hkernels\.{op}: offset 1.0 scales by offset \+ weight, so it needs a"):
        fn(*args, None, 1e-6, 1.0)
    for bad in (float("nan"), float("inf"), "1", True):
        with pytest.raises(TypeError, match=rf"hkernels\.{op}: offset must be a finite float"):
            fn(*args, torch.zeros(16, device=device), 1e-6, bad)


def test_norm_offset_is_gemmas_one_plus_weight(device):
    """offset=1 scales by 1 + w taken in float32, as Gemma's RMSNorm does: a bfloat16 weight near 0 keeps its small
    values (1 + w in bfloat16 would round them to 1 or 1 + 2⁻⁷, an error of up to 4e-3 here)."""
    x = torch.randn(4, 64, device=device)
    w = (torch.randn(64, device=device) * 3e-3).to(torch.bfloat16)
    want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (1.0 + w.float())
    for backend in KERNEL_BACKENDS:
        with hkernels.use_backend(backend):
            torch.testing.assert_close(hkernels.rms_norm(x, w, 1e-6, offset=1.0), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("op", ["rms_norm", "add_rms_norm"])
def test_norm_offset_follows_the_weight_and_the_offset_from_call_to_call(op, device):
    """The kernels apply offset + w as they load w: calls of one signature (the second and later replay the first's
    plan in one step) follow a weight written in place, given new memory (``param.data = ...``) or another dtype,
    and another offset; with a gradient, each call's dx and dw are the formula's for that call's offset; a frozen
    weight (no requires_grad) in a training step too."""
    g = torch.Generator().manual_seed(6)
    x, r = (torch.randn(3, 64, generator=g).to(device) for _ in range(2))
    w = torch.nn.Parameter((torch.randn(64, generator=g) * 0.1).to(device))
    fn = getattr(hkernels, op)

    def want_of(h: torch.Tensor, w: torch.Tensor, offset: float) -> torch.Tensor:
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * (offset + w.float())

    def check(offset: float) -> None:
        for _ in range(3):  # (the first call records a plan; the next replay it)
            out = fn(x, w, 1e-6, offset=offset) if op == "rms_norm" else fn(x, r, w, 1e-6, offset=offset)[0]
            h = x if op == "rms_norm" else x + r
            want = want_of(h, w.detach(), offset)
            torch.testing.assert_close(out.float(), want.to(out.dtype).float(), rtol=1e-5, atol=1e-5)

    for backend in KERNEL_BACKENDS:
        with hkernels.use_backend(backend), torch.no_grad():
            check(1.0)
            w.mul_(3.0)
            check(1.0)
            w.data = torch.randn(64, generator=g).to(device)
            check(1.0)
            check(0.5)
            w.data = w.data.to(torch.bfloat16)
            check(1.0)
            w.data = w.data.float()
        with hkernels.use_backend(backend):
            for offset in (1.0, 0.5, 1.0):
                for _ in range(2):
                    xg, wg = x.clone().requires_grad_(), w.detach().clone().requires_grad_()
                    out = fn(xg, wg, 1e-6, offset=offset) if op == "rms_norm" else \
                        fn(xg, r, wg, 1e-6, offset=offset)[0]
                    dy = torch.randn(out.shape, generator=g).to(device)
                    dx, dw = torch.autograd.grad(out, (xg, wg), dy)
                    ref, wref = x.clone().requires_grad_(), w.detach().clone().requires_grad_()
                    want = want_of(ref if op == "rms_norm" else ref + r, wref, offset)
                    dref, dwref = torch.autograd.grad(want, (ref, wref), dy)
                    torch.testing.assert_close(dx, dref, rtol=1e-4, atol=1e-4)
                    torch.testing.assert_close(dw, dwref, rtol=1e-4, atol=1e-4)
            frozen = w.detach()
            xg = x.clone().requires_grad_()
            out = fn(xg, frozen, 1e-6, offset=1.0) if op == "rms_norm" else fn(xg, r, frozen, 1e-6, offset=1.0)[0]
            (dx,) = torch.autograd.grad(out.float().sum(), xg)
            ref = x.clone().requires_grad_()
            want = want_of(ref if op == "rms_norm" else ref + r, frozen, 1.0)
            (dref,) = torch.autograd.grad(want.to(out.dtype).float().sum(), ref)
            torch.testing.assert_close(dx.float(), dref, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_norm_offset_in_a_cuda_graph_follows_the_weight():
    """A CUDA graph captured around a Gemma norm without a gradient reads the weight itself on every replay (offset
    + w made inside the kernel, nothing kept from an eager call): a replay after the weight is written gives the
    new result."""
    x = torch.randn(4, 256, device="cuda")
    w = torch.nn.Parameter(torch.randn(256, device="cuda") * 0.1)
    with torch.no_grad():
        hkernels.rms_norm(x, w, 1e-6, offset=1.0)  # (an eager call first: the scale is kept)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            hkernels.rms_norm(x, w, 1e-6, offset=1.0)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = hkernels.rms_norm(x, w, 1e-6, offset=1.0)
        w.mul_(3.0)
        graph.replay()
        want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (1.0 + w)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def test_norm_llama_casting_is_hugging_faces_llama_rmsnorm(device):
    """casting="llama": the normalised x rounded to x's dtype, then times the weight, the result in their promoted
    dtype — a float32 weight on bfloat16 input gives float32, and gradients of each input's dtype, as the module
    computes them; with one dtype, the fused kernel (the float32 form); other values and an offset are refused."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(5, 64, generator=g).to(device).to(torch.bfloat16).requires_grad_()
    w = (1.0 + 0.2 * torch.randn(64, generator=g)).to(device).requires_grad_()

    def llama(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)

    want = llama(x, w)
    up = torch.randn(want.shape, generator=g).to(device)
    want_grads = torch.autograd.grad(want, (x, w), up)
    for backend in KERNEL_BACKENDS:
        with hkernels.use_backend(backend):
            got = hkernels.rms_norm(x, w, 1e-6, casting="llama")
            assert got.dtype == torch.float32
            xhat = hkernels.rms_norm(x.detach(), None, 1e-6)
            assert xhat.dtype == torch.bfloat16 and torch.equal(got, w.detach() * xhat)  # x̂ in x's dtype, then · w
            # (both round x̂ to bfloat16; the kernel's float32 x̂ and PyTorch's may differ in the last bit, which can
            # move that rounding by one bfloat16 step, 2⁻⁸ relative, on an element near a rounding boundary)
            torch.testing.assert_close(got, want, rtol=2**-8, atol=1e-5)
            for a, b in zip(torch.autograd.grad(got, (x, w), up), want_grads, strict=True):
                assert a.dtype == b.dtype
                torch.testing.assert_close(a, b, rtol=1.6e-2, atol=1e-2)
            same = hkernels.rms_norm(x, w.detach().to(torch.bfloat16), 1e-6, casting="llama")
            assert torch.equal(same, hkernels.rms_norm(x, w.detach().to(torch.bfloat16), 1e-6))
    with pytest.raises(ValueError, match=r"hkernels\.rms_norm: casting must be 'float32' or 'llama', got 'gemma'"):
        hkernels.rms_norm(x, w, casting="gemma")
    with pytest.raises(ValueError, match=r"hkernels\.rms_norm: casting='llama' is the form without an offset"):
        hkernels.rms_norm(x, w, offset=1.0, casting="llama")


def _norm_grads(op: str, backend: str, shape: tuple[int, ...], in_place: bool, tail: str, device: torch.device
                ) -> tuple[tuple[torch.Tensor, ...], bool, list[torch.Tensor]]:
    """rms_norm (or add_rms_norm, its sum's gradient coming in too) forward and backward on one backend, y's
    gradient reaching it as ``tail`` makes it: (the inputs' gradients, whether x's (or residual's) gradient is the
    buffer y's gradient came in, the tensors that must be left as they were)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(shape, generator=g).to(device).requires_grad_()
    w = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(device).requires_grad_()
    r = torch.randn(shape, generator=g).to(device).requires_grad_()
    res = torch.randn(shape, generator=g).to(device).requires_grad_()
    inputs = (x, w) if op == "rms_norm" else (x, res, w)
    with hkernels.use_backend(backend):
        if op == "rms_norm":
            y, h = hkernels.rms_norm(x, w, 1e-6, in_place=in_place), None
        else:
            y, h = hkernels.add_rms_norm(x, res, w, 1e-6, in_place=in_place)
        seen: list[int] = []
        kept: list[torch.Tensor] = []
        y.register_hook(lambda grad: seen.append(grad.data_ptr()))  # (holds nothing past the call)
        more = (h * 0.5).sum() if h is not None else 0.0
        if tail == "scaled":
            ((y * 3).sum() + more).backward()
        elif tail == "residual":  # y's gradient is also r's (the add passes one tensor to both)
            (((y + r) * 3).sum() + more).backward()
            kept.append(r.grad)
        elif tail == "given":  # the caller's own tensor
            up = torch.full(shape, 3.0, device=device)
            torch.autograd.backward([y] if h is None else [y, h], [up] if h is None else [up, torch.ones_like(h)])
            kept.append(up)
        elif tail == "hooked":  # a hook that keeps y's gradient
            y.register_hook(kept.append)
            ((y * 3).sum() + more).backward()
        elif tail == "kept detached":  # a hook that keeps another tensor on the gradient's memory
            y.register_hook(lambda grad: kept.append(grad.detach()))
            ((y * 3).sum() + more).backward()
        elif tail == "linear":  # a matmul's gradient, viewed back to y's shape (a norm feeding a linear layer)
            ((y @ torch.full((shape[-1], 2), 1.5, device=device)).sum() + more).backward()
    # (add_rms_norm's one gradient goes to x and residual: one of them takes the buffer, the other a copy)
    return tuple(t.grad for t in inputs), seen[0] in (x.grad.data_ptr(), res.grad.data_ptr() if h is not None
                                                      else None), kept


@pytest.mark.parametrize("backend", ["helion", "triton", "torch"])
@pytest.mark.parametrize("shape", [(6, 32), (2, 3, 32), (1, 32), (3, 8200)], ids=str)
@pytest.mark.parametrize("op", ["rms_norm", "add_rms_norm"])
def test_norm_in_place_writes_the_input_gradient_over_the_output_gradient(op, backend, shape, device):
    """in_place=True: the backward writes x's gradient into the buffer of y's gradient where nothing else holds
    it, the same values as out of place; where something does (a gradient shared with a residual, passed by the
    caller, kept by a hook) it writes a new buffer and leaves that one as it was."""
    for tail in ("scaled", "residual", "given", "hooked", "kept detached", "linear"):
        want, _, _ = _norm_grads(op, backend, shape, False, tail, device)
        got, reused, kept = _norm_grads(op, backend, shape, True, tail, device)
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b), tail
        assert reused == (tail in ("scaled", "residual", "linear")), f"{tail}: y's gradient buffer reused: {reused}"
        for t in kept:
            assert torch.equal(t, torch.full(shape, 3.0, device=device)), f"{tail}: a held gradient was written"
    with hkernels.use_backend(backend):  # its outputs are tensors of their own, not views: writable in place
        x = torch.randn(shape, device=device, requires_grad=True)
        outs = hkernels.rms_norm(x, None, in_place=True) if op == "rms_norm" else hkernels.add_rms_norm(
            x, torch.randn(shape, device=device), None, in_place=True)
        for out in (outs,) if op == "rms_norm" else outs:
            out.mul_(2)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_one_row_results_can_be_written_in_place(backend, device):
    """A call of one row (decoding) returns tensors of its own, not views of a padded buffer: a caller may write
    into them in place, as into PyTorch's results."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(1, 32, generator=g).to(device).requires_grad_()
    q = torch.randn(1, 2, 16, generator=g).to(device).requires_grad_()
    cu = torch.tensor([0, 1], dtype=torch.int32, device=device)
    with hkernels.use_backend(backend):
        outs = [*hkernels.add_rms_norm(x, torch.randn(1, 32, generator=g).to(device)),
                hkernels.rms_norm(x), hkernels.cross_entropy(x, torch.tensor([3], device=device), reduction="none"),
                hkernels.attention_varlen(q, q, q, cu, max_seqlen_q=1, max_seqlen_k=1)]
    for out in outs:
        out.mul_(2)


def test_norm_in_place_is_a_bool_and_left_to_the_compiler_in_graphs(device):
    x = torch.randn(4, 16, device=device, requires_grad=True)
    with pytest.raises(TypeError, match=r"hkernels\.rms_norm: in_place must be a bool, got int"):
        hkernels.rms_norm(x, None, in_place=1)
    with pytest.raises(TypeError, match=r"hkernels\.add_rms_norm: in_place must be a bool, got str"):
        hkernels.add_rms_norm(x, x, None, in_place="yes")
    w = torch.randn(16, device=device, requires_grad=True)
    up = torch.randn(4, 16, device=device)
    want = torch.autograd.grad(hkernels.rms_norm(x, w), (x, w), up)
    torch._dynamo.reset()
    compiled = torch.compile(lambda x, w: hkernels.rms_norm(x, w, in_place=True), backend="aot_eager", fullgraph=True)
    up_before = up.clone()
    got = torch.autograd.grad(compiled(x, w), (x, w), up)
    assert torch.equal(up, up_before)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)
    module = hkernels.nn.RMSNorm(16, in_place=True).to(device)
    assert "in_place=True" in repr(module)
    torch.testing.assert_close(module(x), hkernels.rms_norm(x, module.weight, torch.finfo(x.dtype).eps))


@pytest.mark.parametrize(("option", "value", "error"), [
    ("softcap", 0.0, ValueError), ("softcap", -1.0, ValueError), ("softcap", float("nan"), ValueError),
    ("softcap", float("inf"), ValueError), ("lse_square_scale", -1e-4, ValueError),
    ("lse_square_scale", float("inf"), ValueError), ("return_z_loss", 1, TypeError),
])
def test_loss_options_out_of_range_raise_naming_the_op(option, value, error, device):
    logits = torch.randn(3, 10, device=device)
    target = torch.tensor([1, 2, 3], device=device)
    with pytest.raises(error, match=rf"hkernels\.cross_entropy: {option} must be"):
        hkernels.cross_entropy(logits, target, **{option: value})


@pytest.mark.parametrize("backend", ["helion", "triton", "torch"])
def test_z_loss_is_part_of_the_loss_and_returned_alone(backend, device):
    """loss with lse_square_scale λ = the plain loss + λ·mean(lse²) over the kept tokens; return_z_loss gives that
    term alone; a softcap of 1e6 leaves the logits as they are (tanh(x/c)·c = x to float32 precision)."""
    g = torch.Generator().manual_seed(9)
    logits = (torch.randn(6, 40, generator=g) * 3).to(device)
    target = torch.tensor([1, -100, 5, 39, 0, 7], device=device)
    with hkernels.use_backend(backend):
        plain = hkernels.cross_entropy(logits, target)
        loss, z = hkernels.cross_entropy(logits, target, lse_square_scale=1e-2, return_z_loss=True)[:2]
        capped = hkernels.cross_entropy(logits, target, softcap=1e6)
    kept = target != -100
    want_z = 1e-2 * torch.logsumexp(logits[kept], -1).pow(2).mean()
    torch.testing.assert_close(z, want_z, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss, plain + want_z, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(capped, plain, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_multimodal_rope_selects_streams_without_a_gather_unless_tables_need_gradients(backend, device, monkeypatch):
    """rope with three sections and tables that need no gradient runs the multimodal custom op (Triton's kernel
    reads each table element from its stream; no selected tables are made by ``mrope_tables``), equal to the
    float64 reference at every call of a signature; tables that need gradients take the gather path, and their
    gradients are the reference's."""
    from hkernels.functional import rope as rope_module

    g = torch.Generator().manual_seed(12)
    q = torch.randn(2, 4, 9, 32, generator=g).to(device).requires_grad_()
    k = torch.randn(2, 2, 9, 32, generator=g).to(device).requires_grad_()
    angles = torch.randn(3, 2, 9, 32, generator=g).to(device)
    cos, sin = angles.cos(), angles.sin()
    section = [4, 6, 6]
    gathered = []
    real = rope_module.mrope_tables
    monkeypatch.setattr(rope_module, "mrope_tables", lambda *a, **kw: gathered.append(1) or real(*a, **kw))
    with hkernels.use_backend(backend):
        for _ in range(3):
            out = hkernels.rope(q, k, cos, sin, mrope_section=section)
            dy = [torch.randn(t.shape, generator=g).to(device) for t in out]
            grads = torch.autograd.grad(out, (q, k), dy)
            want = references.rope(q.double(), k.double(), cos.double(), sin.double(), mrope_section=section)
            wgrads = torch.autograd.grad(want, (q, k), [d.double() for d in dy])
            for a, b in (*zip(out, want, strict=True), *zip(grads, wgrads, strict=True)):
                torch.testing.assert_close(a.double(), b.double(), rtol=1e-5, atol=1e-5)
        assert not gathered
        tc, ts = cos.clone().requires_grad_(), sin.clone().requires_grad_()
        out = hkernels.rope(q, k, tc, ts, mrope_section=section)
        assert gathered
        want = references.rope(q.double(), k.double(), tc.double(), ts.double(), mrope_section=section)
        dy = [torch.randn(t.shape, generator=g).to(device) for t in out]
        got = torch.autograd.grad(out, (tc, ts), dy)
        ref = torch.autograd.grad(want, (tc, ts), [d.double() for d in dy])
        for a, b in zip(got, ref, strict=True):
            torch.testing.assert_close(a.double(), b.double(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("op", ["rms_norm", "layer_norm"])
def test_helion_one_row_runs_the_code_of_every_row_count(op, device, monkeypatch):
    """A one-row call on Helion binds at two rows (Helion 1.5.0 would take a dim of 1 for a broadcast): after a call
    of another row count it binds nothing new, and its forward and backward are right (no padded copy)."""
    import helion

    from hkernels.ops import layer_norm as helion_layer_norm
    from hkernels.ops import rms_norm as helion_rms_norm

    monkeypatch.setenv("HKERNELS_CODE_CACHE", "0")  # (a binding, not a stored file)
    module = helion_rms_norm if op == "rms_norm" else helion_layer_norm
    kernels = [k for k in vars(module).values() if isinstance(k, helion.Kernel)]
    g = torch.Generator().manual_seed(11)
    w = torch.randn(96, generator=g).to(device).requires_grad_()
    fn, ref = getattr(hkernels, op), getattr(references, op)
    with hkernels.use_backend("helion"):
        x3 = torch.randn(3, 96, generator=g).to(device).requires_grad_()
        torch.autograd.grad(fn(x3, w).sum(), [x3, w])
        bound = {k.name: len(k._bound_kernels) for k in kernels}
        x1 = torch.randn(1, 96, generator=g).to(device).requires_grad_()
        dy = torch.randn(1, 96, generator=g).to(device)
        y = fn(x1, w)
        dx, dw = torch.autograd.grad(y, [x1, w], dy)
    assert {k.name: len(k._bound_kernels) for k in kernels} == bound
    x64, w64 = x1.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    y64 = ref(x64, w64)
    dx64, dw64 = torch.autograd.grad(y64, [x64, w64], dy.double())
    for got, want in ((y, y64), (dx, dx64), (dw, dw64)):
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
