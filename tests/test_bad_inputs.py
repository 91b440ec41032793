"""The bad-input matrix: every op × every kind of bad or awkward input, one test per cell.

A cell either raises an exception that names the op (``hkernels.<op>: ...``) and the problem, or gives the right
answer (checked as the fuzz tests check: against float64 and PyTorch's own computation, NaN and inf included).
Cells that do not apply to an op (softmax has no second tensor to mismatch) are not generated; cells that need a
GPU (a CPU tensor sent to a GPU backend, more than 2³¹ elements) are skipped elsewhere, with the reason.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any

import pytest
import torch

import hkernels
from hkernels import references
from tests.conftest import ON_GPU
from tests.specs import cast_case
from tests.test_fuzz import MAKERS, Fixed, _with_grads, run_case

Tensor = torch.Tensor


def _f(d: torch.device, *shape: int, dtype: torch.dtype = torch.float32) -> Tensor:
    return torch.randn(shape, device=d).to(dtype)


def _idx(d: torch.device, t: int, v: int) -> Tensor:
    return torch.randint(0, v, (t,), device=d)


# Per op: a good call's arguments, the main input's name and the second tensor's (None: there is none).
GOOD: dict[str, tuple[Callable[[torch.device], dict[str, Any]], str, str | None]] = {
    "rms_norm": (lambda d: {"x": _f(d, 3, 8), "weight": _f(d, 8)}, "x", "weight"),
    "layer_norm": (lambda d: {"x": _f(d, 3, 8), "weight": _f(d, 8), "bias": _f(d, 8)}, "x", "bias"),
    "softmax": (lambda d: {"x": _f(d, 3, 8)}, "x", None),
    "add_rms_norm": (lambda d: {"x": _f(d, 3, 8), "residual": _f(d, 3, 8), "weight": _f(d, 8)}, "x", "residual"),
    "swiglu": (lambda d: {"gate": _f(d, 3, 8), "up": _f(d, 3, 8)}, "gate", "up"),
    "geglu": (lambda d: {"gate": _f(d, 3, 8), "up": _f(d, 3, 8)}, "gate", "up"),
    "rope": (lambda d: {"q": _f(d, 1, 2, 3, 4), "k": _f(d, 1, 1, 3, 4), "cos": _f(d, 3, 4), "sin": _f(d, 3, 4)},
             "q", "k"),
    "qk_norm_rope": (lambda d: {"q": _f(d, 1, 2, 3, 4), "k": _f(d, 1, 1, 3, 4), "q_weight": _f(d, 4),
                                "k_weight": _f(d, 4), "cos": _f(d, 3, 4), "sin": _f(d, 3, 4)}, "q", "k"),
    "cross_entropy": (lambda d: {"logits": _f(d, 3, 8), "target": _idx(d, 3, 8)}, "logits", "target"),
    "fused_linear_cross_entropy": (
        lambda d: {"hidden": _f(d, 3, 4), "weight": _f(d, 10, 4), "target": _idx(d, 3, 10)}, "hidden", "weight"),
    "matmul": (lambda d: {"a": _f(d, 3, 4), "b": _f(d, 4, 5)}, "a", "b"),
    "attention": (lambda d: {"q": _f(d, 1, 2, 3, 16), "k": _f(d, 1, 1, 3, 16), "v": _f(d, 1, 1, 3, 16)}, "q", "k"),
    "attention_varlen": (lambda d: {"q": _f(d, 5, 2, 16), "k": _f(d, 5, 1, 16), "v": _f(d, 5, 1, 16),
                                    "cu_seqlens_q": torch.tensor([0, 2, 5], dtype=torch.int32, device=d)},
                         "q", "k"),
    "decode_attention": (lambda d: {"q": _f(d, 2, 2, 1, 16), "k_cache": _f(d, 2, 1, 5, 16),
                                    "v_cache": _f(d, 2, 1, 5, 16),
                                    "cache_seqlens": torch.tensor([5, 2], dtype=torch.int32, device=d)},
                         "q", "k_cache"),
    "grouped_matmul": (lambda d: {"x": _f(d, 5, 4), "weight": _f(d, 2, 3, 4),
                                  "group_sizes": torch.tensor([2, 3], device=d)}, "x", "weight"),
    "moe": (lambda d: {"x": _f(d, 3, 4), "gate_up_proj": _f(d, 2, 6, 4), "down_proj": _f(d, 2, 4, 3),
                       "topk_ids": torch.tensor([[0, 1], [1, 1], [0, 0]], device=d), "topk_weights": _f(d, 3, 2)},
            "x", "gate_up_proj"),
}


def test_every_op_is_in_the_matrix():
    assert sorted(GOOD) == hkernels.ops() == sorted(MAKERS)


def _cells() -> list[Any]:
    out = []
    for op, (_, _main, other) in sorted(GOOD.items()):
        out += [pytest.param(op, cell, id=f"{op}-{cell}") for cell in ("not_a_tensor", "integer", "float64_helion",
                                                                       "float64_triton", "cpu_tensor_gpu_backend")]
        if other is not None:
            out += [pytest.param(op, cell, id=f"{op}-{cell}") for cell in ("shape_mismatch", "device_mix")]
            if op not in ("rms_norm", "layer_norm", "add_rms_norm"):  # norms take parameters of another dtype
                out.append(pytest.param(op, "dtype_mix", id=f"{op}-dtype_mix"))
        if op in ("rope", "qk_norm_rope", "attention", "attention_varlen", "decode_attention"):
            out.append(pytest.param(op, "unsupported_head_dim", id=f"{op}-unsupported_head_dim"))
    return out


def _bad_call(op: str, cell: str, d: torch.device) -> tuple[dict[str, Any], str | None, type[Exception], str]:
    """(arguments, backend to ask for, the exception, a pattern its message must match)."""
    make, main, other = GOOD[op]
    args = make(d)
    named = rf"hkernels\.{op}: "
    if cell == "not_a_tensor":
        args[main] = args[main].tolist()
        return args, None, TypeError, named + rf"{main} must be a torch\.Tensor"
    if cell == "integer":
        args[main] = args[main].to(torch.int64)
        return args, None, TypeError, named + rf"{main} must be .*float.*int64"
    if cell.startswith("float64_"):
        backend = cell.removeprefix("float64_")
        args = {k: v.double() if v.is_floating_point() else v for k, v in args.items()}
        return args, backend, hkernels.BackendUnavailableError, named + rf"backend '{backend}' cannot run .*float64"
    if cell == "cpu_tensor_gpu_backend":
        args = {k: v.cpu() for k, v in args.items()}
        return args, "triton", hkernels.BackendUnavailableError, named + r"backend 'triton' cannot run .*CUDA tensors"
    if cell == "shape_mismatch":
        t = args[other]
        args[other] = torch.randn(*t.shape[:-1], t.shape[-1] + 1, device=d).to(t.dtype)
        if op == "cross_entropy":
            args[other] = _idx(d, 4, 8)
        if op == "matmul":  # a longer row of b is a wider output: the mismatch is in K
            args[other] = _f(d, 5, 5)
        return args, None, ValueError, named + rf"(.*{other}|{main}.*)"
    if cell == "device_mix":
        args[other] = args[other].to("meta")
        return args, None, ValueError, named + r".*(meta|device)"
    if cell == "dtype_mix":
        args[other] = args[other].to(torch.float16) if op != "cross_entropy" else args[other].float()
        return args, None, TypeError, named + rf".*({other}|dtype|class indices)"
    if cell == "unsupported_head_dim":
        if op in ("rope", "qk_norm_rope"):
            args.update(q=_f(d, 1, 2, 3, 5), k=_f(d, 1, 1, 3, 5), cos=_f(d, 3, 5), sin=_f(d, 3, 5))
            if op == "qk_norm_rope":
                args.update(q_weight=_f(d, 5), k_weight=_f(d, 5))
            return args, None, ValueError, named + r"the head dim D must be even"
        if op == "attention_varlen":
            args.update(q=_f(d, 5, 2, 48), k=_f(d, 5, 1, 48), v=_f(d, 5, 1, 48))
            return args, None, ValueError, named + r"head dim D must be one of \(16, 32, 64, 128, 256\), got 48"
        if op == "decode_attention":
            args.update(q=_f(d, 2, 2, 1, 48), k_cache=_f(d, 2, 1, 5, 48), v_cache=_f(d, 2, 1, 5, 48))
            return args, None, ValueError, named + r"head dim D must be one of \(16, 32, 64, 128, 256\), got 48"
        args = {"q": _f(d, 1, 2, 3, 48), "k": _f(d, 1, 1, 3, 48), "v": _f(d, 1, 1, 3, 48)}
        return args, "triton", (ValueError, hkernels.BackendUnavailableError), named + r".*(head dim|D\b)"
    raise AssertionError(cell)


@pytest.mark.parametrize(("op", "cell"), _cells())
def test_bad_input_raises_naming_the_op_and_the_problem(op, cell, device):
    if cell == "cpu_tensor_gpu_backend" and not ON_GPU:
        pytest.skip("on a CPU, CPU tensors are the kernels' own (interpret mode); runs on the GPU")
    if cell == "device_mix" and device.type == "meta":
        pytest.skip("needs a device other than meta")
    args, backend, error, pattern = _bad_call(op, cell, device)
    with pytest.raises(error, match=pattern):
        if backend is None:
            getattr(hkernels, op)(**args)
        else:
            with hkernels.use_backend(backend):
                getattr(hkernels, op)(**args)


@pytest.mark.parametrize(("bad", "error", "pattern"), [
    (lambda d: torch.tensor([2.0, 3.0], device=d), TypeError, r"group_sizes must be a 1-d int32 or int64 tensor, got "
     r"torch\.float32"),
    (lambda d: torch.tensor([[2, 3]], device=d), TypeError, r"group_sizes must be a 1-d .* shape \[1, 2\]"),
    (lambda d: torch.tensor([1, 1, 3], device=d), ValueError, r"group_sizes has 3 entries for 2 experts"),
    (lambda d: [2, 3], TypeError, r"group_sizes must be a 1-d int32 or int64 tensor, got list"),
    (lambda d: torch.tensor([2, 3], device="meta"), ValueError, r"group_sizes is on meta"),
], ids=["float", "2d", "length", "list", "device"])
def test_grouped_matmul_group_sizes_are_checked(bad, error, pattern, device):
    """group_sizes is read on the device: its type, length and device are checked on the host (its values are not:
    a host sync; they are clamped as documented)."""
    if device.type == "meta":
        pytest.skip("needs a device other than meta")
    x, w = _f(device, 5, 4), _f(device, 2, 3, 4)
    with pytest.raises(error, match=r"hkernels\.grouped_matmul: " + pattern):
        hkernels.grouped_matmul(x, w, bad(device))


@pytest.mark.parametrize(("change", "error", "pattern"), [
    (lambda a: {"topk_ids": a["topk_ids"].float()}, TypeError, r"topk_ids must be an int32 or int64 tensor, got "
     r"torch\.float32"),
    (lambda a: {"topk_ids": a["topk_ids"].tolist()}, TypeError, r"topk_ids must be an int32 or int64 tensor, got list"),
    (lambda a: {"topk_weights": a["topk_ids"]}, TypeError, r"topk_weights must be a floating tensor, got torch\.int64"),
    (lambda a: {"topk_weights": a["topk_weights"][:, :1]}, ValueError, r"topk_ids \[3, 2\] and topk_weights \[3, 1\]"),
    (lambda a: {"topk_ids": a["topk_ids"][:2], "topk_weights": a["topk_weights"][:2]}, ValueError,
     r"topk_ids \[2, 2\] .* must both be \[\.\.\., k\] with x's leading dims \[3\]"),
    (lambda a: {"down_proj": a["down_proj"][:1]}, ValueError, r"down_proj must be \[E, H, I\] = \[2, 4, 3\]"),
    (lambda a: {"gate_up_proj": a["gate_up_proj"][:, :5]}, ValueError, r"gate_up_proj must be \[E, 2·I, H\]"),
    (lambda a: {"topk_ids": a["topk_ids"].to("meta")}, ValueError, r"topk_ids is on meta"),
], ids=["ids_float", "ids_list", "weights_int", "weights_shape", "tokens", "experts", "odd_gate_up", "device"])
def test_moe_routing_is_checked(change, error, pattern, device):
    """The routing's types, shapes and devices are checked on the host with the op named; the ids' values are not
    (a host sync): an id outside [0, E) selects nothing, as documented."""
    if device.type == "meta":
        pytest.skip("needs a device other than meta")
    args = GOOD["moe"][0](device)
    args.update(change(args))
    with pytest.raises(error, match=r"hkernels\.moe: " + pattern):
        hkernels.moe(**args)


@pytest.mark.parametrize(("change", "error", "pattern"), [
    (lambda a: {"position_ids": a["position_ids"].float()}, TypeError, r"position_ids must be an int32 or int64 "
     r"tensor, got torch\.float32"),
    (lambda a: {"position_ids": a["position_ids"].to(torch.int16)}, TypeError, r"position_ids must be an int32 or "
     r"int64 tensor, got torch\.int16"),
    (lambda a: {"position_ids": a["position_ids"].tolist()}, TypeError, r"position_ids must be an int32 or int64 "
     r"tensor, got list"),
    (lambda a: {"position_ids": a["position_ids"][:2]}, ValueError, r"position_ids must be \[S\] = \[3\] or "
     r"\[B, S\] = \[1, 3\] \(or \[1, S\]\) to match q \[1, 2, 3, 4\], got \[2\]"),
    (lambda a: {"position_ids": a["position_ids"].expand(2, 3)}, ValueError, r"position_ids must be .*, got \[2, 3\]"),
    (lambda a: {"position_ids": a["position_ids"][None, None]}, ValueError,
     r"position_ids must be .*, got \[1, 1, 3\]"),
    (lambda a: {"position_ids": a["position_ids"].to("meta")}, ValueError, r"position_ids is on meta"),
    (lambda a: {"cos": a["cos"][None], "sin": a["sin"][None]}, ValueError, r"with position_ids, cos must be a table "
     r"\[P, D\] with D = 4 .*, got \[1, 6, 4\]"),
    (lambda a: {"sin": a["sin"][:, :2]}, ValueError, r"with position_ids, sin must be a table \[P, D\] with D = 4"),
    (lambda a: {"sin": a["sin"][:5]}, ValueError, r"cos and sin must have the same shape, got \[6, 4\] and \[5, 4\]"),
    (lambda a: {"cos": a["cos"][:0], "sin": a["sin"][:0]}, ValueError, r"cos and sin have no rows \(P = 0\)"),
], ids=["ids_float", "ids_int16", "ids_list", "ids_length", "ids_batch", "ids_3d", "ids_device", "table_3d",
        "table_d", "tables_differ", "table_empty"])
def test_rope_positions_are_checked(change, error, pattern, device):
    """With position_ids, the tables are [P, D] and the positions an integer [S] or [B, S] on q's device, checked on
    the host with the op named; their values are not (a host sync): a position outside [0, P) gives NaN rows."""
    if device.type == "meta":
        pytest.skip("needs a device other than meta")
    args = GOOD["rope"][0](device)
    args.update(cos=_f(device, 6, 4), sin=_f(device, 6, 4), position_ids=torch.tensor([0, 1, 5], device=device))
    args.update(change(args))
    with pytest.raises(error, match=r"hkernels\.rope: " + pattern):
        hkernels.rope(**args)


@pytest.mark.parametrize("eps", [0.0, -1e-6, 0, math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("op", ["rms_norm", "layer_norm", "add_rms_norm"])
def test_eps_must_be_finite_and_positive(op, eps, device):
    """eps ≤ 0 would divide by zero on a constant row (NaN out); a non-finite eps is never meant."""
    args = GOOD[op][0](device)
    with pytest.raises(ValueError, match=rf"hkernels\.{op}: eps must be a finite number greater than 0"):
        getattr(hkernels, op)(**args, eps=eps)


def test_eps_of_int_type_is_accepted(device):
    args = GOOD["rms_norm"][0](device)
    torch.testing.assert_close(hkernels.rms_norm(**args, eps=1), references.rms_norm(**args, eps=1))


@pytest.mark.parametrize(("change", "error", "pattern"), [
    (lambda a: {"q": a["q"][0]}, ValueError, r"q must be 4-d, got shape \[2, 1, 16\]"),
    (lambda a: {"k_cache": a["k_cache"][0], "v_cache": a["v_cache"][0]}, ValueError, r"k_cache must be 4-d"),
    (lambda a: {"v_cache": a["v_cache"][:, :, :4]}, ValueError, r"k_cache and v_cache must have the same shape"),
    (lambda a: {"k_cache": a["k_cache"][:1], "v_cache": a["v_cache"][:1]}, ValueError,
     r".*k_cache .* must agree on B and D"),
    (lambda a: {"q": _f(a["q"].device, 2, 3, 1, 16), "k_cache": _f(a["q"].device, 2, 2, 5, 16),
                "v_cache": _f(a["q"].device, 2, 2, 5, 16)}, ValueError,
     r"the query heads \(3\) must be a multiple of the key/value heads \(2\)"),
    (lambda a: {"cache_seqlens": a["cache_seqlens"][:1]}, ValueError,
     r"cache_seqlens must be \[B\] = \[2\] .*got \[1\]"),
    (lambda a: {"cache_seqlens": a["cache_seqlens"][None]}, ValueError, r"cache_seqlens must be \[B\] = \[2\]"),
    (lambda a: {"cache_seqlens": a["cache_seqlens"].float()}, TypeError,
     r"cache_seqlens must be an int32 or int64 tensor, got torch\.float32"),
    (lambda a: {"cache_seqlens": a["cache_seqlens"].to(torch.int16)}, TypeError,
     r"cache_seqlens must be an int32 or int64 tensor, got torch\.int16"),
    (lambda a: {"cache_seqlens": [5, 2]}, TypeError, r"cache_seqlens must be an int32 or int64 tensor, got list"),
    (lambda a: {"cache_seqlens": a["cache_seqlens"].to("meta")}, ValueError, r"cache_seqlens is on meta"),
    (lambda a: {"window": (-2, None)}, ValueError, r"window's left must be >= 0, or None / -1 \(unbounded\), got -2"),
    (lambda a: {"window": (2.5, 0)}, TypeError, r"window's left must be an int, None or -1"),
    (lambda a: {"window": 4}, TypeError, r"window must be \(left, right\) or None, got 4"),
    (lambda a: {"softcap": math.nan}, ValueError, r"softcap must be a finite float > 0 \(0 or None: no cap\), got nan"),
    (lambda a: {"softcap": -5.0}, ValueError, r"softcap must be a finite float > 0"),
    (lambda a: {"softcap": math.inf}, ValueError, r"softcap must be a finite float > 0"),
    (lambda a: {"softcap": "5"}, TypeError, r"softcap must be a float or None, got str"),
    (lambda a: {"scale": "0.1"}, TypeError, r"scale must be a float or None, got str"),
], ids=["q_3d", "cache_3d", "caches_differ", "batch", "heads", "lengths_short", "lengths_2d", "lengths_float",
        "lengths_int16", "lengths_list", "lengths_device", "window_negative", "window_float", "window_int",
        "softcap_nan", "softcap_negative", "softcap_inf", "softcap_str", "scale_str"])
def test_decode_attention_arguments_are_checked(change, error, pattern, device):
    """Shapes, heads, the lengths' type, shape and device, the window and the softcap are checked on the host with
    the op named; the lengths' values are not (a host sync): they are clamped to [0, S_max], as documented."""
    if device.type == "meta":
        pytest.skip("needs a device other than meta")
    args = GOOD["decode_attention"][0](device)
    args.update(change(args))
    with pytest.raises(error, match=r"hkernels\.decode_attention: " + pattern):
        hkernels.decode_attention(**args)


