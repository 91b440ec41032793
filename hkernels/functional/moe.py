"""moe: the experts of a SwiGLU mixture-of-experts layer, ``out[t] = Σⱼ w[t, j] · down[e] (silu(g) ⊙ u)``.

The public function and its checks, its autograd (custom ops ``hkernels::moe_fwd`` and ``_bwd``), then the
reference math and the torch backend. Kernels: ``hkernels/ops/moe.py`` (Helion), ``triton_fallback/moe.py`` (whose
docstring gives the forward and backward math); routing: ``hkernels/runtime/routing.py``.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.nn.functional as F

from hkernels import dispatch
from hkernels.functional._base import (
    Autocast,
    Public,
    Tensor,
    autograd,
    call,
    check_range,
    check_same,
    check_tensor,
    compute_dtype,
    torch_traces_when,
    wants_grad,
)
from hkernels.functional.grouped_matmul import grouped_mm, grouped_mm_takes, grouped_mm_traces, weight_grads
from hkernels.runtime.routing import routing

OP = "moe"
_INT = (torch.int32, torch.int64)


def moe(x: Tensor, gate_up_proj: Tensor, down_proj: Tensor, topk_ids: Tensor, topk_weights: Tensor) -> Tensor:
    """The experts of a SwiGLU MoE layer, in the layout of Hugging Face's experts modules and Liger's fused MoE.

    x: [..., H]; gate_up_proj: [E, 2·I, H] (gate rows, then up rows); down_proj: [E, H, I]; topk_ids: [..., k]
    int32/int64 and topk_weights: [..., k] floating, on x's device -> [..., H] in x's dtype, where
    ``out[t] = Σⱼ topk_weights[t, j] · down_proj[e] · (silu(g) ⊙ u)``, (g, u) = gate_up_proj[e] · x[t] split in
    halves, e = topk_ids[t, j]. A row may repeat an expert; experts may get no token. No host sync: an id outside
    [0, E) selects nothing (its slot adds zero, and its weight's gradient is zero) instead of being checked
    (``HKERNELS_CHECK=1`` raises instead).
    Differentiable in x, both weights and topk_weights; the backward keeps the first matmul's outputs (2·I per
    token and slot, x's dtype) and recomputes the rest.
    """
    return _CALLS(x, gate_up_proj, down_proj, topk_ids, topk_weights)


def _check(x: Any, gate_up_proj: Any, down_proj: Any, topk_ids: Any, topk_weights: Any) -> None:
    check_tensor(OP, "x", x)
    if x.dim() == 0:
        raise ValueError("hkernels.moe: x must be [..., H], got a 0-d tensor")
    check_tensor(OP, "gate_up_proj", gate_up_proj, (3,))
    check_tensor(OP, "down_proj", down_proj, (3,))
    check_same(OP, ("x", "gate_up_proj"), x, gate_up_proj, shape=False)
    check_same(OP, ("x", "down_proj"), x, down_proj, shape=False)
    H = x.shape[-1]
    E, I2, H1 = gate_up_proj.shape
    if H1 != H or I2 % 2:
        raise ValueError(f"hkernels.moe: gate_up_proj must be [E, 2·I, H] with H = {H} (x's last dim), got "
                         f"{list(gate_up_proj.shape)}")
    if tuple(down_proj.shape) != (E, H, I2 // 2):
        raise ValueError(f"hkernels.moe: down_proj must be [E, H, I] = {[E, H, I2 // 2]} to match gate_up_proj "
                         f"{list(gate_up_proj.shape)}, got {list(down_proj.shape)}")
    if not isinstance(topk_ids, torch.Tensor) or topk_ids.dtype not in _INT:
        got = topk_ids.dtype if isinstance(topk_ids, torch.Tensor) else type(topk_ids).__name__
        raise TypeError(f"hkernels.moe: topk_ids must be an int32 or int64 tensor, got {got}")
    if not isinstance(topk_weights, torch.Tensor) or not topk_weights.dtype.is_floating_point:
        got = topk_weights.dtype if isinstance(topk_weights, torch.Tensor) else type(topk_weights).__name__
        raise TypeError(f"hkernels.moe: topk_weights must be a floating tensor, got {got}")
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != x.dim() or topk_ids.shape[:-1] != x.shape[:-1]:
        raise ValueError(f"hkernels.moe: topk_ids {list(topk_ids.shape)} and topk_weights "
                         f"{list(topk_weights.shape)} must both be [..., k] with x's leading dims "
                         f"{list(x.shape[:-1])}")
    for name, t in (("topk_ids", topk_ids), ("topk_weights", topk_weights)):
        if t.device != x.device:
            raise ValueError(f"hkernels.moe: {name} is on {t.device} but x is on {x.device}")


def _values(x: Tensor, gate_up_proj: Tensor, down_proj: Tensor, topk_ids: Tensor, topk_weights: Tensor) -> None:
    check_range(OP, "topk_ids", topk_ids, 0, gate_up_proj.shape[0], why=" (the experts, E = gate_up_proj's first dim)")


def _body(request: str, x: Tensor, gate_up_proj: Tensor, down_proj: Tensor, topk_ids: Tensor,
          topk_weights: Tensor) -> Tensor:
    shape = x.shape
    H, k = shape[-1], topk_ids.shape[-1]
    x2 = x.reshape(-1, H)
    ids = topk_ids.reshape(x2.shape[0], k)
    tw = topk_weights.reshape(x2.shape[0], k)
    if tw.dtype == torch.float64 and x.dtype != torch.float64:  # the kernels read routing weights up to float32
        tw = tw.float()
    save = wants_grad(x, gate_up_proj, down_proj, topk_weights)
    out = call(_fwd, x2, gate_up_proj, down_proj, ids, tw, save, request)[0]
    return out.view(shape)


# ------------------------------------------------------------------------------------------------------ autograd


def _unit_rows(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


@torch.library.custom_op("hkernels::moe_fwd", mutates_args=())
def _fwd(x: Tensor, gate_up_proj: Tensor, down_proj: Tensor, topk_ids: Tensor, topk_weights: Tensor, save: bool,
         backend: str) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    if x.numel() == 0 or gate_up_proj.numel() == 0 or topk_ids.numel() == 0:  # nothing for a kernel to do
        backend = "torch"
    return dispatch.run(OP, "moe_fwd", backend, _unit_rows(x), gate_up_proj, down_proj, topk_ids.contiguous(),
                        topk_weights.contiguous(), save)


@_fwd.register_fake
def _(x: Tensor, gate_up_proj: Tensor, down_proj: Tensor, topk_ids: Tensor, topk_weights: Tensor, save: bool,
      backend: str) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    rows = topk_ids.numel()
    index = topk_ids.new_empty(rows, dtype=torch.int32)
    return (x.new_empty(x.shape), x.new_empty((rows, gate_up_proj.shape[1]) if save else (0,)), index,
            index.new_empty(rows), index.new_empty(rows), index.new_empty(gate_up_proj.shape[0] + 1))


@torch.library.custom_op("hkernels::moe_bwd", mutates_args=())
def _bwd(dout: Tensor, x: Tensor, gate_up_proj: Tensor, down_proj: Tensor, topk_ids: Tensor, topk_weights: Tensor,
         pre: Tensor, src: Tensor, order: Tensor, pos: Tensor, ends: Tensor, need_x: bool, need_weights: bool,
         backend: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    if x.numel() == 0 or gate_up_proj.numel() == 0 or topk_ids.numel() == 0:
        backend = "torch"
    dx, dgu, dd, dtw = dispatch.run(OP, "moe_bwd", backend, _unit_rows(dout), _unit_rows(x), gate_up_proj,
                                    down_proj, topk_ids.contiguous(), topk_weights.contiguous(), pre, src, order,
                                    pos, ends, need_x, need_weights)
    return (dx if dx is not None else x.new_empty(0), dgu if dgu is not None else gate_up_proj.new_empty(0),
            dd if dd is not None else down_proj.new_empty(0), dtw)


@_bwd.register_fake
def _(dout: Tensor, x: Tensor, gate_up_proj: Tensor, down_proj: Tensor, topk_ids: Tensor, topk_weights: Tensor,
      pre: Tensor, src: Tensor, order: Tensor, pos: Tensor, ends: Tensor, need_x: bool, need_weights: bool,
      backend: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return (x.new_empty(x.shape if need_x else (0,)),
            gate_up_proj.new_empty(gate_up_proj.shape if need_weights else (0,)),
            down_proj.new_empty(down_proj.shape if need_weights else (0,)), topk_weights.new_empty(topk_weights.shape))


def _setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, ...]) -> None:
    x, gate_up_proj, down_proj, topk_ids, topk_weights, _save, backend = inputs
    ctx.save_for_backward(x, gate_up_proj, down_proj, topk_ids, topk_weights, *output[1:])
    ctx.backend = backend
    ctx.mark_non_differentiable(*output[1:])
    ctx.set_materialize_grads(False)


def _backward(ctx: Any, dout: Tensor | None, *_: Any) -> tuple[Tensor | None, ...]:
    if dout is None:
        return (None,) * 7
    x, gate_up_proj, down_proj, topk_ids, topk_weights, pre, src, order, pos, ends = ctx.saved_tensors
    if pre.numel() == 0 and x.numel() and topk_ids.numel() and gate_up_proj.numel():
        raise RuntimeError("hkernels.moe: the forward ran without a gradient wanted and kept nothing for the "
                           "backward; call it with requires_grad inputs under grad mode")
    need = ctx.needs_input_grad
    # The weight gradients, half the backward's work, only when one is wanted (frozen experts skip them).
    dx, dgu, dd, dtw = call(_bwd, dout, x, gate_up_proj, down_proj, topk_ids, topk_weights, pre, src, order, pos,
                            ends, need[0], need[1] or need[2], ctx.backend)
    return (dx if need[0] else None, dgu if need[1] else None, dd if need[2] else None, None,
            dtw if need[4] else None, None, None)


autograd(_fwd, _backward, _setup)


# ------------------------------------------------------------------------------- reference and the torch backend


def reference(x: Tensor, gate_up_proj: Tensor, down_proj: Tensor, topk_ids: Tensor, topk_weights: Tensor) -> Tensor:
    """out[t] = Σⱼ w[t, j] · down[e] (silu(g) ⊙ u), one expert at a time (ids outside [0, E) add nothing);
    float32 math for 16-bit inputs. Differentiable (autograd through plain torch ops)."""
    ct = compute_dtype(x.dtype)
    shape = x.shape
    x2 = x.reshape(-1, shape[-1]).to(ct)
    ids = topk_ids.reshape(x2.shape[0], topk_ids.shape[-1])
    w = topk_weights.reshape(ids.shape).to(ct)
    out = torch.zeros(x2.shape, dtype=ct, device=x.device)
    for e in range(gate_up_proj.shape[0]):
        t, j = torch.nonzero(ids == e, as_tuple=True)
        if t.numel():
            g, u = (x2[t] @ gate_up_proj[e].to(ct).T).chunk(2, -1)
            y = (F.silu(g) * u) @ down_proj[e].to(ct).T
            out = out.index_add(0, t, y * w[t, j, None])
    return out.to(x.dtype).view(shape)


def _groups(ends: Tensor) -> list[tuple[int, int, int]]:
    """(expert, start, end) sorted rows of each non-empty group (one host sync)."""
    bounds = [0, *ends.tolist()[:-1]]
    return [(e, s, t) for e, (s, t) in enumerate(itertools.pairwise(bounds)) if t > s]


def _combine(y: Tensor, pos: Tensor, topk_ids: Tensor, weights: Tensor | None, E: int) -> Tensor:
    """out[t] = Σⱼ (w[t, j] ·) y[pos[t, j]] over the slots with an id in [0, E)."""
    T, k = topk_ids.shape
    rows = y[pos.long()].view(T, k, y.shape[1])
    valid = ((topk_ids >= 0) & (topk_ids < E))[..., None]
    if weights is not None:
        rows = rows * weights.to(y.dtype)[..., None]
    return torch.where(valid, rows, 0.0).sum(1)  # (a where, not a product: rows past the groups may be unwritten)


def moe_fwd(x: Tensor, gate_up_proj: Tensor, down_proj: Tensor, topk_ids: Tensor, topk_weights: Tensor, save: bool
            ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The kernels' forward, written out in torch on the same sorted layout (see triton_fallback/moe.py)."""
    E, I2, _ = gate_up_proj.shape
    src, order, pos, ends = routing(topk_ids, E)
    if grouped_mm_takes(x, gate_up_proj, down_proj):  # PyTorch's grouped GEMM, on the same sorted rows
        offs = ends[:E]
        pre = grouped_mm(x[src.long()], gate_up_proj.transpose(1, 2), offs)
        if pre is not None:
            g, u = pre.float().chunk(2, -1)
            y = grouped_mm((F.silu(g) * u).to(x.dtype), down_proj.transpose(1, 2), offs)
            if y is not None:
                out = _combine(y.float(), pos, topk_ids, topk_weights, E).to(x.dtype)
                return out, (pre if save else pre.new_empty(0)), src, order, pos, ends
    ct = compute_dtype(x.dtype)
    rows = src.numel()
    pre = x.new_zeros((rows, I2))
    y = torch.zeros((rows, x.shape[1]), dtype=ct, device=x.device)
    for e, s, t in _groups(ends):
        gu = x[src[s:t].long()].to(ct) @ gate_up_proj[e].to(ct).T
        pre[s:t] = gu.to(x.dtype)
        g, u = gu.chunk(2, -1)
        y[s:t] = (F.silu(g) * u).to(x.dtype).to(ct) @ down_proj[e].to(ct).T
    out = _combine(y.to(x.dtype).to(ct), pos, topk_ids, topk_weights, E).to(x.dtype)
    return out, (pre if save else pre.new_empty(0)), src, order, pos, ends


def moe_bwd(dout: Tensor, x: Tensor, gate_up_proj: Tensor, down_proj: Tensor, topk_ids: Tensor, topk_weights: Tensor,
            pre: Tensor, src: Tensor, order: Tensor, pos: Tensor, ends: Tensor, need_x: bool = True,
            need_weights: bool = True) -> tuple[Tensor | None, Tensor | None, Tensor | None, Tensor]:
    """(dx or None, dgate_up_proj or None, ddown_proj or None, dtopk_weights), written out (a custom op's
    implementation runs without autograd); the math is triton_fallback/moe.py's."""
    if grouped_mm_takes(dout, x, gate_up_proj, down_proj):
        found = _moe_bwd_grouped_mm(dout, x, gate_up_proj, down_proj, topk_ids, topk_weights, pre, src, order, pos,
                                    ends, need_x, need_weights)
        if found is not None:
            return found
    ct = compute_dtype(x.dtype)
    E, _I2, H = gate_up_proj.shape
    rows = src.numel()
    w = topk_weights.reshape(-1)[order.long()].to(ct)
    dx_rows = torch.zeros((rows, H), dtype=ct, device=x.device)
    dgu = torch.zeros(gate_up_proj.shape, dtype=ct, device=x.device)
    dd = torch.zeros(down_proj.shape, dtype=ct, device=x.device)
    dsw = torch.zeros(rows, dtype=ct, device=x.device)
    for e, s, t in _groups(ends):
        tokens = src[s:t].long()
        g, u = pre[s:t].to(ct).chunk(2, -1)
        sig = torch.sigmoid(g)
        h = g * sig * u
        do = dout[tokens].to(ct)
        dh_raw = do @ down_proj[e].to(ct)
        dsw[s:t] = (dh_raw * h).sum(1)
        dh = dh_raw * w[s:t, None]
        dpre = torch.cat([dh * u * sig * (1 + g * (1 - sig)), dh * g * sig], 1).to(x.dtype).to(ct)
        dd[e] = do.T @ (h * w[s:t, None]).to(x.dtype).to(ct)
        dgu[e] = dpre.T @ x[tokens].to(ct)
        dx_rows[s:t] = dpre @ gate_up_proj[e].to(ct)
    dx = _combine(dx_rows.to(x.dtype).to(ct), pos, topk_ids, None, E).to(x.dtype)
    dtw = dsw[pos.long()].view(topk_weights.shape).to(topk_weights.dtype)
    return (dx if need_x else None, dgu.to(gate_up_proj.dtype) if need_weights else None,
            dd.to(down_proj.dtype) if need_weights else None, dtw)


def _moe_bwd_grouped_mm(dout: Tensor, x: Tensor, gate_up_proj: Tensor, down_proj: Tensor, topk_ids: Tensor,
                        topk_weights: Tensor, pre: Tensor, src: Tensor, order: Tensor, pos: Tensor, ends: Tensor,
                        need_x: bool, need_weights: bool
                        ) -> tuple[Tensor | None, Tensor | None, Tensor | None, Tensor] | None:
    """moe_bwd with ``torch._grouped_mm``'s grouped GEMMs (None where one raised). The rows past the last expert's
    (out-of-range ids) are left unwritten by them and masked here."""
    E = gate_up_proj.shape[0]
    offs = ends[:E]
    valid = torch.arange(src.shape[0], device=x.device, dtype=torch.int32) < ends[E - 1:E]
    tokens = src.long()
    do = dout[tokens]
    dh_raw = grouped_mm(do, down_proj, offs)
    if dh_raw is None:
        return None
    w = topk_weights.reshape(-1)[order.long()].float()[:, None]
    g, u = pre.float().chunk(2, -1)
    sig = torch.sigmoid(g)
    h = g * sig * u
    dh_raw = dh_raw.float()
    dsw = torch.where(valid, (dh_raw * h).sum(1), 0.0)
    dh = dh_raw * w
    dpre = torch.cat([dh * u * sig * (1 + g * (1 - sig)), dh * g * sig], 1).to(x.dtype)
    dx = dgu = dd = None
    if need_x:
        dx_rows = grouped_mm(dpre, gate_up_proj, offs)
        if dx_rows is None:
            return None
        dx = _combine(dx_rows.float(), pos, topk_ids, None, E).to(x.dtype)
    if need_weights:
        dd = weight_grads(grouped_mm(do.t(), (h * w).to(x.dtype), offs), offs)
        dgu = weight_grads(grouped_mm(dpre.t(), x[tokens], offs), offs)
        if dd is None or dgu is None:
            return None
    dtw = dsw[pos.long()].view(topk_weights.shape).to(topk_weights.dtype)
    return dx, dgu, dd, dtw


def _torch_takes(name: str, args: tuple[Any, ...]) -> bool:
    """The torch backend's call runs ``torch._grouped_mm`` on the sorted rows, reading nothing on the host
    (traceable into a graph): the forward's (x, gate_up, down, ...), the backward's (dout, x, gate_up, down, ...)."""
    return grouped_mm_traces(*args[:3]) if name.endswith("_fwd") else grouped_mm_traces(*args[:4])


torch_traces_when(OP, _torch_takes)


# Under autocast: as its experts' matmuls (and Hugging Face's eager experts), every input in autocast's dtype.
_CALLS = Public(OP, _check, _body, values=_values, autocast=Autocast("lower", ("aten::mm",)))
