"""What the shared suite knows about each op: how to call it, how to make inputs, which shapes, how close.

Tolerances are written once per dtype. A result passes when its largest error against the float64 reference
is within ``factor`` times the error PyTorch's own computation in the same dtype makes on the same inputs
(``hkernels.references`` run on the low-precision tensors: float32 math, one rounding at the end), plus a floor
``atol`` relative to the size of the reference (so exact-zero baselines do not demand exact results). Gradients
get one more term: float32's floor times the size of the terms the backward subtracts (rstd·|w|·|dy| for the
norms). The kernels compute in float32 whatever the I/O dtype, and a gradient that is mathematically 0
(layer_norm with N = 1) keeps the float32 rounding of those terms in any fused kernel (a contracted multiply-add
leaves 1 ulp × 1/sqrt(eps) on the GPU), which PyTorch's unfused eager baseline happens to avoid. No
element is asked to be closer than one ulp of the dtype at its own size (:func:`ulps`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch

from tests.conftest import ON_GPU

Tensor = torch.Tensor

TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    # dtype: (factor over same-dtype PyTorch error, floor relative to max |reference|)
    torch.float32: (4.0, 2e-6),
    torch.bfloat16: (2.0, 2e-3),
    torch.float16: (2.0, 3e-4),
}
DTYPES = list(TOLERANCES)
BACKENDS = ["helion", "triton", "torch"]

# (name, shape). Odd shapes always; the large-N row is longer than any block of registers, so it takes the
# looped kernels (in interpret mode a shorter one that still does, in three chunks, the last one partial: the
# interpreter's time grows with N); "many_rows" has more rows than programs in a persistent grid.
SHAPES: list[tuple[str, tuple[int, ...]]] = [
    ("one_row", (1, 64)),
    ("n1", (5, 1)),
    ("odd", (7, 37)),
    ("3d", (2, 3, 100)),
    ("many_rows", (37, 96)),
    ("large_n", (3, 262144) if ON_GPU else (3, 65539)),
]
if ON_GPU:  # cheap there: model-sized rows, long rows past the resident limits, the vocabulary
    SHAPES += [
        ("llama_8b", (512, 4096)),
        ("llama_70b", (64, 8192)),
        ("past_resident", (5, 32771)),
        ("vocab", (8, 128256)),
    ]


@dataclass(frozen=True)
class Variant:
    """One way of calling an op: which parameter tensors it gets and its other arguments."""

    op: str
    params: tuple[str, ...] = ()  # parameter tensors of shape [N] given (weight, bias)
    kwargs: dict[str, Any] = field(default_factory=dict)
    only_3d: bool = False

    @property
    def id(self) -> str:
        parts = [self.op, *self.params] + [f"{k}={v}" for k, v in self.kwargs.items()]
        return "-".join(parts) if len(parts) > 1 else f"{self.op}-plain"

    def call(self, module: ModuleType, x: Tensor, params: dict[str, Tensor]) -> Tensor:
        fn: Callable[..., Tensor] = getattr(module, self.op)
        return fn(x, **params, **self.kwargs)

    def grad_scale(self, x: Tensor, params: dict[str, Tensor], dy: Tensor) -> float:
        """Size of the terms a backward combines (see the module doc), from float64 inputs."""
        scale = dy.abs().max().item() if dy.numel() else 0.0
        if self.op == "softmax" or x.numel() == 0:
            return scale
        centred = x - x.mean(-1, keepdim=True) if self.op == "layer_norm" else x
        rstd = torch.rsqrt(centred.pow(2).mean(-1) + self.kwargs["eps"]).max().item()
        weight = (params["weight"] + self.kwargs.get("offset", 0.0)).abs().max().item() if "weight" in params else 1.0
        return scale * rstd * weight


VARIANTS = [
    Variant("rms_norm", ("weight",), {"eps": 1e-6}),
    Variant("rms_norm", (), {"eps": 1e-5}),
    Variant("rms_norm", ("weight",), {"eps": 1e-6, "offset": 1.0}),  # Gemma's x̂ · (1 + w)
    Variant("layer_norm", ("weight", "bias"), {"eps": 1e-5}),
    Variant("layer_norm", ("weight",), {"eps": 1e-5}),
    Variant("layer_norm", (), {"eps": 1e-5}),
    Variant("softmax", (), {"dim": -1}),
    Variant("softmax", (), {"dim": 1}, only_3d=True),
]


def make_inputs(variant: Variant, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, seed: int):
    """x, its parameters and an upstream gradient, drawn fresh (never zeros) in float64 then cast."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    n = shape[-1]
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    if variant.op == "layer_norm":
        x = x * 2.0 + 3.0  # a mean far from zero: the variance must be taken around it
    if variant.op == "softmax":
        x = x * 3.0
    params = {
        name: torch.randn(n, generator=g, dtype=torch.float64) * 0.5 + (1.0 if name == "weight" else 0.0)
        for name in variant.params
    }
    dy = torch.randn(shape, generator=g, dtype=torch.float64)
    cast = lambda t: t.to(device=device, dtype=dtype)
    return cast(x), {k: cast(v) for k, v in params.items()}, cast(dy)


def ulps(dtype: torch.dtype, ref: Tensor) -> Tensor:
    """One unit in the last place of ``dtype`` at each element's own size |ref| (0 where ref is not finite): the
    least error a check asks for, element by element. The bound from PyTorch's error alone can fall below it where
    PyTorch's result happens to be almost exact: matmul's bias gradient in bfloat16 (a sum of a few rounded terms),
    measured over 150 draws with 7 rows, had the same error as PyTorch's (mean 3.0e-3 vs 3.1e-3 of the largest
    value), and each exceeded twice the other's in about 5% of them."""
    info = torch.finfo(dtype)
    size = ref.double().abs().clamp_min(info.tiny)
    one = info.eps * torch.exp2(torch.floor(torch.log2(size)))
    return torch.where(torch.isfinite(ref), one, 0.0)