@pytest.mark.parametrize(("op", "change", "error", "pattern"), [
    ("attention", lambda a: {"window": (-2, 0)}, ValueError, r"window's left must be >= 0, or None / -1"),
    ("attention", lambda a: {"window": (1.5, 0)}, TypeError, r"window's left must be an int"),
    ("attention", lambda a: {"window": 3}, TypeError, r"window must be \(left, right\) or None, got 3"),
    ("attention", lambda a: {"softcap": -1.0}, ValueError, r"softcap must be a finite float > 0"),
    ("attention", lambda a: {"softcap": math.inf}, ValueError, r"softcap must be a finite float > 0"),
    ("attention", lambda a: {"softcap": "5"}, TypeError, r"softcap must be a float or None, got str"),
    ("attention", lambda a: {"k": a["k"][:, :, :2], "v": a["v"][:, :, :2], "window": (1, 1)}, ValueError,
     r"causal=True or a window needs as many queries as keys"),
    ("attention_varlen", lambda a: {"cu_seqlens_q": a["cu_seqlens_q"].float()}, ValueError,
     r"cu_seqlens_q must be 1-D int32 \(or int64\)"),
    ("attention_varlen", lambda a: {"cu_seqlens_q": a["cu_seqlens_q"][None]}, ValueError,
     r"cu_seqlens_q must be 1-D int32"),
    ("attention_varlen", lambda a: {"cu_seqlens_q": [0, 2, 5]}, TypeError, r"cu_seqlens_q must be a tensor, got list"),
    ("attention_varlen", lambda a: {"cu_seqlens_q": a["cu_seqlens_q"].to("meta")}, ValueError,
     r"cu_seqlens_q is on meta"),
    ("attention_varlen", lambda a: {"cu_seqlens_k": a["cu_seqlens_q"][:2]}, ValueError,
     r"cu_seqlens_q and cu_seqlens_k must both be \[N \+ 1\]"),
    ("attention_varlen", lambda a: {"k": a["k"][:4], "v": a["v"][:4]}, ValueError,
     r"without cu_seqlens_k, k must have as many rows as q"),
    ("attention_varlen", lambda a: {"max_seqlen_q": -1}, ValueError, r"max_seqlen_q must be an int >= 0 or None"),
    ("attention_varlen", lambda a: {"q": a["q"][None]}, ValueError, r"q must be 3-d"),
    ("attention_varlen", lambda a: {"window": (-3, None)}, ValueError, r"window's left must be >= 0"),
    ("attention_varlen", lambda a: {"softcap": 0.0 - 2}, ValueError, r"softcap must be a finite float > 0"),
], ids=["window_negative", "window_float", "window_int", "softcap_negative", "softcap_inf", "softcap_str",
        "window_cross", "cu_float", "cu_2d", "cu_list", "cu_device", "cu_lengths_differ", "k_rows", "max_negative",
        "q_4d", "varlen_window", "varlen_softcap"])
