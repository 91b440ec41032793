"""GeGLU in Helion (the twin of ``triton_fallback/geglu.py``).

Math, element-wise over gate g and up u:  y = gelu(g)·u, with gelu in one of torch's two forms:
  approximate="tanh":  gelu(g) = ½·g·(1 + tanh(√(2/π)·(g + 0.044715·g³))) = g·σ(2z),  z = √(2/π)·(g + 0.044715·g³)
  approximate="none":  gelu(g) = ½·g·(1 + erf(g/√2)) = g·Φ(g)
(½·(1 + tanh z) = σ(2z) exactly, which needs no tanh and cannot overflow: σ(2z) → 0 or 1 at large |g|).
For 16-bit inputs Φ comes from a cheaper form than erf (see ``P, A1..A5``): libdevice's erf costs ~40 instructions
per element, which leaves the bf16 forward bound by instruction issue, well below the copy rate (see
bench/results/h200/README.md); the cheaper form's error (≤ 3e-7 absolute) is far below a 16-bit ulp. float32 keeps
erf: at 4 bytes an element there is time for it.
Backward:  dg = dy·u·gelu'(g),  du = dy·gelu(g), with the exact derivative of the chosen form.

Shapes: gate, up, dy: [M, N] with unit column stride and any row stride; outputs are contiguous [M, N] in gate's
dtype. Bytes for b-byte elements: forward reads 2·M·N·b and writes M·N·b; backward reads 3·M·N·b and writes
2·M·N·b. Tiling, dynamic row counts and the int64 twins as in ``swiglu.py``.
"""

from __future__ import annotations

from collections.abc import Callable

import helion
import helion.language as hl
import torch

from hkernels.ops.swiglu import bind, int64_twin

Tensor = torch.Tensor
# traced at a symbolic row count (see hkernels/ops/rms_norm.py)
SYMBOLIC = frozenset({"geglu_fwd", "geglu_bwd"})

TWO_SQRT_2_OVER_PI = 1.5957691216057308  # 2·√(2/π): σ's argument is 2z
TWO_SQRT_2_OVER_PI_X3C = 0.21406444881780076  # 2·√(2/π)·3·0.044715, in d(2z)/dg
SQRT_HALF = 0.7071067811865475
INV_SQRT_2PI = 0.3989422804014327
# Abramowitz & Stegun 7.1.26: erfc(x) ≈ t·(A1 + t·(A2 + t·(A3 + t·(A4 + t·A5))))·e^(−x²), t = 1/(1 + P·x), x ≥ 0,
# |error| ≤ 1.5e-7. At x = |g|/√2: Φ(g) = ½·erfc(x) for g < 0 and 1 − ½·erfc(x) for g ≥ 0 (no 1 + erf cancellation
# in the negative tail); e^(−x²) = e^(−g²/2) also gives φ(g) in the backward. At large |g|, Φ is 0 or 1.
P, A1, A2, A3, A4, A5 = 0.3275911, 0.254829592, -0.284496736, 1.421413741, -1.453152027, 1.061405429


@helion.kernel(static_shapes=False)
def _geglu_fwd(gate: Tensor, up: Tensor, approx_tanh: hl.constexpr, fast_cdf: hl.constexpr) -> Tensor:
    # gate, up: [M, N] -> y [M, N]; reads a tile of gate and up once, writes the tile of y.
    m, n = gate.size()
    n = hl.specialize(n)
    y = torch.empty([m, n], dtype=gate.dtype, device=gate.device)
    for tile_m, tile_n in hl.tile([m, n]):
        gf = gate[tile_m, tile_n].to(torch.float32)
        if approx_tanh:
            a = gf * torch.sigmoid(TWO_SQRT_2_OVER_PI * (gf + 0.044715 * gf * gf * gf))
        elif fast_cdf:
            x = torch.abs(gf) * SQRT_HALF
            t = 1.0 / (1.0 + P * x)
            half_tail = 0.5 * t * (A1 + t * (A2 + t * (A3 + t * (A4 + t * A5)))) * torch.exp(-x * x)
            a = gf * torch.where(gf >= 0.0, 1.0 - half_tail, half_tail)
        else:
            a = 0.5 * gf * (1.0 + torch.erf(gf * SQRT_HALF))
        y[tile_m, tile_n] = (a * up[tile_m, tile_n].to(torch.float32)).to(y.dtype)
    return y