def max_error(
    name: str, out: Tensor, ref: Tensor, base: Tensor, dtype: torch.dtype, term_scale: float = 0.0
) -> str | None:
    """None if ``out`` is as close to the float64 ``ref`` as the dtype allows (see module doc), else a report."""
    factor, atol = TOLERANCES[dtype]
    if out.shape != ref.shape:
        return f"{name}: shape {list(out.shape)} != reference {list(ref.shape)}"
    if out.numel() == 0:
        return None
    both_nan = torch.isnan(out.double()) & torch.isnan(ref)  # NaN where PyTorch gives NaN (a mean over no tokens)
    err = (out.double() - ref).abs().masked_fill(both_nan, 0.0)
    base_err = torch.nan_to_num((base.double() - ref).abs().masked_fill(both_nan, 0.0), nan=0.0).max().item()
    scale = max(1.0, torch.nan_to_num(ref.abs(), nan=0.0).max().item())
    allowed = factor * base_err + atol * scale + TOLERANCES[torch.float32][1] * term_scale
    limit = ulps(dtype, ref).clamp_min(allowed)  # never less than one ulp of the element's own size
    excess = torch.nan_to_num(err - limit, nan=float("inf"))  # NaN error: a failure
    worst = excess.argmax().item()
    if excess.flatten()[worst].item() <= 0:
        return None
    worst_err = err.flatten()[worst].item()
    idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), err.shape))
    return (
        f"{name}: max error {worst_err:.3g} at {idx} (got {out.flatten()[worst].item():.6g}, float64 reference "
        f"{ref.flatten()[worst].item():.6g}); allowed {limit.flatten()[worst].item():.3g} = {factor} x same-dtype "
        f"torch error {base_err:.3g} + {atol} x {scale:.3g} + float32 floor x terms {term_scale:.3g}, at least one "
        "ulp of that element"
    )


# ------------------------------------------------------------------------------------------------------------
# The LLM operator set. Each op's inputs are more varied than [M, N] + parameters, so a case is a function that
# draws float64 inputs: ``Case.make(generator)`` returns (tensors, other arguments); ``grads`` names the tensors
# that get a gradient. Outputs may be a tuple; each output gets a fresh upstream gradient (for a scalar loss, a
# random factor, or exactly 1: the path where the loss backward moves nothing).
# ------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    op: str
    name: str
    make: Callable[[torch.Generator], tuple[dict[str, Tensor], dict[str, Any]]]
    grads: tuple[str, ...]
    unit_upstream: bool = False  # upstream gradient exactly 1 (scalar losses)
    gpu_only: bool = False
    min_chunk: int | None = None  # fused_linear_cross_entropy: tokens per chunk, small to test several chunks
    # PyTorch's own computation in the dtype under test, when it is not hkernels.references' (float32 math, one
    # rounding): matmul and attention round their intermediates, as every fast kernel does.
    base: Callable[..., Any] | None = None
    # The kernel backends that take the case (None: both); the others refuse it with a clear error (tested apart).
    kernels: tuple[str, ...] | None = None

    @property
    def id(self) -> str:
        return f"{self.op}-{self.name}"


def _randn(g: torch.Generator, *shape: int, scale: float = 1.0, shift: float = 0.0) -> Tensor:
    return torch.randn(shape, generator=g, dtype=torch.float64) * scale + shift


def _halves(g: torch.Generator, m: int, n: int) -> tuple[Tensor, Tensor]:
    """gate and up as the two column halves of one [M, 2N] projection output (row stride 2N)."""
    both = _randn(g, m, 2 * n, scale=2.0)
    return both[:, :n], both[:, n:]


def _gated(op: str, shapes: list[tuple[str, tuple[int, ...]]], **kwargs: Any) -> list[Case]:
    suffix = "".join(f"-{k}={v}" for k, v in kwargs.items())
    cases = [
        Case(op, f"{name}{suffix}",
             lambda g, s=shape: ({"gate": _randn(g, *s, scale=2.0), "up": _randn(g, *s)}, dict(kwargs)),
             ("gate", "up"))
        for name, shape in shapes
    ]
    cases.append(Case(op, f"halves{suffix}", lambda g: (dict(zip(("gate", "up"), _halves(g, 9, 40), strict=True)),
                                                        dict(kwargs)), ("gate", "up")))
    return cases


