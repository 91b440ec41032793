"""swiglu: the SwiGLU gate of a Llama MLP, ``silu(gate) * up``.

The public function and its checks, its autograd (custom ops ``hkernels::swiglu_fwd`` / ``_bwd``), then the
reference math and the torch backend. Kernels: ``hkernels/ops/swiglu.py`` (Helion), ``triton_fallback/swiglu.py``.
"""

from __future__ import annotations

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


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """The SwiGLU gate of a Llama MLP: ``silu(gate) * up``.

    gate, up: [..., N], one shape and dtype (float16/bfloat16/float32; float64 on the torch backend). Either may
    be a column slice of a wider tensor (e.g. the halves of a fused gate-up projection): read in place. Math in
    float32; the result has gate's dtype. Differentiable in both.
    """
    return _CALLS(gate, up)


def _check(gate: Any, up: Any) -> None:
    check_tensor(OP, "gate", gate, None)
    check_tensor(OP, "up", up, None)
    check_same(OP, ("gate", "up"), gate, up)


def _body(request: str, gate: Tensor, up: Tensor) -> Tensor:
    if gate.dim() == 0:
        return _body(request, gate.reshape(1), up.reshape(1)).reshape(())
    y = call(_fwd, as_rows(gate), as_rows(up), request)
    return y if y.shape == gate.shape else y.reshape(gate.shape)


# ------------------------------------------------------------------------------------------------------ autograd


@torch.library.custom_op("hkernels::swiglu_fwd", mutates_args=())
def _fwd(gate: Tensor, up: Tensor, backend: str) -> Tensor:
    if gate.numel() == 0:
        return gate.new_empty(gate.shape)
    return dispatch.run(OP, "swiglu_fwd", backend, rows(gate), rows(up))


@_fwd.register_fake
def _(gate: Tensor, up: Tensor, backend: str) -> Tensor:
    return gate.new_empty(gate.shape)


@torch.library.custom_op("hkernels::swiglu_bwd", mutates_args=())
def _bwd(dy: Tensor, gate: Tensor, up: Tensor, backend: str) -> tuple[Tensor, Tensor]:
    if gate.numel() == 0:
        return gate.new_zeros(gate.shape), up.new_zeros(up.shape)
    return dispatch.run(OP, "swiglu_bwd", backend, rows(dy), rows(gate), rows(up))


@_bwd.register_fake
def _(dy: Tensor, gate: Tensor, up: Tensor, backend: str) -> tuple[Tensor, Tensor]:
    return gate.new_empty(gate.shape), up.new_empty(up.shape)


def _setup(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    gate, up, backend = inputs
    ctx.save_for_backward(gate, up)
    ctx.backend = backend


def _backward(ctx: Any, dy: Tensor) -> tuple[Tensor | None, ...]:
    gate, up = ctx.saved_tensors
    dgate, dup = call(_bwd, dy, gate, up, ctx.backend)
    return dgate, dup, None


autograd(_fwd, _backward, _setup)


def _backward_fast(plan: Any, ctx: Any, dy: Tensor | None) -> Any:
    """_backward in one step for gradients of this signature: the kernel function its plan ran."""
    run = bound_backward(plan, "swiglu_bwd", dy)
    if run is None:
        return None

    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor, Tensor]:
        gate, up = ctx.saved_tensors
        return run(dy, gate, up)
    return backward


# ------------------------------------------------------------------------------- reference and the torch backend


def reference(gate: Tensor, up: Tensor) -> Tensor:
    """y = silu(gate) · up."""
    ct = compute_dtype(gate.dtype)
    return (torch.nn.functional.silu(gate.to(ct)) * up.to(ct)).to(gate.dtype)


def swiglu_fwd(gate: Tensor, up: Tensor) -> Tensor:
    """gate, up: [M, N] -> y [M, N]."""
    return reference(gate, up)


def swiglu_bwd(dy: Tensor, gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
    """dgate = dy·up·σ(g)·(1 + g·(1 − σ(g))),  dup = dy·silu(g)."""
    ct = compute_dtype(gate.dtype)
    g, u, d = gate.to(ct), up.to(ct), dy.to(ct)
    sig = torch.sigmoid(g)
    return (d * u * sig * (1 + g * (1 - sig))).to(gate.dtype), (d * g * sig).to(up.dtype)


def _fast(plan: Any, request: str, gate: Tensor, up: Tensor) -> Any:
    """Calls of this signature in one step: the kernel function the plan ran, on views of the rows (through a Lane
    when a gradient is wanted)."""
    run, rows_of = bound(plan, "swiglu_fwd"), rows_view(gate)
    if run is None or rows_of is None or rows_view(up) is None:
        return None
    flat = gate.dim() == 2
    if wants_grad(gate, up):
        return Lane(run, _setup, _backward, request, 2, None if flat else gate.shape, rows_of, 2, 1,
                        _backward_fast).apply
    if flat:
        return run
    shape = gate.shape
    return lambda gate, up: run(gate.view(rows_of), up.view(rows_of)).view(shape)


_CALLS = Public(OP, _check, _body, _fast)
