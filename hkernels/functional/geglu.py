"""geglu: the GeGLU gate, ``gelu(gate) * up``, gelu exact (``"none"``) or its tanh approximation.

The public function and its checks, its autograd (custom ops ``hkernels::geglu_fwd`` / ``_bwd``), then the
reference math and the torch backend. Kernels: ``hkernels/ops/geglu.py`` (Helion), ``triton_fallback/geglu.py``.
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

OP = "geglu"
_GELU_FORMS = ("tanh", "none")


def geglu(gate: Tensor, up: Tensor, approximate: str = "tanh") -> Tensor:
    """The GeGLU gate: ``gelu(gate, approximate) * up``; ``approximate`` is "tanh" (default) or "none" (erf).

    gate, up: [..., N], one shape and dtype; column slices are read in place. Math in float32; the result has
    gate's dtype. Differentiable in both.
    """
    return _CALLS(gate, up, approximate)


def _check(gate: Any, up: Any, approximate: Any) -> None:
    check_tensor(OP, "gate", gate, None)
    check_tensor(OP, "up", up, None)
    check_same(OP, ("gate", "up"), gate, up)
    if approximate not in _GELU_FORMS:
        raise ValueError(f"hkernels.geglu: approximate must be 'tanh' or 'none', got {approximate!r}")


def _body(request: str, gate: Tensor, up: Tensor, approximate: str) -> Tensor:
    if gate.dim() == 0:
        return _body(request, gate.reshape(1), up.reshape(1), approximate).reshape(())
    y = call(_fwd, as_rows(gate), as_rows(up), approximate, request)
    return y if y.shape == gate.shape else y.reshape(gate.shape)


# ------------------------------------------------------------------------------------------------------ autograd


@torch.library.custom_op("hkernels::geglu_fwd", mutates_args=())
def _fwd(gate: Tensor, up: Tensor, approximate: str, backend: str) -> Tensor:
    if gate.numel() == 0:
        return gate.new_empty(gate.shape)
    return dispatch.run(OP, "geglu_fwd", backend, rows(gate), rows(up), approximate)


@_fwd.register_fake
def _(gate: Tensor, up: Tensor, approximate: str, backend: str) -> Tensor:
    return gate.new_empty(gate.shape)


@torch.library.custom_op("hkernels::geglu_bwd", mutates_args=())
def _bwd(dy: Tensor, gate: Tensor, up: Tensor, approximate: str, backend: str) -> tuple[Tensor, Tensor]:
    if gate.numel() == 0:
        return gate.new_zeros(gate.shape), up.new_zeros(up.shape)
    return dispatch.run(OP, "geglu_bwd", backend, rows(dy), rows(gate), rows(up), approximate)


@_bwd.register_fake
def _(dy: Tensor, gate: Tensor, up: Tensor, approximate: str, backend: str) -> tuple[Tensor, Tensor]:
    return gate.new_empty(gate.shape), up.new_empty(up.shape)


def _setup(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    gate, up, approximate, backend = inputs
    ctx.save_for_backward(gate, up)
    ctx.approximate, ctx.backend = approximate, backend


def _backward(ctx: Any, dy: Tensor) -> tuple[Tensor | None, ...]:
    gate, up = ctx.saved_tensors
    dgate, dup = call(_bwd, dy, gate, up, ctx.approximate, ctx.backend)
    return dgate, dup, None, None


autograd(_fwd, _backward, _setup)


def _backward_fast(plan: Any, ctx: Any, dy: Tensor | None) -> Any:
    """_backward in one step for gradients of this signature: the kernel function its plan ran."""
    run = bound_backward(plan, "geglu_bwd", dy)
    if run is None:
        return None

    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor | None, ...]:
        gate, up = ctx.saved_tensors
        return (*run(dy, gate, up, ctx.approximate), None)
    return backward


# ------------------------------------------------------------------------------- reference and the torch backend


def reference(gate: Tensor, up: Tensor, approximate: str = "tanh") -> Tensor:
    """y = gelu(gate) · up, gelu exact (``"none"``) or its tanh approximation."""
    ct = compute_dtype(gate.dtype)
    return (torch.nn.functional.gelu(gate.to(ct), approximate=approximate) * up.to(ct)).to(gate.dtype)


def geglu_fwd(gate: Tensor, up: Tensor, approximate: str) -> Tensor:
    """gate, up: [M, N] -> y [M, N]."""
    return reference(gate, up, approximate)


def geglu_bwd(dy: Tensor, gate: Tensor, up: Tensor, approximate: str) -> tuple[Tensor, Tensor]:
    """dgate = dy·up·gelu'(g),  dup = dy·gelu(g)."""
    ct = compute_dtype(gate.dtype)
    g, u, d = gate.to(ct), up.to(ct), dy.to(ct)
    if approximate == "tanh":
        k = math.sqrt(2 / math.pi)
        t = torch.tanh(k * (g + 0.044715 * g**3))
        gelu = 0.5 * g * (1 + t)
        dgelu = 0.5 * (1 + t) + 0.5 * g * (1 - t * t) * k * (1 + 3 * 0.044715 * g * g)
    else:
        gelu = 0.5 * g * (1 + torch.erf(g / math.sqrt(2)))
        dgelu = 0.5 * (1 + torch.erf(g / math.sqrt(2))) + g * torch.exp(-0.5 * g * g) / math.sqrt(2 * math.pi)
    return (d * u * dgelu).to(gate.dtype), (d * gelu).to(up.dtype)


def _fast(plan: Any, request: str, gate: Tensor, up: Tensor, approximate: str) -> Any:
    """Calls of this signature in one step: the kernel function the plan ran, on views of the rows (through a Lane
    when a gradient is wanted)."""
    run, rows_of = bound(plan, "geglu_fwd"), rows_view(gate)
    if run is None or rows_of is None or rows_view(up) is None:
        return None
    flat = gate.dim() == 2
    if wants_grad(gate, up):
        return Lane(run, _setup, _backward, request, 3, None if flat else gate.shape, rows_of, 2, 1,
                        _backward_fast).apply
    if flat:
        return run
    shape = gate.shape
    return lambda gate, up, approximate: run(gate.view(rows_of), up.view(rows_of), approximate).view(shape)


_CALLS = Public(OP, _check, _body, _fast)