def _rope_positions(g: torch.Generator, kind: str, b: int, s: int, p: int) -> Tensor:
    """position_ids into tables of p > s rows. "shared": [S], one run for the batch ending at the table's last row
    (a later decode step); "packed": [B, S], sequences packed into each row, positions restarting at 0 where one
    begins (Hugging Face's padding-free collator), one restart at least mid-row."""
    if kind == "shared":
        return torch.arange(p - s, p)
    idx = torch.arange(s)
    starts = torch.rand(b, s, generator=g) < 0.3
    starts[:, 0] = starts[:, s // 2] = True
    return idx - torch.where(starts, idx, 0).cummax(-1).values


def _rope_case(name: str, b: int, hq: int, hk: int, s: int, d: int, batch_tables: bool = False,
               transposed: bool = False, gpu_only: bool = False, positions: str | None = None,
               mrope: list[int] | None = None) -> Case:
    def make(g: torch.Generator) -> tuple[dict[str, Tensor], dict[str, Any]]:
        if transposed:  # q, k as views of [B, S, H, D] projections: strides (S·H·D, D, H·D, 1)
            q = _randn(g, b, s, hq, d).transpose(1, 2)
            k = _randn(g, b, s, hk, d).transpose(1, 2)
        else:
            q, k = _randn(g, b, hq, s, d), _randn(g, b, hk, s, d)
        if mrope is not None:  # three streams' tables [3, (B,) S, D], chunks of the head dim from each in turn
            angles = _randn(g, 3, *((b,) if batch_tables else ()), s, d, scale=3.0)
            kwargs = {"mrope_section": list(mrope)}
        elif positions is not None:  # tables [P, D] of more positions than tokens, read at position_ids
            angles = _randn(g, s + 7, d, scale=3.0)
            kwargs = {"position_ids": _rope_positions(g, positions, b, s, s + 7)}
        else:
            angles = _randn(g, *((b,) if batch_tables else ()), s, d, scale=3.0)  # any angles, halves not tied
            kwargs = {}
        return {"q": q, "k": k, "cos": torch.cos(angles), "sin": torch.sin(angles)}, kwargs

    return Case("rope", name, make, ("q", "k"), gpu_only=gpu_only)


def _qk_case(name: str, b: int, hq: int, hk: int, s: int, d: int, eps: float = 1e-6, **rope: Any) -> Case:
    """rope's inputs (see _rope_case) and per-head norm weights near 1 (trained ones are), q's rows scaled apart
    from k's so that each head's norm matters."""
    base = _rope_case(name, b, hq, hk, s, d, **rope)

    def make(g: torch.Generator) -> tuple[dict[str, Tensor], dict[str, Any]]:
        tensors, kwargs = base.make(g)
        tensors["k"] = tensors["k"] * 4.0
        tensors["q_weight"] = _randn(g, d, scale=0.3, shift=1.0)
        tensors["k_weight"] = _randn(g, d, scale=0.3, shift=1.0)
        return tensors, {**kwargs, "eps": eps}

    return Case("qk_norm_rope", name, make, ("q", "k", "q_weight", "k_weight"), gpu_only=base.gpu_only)


def _targets(g: torch.Generator, t: int, v: int, ignored: float = 0.2, ignore_index: int = -100) -> Tensor:
    target = torch.randint(0, v, (t,), generator=g)
    drop = torch.rand(t, generator=g) < ignored
    return torch.where(drop, ignore_index, target)


def _ce_case(name: str, t: int, v: int, unit: bool = False, ignored: float = 0.2, gpu_only: bool = False,
             weighted: bool = False, **kwargs: Any) -> Case:
    """``weighted``: class weights drawn in [0.25, 2)."""
    def make(g: torch.Generator) -> tuple[dict[str, Tensor], dict[str, Any]]:
        target = _targets(g, t, v, ignored, kwargs.get("ignore_index", -100))
        extra = {"weight": torch.rand(v, generator=g, dtype=torch.float64) * 1.75 + 0.25} if weighted else {}
        return {"logits": _randn(g, t, v, scale=3.0)}, {"target": target, **kwargs, **extra}

    return Case("cross_entropy", name, make, ("logits",), unit_upstream=unit, gpu_only=gpu_only)


def _flce_case(name: str, t: int, h: int, v: int, bias: bool = True, unit: bool = False, ignored: float = 0.2,
               gpu_only: bool = False, min_chunk: int | None = None, weighted: bool = False, **kwargs: Any) -> Case:
    def make(g: torch.Generator) -> tuple[dict[str, Tensor], dict[str, Any]]:
        tensors = {"hidden": _randn(g, t, h), "weight": _randn(g, v, h, scale=h**-0.5)}
        if bias:
            tensors["bias"] = _randn(g, v, scale=0.5)
        extra = {"ce_weight": torch.rand(v, generator=g, dtype=torch.float64) * 1.75 + 0.25} if weighted else {}
        return tensors, {"target": _targets(g, t, v, ignored), **kwargs, **extra}

    grads = ("hidden", "weight", "bias") if bias else ("hidden", "weight")
    return Case("fused_linear_cross_entropy", name, make, grads, unit_upstream=unit, gpu_only=gpu_only,
                min_chunk=min_chunk, base=_torch_chunked_linear_ce)


def _torch_chunked_linear_ce(hidden: Tensor, weight: Tensor, target: Tensor, bias: Tensor | None = None,
                             ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0,
                             lse_square_scale: float = 0.0, softcap: float | None = None, return_z_loss: bool = False,
                             return_token_accuracy: bool = False, return_predicted_tokens: bool = False,
                             return_entropy: bool = False, ce_weight: Tensor | None = None,
                             chunk_size: int | None = None) -> Any:
    """The error baseline of the linear loss: plain PyTorch in the input dtype over the same token chunks as the op
    (hkernels/runtime/chunked.py), so its gradients for weight and bias are sums of per-chunk gradients each rounded to
    that dtype, as the op's are by design (an unchunked baseline rounds once and would hold the op to a
    different algorithm). The loss options and metrics as the op takes them."""
    from hkernels import references
    from hkernels.functional.cross_entropy import loss_output
    from hkernels.runtime import chunked as _chunked

    rows = chunk_size or _chunked.chunk_rows(hidden.shape[0], hidden.shape[1], weight.shape[0])
    parts = [  # per token of each chunk: (loss, z term, -, predicted class, entropy)
        references.cross_entropy(torch.nn.functional.linear(hidden[i:i + rows], weight, bias).float(),
                                 target[i:i + rows], ignore_index, "none", label_smoothing,
                                 lse_square_scale=lse_square_scale, softcap=softcap, return_z_loss=True,
                                 return_predicted_tokens=True, return_entropy=True, weight=ce_weight)
        for i in range(0, hidden.shape[0], rows)
    ]
    def joined(k: int, dtype: torch.dtype) -> Tensor:  # T = 0: no chunks
        return torch.cat([p[k] for p in parts]) if parts else hidden.new_zeros(0, dtype=dtype)

    loss, z, pred, ent = (joined(k, d) for k, d in ((0, torch.float32), (1, torch.float32), (3, torch.int64),
                                                   (4, torch.float32)))
    dtype = torch.promote_types(hidden.dtype, torch.float32)  # the op's loss is float32, as HF's is
    if reduction != "none":
        valid = target != ignore_index
        count = valid.sum() if ce_weight is None else torch.where(valid, ce_weight[torch.where(valid, target, 0)],
                                                                  0.0).sum()
        loss, z = ((t.sum() if reduction == "sum" else t.sum() / count) for t in (loss, z))
    returns = (return_z_loss, return_token_accuracy, return_predicted_tokens, return_entropy)
    return loss_output(loss.to(dtype), z.to(dtype), pred, ent, target, ignore_index, reduction, returns)


_ELEMENTWISE = [(n, s) for n, s in SHAPES if n != "large_n"] + [("long_rows", (2, 100003))]
_NORM_SHAPES = SHAPES

CASES_LLM: list[Case] = [
    *_gated("swiglu", _ELEMENTWISE),
    *_gated("swiglu", [("odd", (7, 37)), ("3d", (2, 3, 100))], gate_multiplier=0.7, down_multiplier=1.3),  # Falcon-H1
    *_gated("geglu", _ELEMENTWISE, approximate="tanh"),
    *_gated("geglu", [("odd", (7, 37)), ("3d", (2, 3, 100))], approximate="none"),
    Case("swiglu", "large_gate", lambda g: ({"gate": torch.linspace(-120, 120, 64, dtype=torch.float64).reshape(2, 32),
                                             "up": _randn(g, 2, 32)}, {}), ("gate", "up")),
    Case("geglu", "large_gate", lambda g: ({"gate": torch.linspace(-60, 60, 64, dtype=torch.float64).reshape(2, 32),
                                            "up": _randn(g, 2, 32)}, {"approximate": "tanh"}), ("gate", "up")),
    _rope_case("one_token", 1, 1, 1, 1, 64),
    _rope_case("gqa", 2, 4, 2, 7, 64),
    _rope_case("d128_odd_s", 1, 3, 1, 37, 128),
    _rope_case("batch_tables", 2, 2, 1, 5, 64, batch_tables=True),
    _rope_case("transposed", 2, 4, 2, 9, 128, transposed=True),
    _rope_case("d2", 1, 2, 2, 3, 2),
    _rope_case("d2_one_token", 1, 1, 1, 1, 2),  # every size 1 too: a shape Helion's codegen must handle
    _rope_case("llama_8b", 2, 32, 8, 256, 128, transposed=True, gpu_only=True),
    _rope_case("llama_70b_odd", 1, 64, 8, 1000, 128, gpu_only=True),
    _rope_case("packed", 2, 4, 2, 11, 64, positions="packed"),
    _rope_case("shared_positions", 2, 2, 1, 5, 64, positions="shared"),
    _rope_case("transposed_packed", 2, 4, 2, 9, 128, transposed=True, positions="packed"),
    _rope_case("llama_8b_packed", 2, 32, 8, 256, 128, transposed=True, gpu_only=True, positions="packed"),
    _rope_case("mrope", 2, 4, 2, 7, 16, mrope=[2, 3, 3]),
    _qk_case("one_token", 1, 1, 1, 1, 64),
    _qk_case("gqa_odd_s", 2, 4, 2, 7, 64),
    _qk_case("d128_transposed", 1, 4, 2, 37, 128, transposed=True),
    _qk_case("d4_batch_tables", 2, 2, 1, 5, 4, batch_tables=True),
    _qk_case("d256_eps", 1, 2, 1, 9, 256, eps=1e-2),  # Gemma 3's head dim
    _qk_case("packed", 2, 4, 2, 11, 64, positions="packed"),
    _qk_case("head_groups", 2, 20, 10, 6, 8, batch_tables=True),  # Triton's programs: 4 and 2 groups of 5 heads
    _qk_case("qwen3_8b", 2, 32, 8, 256, 128, transposed=True, gpu_only=True),
    _qk_case("qwen3_odd_packed", 1, 16, 8, 1000, 128, transposed=True, gpu_only=True, positions="packed"),
    _rope_case("mrope_batch_tables_transposed", 2, 4, 2, 9, 64, batch_tables=True, transposed=True,
               mrope=[8, 12, 12]),
    _rope_case("qwen2_5_vl_7b_mrope", 1, 28, 4, 512, 128, batch_tables=True, transposed=True, gpu_only=True,
               mrope=[16, 24, 24]),
    *[
        Case("add_rms_norm", f"{name}{'-weight' if w else ''}",
             lambda g, s=shape, w=w: ({"x": _randn(g, *s), "residual": _randn(g, *s, scale=2.0),
                                       **({"weight": _randn(g, s[-1], scale=0.5, shift=1.0)} if w else {})},
                                      {"eps": 1e-6}),
             ("x", "residual", "weight") if w else ("x", "residual"))
        for name, shape in _NORM_SHAPES for w in (True, False) if w or name in ("odd", "3d", "large_n")
    ],
    *[
        Case("add_rms_norm", f"{name}-weight-offset",  # Gemma's x̂ · (1 + w), w near 0
             lambda g, s=shape: ({"x": _randn(g, *s), "residual": _randn(g, *s, scale=2.0),
                                  "weight": _randn(g, s[-1], scale=0.3)}, {"eps": 1e-6, "offset": 1.0}),
             ("x", "residual", "weight"))
        for name, shape in _NORM_SHAPES if name in ("odd", "3d", "many_rows")
    ],
    _ce_case("one_token", 1, 7),
    _ce_case("odd_v", 37, 1000),
    _ce_case("sum", 5, 300, reduction="sum"),
    _ce_case("none", 5, 300, reduction="none"),
    _ce_case("unit_upstream", 9, 500, unit=True),
    _ce_case("smoothing", 7, 301, label_smoothing=0.1),
    _ce_case("smoothing_none", 7, 301, reduction="none", label_smoothing=0.2),
    _ce_case("all_ignored", 4, 50, ignored=1.0),
    _ce_case("all_ignored_sum", 4, 50, ignored=1.0, reduction="sum"),
    _ce_case("ignore_other", 6, 40, ignore_index=3),
    _ce_case("large_v", 2, 262144),
    # the loss options (Liger's names), fused into the same passes
    _ce_case("softcap", 9, 301, softcap=5.0),
    _ce_case("z_loss", 9, 301, lse_square_scale=1e-2),
    _ce_case("z_loss_returned", 9, 301, lse_square_scale=1e-2, return_z_loss=True),
    _ce_case("softcap_z_smoothing_none", 7, 301, reduction="none", softcap=3.0, lse_square_scale=1e-3,
             label_smoothing=0.1, return_z_loss=True),
    _ce_case("softcap_z_sum_one_token", 1, 50, reduction="sum", softcap=2.0, lse_square_scale=1e-2),
    _ce_case("softcap_large_v", 2, 262144, softcap=30.0, lse_square_scale=1e-4),
    # the metrics trainers log, from the same pass
    _ce_case("metrics", 9, 301, return_token_accuracy=True, return_predicted_tokens=True, return_entropy=True),
    _ce_case("metrics_none_softcap", 7, 301, reduction="none", softcap=30.0, return_token_accuracy=True,
             return_predicted_tokens=True, return_entropy=True, return_z_loss=True, lse_square_scale=1e-3),
    _ce_case("metrics_all_ignored", 4, 50, ignored=1.0, return_token_accuracy=True, return_entropy=True),
    # class weights, as F.cross_entropy's
    _ce_case("weighted", 9, 301, weighted=True),
    _ce_case("weighted_smoothing_sum", 9, 301, weighted=True, reduction="sum", label_smoothing=0.1),
    _ce_case("weighted_smoothing_none_softcap_z", 7, 301, weighted=True, reduction="none", label_smoothing=0.2,
             softcap=5.0, lse_square_scale=1e-2),
    _ce_case("weighted_unit", 9, 500, weighted=True, unit=True, label_smoothing=0.1),
    _ce_case("vocab", 64, 128256, gpu_only=True),
    _ce_case("vocab_softcap_z", 64, 128256, softcap=30.0, lse_square_scale=1e-4, return_z_loss=True, gpu_only=True),
    _ce_case("vocab_unit", 64, 128256, unit=True, gpu_only=True),
    _ce_case("vocab_262k", 16, 262144, gpu_only=True),
    _flce_case("one_token", 1, 16, 50),
    _flce_case("odd", 37, 48, 301),
    _flce_case("no_bias_sum", 9, 32, 200, bias=False, reduction="sum"),
    _flce_case("none", 9, 32, 200, reduction="none"),
    _flce_case("unit_upstream", 9, 32, 200, unit=True),
    _flce_case("smoothing", 9, 32, 200, label_smoothing=0.1),
    _flce_case("all_ignored", 4, 16, 50, ignored=1.0),
    _flce_case("chunks", 150, 16, 64, unit=True, min_chunk=64),  # 3 chunks, the last partial
    _flce_case("chunks_none", 150, 16, 64, reduction="none", min_chunk=64),
    _flce_case("chunk_size", 150, 16, 64, unit=True, chunk_size=48),  # the caller's chunks: 4, the last of 6 tokens
    _flce_case("chunk_size_none", 150, 16, 64, reduction="none", chunk_size=40, softcap=3.0),
    _flce_case("softcap_z", 9, 32, 200, softcap=4.0, lse_square_scale=1e-2),
    _flce_case("softcap_z_returned_chunks", 150, 16, 64, unit=True, min_chunk=64, softcap=2.0, lse_square_scale=1e-3,
               return_z_loss=True),
    _flce_case("softcap_none", 9, 32, 200, reduction="none", softcap=4.0, lse_square_scale=1e-2, return_z_loss=True),
    _flce_case("metrics_chunks", 150, 16, 64, min_chunk=64, return_token_accuracy=True, return_predicted_tokens=True,
               return_entropy=True),
    _flce_case("weighted_smoothing_chunks", 150, 16, 64, min_chunk=64, weighted=True, label_smoothing=0.1),
    _flce_case("weighted_none", 9, 32, 200, weighted=True, reduction="none"),
    _flce_case("llama_like", 2048, 512, 32000, bias=False, gpu_only=True),
    _flce_case("gemma_like_softcap", 1024, 512, 32000, bias=False, softcap=30.0, lse_square_scale=1e-4,
               gpu_only=True),
    _flce_case("llama_chunks", 3000, 256, 32000, gpu_only=True),
]


def _torch_matmul(a: Tensor, b: Tensor, bias: Tensor | None = None, activation: str | None = None) -> Tensor:
    """PyTorch unfused in the input dtype: matmul, + bias, activation, each rounded."""
    z = torch.matmul(a, b)
    z = z + bias if bias is not None else z
    acts = {None: lambda t: t, "relu": torch.relu, "gelu": torch.nn.functional.gelu, "silu": torch.nn.functional.silu,
            "gelu_tanh": lambda t: torch.nn.functional.gelu(t, approximate="tanh")}
    return acts[activation](z)


def _torch_attention_masked(q: Tensor, k: Tensor, v: Tensor, causal: bool = False, scale: float | None = None,
                            window: Any = None, softcap: float | None = None) -> Tensor:
    """PyTorch in the input dtype with an explicit mask and cap (SDPA takes neither a cap nor an end-aligned mask
    for Sq ≠ Sk): each product, the cap and the softmax rounded, as a flash kernel rounds P; a query that keeps no
    key gets 0."""
    from hkernels.functional import attention as fa

    left, right = fa.window_bounds("attention", window, causal)
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    keep = fa.mask(q.shape[2], k.shape[2], causal, left, right, q.device)
    p = torch.softmax(s.float() if keep is None else s.float().masked_fill(~keep, float("-inf")), -1)
    if keep is not None:  # a query without keys: 0 (its softmax is 0/0); a NaN score stays NaN
        p = torch.where(keep.any(-1, keepdim=True), p, 0.0)
    return torch.matmul(p.to(q.dtype), v)


def _torch_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool = False, scale: float | None = None,
                     window: Any = None, softcap: float | None = None) -> Tensor:
    """PyTorch's scaled_dot_product_attention in the input dtype (kv heads repeated for grouped queries), on
    copies with row-major strides: on a GPU its memory-efficient kernel raises "query is not correctly aligned"
    for a transposed float32 q and reads out of alignment (a CUDA misaligned-address fault) for a float16 column
    slice; the layout is hkernels' to handle, not the baseline's. ``contiguous()`` is not enough: with one query
    (S = 1) a transposed q counts as contiguous and keeps the odd stride of its size-1 dim, which SDPA checks."""
    if window is not None or softcap:
        return _torch_attention_masked(q, k, v, causal, scale, window, softcap)
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    q, k, v = (t.clone(memory_format=torch.contiguous_format) for t in (q, k, v))
    # Scales <= 0 are computed as the same scores, exactly, with a positive one: (-q)·k·|scale|, and (0·q)·k·1
    # (autograd carries the factor to dq). SDPA's own gradients for them are unusable as a bound: NaN on a CPU for a
    # negative causal case in bfloat16, and "error 0" on the GPU for 0 and -0.3 (the bound reads NaN as 0), which
    # no bf16 rounding can meet.
    if scale is not None and scale < 0:
        q, scale = -q, -scale
    elif scale == 0:
        q, scale = q * 0.0, 1.0
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)


