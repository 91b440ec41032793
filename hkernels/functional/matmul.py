"""matmul: ``activation(a @ b + bias)`` with the bias and activation fused into the matmul's epilogue.

The public function and its checks, its autograd (custom ops ``hkernels::matmul_fwd`` and ``matmul_act_bwd``; the
backward's matmuls are the forward op again, on the same backend), then the reference math and the torch backend.
Kernels: ``hkernels/ops/matmul.py`` (Helion), ``triton_fallback/matmul.py``.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from hkernels import dispatch
from hkernels.functional._base import (
    Autocast,
    Public,
    Tensor,
    autograd,
    bound,
    call,
    check_same,
    check_tensor,
    compute_dtype,
    placeholder,
    wants_grad,
)

OP = "matmul"
ACTIVATIONS = (None, "relu", "gelu", "gelu_tanh", "silu")


def matmul(a: Tensor, b: Tensor, bias: Tensor | None = None, activation: str | None = None) -> Tensor:
    """``activation(a @ b + bias)`` with the bias and activation fused into the matmul's epilogue.

    a: [M, K] or [B, M, K]; b: [K, N] or [B, K, N] (a transposed view such as ``weight.t()`` is read in place);
    one dtype (bfloat16/float16 with float32 accumulation, or float32); bias: [N] or None; activation: None,
    "relu", "gelu" (erf), "gelu_tanh" or "silu". The epilogue is float32 with one rounding. Differentiable in a,
    b and bias (the backward's matmuls run on the same backend).
    """
    return _CALLS(a, b, bias, activation)


def _check(a: Any, b: Any, bias: Any, activation: Any) -> None:
    check_tensor(OP, "a", a, (2, 3))
    check_tensor(OP, "b", b, (2, 3))
    check_same(OP, ("a", "b"), a, b, shape=False)
    if a.dim() != b.dim():
        raise ValueError(f"hkernels.matmul: a and b must both be 2-d or both 3-d (batched), got shapes "
                         f"{list(a.shape)} and {list(b.shape)}")
    if a.shape[-1] != b.shape[-2] or (a.dim() == 3 and a.shape[0] != b.shape[0]):
        raise ValueError(f"hkernels.matmul: cannot multiply a {list(a.shape)} by b {list(b.shape)}: a's last dim "
                         "must equal b's second-to-last (and batch sizes must agree)")
    if bias is not None:
        check_tensor(OP, "bias", bias, (1,))
        if bias.shape[0] != b.shape[-1] or bias.device != a.device:
            raise ValueError(f"hkernels.matmul: bias must be [N] = [{b.shape[-1]}] on {a.device}, got "
                             f"{list(bias.shape)} on {bias.device}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"hkernels.matmul: activation must be one of None, 'relu', 'gelu', 'gelu_tanh', 'silu'; "
                         f"got {activation!r}")


def _body(request: str, a: Tensor, b: Tensor, bias: Tensor | None, activation: str | None) -> Tensor:
    keep_pre = activation is not None and torch.is_grad_enabled() and (
        a.requires_grad or b.requires_grad or (bias is not None and bias.requires_grad))
    y, _ = call(_fwd, a, b, bias, activation or "", keep_pre, request)
    return y


# ------------------------------------------------------------------------------------------------------ autograd


def _out_shape(a: Tensor, b: Tensor) -> list[int]:
    return [*a.shape[:-1], b.shape[-1]]


@torch.library.custom_op("hkernels::matmul_fwd", mutates_args=())
def _fwd(a: Tensor, b: Tensor, bias: Tensor | None, activation: str, keep_pre: bool, backend: str
         ) -> tuple[Tensor, Tensor]:
    act = activation or None
    if a.numel() == 0 or b.numel() == 0:  # nothing for a kernel to do (K = 0 leaves act(bias))
        backend = "torch"
    y, pre = dispatch.run(OP, "matmul_fwd", backend, a, b, bias, act, keep_pre)
    return y, pre if pre is not None else placeholder(a)


@_fwd.register_fake
def _(a: Tensor, b: Tensor, bias: Tensor | None, activation: str, keep_pre: bool, backend: str
      ) -> tuple[Tensor, Tensor]:
    y = a.new_empty(_out_shape(a, b))
    return y, (a.new_empty(y.shape) if keep_pre and activation else placeholder(a))


@torch.library.custom_op("hkernels::matmul_act_bwd", mutates_args=())
def _act_bwd(dy: Tensor, pre: Tensor, activation: str, backend: str) -> Tensor:
    if dy.numel() == 0:
        return dy.new_zeros(dy.shape)
    return dispatch.run(OP, "matmul_act_bwd", backend, dy.contiguous(), pre, activation)


@_act_bwd.register_fake
def _(dy: Tensor, pre: Tensor, activation: str, backend: str) -> Tensor:
    return dy.new_empty(dy.shape)


def _setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
    a, b, bias, activation, _keep_pre, backend = inputs
    ctx.save_for_backward(a, b, output[1] if activation else None)
    ctx.activation, ctx.backend, ctx.has_bias = activation, backend, bias is not None
    ctx.bias_dtype = bias.dtype if bias is not None else None
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)


def _backward(ctx: Any, dy: Tensor | None, _dpre: Tensor | None) -> tuple[Tensor | None, ...]:
    # z = a @ b + bias, y = act(z):  dz = dy · act'(z);  da = dz @ bᵀ;  db = aᵀ @ dz;  dbias = Σ_rows dz.
    # The gradient matmuls run on the same backend's matmul (no epilogue).
    if dy is None:
        return (None,) * 6
    a, b, pre = ctx.saved_tensors
    dz = call(_act_bwd, dy, pre, ctx.activation, ctx.backend) if ctx.activation else dy
    need_a, need_b, need_bias = ctx.needs_input_grad[:3]
    da = call(_fwd, dz, b.transpose(-1, -2), None, "", False, ctx.backend)[0] if need_a else None
    db = call(_fwd, a.transpose(-1, -2), dz, None, "", False, ctx.backend)[0] if need_b else None
    dbias = None
    if ctx.has_bias and need_bias:
        dbias = dz.reshape(-1, dz.shape[-1]).sum(0, dtype=torch.float32).to(ctx.bias_dtype)
    return da, db, dbias, None, None, None


autograd(_fwd, _backward, _setup)


# ------------------------------------------------------------------------------- reference and the torch backend


def activate(z: Tensor, activation: str | None) -> Tensor:
    if activation is None:
        return z
    if activation == "relu":
        return torch.relu(z)
    if activation == "gelu":
        return torch.nn.functional.gelu(z)
    if activation == "gelu_tanh":
        return torch.nn.functional.gelu(z, approximate="tanh")
    return torch.nn.functional.silu(z)


def reference(a: Tensor, b: Tensor, bias: Tensor | None = None, activation: str | None = None) -> Tensor:
    """act(a @ b + bias): a [M, K] or [B, M, K], b [K, N] or [B, K, N]; float32 accumulation for 16-bit inputs."""
    ct = compute_dtype(a.dtype)
    z = torch.matmul(a.to(ct), b.to(ct))
    if bias is not None:
        z = z + bias.to(ct)
    return activate(z, activation).to(a.dtype)


def matmul_fwd(a: Tensor, b: Tensor, bias: Tensor | None, activation: str | None, keep_pre: bool
               ) -> tuple[Tensor, Tensor | None]:
    """-> (act(a @ b + bias) in a's dtype, the pre-activation a @ b + bias (when keep_pre and an activation)).
    16-bit inputs: PyTorch's own call, cuBLAS in their dtype (float32 accumulation) with the bias added in its
    epilogue (addmm), the activation on that result, as ``F.linear`` then the activation computes it."""
    if a.dtype in (torch.bfloat16, torch.float16) and b.dtype == a.dtype and (bias is None or bias.dtype == a.dtype):
        if bias is None:
            z = torch.matmul(a, b)
        elif a.dim() == 2:
            z = torch.addmm(bias, a, b)
        else:
            z = torch.baddbmm(bias, a, b)
        pre = z if keep_pre and activation is not None else None
        return activate(z, activation), pre
    ct = compute_dtype(a.dtype)
    z = torch.matmul(a.to(ct), b.to(ct))
    if bias is not None:
        z = z + bias.to(ct)
    pre = z.to(a.dtype) if keep_pre and activation is not None else None
    return activate(z, activation).to(a.dtype), pre


def matmul_act_bwd(dy: Tensor, z: Tensor, activation: str) -> Tensor:
    """dz = dy · act'(z) (written out: a custom op's implementation runs without autograd)."""
    ct = compute_dtype(z.dtype)
    zf, d = z.to(ct), dy.to(ct)
    if activation == "relu":
        return torch.where(zf <= 0, 0.0, d).to(dy.dtype)  # NaN passes, as in torch.relu's backward
    if activation == "silu":
        sig = torch.sigmoid(zf)
        return (d * sig * (1 + zf * (1 - sig))).to(dy.dtype)
    if activation == "gelu":
        cdf = 0.5 * (1 + torch.erf(zf / math.sqrt(2)))
        return (d * (cdf + zf * torch.exp(-0.5 * zf * zf) / math.sqrt(2 * math.pi))).to(dy.dtype)
    k = math.sqrt(2 / math.pi)  # gelu_tanh
    t = torch.tanh(k * (zf + 0.044715 * zf**3))
    dgelu = 0.5 * (1 + t) + 0.5 * zf * (1 - t * t) * k * (1 + 3 * 0.044715 * zf * zf)
    return (d * dgelu).to(dy.dtype)


def _fast(plan: Any, request: str, a: Tensor, b: Tensor, bias: Tensor | None, activation: str | None) -> Any:
    """Calls of this signature without a gradient in one step: the kernel function the plan ran."""
    run = bound(plan, "matmul_fwd")
    if run is None or wants_grad(a, b, bias) or a.numel() == 0 or b.numel() == 0:
        return None
    act = activation or None
    return lambda a, b, bias, activation: run(a, b, bias, act, False)[0]


# Under autocast: as torch.matmul / addmm, in autocast's dtype; the activation after it.
_CALLS = Public(OP, _check, _body, _fast, autocast=Autocast("lower", ("aten::matmul", "aten::addmm")))