def test_attention_options_are_checked(op, change, error, pattern, device):
    """The window, the cap and the packed layout's bounds are checked on the host with the op named; the bounds'
    values are not (a host sync): the kernels clamp them to the rows that exist."""
    if device.type == "meta":
        pytest.skip("needs a device other than meta")
    args = GOOD[op][0](device)
    args.update(change(args))
    with pytest.raises(error, match=rf"hkernels\.{op}: " + pattern):
        getattr(hkernels, op)(**args)


@pytest.mark.parametrize("chunk_size", [0, -4, 2.5, True, "64"])
def test_linear_loss_chunk_size_is_checked(chunk_size, device):
    """Tokens per chunk: a positive int or None; anything else is named, never rounded or taken as the default."""
    if device.type == "meta":
        pytest.skip("needs a device other than meta")
    args = GOOD["fused_linear_cross_entropy"][0](device)
    with pytest.raises(ValueError, match=r"hkernels\.fused_linear_cross_entropy: chunk_size must be a positive int"):
        hkernels.fused_linear_cross_entropy(**args, chunk_size=chunk_size)


# Cells with a right answer: the op's fuzz maker with the choices fixed, checked as the fuzzing checks.
RIGHT: dict[str, dict[str, Any]] = {
    "zero_rows": {"rows": 0, "tokens": 0, "seq": 0, "m": 0},
    "n1": {"cols": 1, "hidden": 1, "vocab": 1, "k": 1, "n": 1, "head dim": 2},
    "transposed": {"layout": "transposed", "bshd": True},
    "column_slice": {"layout": "sliced"},
    "expanded_rows": {"layout": "expanded"},
    "nan_row": {"values": "special"},
}