def _mm_case(name: str, m: int, k: int, n: int, batch: int = 0, bias: bool = False, activation: str | None = None,
             transposed_b: bool = False, gpu_only: bool = False) -> Case:
    def make(g: torch.Generator) -> tuple[dict[str, Tensor], dict[str, Any]]:
        lead = (batch,) if batch else ()
        a = _randn(g, *lead, m, k)
        b = _randn(g, *lead, n, k).transpose(-1, -2) if transposed_b else _randn(g, *lead, k, n)
        tensors = {"a": a, "b": b * k**-0.5}
        if bias:
            tensors["bias"] = _randn(g, n, scale=0.5)
        return tensors, {"activation": activation}

    grads = ("a", "b", "bias") if bias else ("a", "b")
    return Case("matmul", name, make, grads, gpu_only=gpu_only, base=_torch_matmul)


def _attn_case(name: str, b: int, hq: int, hk: int, s: int, skv: int, d: int, causal: bool = False,
               transposed: bool = False, scale: float | None = None, gpu_only: bool = False,
               kernels: tuple[str, ...] | None = None, **options: Any) -> Case:
    def make(g: torch.Generator) -> tuple[dict[str, Tensor], dict[str, Any]]:
        if transposed:  # views of [B, S, H, D] projections
            q = _randn(g, b, s, hq, d).transpose(1, 2)
            k, v = (_randn(g, b, skv, hk, d).transpose(1, 2) for _ in range(2))
        else:
            q, k, v = _randn(g, b, hq, s, d), _randn(g, b, hk, skv, d), _randn(g, b, hk, skv, d)
        return {"q": q, "k": k, "v": v}, {"causal": causal, "scale": scale, **options}

    return Case("attention", name, make, ("q", "k", "v"), gpu_only=gpu_only, base=_torch_attention, kernels=kernels)


