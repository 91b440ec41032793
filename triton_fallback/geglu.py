"""GeGLU in hand-written Triton: the twin of ``hkernels/ops/geglu.py``, whose docstring gives the math (both gelu
forms and their derivatives), the shapes and the bytes moved.

For 16-bit inputs Φ comes from ``_normal_cdf_fast`` instead of erf (as the Helion kernels' ``P, A1..A5``). Tiles and
launch settings as in ``swiglu.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl

from triton_fallback.swiglu import _tile, bind_gated, bind_gated_bwd

SYMBOLIC = frozenset({"geglu_fwd", "geglu_bwd"})  # (see triton_fallback/rms_norm.py)

Tensor = torch.Tensor

# Constants are written as literals in the kernels (module-level tl.constexpr floats times a tensor fail in
# Triton 3.9's interpreter): 1.5957691216057308 = 2·√(2/π) (σ's argument is 2z), 0.21406444881780076 =
# 2·√(2/π)·3·0.044715 (in d(2z)/dg), 0.7071067811865475 = 1/√2, 0.3989422804014327 = 1/√(2π).


@triton.jit
def _normal_cdf_fast(g):
    # Φ(g) and e^(−g²/2), from erfc(x) ≈ t·(a1 + t·(a2 + t·(a3 + t·(a4 + t·a5))))·e^(−x²), t = 1/(1 + p·x), x ≥ 0
    # (Abramowitz & Stegun 7.1.26, |error| ≤ 1.5e-7), at x = |g|/√2: Φ(g) = ½·erfc(x) for g < 0 and 1 − ½·erfc(x)
    # for g ≥ 0, so the negative tail has no 1 + erf cancellation. At large |g|, e^(−x²) = 0 and Φ is 0 or 1.
    x = tl.abs(g) * 0.7071067811865475
    t = 1.0 / (1.0 + 0.3275911 * x)
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
    e = tl.exp(-x * x)
    half_tail = 0.5 * poly * e
    return tl.where(g >= 0.0, 1.0 - half_tail, half_tail), e


@triton.jit
def _geglu_fwd_kernel(
    g_ptr, u_ptr, y_ptr,  # gate, up: [M, N] rows of unit column stride; y: [M, N] contiguous
    M, N, stride_g, stride_u,
    APPROX_TANH: tl.constexpr, FAST_CDF: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # Reads a tile of gate and up once, writes the tile of y.
    rows, cols, mask = _tile(M, N, BLOCK_M, BLOCK_N)
    g = tl.load(g_ptr + rows[:, None] * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + rows[:, None] * stride_u + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if APPROX_TANH:
        a = g * tl.sigmoid(1.5957691216057308 * (g + 0.044715 * g * g * g))
    elif FAST_CDF:
        cdf, _ = _normal_cdf_fast(g)
        a = g * cdf
    else:
        a = 0.5 * g * (1.0 + tl.math.erf(g * 0.7071067811865475))
    tl.store(y_ptr + rows[:, None] * N + cols[None, :], (a * u).to(y_ptr.dtype.element_ty), mask=mask)


# Backward.
#   tanh form, s = σ(2z):  gelu' = s + g·s·(1 − s)·d(2z)/dg,  d(2z)/dg = 2·√(2/π)·(1 + 3·0.044715·g²).
#     1 − s is taken as e·s with e = e^(−2z) (= σ(−2z), no cancellation where s ≈ 1); where e overflows, s = 0
#     and 1 − s = 1, so the product stays 0 instead of inf·0.
#   erf form:  gelu' = Φ(g) + g·φ(g),  Φ(g) = ½·(1 + erf(g/√2)),  φ(g) = e^(−g²/2)/√(2π).
#   dg = dy·u·gelu'(g),  du = dy·gelu(g).
@triton.jit
def _geglu_bwd_kernel(
    dy_ptr, g_ptr, u_ptr, dg_ptr, du_ptr,  # dy, gate, up: [M, N], unit column stride; dg, du: [M, N] contiguous
    M, N, stride_dy, stride_g, stride_u,
    APPROX_TANH: tl.constexpr, FAST_CDF: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # Reads a tile of dy, gate and up once, writes the tiles of dgate and dup.
    rows, cols, mask = _tile(M, N, BLOCK_M, BLOCK_N)
    dy = tl.load(dy_ptr + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + rows[:, None] * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + rows[:, None] * stride_u + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    g2 = g * g
    if APPROX_TANH:
        e = tl.exp(-1.5957691216057308 * (g + 0.044715 * g2 * g))
        s = 1.0 / (1.0 + e)
        one_minus_s = tl.where(s == 0.0, 1.0, e * s)
        gelu = g * s
        dgelu = s + gelu * one_minus_s * (1.5957691216057308 + 0.21406444881780076 * g2)
    elif FAST_CDF:
        cdf, e = _normal_cdf_fast(g)  # e = e^(−g²/2): φ(g) from the same exponential
        gelu = g * cdf
        dgelu = cdf + g * 0.3989422804014327 * e
    else:
        cdf = 0.5 * (1.0 + tl.math.erf(g * 0.7071067811865475))
        gelu = g * cdf
        dgelu = cdf + g * 0.3989422804014327 * tl.exp(-0.5 * g2)
    out = rows[:, None] * N + cols[None, :]
    tl.store(dg_ptr + out, (dy * u * dgelu).to(dg_ptr.dtype.element_ty), mask=mask)
    tl.store(du_ptr + out, (dy * gelu).to(du_ptr.dtype.element_ty), mask=mask)


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
    return bind_gated(_geglu_fwd_kernel, gate, up, APPROX_TANH=_approx_tanh(approximate),
                      FAST_CDF=gate.dtype != torch.float32)


def _bind_bwd(dy: Tensor, gate: Tensor, up: Tensor, approximate: str) -> Callable[..., Any]:
    return bind_gated_bwd(_geglu_bwd_kernel, dy, gate, up, APPROX_TANH=_approx_tanh(approximate),
                          FAST_CDF=gate.dtype != torch.float32)


# Binders (see hkernels/runtime/plan.py): the same function for every call of one signature, set up once.
geglu_fwd.bind = _bind_fwd  # type: ignore[attr-defined]
geglu_bwd.bind = _bind_bwd  # type: ignore[attr-defined]