@pytest.mark.parametrize("backend", ["helion", "triton"])
@pytest.mark.parametrize("cell", sorted(RIGHT))
@pytest.mark.parametrize("op", sorted(MAKERS))
def test_awkward_input_gives_the_right_answer(op, cell, backend, device):
    run_case(op, backend, Fixed(torch.bfloat16, **RIGHT[cell]), device)


@pytest.mark.parametrize("backend", ["helion", "triton"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("op", ["cross_entropy", "fused_linear_cross_entropy"])
def test_all_targets_ignored(op, reduction, backend, device):
    """mean: NaN (0/0, as PyTorch); sum: 0; none: zeros; every gradient 0."""
    run_case(op, backend, Fixed(torch.float32, ignored=1.0, reduction=reduction), device)


@pytest.mark.parametrize("backend", ["helion", "triton"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("op", ["cross_entropy", "fused_linear_cross_entropy"])
def test_one_class_loss_is_exactly_zero(op, smoothing, backend, device):
    """With one class, log-softmax is exactly 0 and so is PyTorch's loss, however large the logits; computed as
    lse − (1−ε)·x_t − ε·mean(x) it would be an ulp of |x| instead. ε = 0 (lse − x_t) keeps the path without
    smoothing exact as well."""
    g = torch.Generator().manual_seed(0)
    h = (torch.randn(33, 16, generator=g) * 1e5).to(device)
    w = torch.randn(1, 16, generator=g).to(device)
    target = torch.zeros(33, dtype=torch.long, device=device)
    with hkernels.use_backend(backend):
        if op == "cross_entropy":
            loss = hkernels.cross_entropy(h @ w.t(), target, reduction="none", label_smoothing=smoothing)
        else:
            loss = hkernels.fused_linear_cross_entropy(h, w, target, reduction="none", label_smoothing=smoothing)
    assert torch.equal(loss, torch.zeros_like(loss)), f"{op} on {backend}: {loss.abs().max().item()}"


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU with > 16 GB free: a tensor of more than 2^31 elements")
@pytest.mark.parametrize("backend", ["helion", "triton"])
@pytest.mark.parametrize("op", ["rms_norm", "layer_norm", "softmax", "swiglu", "geglu", "add_rms_norm",
                                "cross_entropy", "matmul", "rope"])
def test_more_than_2_31_elements(op, backend, device):
    """Offsets past 2³¹ need 64-bit index arithmetic: the last rows must be as right as the first."""
    n = {"cross_entropy": 128256, "matmul": 32771}.get(op, 4096)
    m = (2**31) // n + 3
    if op == "rope":  # q [1, 32, S, 128] past 2³¹ elements (S = m); rows are positions
        q = torch.randn(1, 32, m, 128, device=device, dtype=torch.bfloat16)
        k = torch.randn(1, 8, m, 128, device=device, dtype=torch.bfloat16)
        cos, sin = torch.randn(2, m, 128, device=device).unbind(0)
        pos = torch.tensor([0, 1, m // 2, m - 2, m - 1], device=device)
        with hkernels.use_backend(backend):
            got = torch.cat([t[:, :, pos] for t in hkernels.rope(q, k, cos, sin)], 1)
        want = torch.cat(references.rope(q[:, :, pos], k[:, :, pos], cos[pos], sin[pos]), 1)
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
        return
    if op == "matmul":  # the output [M, 32771] past 2³¹ elements, K small
        a = torch.randn(m, 64, device=device, dtype=torch.bfloat16)
        b = torch.randn(64, n, device=device, dtype=torch.bfloat16) * 0.125
        rows = torch.tensor([0, 1, m // 2, m - 2, m - 1], device=device)
        with hkernels.use_backend(backend):
            got = hkernels.matmul(a, b)[rows]
        torch.testing.assert_close(got.float(), references.matmul(a[rows], b).float(), atol=2e-2, rtol=2e-2)
        return
    x = torch.randn(m, n, device=device, dtype=torch.bfloat16)
    rows = torch.tensor([0, 1, m // 2, m - 2, m - 1], device=device)
    with hkernels.use_backend(backend):
        if op in ("swiglu", "geglu"):
            up = torch.randn_like(x)
            got = getattr(hkernels, op)(x, up)[rows]
            want = getattr(references, op)(x[rows], up[rows])
        elif op == "add_rms_norm":
            res = torch.randn_like(x)
            got = hkernels.add_rms_norm(x, res)[0][rows]
            want = references.add_rms_norm(x[rows], res[rows])[0]
        elif op == "cross_entropy":
            target = torch.randint(0, n, (m,), device=device)
            got = hkernels.cross_entropy(x, target, reduction="none")[rows]
            want = references.cross_entropy(x[rows], target[rows], reduction="none")
        else:
            got = getattr(hkernels, op)(x)[rows]
            want = getattr(references, op)(x[rows])
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


def _linear_loss_rows_check(tokens: int, backend: str, device: torch.device) -> None:
    """The linear loss over [tokens, 4096] hidden states: the loss and the hidden-state gradient of the first, middle
    and last rows against the reference on those rows alone (each row's loss and gradient depend on that row and the
    weight only). The weight's gradient sums over every row and is not checked here."""
    g = torch.Generator(device=device).manual_seed(0)
    h = (torch.randn(tokens, 4096, device=device, generator=g) / 64).to(torch.bfloat16).requires_grad_(True)
    w = torch.randn(256, 4096, device=device, generator=g).to(torch.bfloat16)
    target = torch.randint(0, 256, (tokens,), device=device, generator=g)
    rows = torch.tensor(sorted({0, 1, tokens // 2, tokens - 2, tokens - 1}), device=device)
    with hkernels.use_backend(backend):
        loss = hkernels.fused_linear_cross_entropy(h, w, target, reduction="none")
        (dh,) = torch.autograd.grad(loss, h, torch.ones_like(loss))
    h_rows = h.detach()[rows].requires_grad_(True)
    want = references.fused_linear_cross_entropy(h_rows, w, target[rows], reduction="none")
    (want_dh,) = torch.autograd.grad(want, h_rows, torch.ones_like(want))
    torch.testing.assert_close(loss[rows].float(), want.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(dh[rows].float(), want_dh.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU with > 20 GB free: hidden states of more than 2^31 elements")
@pytest.mark.parametrize("backend", ["helion", "triton"])
def test_linear_loss_more_than_2_31_elements(backend, device):
    """Long-context training (e.g. 4 × 128k tokens of hidden 4096) gives the linear loss hidden states and their
    gradient past 2³¹ elements: the last rows must be as right as the first."""
    _linear_loss_rows_check(2**31 // 4096 + 3, backend, device)


@pytest.mark.parametrize("backend", ["helion", "triton"])
def test_linear_loss_rows_check_itself(backend, device):
    """The GPU-only check above at a size any device runs: the rows it compares are the right ones."""
    _linear_loss_rows_check(37, backend, device)


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU with > 30 GB free: tensors of more than 2^31 elements")
@pytest.mark.parametrize("backend", ["helion", "triton"])
def test_attention_more_than_2_31_elements(backend, device):
    """q, o and their gradients past 2³¹ elements through the batch ([4097, 32, 128, 128]; one key/value head keeps
    k and v small). Each batch is computed on its own, in the same order, whatever B is: so the first and last
    batches must equal, bit for bit, the same backend's answer for those batches alone (32-bit offsets there). A
    float64 bound is the other tests' job; here it would only measure bf16 rounding."""
    b = (2**31) // (32 * 128 * 128) + 1
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(b, 32, 128, 128, device=device, dtype=torch.bfloat16, generator=g).requires_grad_()
    k, v = (t.requires_grad_() for t in torch.randn(2, b, 1, 128, 128, device=device, dtype=torch.bfloat16,
                                                    generator=g).unbind(0))
    do = torch.randn(b, 32, 128, 128, device=device, dtype=torch.bfloat16, generator=g)
    batches = torch.tensor([0, 1, b // 2, b - 2, b - 1], device=device)
    with hkernels.use_backend(backend):
        o = hkernels.attention(q, k, v, causal=True)
        big = (o, *torch.autograd.grad(o, (q, k, v), do))
        small_in = [t[batches].detach().requires_grad_() for t in (q, k, v)]
        small_o = hkernels.attention(*small_in, causal=True)
        small = (small_o, *torch.autograd.grad(small_o, small_in, do[batches]))
    for name, got, want in zip(("o", "dq", "dk", "dv"), big, small, strict=True):
        got = got[batches]
        off = (got.float() - want.float()).abs().max().item()
        assert torch.equal(got, want), f"{name}: {off} off at batches {batches.tolist()} (of {b})"


# ------------------------------------------------------------------------------------------ faults, threads


def _break_helion_compiles(monkeypatch) -> None:
    """Every Helion kernel fails where it would compile: in the two places Helion kernels are compiled
    (hkernels/ops/_helion.py's compiled, rope's ``_compiled_for``). Auto's measured table is set aside, so auto picks
    Helion first: a GPU's table may pick Triton (sm90's does for matmul, small rope and small linear-CE calls), where no
    Helion kernel would run and nothing would be tested."""
    from hkernels import configs, dispatch
    from hkernels.ops import _helion, rope

    def broken(*args, **kwargs):
        raise RuntimeError("simulated Helion compile failure")

    monkeypatch.setattr(_helion, "compiled", broken)
    monkeypatch.setattr(rope, "_compiled_for", broken)
    monkeypatch.setattr(configs, "auto_bucket", lambda op, tensors, fn=None: None)
    dispatch._forget_routes()  # routes remembered from the table would skip the patched auto_bucket


_KERNELS = {"kv seq": 7}  # attention with one key runs no kernel (its answer is written out): give it seven


@pytest.mark.parametrize("op", sorted(MAKERS))
def test_helion_compile_failure_falls_back_to_triton_with_one_warning(op, monkeypatch, device):
    _break_helion_compiles(monkeypatch)
    with pytest.warns(hkernels.HKernelsFallbackWarning, match=rf"hkernels\.{op}: Helion could not run"):
        run_case(op, "auto", Fixed(torch.float32, seq=5, **_KERNELS), device)  # right answers, fwd and bwd, on Triton
    import warnings

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        run_case(op, "auto", Fixed(torch.float32, seed=1, seq=5, **_KERNELS), device)
    assert not [w for w in seen if issubclass(w.category, hkernels.HKernelsFallbackWarning)]  # remembered


@pytest.mark.parametrize("op", ["cross_entropy", "rms_norm"])
def test_selected_backend_sees_a_remembered_helion_failure(op, monkeypatch, device):
    """After a Helion failure under auto, selected_backend names Triton and the failure, for a loss too (whose
    kernel takes more tensors than its public call, while the failure is remembered under the kernel's own)."""
    _break_helion_compiles(monkeypatch)
    x = torch.randn(6, 40, device=device)
    args = (x, torch.randint(0, 40, (6,), device=device)) if op == "cross_entropy" else (x,)
    assert hkernels.selected_backend(op, *args) == "helion"
    with pytest.warns(hkernels.HKernelsFallbackWarning):
        getattr(hkernels, op)(*args)
    sel = hkernels.selected_backend(op, *args)
    assert sel == "triton" and "failed" in sel.reason, sel.reason


@pytest.mark.parametrize("op", sorted(MAKERS))
def test_helion_compile_failure_under_an_explicit_request_raises(op, monkeypatch, device):
    _break_helion_compiles(monkeypatch)
    with pytest.raises(hkernels.BackendUnavailableError, match=rf"hkernels\.{op}: backend 'helion' failed"):
        run_case(op, "helion", Fixed(torch.float32, seq=5, **_KERNELS), device)


def test_threads_compiling_the_same_kernels_at_once(device):
    """Eight threads, half on each backend, all making the first call of the same ops and shapes at once."""
    import threading

    from hkernels.ops import _helion

    _helion.forget()  # nothing compiled yet in this process for these shapes
    barrier, errors = threading.Barrier(8), []

    def worker(i: int) -> None:
        try:
            with hkernels.use_backend("helion" if i % 2 else "triton"):
                barrier.wait()
                for op in ("rms_norm", "softmax", "swiglu", "rope", "cross_entropy"):
                    d = Fixed(torch.bfloat16, seed=i, rows=9, cols=131, seq=5)
                    run_case(op, "helion" if i % 2 else "triton", d, device)
        except Exception as e:  # collected: an exception in a thread would otherwise be lost
            errors.append(f"thread {i}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, "\n".join(errors)


# ------------------------------------------------------------------------------------------------ determinism

# On the GPU, shapes large enough that several programs share a reduction (weight gradients, attention's dq).
BIG = {"rows": 1031, "cols": 4096, "tokens": 1031, "hidden": 48, "vocab": 1031, "m": 257, "k": 100, "n": 100,
       "seq": 64, "kv seq": 65, "head dim": 128, "dim": 64} if ON_GPU else {}


@pytest.mark.parametrize("backend", ["helion", "triton"])
@pytest.mark.parametrize("op", sorted(MAKERS))
def test_bitwise_deterministic(op, backend, device):
    """The same inputs give bitwise-equal outputs and gradients, call after call (on a CPU the interpreter runs
    programs one after another, so this can only fail on a GPU, where it runs with the suite)."""
    d = Fixed(torch.bfloat16, **BIG)
    tensors64, kwargs, grads, _ = MAKERS[op](d)
    kwargs = {k: v.to(device) if isinstance(v, Tensor) else v for k, v in kwargs.items()}
    inputs = cast_case(tensors64, torch.bfloat16, device)
    with hkernels.use_backend(backend):
        first, first_grads, ups = _with_grads(getattr(hkernels, op), inputs, kwargs, grads, None, d.gen)
        for _ in range(3):
            again, again_grads, _ = _with_grads(getattr(hkernels, op), inputs, kwargs, grads, ups, d.gen)
            for a, b in zip((*first, *first_grads), (*again, *again_grads), strict=True):
                assert torch.equal(a.detach(), b.detach()) or (
                    torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(a.nan_to_num(), b.nan_to_num())
                ), f"{op} on {backend}: not bitwise equal between calls"


@pytest.mark.parametrize("backend", ["helion", "triton"])
@pytest.mark.parametrize("special", [math.nan, math.inf, -math.inf])
def test_attention_with_one_key_and_a_non_finite_score_gives_nan(special, backend, device):
    """softmax over one score s is exp(s − s): NaN when s is not finite, so is that query's output (PyTorch's SDPA
    on a GPU and the float64 formula agree; its CPU kernel gives 0, so the generic check accepts either and cannot
    tell a one-key shortcut that returns v)."""
    q = torch.randn(1, 2, 3, 16, device=device, dtype=torch.bfloat16)
    k = torch.randn(1, 1, 1, 16, device=device, dtype=torch.bfloat16).abs() + 0.5  # score of ±inf stays ±inf
    v = torch.randn(1, 1, 1, 16, device=device, dtype=torch.bfloat16)
    q[0, 1, 2, 0] = special
    with hkernels.use_backend(backend):
        o = hkernels.attention(q, k, v)
    bad = torch.zeros(o.shape[:-1], dtype=torch.bool, device=device)
    bad[0, 1, 2] = True
    assert torch.isnan(o[bad]).all(), f"{backend}: one key, score {special}: got {o[bad]}"
    assert torch.isfinite(o[~bad]).all(), f"{backend}: a non-finite score leaked into other queries"
    torch.testing.assert_close(o[~bad], v.expand(1, 2, 3, 16)[~bad])


@pytest.mark.parametrize("backend", ["helion", "triton"])
@pytest.mark.parametrize("kv", [1, 3])
def test_attention_rows_whose_scores_are_all_far_below_zero(kv, backend, device):
    """|q| ~ 1e5: some rows' scores are all below −88, where exp of a padded key's score 0 minus the row's max
    overflows; a kernel that lets a padded key in gives NaN there (forward and dq), PyTorch a finite answer."""
    run_case("attention", backend, Fixed(torch.float32, values="large", seq=7, **{"kv seq": kv}), device)


@pytest.mark.parametrize("backend", ["helion", "triton"])
@pytest.mark.parametrize("kv", [65, 130])
def test_attention_a_dominant_key_gets_weight_one(kv, backend, device):
    """Scores ~1e5 (|q| ~ 1e5, bf16): every row's softmax is one-hot, so o is exactly the top key's v row and dk is
    0 up to float32 rounding. With the fused exp2(s·c − m·c) the top key would get p = exp2(rounding error) ≠ 1, o
    would miss v by an ulp and dk by |q| times an ulp of dp, far above PyTorch's error. The CPU interpreter never
    fuses a multiply into an add, so only a GPU run can fail this."""
    g = torch.Generator().manual_seed(5)
    q = (torch.randn(1, 2, 3, 128, generator=g, dtype=torch.float64) * 1e5).to(torch.bfloat16)
    k, v = (torch.randn(1, 1, kv, 128, generator=g, dtype=torch.float64).to(torch.bfloat16) for _ in range(2))
    scores = (q.double() @ k.double().transpose(-1, -2)) * 128**-0.5
    top2 = scores.topk(2, -1).values
    assert ((top2[..., 0] - top2[..., 1]) > 1000).all(), "the premise: one key dominates every row"
    q, k, v = (t.to(device).requires_grad_() for t in (q, k, v))
    with hkernels.use_backend(backend):
        o = hkernels.attention(q, k, v)
        do = torch.randn(o.shape, generator=g, dtype=torch.float64).to(device=device, dtype=o.dtype)
        (dk,) = torch.autograd.grad(o, (k,), do)
    want = v.detach()[0, 0][scores.argmax(-1)[0].to(device)].unsqueeze(0)  # [1, 2, 3, 128]: each row's top key
    assert torch.equal(o.detach(), want), f"{backend}: o is not exactly the top key's value row"
    bound = 1e-5 * q.detach().abs().max().item() * do.abs().max().item()  # float32 rounding of dp − δ, times |q|
    worst = dk.abs().max().item()
    assert worst <= bound, f"{backend}: dk {worst:.3g} where it is 0 (bound {bound:.3g})"


# ---------------------------------------------------------------------------------------------------- growth


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _settled_gpu_bytes(device: torch.device) -> int:
    """torch.cuda.memory_allocated once it stops changing. The backward of CUDA tensors runs on autograd's device
    thread, which can drop its last intermediate gradients a moment after torch.autograd.grad has returned (and
    torch.cuda.synchronize waits for kernels, not threads): a single reading can be one such tensor off, above or
    below the settled value."""
    import time

    now = torch.cuda.memory_allocated(device)
    for _ in range(200):
        time.sleep(0.002)
        again = torch.cuda.memory_allocated(device)
        if again == now:
            return now
        now = again
    return now


@pytest.mark.skipif(not ON_GPU, reason="10,000 calls per op: a GPU's worth of time (interpreted kernels take ms each)")
@pytest.mark.parametrize("backend", ["helion", "triton"])
@pytest.mark.parametrize("op", sorted(MAKERS))
def test_ten_thousand_calls_leave_memory_flat(op, backend, device):
    """Forward and backward 10,000 times: GPU memory back to where it was, host memory growing < 2 KB a call."""
    import gc

    d = Fixed(torch.bfloat16, rows=64, cols=4096, tokens=64, seq=5, **_KERNELS)
    tensors64, kwargs, grads, _ = MAKERS[op](d)
    kwargs = {k: v.to(device) if isinstance(v, Tensor) else v for k, v in kwargs.items()}
    inputs = cast_case(tensors64, torch.bfloat16, device)
    fn = getattr(hkernels, op)
    outs, _, ups = _with_grads(fn, inputs, kwargs, grads, None, d.gen)
    # upstream gradients on the device once: a host-to-device copy from pageable memory per call syncs every call
    ups = [u.to(device=o.device, dtype=o.dtype) for o, u in zip(outs, ups, strict=True)]

    def calls(n: int) -> None:
        with hkernels.use_backend(backend):
            for _ in range(n):
                _with_grads(fn, inputs, kwargs, grads, ups, d.gen)
        torch.cuda.synchronize(device)
        gc.collect()

    calls(2000)  # compiled, cached, allocator warm
    gpu, host = _settled_gpu_bytes(device), _rss_bytes()
    calls(8000)
    after = _settled_gpu_bytes(device)
    assert after == gpu, f"{op} on {backend}: GPU memory changed by {after - gpu} bytes over 8,000 calls"
    grew = _rss_bytes() - host
    assert grew < 8000 * 2048, f"{op} on {backend}: host memory grew {grew / 2**20:.1f} MiB over 8,000 calls"


def test_mrope_section_errors_name_the_op(device):
    """rope's mrope_section: a section that does not sum to D / 2, tables without three streams, or position_ids
    beside it, each a clear error naming the op."""
    q, k = torch.randn(1, 2, 3, 8, device=device), torch.randn(1, 1, 3, 8, device=device)
    three = torch.randn(3, 3, 8, device=device)
    with pytest.raises(ValueError, match=r"hkernels\.rope: mrope_section \[1, 1, 1\] must sum to D / 2"):
        hkernels.rope(q, k, three, three, mrope_section=[1, 1, 1])
    with pytest.raises(ValueError, match=r"hkernels\.rope: with mrope_section, cos must be \[3, S, D\]"):
        hkernels.rope(q, k, three[:2], three, mrope_section=[2, 1, 1])
    with pytest.raises(TypeError, match=r"hkernels\.rope: mrope_section must be a list of positive ints"):
        hkernels.rope(q, k, three, three, mrope_section=[2, 2.0])
    with pytest.raises(ValueError, match=r"hkernels\.rope: mrope_section takes its positions"):
        hkernels.rope(q, k, three, three, position_ids=torch.arange(3, device=device), mrope_section=[2, 1, 1])