def _torch_attention_varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor | None = None,
                            max_seqlen_q: int | None = None, max_seqlen_k: int | None = None, causal: bool = False,
                            scale: float | None = None, window: Any = None, softcap: float | None = None) -> Tensor:
    """:func:`_torch_attention_masked` per sequence (masks aligned at its end), zeros for rows of no sequence."""
    cu_k = cu_seqlens_q if cu_seqlens_k is None else cu_seqlens_k
    out = q.new_zeros(q.shape) + q[:0].sum()
    bq, bk = cu_seqlens_q.tolist(), cu_k.tolist()
    for qa, qb, ka, kb in zip(bq[:-1], bq[1:], bk[:-1], bk[1:], strict=True):
        if qb > qa and kb > ka:
            seq = [t[a:b].transpose(0, 1).unsqueeze(0) for t, a, b in ((q, qa, qb), (k, ka, kb), (v, ka, kb))]
            out[qa:qb] = _torch_attention_masked(*seq, causal, scale, window, softcap)[0].transpose(0, 1)
    return out


def _varlen_case(name: str, hq: int, hk: int, d: int, lens_q: list[int], lens_k: list[int] | None = None,
                 give_max: bool = True, extra_rows: int = 0, gpu_only: bool = False,
                 kernels: tuple[str, ...] | None = None, **options: Any) -> Case:
    """Packed q [Tq, Hq, D], k/v [Tk, Hk, D] of sequences of the given lengths (k's default to q's: self-attention);
    ``extra_rows`` rows past the last sequence."""
    def make(g: torch.Generator) -> tuple[dict[str, Tensor], dict[str, Any]]:
        cu = lambda lens: torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        tq = sum(lens_q) + extra_rows
        tk = sum(lens_k) + extra_rows if lens_k is not None else tq
        q, k, v = _randn(g, tq, hq, d), _randn(g, tk, hk, d), _randn(g, tk, hk, d)
        kwargs: dict[str, Any] = {"cu_seqlens_q": cu(lens_q), **options}
        if lens_k is not None:
            kwargs["cu_seqlens_k"] = cu(lens_k)
        if give_max:
            kwargs["max_seqlen_q"] = max(lens_q)
            kwargs["max_seqlen_k"] = max(lens_k if lens_k is not None else lens_q)
        return {"q": q, "k": k, "v": v}, kwargs

    return Case("attention_varlen", name, make, ("q", "k", "v"), gpu_only=gpu_only, base=_torch_attention_varlen,
                kernels=kernels)


