"""What the shared suite knows about each op: how to call it, how to make inputs, which shapes, how close.

Tolerances are written once per dtype. A result passes when its largest error against the float64 reference
is within ``factor`` times the error PyTorch's own computation in the same dtype makes on the same inputs
(``hkernels.reference`` run on the low-precision tensors: float32 math, one rounding at the end), plus a floor
``atol`` relative to the size of the reference (so exact-zero baselines do not demand exact results). Gradients
get one more term: float32's floor times the size of the terms the backward subtracts (rstd·|w|·|dy| for the
norms). The kernels compute in float32 whatever the I/O dtype, and a gradient that is mathematically 0
(layer_norm with N = 1) keeps the float32 rounding of those terms in any fused kernel (seen on the H200: a
contracted multiply-add left 1 ulp × 1/sqrt(eps)), which PyTorch's unfused eager baseline happens to avoid.
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
# looped kernels; "many_rows" has more rows than programs in a persistent grid.
SHAPES: list[tuple[str, tuple[int, ...]]] = [
    ("one_row", (1, 64)),
    ("n1", (5, 1)),
    ("odd", (7, 37)),
    ("3d", (2, 3, 100)),
    ("many_rows", (37, 96)),
    ("large_n", (3, 262144)),
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
        weight = params["weight"].abs().max().item() if "weight" in params else 1.0
        return scale * rstd * weight


VARIANTS = [
    Variant("rms_norm", ("weight",), {"eps": 1e-6}),
    Variant("rms_norm", (), {"eps": 1e-5}),
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


def max_error(
    name: str, out: Tensor, ref: Tensor, base: Tensor, dtype: torch.dtype, term_scale: float = 0.0
) -> str | None:
    """None if ``out`` is as close to the float64 ``ref`` as the dtype allows (see module doc), else a report."""
    factor, atol = TOLERANCES[dtype]
    if out.shape != ref.shape:
        return f"{name}: shape {list(out.shape)} != reference {list(ref.shape)}"
    if out.numel() == 0:
        return None
    err = (out.double() - ref).abs()
    base_err = (base.double() - ref).abs().max().item()
    scale = max(1.0, ref.abs().max().item())
    allowed = factor * base_err + atol * scale + TOLERANCES[torch.float32][1] * term_scale
    worst = torch.nan_to_num(err, nan=float("inf")).argmax().item()
    worst_err = err.flatten()[worst].item()
    if worst_err <= allowed:  # False for NaN
        return None
    idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), err.shape))
    return (
        f"{name}: max error {worst_err:.3g} at {idx} (got {out.flatten()[worst].item():.6g}, float64 reference "
        f"{ref.flatten()[worst].item():.6g}); allowed {allowed:.3g} = {factor} x same-dtype torch error "
        f"{base_err:.3g} + {atol} x {scale:.3g} + float32 floor x terms {term_scale:.3g}"
    )
