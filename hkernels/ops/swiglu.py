"""SwiGLU in Helion (the twin of ``triton_fallback/swiglu.py``).

Math, element-wise over gate g and up u, with the multipliers α (the gate's) and β (the result's; both 1 for plain
SwiGLU, Falcon-H1's ``mlp_multipliers`` otherwise):  y = β·silu(α·g)·u.
Backward (a = α·g):  dg = α·β·dy·u·σ(a)·(1 + a·(1 − σ(a))),  du = β·dy·a·σ(a).

Shapes: gate, up, dy: [M, N] with unit column stride and any row stride (e.g. the two halves of a [M, 2N]
projection); outputs are contiguous [M, N] in gate's dtype. Bytes for b-byte elements: forward reads 2·M·N·b and
writes M·N·b; backward reads 3·M·N·b and writes 2·M·N·b. Nothing is read twice.

Kernels tile [M, N] with the config's ``block_sizes = [rows, columns]`` (``hkernels/configs``, see ``_helion.py``);
the shipped sm90 configs walk column blocks fastest (``loop_orders=[[1, 0]]``: consecutive programs stream a row;
faster than rows-fastest, see bench/results/h200/README.md) with 2048-element tiles. Row counts are dynamic (one
compile serves every token count); N is specialised, so a column block that divides N needs no mask. Helion picks
64-bit indices from a tensor's element count, but a column-slice view spans more memory than it holds: ``run``
takes the int64 twin of a kernel when a row offset can pass 2^31. ``geglu.py`` shares ``run``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import helion
import helion.language as hl
import torch

from hkernels.ops import _helion

Tensor = torch.Tensor
# traced at a symbolic row count (see hkernels/ops/rms_norm.py)
SYMBOLIC = frozenset({"swiglu_fwd", "swiglu_bwd"})
_INT32_MAX = 2**31 - 1


@helion.kernel(static_shapes=False)
def _swiglu_fwd(gate: Tensor, up: Tensor, alpha: float, beta: float) -> Tensor:
    # gate, up: [M, N] -> y = β·silu(α·gate)·up [M, N]; reads a tile of gate and up once, writes the tile of y.
    m, n = gate.size()
    n = hl.specialize(n)
    y = torch.empty([m, n], dtype=gate.dtype, device=gate.device)
    for tile_m, tile_n in hl.tile([m, n]):
        gf = gate[tile_m, tile_n].to(torch.float32) * alpha
        # σ(g) = 1 / (1 + e^-g): e^-g = inf for g < -88 gives σ = 0 and y = -0, never NaN.
        y[tile_m, tile_n] = (gf * torch.sigmoid(gf) * up[tile_m, tile_n].to(torch.float32) * beta).to(y.dtype)
    return y


# Backward, with a = α·g and s = σ(a):  d silu/da = s + a·s·(1 − s) = s·(1 + a·(1 − s)),
#   dg = α·β·dy·u·s·(1 + a·(1 − s)),  du = β·dy·a·s.
# At a → -∞, s = 0 and the product is 0 (a·(1 − s) stays finite); at a → +∞, 1 − s = 0 and dg = α·β·dy·u.
@helion.kernel(static_shapes=False)
def _swiglu_bwd(dy: Tensor, gate: Tensor, up: Tensor, alpha: float, beta: float) -> tuple[Tensor, Tensor]:
    # dy, gate, up: [M, N] -> (dgate, dup) [M, N]; reads a tile of each input once, writes the tiles of both.
    m, n = gate.size()
    n = hl.specialize(n)
    dgate = torch.empty([m, n], dtype=gate.dtype, device=gate.device)
    dup = torch.empty([m, n], dtype=gate.dtype, device=gate.device)
    for tile_m, tile_n in hl.tile([m, n]):
        dyf = dy[tile_m, tile_n].to(torch.float32) * beta
        gf = gate[tile_m, tile_n].to(torch.float32) * alpha
        uf = up[tile_m, tile_n].to(torch.float32)
        s = torch.sigmoid(gf)
        dgate[tile_m, tile_n] = (dyf * uf * s * (1.0 + gf * (1.0 - s)) * alpha).to(dgate.dtype)
        dup[tile_m, tile_n] = (dyf * gf * s).to(dup.dtype)
    return dgate, dup


def int64_twin(kernel: helion.Kernel) -> helion.Kernel:
    """The same kernel compiled with 64-bit indices (same name, so the same shipped configs)."""
    return helion.kernel(kernel.fn, static_shapes=False, index_dtype=torch.int64)


_WIDE = {k.name: int64_twin(k) for k in (_swiglu_fwd, _swiglu_bwd)}


def spans_past_int32(t: Tensor) -> bool:
    """Whether [M, N] ``t`` (unit column stride) reaches past 2^31 - 1 elements from its first: Helion picks 32-bit
    indices by a tensor's element count, not by how far its rows reach."""
    return (t.shape[0] - 1) * t.stride(0) + t.shape[1] > _INT32_MAX


def bind(kernel: helion.Kernel, wide: dict[str, helion.Kernel], args: tuple[Any, ...]) -> Callable[..., Any]:
    """``kernel`` (or its int64 twin from ``wide``, when an [M, N] tensor of ``args`` spans past 2^31 elements) for
    arguments of this signature, shared with geglu: ``run(*args)``."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if any(spans_past_int32(t) for t in tensors):
        kernel = wide[kernel.name]
    fn, launcher = _helion.bind(kernel, args, tensors[0].shape[1], tensors[0].device)
    return lambda *args: fn(*args, _launcher=launcher)


def swiglu_fwd(gate: Tensor, up: Tensor, alpha: float = 1.0, beta: float = 1.0) -> Tensor:
    """gate, up: [M, N] (unit column stride, any row stride) -> y = β·silu(α·gate)·up, [M, N] contiguous."""
    return _bind_fwd(gate, up, alpha, beta)(gate, up, alpha, beta)


def swiglu_bwd(dy: Tensor, gate: Tensor, up: Tensor, alpha: float = 1.0, beta: float = 1.0
               ) -> tuple[Tensor, Tensor]:
    """dy, gate, up: [M, N] (unit column stride) -> (dgate, dup), each [M, N] contiguous in gate's dtype."""
    return _bind_bwd(dy, gate, up, alpha, beta)(dy, gate, up, alpha, beta)


def _bind_fwd(gate: Tensor, up: Tensor, alpha: float = 1.0, beta: float = 1.0) -> Callable[..., Tensor]:
    run = bind(_swiglu_fwd, _WIDE, (gate, up, float(alpha), float(beta)))
    return lambda gate, up, alpha=1.0, beta=1.0: run(gate, up, float(alpha), float(beta))


def _bind_bwd(dy: Tensor, gate: Tensor, up: Tensor, alpha: float = 1.0, beta: float = 1.0) -> Callable[..., Any]:
    run = bind(_swiglu_bwd, _WIDE, (dy, gate, up, float(alpha), float(beta)))
    return lambda dy, gate, up, alpha=1.0, beta=1.0: run(dy, gate, up, float(alpha), float(beta))


# Binders (see hkernels/runtime/plan.py): the same function for every call of one signature, set up once.
swiglu_fwd.bind = _bind_fwd  # type: ignore[attr-defined]
swiglu_bwd.bind = _bind_bwd  # type: ignore[attr-defined]