def _torch_grouped_matmul(x: Tensor, weight: Tensor, group_sizes: Tensor) -> Tensor:
    """PyTorch per group in the input dtype (each group's product rounded once, as a grouped kernel's)."""
    ends = torch.cumsum(group_sizes.clamp(min=0), 0).clamp(max=x.shape[0]).tolist()
    outs, start = [], 0
    for e, end in enumerate(ends):
        outs.append(x[start:end] @ weight[e].T)
        start = end
    outs.append(x.new_zeros((x.shape[0] - start, weight.shape[1])) + 0.0 * x[start:, :1])  # zeros past the sum
    return torch.cat(outs)


def _gmm_case(name: str, t: int, k: int, n: int, sizes: list[int] | None = None, experts: int = 4,
              transposed_weight: bool = False, gpu_only: bool = False) -> Case:
    """x [T, K], weight [E, N, K] (or a transposed view of [E, K, N]), group sizes given or drawn (summing to T)."""
    def make(g: torch.Generator) -> tuple[dict[str, Tensor], dict[str, Any]]:
        x = _randn(g, t, k)
        w = _randn(g, experts, k, n).transpose(1, 2) if transposed_weight else _randn(g, experts, n, k)
        if sizes is None:
            cuts = torch.sort(torch.randint(0, t + 1, (experts - 1,), generator=g)).values.tolist()
            drawn = torch.tensor([b - a for a, b in zip([0, *cuts], [*cuts, t], strict=True)])
        else:
            drawn = torch.tensor(sizes)
        return {"x": x, "weight": w * k**-0.5}, {"group_sizes": drawn}

    return Case("grouped_matmul", name, make, ("x", "weight"), gpu_only=gpu_only, base=_torch_grouped_matmul)