# Backward.
#   tanh form, s = σ(2z):  gelu' = s + g·s·(1 − s)·d(2z)/dg,  d(2z)/dg = 2·√(2/π)·(1 + 3·0.044715·g²).
#     1 − s is taken as e·s with e = e^(−2z) (= σ(−2z), no cancellation where s ≈ 1); where e overflows, s = 0
#     and 1 − s = 1, so the product stays 0 instead of inf·0.
#   erf form:  gelu' = Φ(g) + g·φ(g),  Φ(g) = ½·(1 + erf(g/√2)),  φ(g) = e^(−g²/2)/√(2π).
#   dg = dy·u·gelu'(g),  du = dy·gelu(g).
@helion.kernel(static_shapes=False)
def _geglu_bwd(
    dy: Tensor, gate: Tensor, up: Tensor, approx_tanh: hl.constexpr, fast_cdf: hl.constexpr
) -> tuple[Tensor, Tensor]:
    # dy, gate, up: [M, N] -> (dgate, dup) [M, N]; reads a tile of each input once, writes the tiles of both.
    m, n = gate.size()
    n = hl.specialize(n)
    dgate = torch.empty([m, n], dtype=gate.dtype, device=gate.device)
    dup = torch.empty([m, n], dtype=gate.dtype, device=gate.device)
    for tile_m, tile_n in hl.tile([m, n]):
        dyf = dy[tile_m, tile_n].to(torch.float32)
        gf = gate[tile_m, tile_n].to(torch.float32)
        g2 = gf * gf
        if approx_tanh:
            e = torch.exp(-TWO_SQRT_2_OVER_PI * (gf + 0.044715 * g2 * gf))
            s = 1.0 / (1.0 + e)
            one_minus_s = torch.where(s == 0.0, 1.0, e * s)
            gelu = gf * s
            dgelu = s + gelu * one_minus_s * (TWO_SQRT_2_OVER_PI + TWO_SQRT_2_OVER_PI_X3C * g2)
        elif fast_cdf:
            x = torch.abs(gf) * SQRT_HALF
            t = 1.0 / (1.0 + P * x)
            e = torch.exp(-0.5 * g2)
            half_tail = 0.5 * t * (A1 + t * (A2 + t * (A3 + t * (A4 + t * A5)))) * e
            cdf = torch.where(gf >= 0.0, 1.0 - half_tail, half_tail)
            gelu = gf * cdf
            dgelu = cdf + gf * INV_SQRT_2PI * e
        else:
            cdf = 0.5 * (1.0 + torch.erf(gf * SQRT_HALF))
            gelu = gf * cdf
            dgelu = cdf + gf * INV_SQRT_2PI * torch.exp(-0.5 * g2)
        dgate[tile_m, tile_n] = (dyf * up[tile_m, tile_n].to(torch.float32) * dgelu).to(dgate.dtype)
        dup[tile_m, tile_n] = (dyf * gelu).to(dup.dtype)
    return dgate, dup


_WIDE = {k.name: int64_twin(k) for k in (_geglu_fwd, _geglu_bwd)}


def _approx_tanh(approximate: str) -> bool:
    if approximate not in ("tanh", "none"):
        raise ValueError(f"geglu: approximate must be 'tanh' or 'none', got {approximate!r}")
    return approximate == "tanh"


def geglu_fwd(gate: Tensor, up: Tensor, approximate: str) -> Tensor:
    """gate, up: [M, N] (unit column stride, any row stride) -> y = gelu(gate)·up, [M, N] contiguous."""
    return _bind_fwd(gate, up, approximate)(gate, up, approximate)


def geglu_bwd(dy: Tensor, gate: Tensor, up: Tensor, approximate: str) -> tuple[Tensor, Tensor]:
    """dy, gate, up: [M, N] (unit column stride) -> (dgate, dup), each [M, N] contiguous in gate's dtype."""
    return _bind_bwd(dy, gate, up, approximate)(dy, gate, up, approximate)


def _bind_fwd(gate: Tensor, up: Tensor, approximate: str) -> Callable[..., Tensor]:
    flags = (_approx_tanh(approximate), gate.dtype != torch.float32)
    run = bind(_geglu_fwd, _WIDE, (gate, up, *flags))
    return lambda gate, up, approximate: run(gate, up, *flags)


def _bind_bwd(dy: Tensor, gate: Tensor, up: Tensor, approximate: str) -> Callable[..., tuple[Tensor, Tensor]]:
    flags = (_approx_tanh(approximate), gate.dtype != torch.float32)
    run = bind(_geglu_bwd, _WIDE, (dy, gate, up, *flags))
    return lambda dy, gate, up, approximate: run(dy, gate, up, *flags)


# Binders (see hkernels/runtime/plan.py): the same function for every call of one signature, set up once.
geglu_fwd.bind = _bind_fwd  # type: ignore[attr-defined]
geglu_bwd.bind = _bind_bwd  # type: ignore[attr-defined]
