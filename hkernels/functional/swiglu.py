"""swiglu: the SwiGLU gate of a Llama MLP, ``silu(gate) * up`` (Falcon-H1's: ``β·silu(α·gate)·up``).

The public function and its checks, its autograd (custom ops ``hkernels::swiglu_fwd`` / ``_bwd``), then the
reference math and the torch backend. Kernels: ``hkernels/ops/swiglu.py`` (Helion), ``triton_fallback/swiglu.py``.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from hkernels import dispatch
from hkernels.functional._base import (
    Lane,
    Public,
    Tensor,
    as_rows,
    autograd,
    bound,
    bound_backward,
    call,
    check_same,
    check_tensor,
    compute_dtype,
    rows,
    rows_view,
    wants_grad,
)

OP = "swiglu"


def swiglu(gate: Tensor, up: Tensor, gate_multiplier: float = 1.0, down_multiplier: float = 1.0) -> Tensor:
    """The SwiGLU gate of a Llama MLP: ``silu(gate) * up``; with Falcon-H1's multipliers
    ``down_multiplier · silu(gate_multiplier · gate) · up``.

    gate, up: [..., N], one shape and dtype (float16/bfloat16/float32; float64 on the torch backend). Either may
    be a column slice of a wider tensor (e.g. the halves of a fused gate-up projection): read in place. Math in
    float32; the result has gate's dtype. Differentiable in both. ``down_multiplier`` scales the result, which by
    linearity is Falcon-H1's scaling of the down projection's output (``down_proj(y) · m == down_proj(y · m)``
    without a bias), fused here instead of a pass of its own.
    """
    return _CALLS(gate, up, gate_multiplier, down_multiplier)


def _check(gate: Any, up: Any, gate_multiplier: Any, down_multiplier: Any) -> None:
    check_tensor(OP, "gate", gate, None)
    check_tensor(OP, "up", up, None)
    check_same(OP, ("gate", "up"), gate, up)
    for name, v in (("gate_multiplier", gate_multiplier), ("down_multiplier", down_multiplier)):
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
            raise TypeError(f"hkernels.swiglu: {name} must be a finite number, got {v!r}")


def _body(request: str, gate: Tensor, up: Tensor, gate_multiplier: float, down_multiplier: float) -> Tensor:
    if gate.dim() == 0:
        return _body(request, gate.reshape(1), up.reshape(1), gate_multiplier, down_multiplier).reshape(())
    y = call(_fwd, as_rows(gate), as_rows(up), float(gate_multiplier), float(down_multiplier), request)
    return y if y.shape == gate.shape else y.reshape(gate.shape)


# ------------------------------------------------------------------------------------------------------ autograd


# alpha, beta: the gate's and the result's multipliers.
@torch.library.custom_op("hkernels::swiglu_fwd", mutates_args=())
def _fwd(gate: Tensor, up: Tensor, alpha: float, beta: float, backend: str) -> Tensor:
    if gate.numel() == 0:
        return gate.new_empty(gate.shape)
    return dispatch.run(OP, "swiglu_fwd", backend, rows(gate), rows(up), alpha, beta)


@_fwd.register_fake
def _(gate: Tensor, up: Tensor, alpha: float, beta: float, backend: str) -> Tensor:
    return gate.new_empty(gate.shape)


@torch.library.custom_op("hkernels::swiglu_bwd", mutates_args=())
def _bwd(dy: Tensor, gate: Tensor, up: Tensor, alpha: float, beta: float, backend: str) -> tuple[Tensor, Tensor]:
    if gate.numel() == 0:
        return gate.new_zeros(gate.shape), up.new_zeros(up.shape)
    return dispatch.run(OP, "swiglu_bwd", backend, rows(dy), rows(gate), rows(up), alpha, beta)


@_bwd.register_fake
def _(dy: Tensor, gate: Tensor, up: Tensor, alpha: float, beta: float, backend: str) -> tuple[Tensor, Tensor]:
    return gate.new_empty(gate.shape), up.new_empty(up.shape)


def _setup(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    gate, up, alpha, beta, backend = inputs
    ctx.save_for_backward(gate, up)
    ctx.alpha, ctx.beta, ctx.backend = alpha, beta, backend


def _backward(ctx: Any, dy: Tensor) -> tuple[Tensor | None, ...]:
    gate, up = ctx.saved_tensors
    dgate, dup = call(_bwd, dy, gate, up, ctx.alpha, ctx.beta, ctx.backend)
    return dgate, dup, None, None, None


autograd(_fwd, _backward, _setup)


def _backward_fast(plan: Any, ctx: Any, dy: Tensor | None) -> Any:
    """_backward in one step for gradients of this signature: the kernel function its plan ran."""
    run = bound_backward(plan, "swiglu_bwd", dy)
    if run is None:
        return None

    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor | None, ...]:
        gate, up = ctx.saved_tensors
        dgate, dup = run(dy, gate, up, ctx.alpha, ctx.beta)
        return dgate, dup, None, None
    return backward


# ------------------------------------------------------------------------------- reference and the torch backend


def reference(gate: Tensor, up: Tensor, gate_multiplier: float = 1.0, down_multiplier: float = 1.0) -> Tensor:
    """y = down_multiplier · silu(gate_multiplier · gate) · up."""
    ct = compute_dtype(gate.dtype)
    return (torch.nn.functional.silu(gate.to(ct) * gate_multiplier) * up.to(ct) * down_multiplier).to(gate.dtype)


def swiglu_fwd(gate: Tensor, up: Tensor, alpha: float = 1.0, beta: float = 1.0) -> Tensor:
    """gate, up: [M, N] -> y = β·silu(α·gate)·up [M, N]."""
    return reference(gate, up, alpha, beta)


def swiglu_bwd(dy: Tensor, gate: Tensor, up: Tensor, alpha: float = 1.0, beta: float = 1.0
               ) -> tuple[Tensor, Tensor]:
    """With a = α·g: dgate = α·β·dy·up·σ(a)·(1 + a·(1 − σ(a))),  dup = β·dy·silu(a)."""
    ct = compute_dtype(gate.dtype)
    g, u, d = gate.to(ct) * alpha, up.to(ct), dy.to(ct) * beta
    sig = torch.sigmoid(g)
    return (d * u * sig * (1 + g * (1 - sig)) * alpha).to(gate.dtype), (d * g * sig).to(up.dtype)


def _fast(plan: Any, request: str, gate: Tensor, up: Tensor, gate_multiplier: float, down_multiplier: float) -> Any:
    """Calls of this signature in one step: the kernel function the plan ran, on views of the rows (through a Lane
    when a gradient is wanted)."""
    run, rows_of = bound(plan, "swiglu_fwd"), rows_view(gate)
    if run is None or rows_of is None or rows_view(up) is None or gate.dim() == 0:
        return None
    alpha, beta = float(gate_multiplier), float(down_multiplier)
    flat = gate.dim() == 2
    if wants_grad(gate, up):
        apply = Lane(run, _setup, _backward, request, 4, None if flat else gate.shape, rows_of, 2, 1,
                     _backward_fast).apply
        return lambda gate, up, gm, dm: apply(gate, up, alpha, beta)
    if flat:
        return lambda gate, up, gm, dm: run(gate, up, alpha, beta)
    shape = gate.shape
    return lambda gate, up, gm, dm: run(gate.view(rows_of), up.view(rows_of), alpha, beta).view(shape)


_CALLS = Public(OP, _check, _body, _fast)