def _torch_moe(x: Tensor, gate_up_proj: Tensor, down_proj: Tensor, topk_ids: Tensor, topk_weights: Tensor) -> Tensor:
    """PyTorch one expert at a time in the input dtype (Hugging Face's eager experts: each product and the SwiGLU
    rounded), the k slots summed in float32."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    ids = topk_ids.reshape(x2.shape[0], topk_ids.shape[-1])
    w = topk_weights.reshape(ids.shape)
    out = torch.zeros(x2.shape, dtype=torch.float32, device=x.device) + 0.0 * x2[:1, :1].float()
    for e in range(gate_up_proj.shape[0]):
        t, j = torch.nonzero(ids == e, as_tuple=True)
        if t.numel():
            g, u = (x2[t] @ gate_up_proj[e].T).chunk(2, -1)
            y = (torch.nn.functional.silu(g) * u) @ down_proj[e].T
            out = out.index_add(0, t, (y * w[t, j, None]).float())
    return out.to(x.dtype).view(shape)


def _moe_case(name: str, t: int | tuple[int, ...], h: int, i: int, experts: int, k: int,
              ids: list[list[int]] | None = None, transposed_weights: bool = False, gpu_only: bool = False) -> Case:
    """x [*t, H], gate_up [E, 2I, H], down [E, H, I] (or transposed views), ids given or drawn, weights in [0, 1)."""
    lead = t if isinstance(t, tuple) else (t,)

    def make(g: torch.Generator) -> tuple[dict[str, Tensor], dict[str, Any]]:
        x = _randn(g, *lead, h)
        if transposed_weights:
            gate_up = _randn(g, experts, h, 2 * i, scale=h**-0.5).transpose(1, 2)
            down = _randn(g, experts, i, h, scale=i**-0.5).transpose(1, 2)
        else:
            gate_up = _randn(g, experts, 2 * i, h, scale=h**-0.5)
            down = _randn(g, experts, h, i, scale=i**-0.5)
        drawn = (torch.tensor(ids) if ids is not None
                 else torch.randint(0, experts, (*lead, k), generator=g)).reshape(*lead, k)
        weights = torch.rand((*lead, k), generator=g, dtype=torch.float64)
        return ({"x": x, "gate_up_proj": gate_up, "down_proj": down, "topk_weights": weights},
                {"topk_ids": drawn})

    return Case("moe", name, make, ("x", "gate_up_proj", "down_proj", "topk_weights"), gpu_only=gpu_only,
                base=_torch_moe)


CASES_LLM += [
    _moe_case("drawn", 37, 48, 40, 5, 2),
    _moe_case("repeats_idle_expert", 4, 32, 24, 4, 3, ids=[[0, 0, 1], [2, 2, 2], [1, 0, 2], [0, 1, 1]]),
    _moe_case("one_token_k1", 1, 32, 16, 3, 1, ids=[[2]]),
    _moe_case("top1", 30, 32, 24, 3, 1),
    _moe_case("ids_out_of_range", 5, 32, 16, 4, 2, ids=[[0, -1], [4, 1], [3, 7], [-5, -5], [2, 3]]),
    _moe_case("weights_t", 21, 40, 24, 4, 2, transposed_weights=True),
    _moe_case("batched_3d", (2, 9), 32, 16, 6, 2),
    _moe_case("qwen3_moe_like", 256, 256, 128, 16, 4, gpu_only=True),
]

CASES_LLM += [
    _gmm_case("drawn", 37, 40, 24),
    _gmm_case("empty_groups", 20, 32, 16, sizes=[0, 12, 0, 8]),
    _gmm_case("one_token", 1, 64, 48, sizes=[0, 1, 0, 0]),
    _gmm_case("one_expert", 9, 16, 33, sizes=[9], experts=1),
    _gmm_case("short_sum", 20, 16, 16, sizes=[3, 5, 0, 2]),  # rows past the sum: zeros
    _gmm_case("over_sum_negative", 20, 16, 16, sizes=[-2, 15, 30, 1]),  # clamped
    _gmm_case("weight_t", 33, 48, 40, transposed_weight=True),
    _gmm_case("qwen3_moe_like", 600, 256, 192, experts=16, gpu_only=True),
    _mm_case("one_row", 1, 64, 48),
    _mm_case("odd", 37, 17, 53),
    _mm_case("n1", 5, 32, 1),
    _mm_case("bias_relu", 33, 64, 40, bias=True, activation="relu"),
    _mm_case("gelu", 20, 48, 72, activation="gelu"),
    _mm_case("bias_gelu_tanh", 20, 48, 72, bias=True, activation="gelu_tanh"),
    _mm_case("silu_weight_t", 19, 64, 96, activation="silu", transposed_b=True),
    _mm_case("batched_bias_silu", 7, 40, 24, batch=3, bias=True, activation="silu"),
    _mm_case("llama_qkv", 512, 4096, 6144, transposed_b=True, gpu_only=True),
    _mm_case("llama_up_silu", 300, 4096, 14336, bias=True, activation="silu", gpu_only=True),
    _attn_case("one_query", 1, 1, 1, 1, 1, 64),
    # one query against many keys (a decode step through attention): a dim of size 1 under a tile of queries
    _attn_case("one_query_many_keys", 2, 4, 2, 1, 37, 64),
    _attn_case("one_query_softcap", 1, 4, 1, 1, 20, 32, softcap=5.0),
    _attn_case("odd", 1, 2, 2, 7, 7, 64),
    _attn_case("causal_odd", 1, 2, 1, 37, 37, 64, causal=True),
    _attn_case("gqa_cross", 2, 4, 2, 9, 20, 16),
    _attn_case("mqa_causal", 1, 4, 1, 20, 20, 16, causal=True),
    _attn_case("d128_transposed", 1, 2, 2, 33, 33, 128, transposed=True, causal=True),
    _attn_case("scale", 1, 2, 1, 10, 17, 32, scale=0.3),
    # zero and negative scales (a zero scale gave Helion NaN in its masked blocks for one commit: -inf * 0)
    _attn_case("scale_zero", 1, 2, 1, 10, 17, 32, scale=0.0),
    _attn_case("scale_zero_causal", 1, 2, 1, 9, 9, 16, causal=True, scale=0.0),
    _attn_case("scale_negative", 1, 2, 1, 10, 17, 32, scale=-0.3),
    _attn_case("scale_negative_causal", 1, 2, 1, 9, 9, 16, causal=True, scale=-0.3),
    _attn_case("llama_causal", 2, 32, 8, 1000, 1000, 128, causal=True, gpu_only=True),
    _attn_case("long_kv", 1, 8, 8, 128, 4099, 64, gpu_only=True),
    _attn_case("window_causal", 1, 2, 1, 37, 37, 64, causal=True, window=(5, None)),
    _attn_case("window_two_sided", 1, 2, 2, 33, 33, 32, window=(4, 6)),
    _attn_case("window_right_only", 1, 2, 1, 20, 20, 16, window=(None, 3)),
    # wider than two interpreter blocks: a program walks masked, whole and masked key blocks
    _attn_case("window_wide", 1, 2, 1, 64, 64, 32, causal=True, window=(40, 0)),
    _attn_case("softcap_cross", 1, 2, 1, 10, 17, 32, softcap=5.0),
    _attn_case("softcap_window_gqa", 2, 4, 2, 40, 40, 64, causal=True, window=(16, 0), softcap=2.0),
    _attn_case("mistral_window", 1, 8, 2, 1500, 1500, 128, causal=True, window=(511, 0), gpu_only=True),
    _attn_case("gemma_softcap", 1, 8, 4, 700, 700, 128, causal=True, window=(255, 0), softcap=50.0,
               gpu_only=True),
    # Gemma's head dim, on Triton (Helion's kernels stop at D = 128)
    _attn_case("d256_window_softcap", 1, 4, 2, 70, 70, 256, causal=True, window=(40, 0), softcap=20.0,
               kernels=("triton",)),
    _attn_case("gemma_d256", 1, 8, 4, 1100, 1100, 256, causal=True, window=(511, 0), softcap=50.0,
               gpu_only=True, kernels=("triton",)),
    _attn_case("d256_full_gqa", 2, 4, 1, 300, 300, 256, gpu_only=True, kernels=("triton",)),
    _varlen_case("self_causal", 4, 2, 64, [5, 0, 1, 17, 9], causal=True),
    _varlen_case("d256", 2, 1, 256, [30, 0, 47], causal=True, kernels=("triton",)),
    _varlen_case("cross_end_aligned", 2, 1, 32, [3, 7, 0, 2, 6], [8, 4, 5, 0, 2], causal=True, extra_rows=3),
    _varlen_case("window_softcap", 2, 2, 64, [20, 13, 31], give_max=False, causal=True, window=(6, 0),
                 softcap=3.0),
    _varlen_case("full", 2, 1, 16, [12, 1, 30]),
    _varlen_case("mixed_docs", 16, 4, 128, [1500, 37, 800, 1, 1000, 750], causal=True, gpu_only=True),
    _varlen_case("mixed_docs_d64_window", 8, 8, 64, [2000, 300, 1800], causal=True, window=(255, 0),
                 gpu_only=True),
]


def _decode_case(name: str, b: int, hq: int, hk: int, sq: int, s_max: int, d: int, lens: list[int] | None = None,
                 transposed: bool = False, int64: bool = False, gpu_only: bool = False, **options: Any) -> Case:
    """q [B, Hq, Sq, D], caches [B, Hk, S_max, D] (or views of [B, S_max, Hk, D]) whose rows past each length hold
    NaN (they must never be read), lengths given or drawn in [0, S_max]; forward only."""
    def make(g: torch.Generator) -> tuple[dict[str, Tensor], dict[str, Any]]:
        q = _randn(g, b, hq, sq, d)
        if transposed:
            k, v = (_randn(g, b, s_max, hk, d).transpose(1, 2) for _ in range(2))
        else:
            k, v = _randn(g, b, hk, s_max, d), _randn(g, b, hk, s_max, d)
        drawn = torch.tensor(lens) if lens is not None else torch.randint(0, s_max + 1, (b,), generator=g)
        for i, n in enumerate(drawn.tolist()):
            k[i, :, max(n, 0):] = float("nan")
            v[i, :, max(n, 0):] = float("nan")
        seqlens = drawn.to(torch.int64 if int64 else torch.int32)
        return {"q": q, "k_cache": k, "v_cache": v}, {"cache_seqlens": seqlens, **options}

    return Case("decode_attention", name, make, (), gpu_only=gpu_only)


CASES_LLM += [
    _decode_case("lengths_0_1_full", 3, 8, 2, 1, 37, 64, lens=[0, 1, 37]),
    _decode_case("speculative_4", 3, 8, 2, 4, 37, 64, lens=[0, 2, 30]),  # L < Sq: early tokens see nothing
    _decode_case("d128_window", 3, 8, 2, 4, 45, 128, lens=[45, 7, 3], window=(5, None)),
    _decode_case("softcap", 2, 4, 4, 2, 50, 64, lens=[50, 17], softcap=5.0),
    _decode_case("softcap_window_mqa", 2, 4, 1, 3, 40, 32, lens=[40, 9], softcap=2.0, window=(3, 0), scale=0.2),
    _decode_case("transposed_caches", 2, 8, 2, 2, 33, 64, transposed=True),
    _decode_case("one_row", 1, 1, 1, 1, 1, 16, lens=[1]),
    _decode_case("scale_negative", 1, 2, 1, 1, 20, 16, lens=[20], scale=-0.3),
    _decode_case("int64_lengths", 2, 2, 2, 1, 20, 32, lens=[20, 5], int64=True),
    _decode_case("rows_past_a_tile", 1, 8, 1, 5, 30, 64, lens=[30]),  # 40 query rows of one kv head
    _decode_case("spec16_d256", 1, 4, 2, 16, 40, 256, lens=[40]),
    _decode_case("one_sequence_32k", 1, 32, 8, 1, 32768, 128, lens=[32763], gpu_only=True),
    _decode_case("batch16_4k", 16, 32, 8, 1, 4096, 128, gpu_only=True),
    _decode_case("batch4_8k_spec4_gemma", 4, 16, 8, 4, 8192, 256, window=(4095, 0), softcap=50.0, gpu_only=True),
]
if not ON_GPU:
    CASES_LLM = [c for c in CASES_LLM if not c.gpu_only]


def cast_case(tensors: dict[str, Tensor], dtype: torch.dtype, device: torch.device) -> dict[str, Tensor]:
    """The float64 inputs in the dtype under test, keeping strided layouts (column slices, transposes) as they are."""
    out = {}
    for name, t in tensors.items():
        if name in ("cos", "sin"):
            out[name] = t.to(device=device, dtype=torch.float32)  # rotary tables are usually kept in float32
            continue
        base = t
        while base._base is not None:
            base = base._base
        if base is not t:  # a view: cast the base, take the same view
            b = base.to(device=device, dtype=dtype)
            out[name] = b.as_strided(t.shape, t.stride(), t.storage_offset())
        else:
            out[name] = t.to(device=device, dtype=dtype)
    return out
