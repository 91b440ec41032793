"""rope: rotary position embedding in Hugging Face's rotate_half convention, ``x·cos + rotate_half(x)·sin``.

The public function and its checks, its autograd (custom ops ``hkernels::rope_fwd`` / ``_bwd``, and
``hkernels::rope_mrope_fwd`` / ``_bwd`` for multimodal rope's three streams), then the reference math and the torch
backend. Kernels: ``hkernels/ops/rope.py`` (Helion), ``triton_fallback/rope.py``.
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
    autograd,
    bound,
    call,
    check_range,
    check_same,
    check_tensor,
    compute_dtype,
    wants_grad,
)

OP = "rope"


def rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, position_ids: Tensor | None = None,
         mrope_section: list[int] | tuple[int, ...] | None = None) -> tuple[Tensor, Tensor]:
    """Rotary position embedding in Hugging Face's rotate_half convention: ``x·cos + rotate_half(x)·sin``.

    q: [B, Hq, S, D], k: [B, Hk, S, D] (Hk may differ from Hq: GQA), one dtype, D even; any strides with unit
    stride along D (e.g. ``x.view(B, S, H, D).transpose(1, 2)``) are read in place. cos, sin: [S, D] or [B, S, D]
    (any float dtype: float32 tables with bfloat16 q are fine). Returns (q_rot, k_rot), contiguous, in q's dtype.
    Differentiable in q and k (and in cos/sin, by PyTorch ops, when they require grad).

    With ``position_ids`` [B, S] (or [S] / [1, S], shared by the batch), int32 or int64 on q's device, cos and sin
    are tables [P, D] of P positions and token s of batch b takes row ``position_ids[b, s]``; positions may restart
    inside a row (packed sequences). The positions are not checked on the host (a sync): a position outside
    [0, P) reads no memory out of bounds and gives NaN for that token's q_rot and k_rot (and their gradients);
    ``HKERNELS_CHECK=1`` raises instead.

    With ``mrope_section`` (Qwen2-VL's and Qwen2.5-VL's multimodal rope, e.g. [16, 24, 24] for D = 128): cos, sin
    are [3, S, D] or [3, B, S, D], the tables of three position streams (temporal, height, width), and the head
    dim, split into chunks of ``mrope_section * 2`` elements (its sum is D / 2), takes chunk i's angles from stream
    i mod 3, as transformers' ``apply_multimodal_rotary_pos_emb`` does. With three sections (Qwen2-VL's and
    Qwen2.5-VL's) and tables that need no gradient, the Triton kernel reads each element from its stream (no
    selected tables made); otherwise the selected tables [B, S, D] are made first by one small gather, then
    rotated. Not with ``position_ids``.
    """
    if mrope_section is not None:
        if position_ids is not None:
            raise ValueError("hkernels.rope: mrope_section takes its positions in cos and sin (three streams), not "
                             "position_ids")
        if type(mrope_section) in (list, tuple) and len(mrope_section) == 3 and not (
                torch.is_grad_enabled() and (getattr(cos, "requires_grad", False)
                                             or getattr(sin, "requires_grad", False))):
            return _CALLS_M(q, k, cos, sin, tuple(mrope_section))
        cos, sin = mrope_tables(cos, sin, mrope_section, q)
    if position_ids is None:
        return _CALLS(q, k, cos, sin)
    return _CALLS_AT(q, k, cos, sin, position_ids)


def mrope_tables(cos: Tensor, sin: Tensor, mrope_section: list[int] | tuple[int, ...], q: Tensor | None = None
                 ) -> tuple[Tensor, Tensor]:
    """Multimodal rope's tables: cos, sin [3, S, D] or [3, B, S, D] (three position streams) -> [S, D] or [B, S, D],
    element d taken from stream i mod 3 where chunk i of ``mrope_section * 2`` holds d. Differentiable (a gather)."""
    _check_section(cos, sin, mrope_section, q)
    D = cos.shape[-1]
    stream = _streams(tuple(mrope_section), cos.device)  # [D]: the stream of each element
    index = stream.view(1, *([1] * (cos.dim() - 2)), D).expand(1, *cos.shape[1:])
    return cos.gather(0, index).squeeze(0), sin.gather(0, index).squeeze(0)


def _check_section(cos: Any, sin: Any, mrope_section: Any, q: Any = None) -> None:
    if (not isinstance(mrope_section, (list, tuple)) or not mrope_section
            or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in mrope_section)):
        raise TypeError(f"hkernels.rope: mrope_section must be a list of positive ints, got {mrope_section!r}")
    for name, t in (("cos", cos), ("sin", sin)):
        if not isinstance(t, torch.Tensor) or t.dim() not in (3, 4) or t.shape[0] != 3:
            got = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"hkernels.rope: with mrope_section, {name} must be [3, S, D] or [3, B, S, D] (three "
                             f"position streams), got {got}")
    D = cos.shape[-1]
    if 2 * sum(mrope_section) != D:
        raise ValueError(f"hkernels.rope: mrope_section {list(mrope_section)} must sum to D / 2 = {D / 2} (D = {D})")
    if isinstance(q, torch.Tensor) and q.dim() == 4 and q.shape[-1] != D:
        raise ValueError(f"hkernels.rope: cos and sin have D = {D}, q has {q.shape[-1]}")


_STREAMS: dict[tuple[Any, ...], Tensor] = {}


def _streams(section: tuple[int, ...], device: torch.device) -> Tensor:
    """[D] int64: which of the three streams each element of the head dim reads (chunk i of section * 2: i mod 3)."""
    key = (section, device)
    found = _STREAMS.get(key)
    if found is None:
        found = torch.cat([torch.full((n,), i % 3, dtype=torch.int64) for i, n in enumerate(section * 2)]).to(device)
        _STREAMS[key] = found
    return found


_INT = (torch.int32, torch.int64)


def _check_qk(q: Any, k: Any, op: str = OP) -> tuple[int, int, int]:
    """Checks q and k; returns (B, S, D). ``op``: the op named in errors (qk_norm_rope shares these checks)."""
    for name, t in (("q", q), ("k", k)):
        check_tensor(op, name, t, (4,))
    check_same(op, ("q", "k"), q, k, shape=False)
    B, _, S, D = q.shape
    if k.shape[0] != B or k.shape[2] != S or k.shape[3] != D:
        raise ValueError(f"hkernels.{op}: q [B, Hq, S, D] = {list(q.shape)} and k [B, Hk, S, D] = {list(k.shape)} "
                         "must agree on B, S and D")
    if D % 2:
        raise ValueError(f"hkernels.{op}: the head dim D must be even (rotate_half splits it), got {D}")
    return B, S, D


def _check_device(name: str, t: Tensor, q: Tensor, op: str = OP) -> None:
    if t.device != q.device:
        raise ValueError(f"hkernels.{op}: {name} is on {t.device} but q is on {q.device}")


def check_tables(q: Any, k: Any, cos: Any, sin: Any, op: str = OP) -> None:
    """q, k and tables [S, D] or [B, S, D] for them (rope's calls without position_ids)."""
    B, S, D = _check_qk(q, k, op)
    for name, t in (("cos", cos), ("sin", sin)):
        check_tensor(op, name, t, (2, 3))
        if t.shape[-2:] != (S, D) or (t.dim() == 3 and t.shape[0] not in (1, B)):
            raise ValueError(f"hkernels.{op}: {name} must be [S, D] = [{S}, {D}] or [B, S, D] = [{B}, {S}, {D}], "
                             f"got {list(t.shape)}")
        _check_device(name, t, q, op)
    if _table(cos).shape != _table(sin).shape:
        raise ValueError(f"hkernels.{op}: cos and sin must have the same shape, got {list(cos.shape)} and "
                         f"{list(sin.shape)}")


def check_positions(q: Any, k: Any, cos: Any, sin: Any, position_ids: Any, op: str = OP) -> None:
    """q, k, tables [P, D] and position_ids into them (rope's calls with position_ids)."""
    B, S, D = _check_qk(q, k, op)
    for name, t in (("cos", cos), ("sin", sin)):
        check_tensor(op, name, t)
        if t.dim() != 2 or t.shape[1] != D:
            raise ValueError(f"hkernels.{op}: with position_ids, {name} must be a table [P, D] with D = {D} (a row "
                             f"per position), got {list(t.shape)}")
        _check_device(name, t, q, op)
    if cos.shape != sin.shape:
        raise ValueError(f"hkernels.{op}: cos and sin must have the same shape, got {list(cos.shape)} and "
                         f"{list(sin.shape)}")
    if not isinstance(position_ids, torch.Tensor) or position_ids.dtype not in _INT:
        got = position_ids.dtype if isinstance(position_ids, torch.Tensor) else type(position_ids).__name__
        raise TypeError(f"hkernels.{op}: position_ids must be an int32 or int64 tensor, got {got}")
    if position_ids.shape not in ((S,), (1, S), (B, S)):
        raise ValueError(f"hkernels.{op}: position_ids must be [S] = [{S}] or [B, S] = [{B}, {S}] (or [1, S]) to "
                         f"match q {list(q.shape)}, got {list(position_ids.shape)}")
    _check_device("position_ids", position_ids, q, op)
    if cos.shape[0] == 0 and position_ids.numel():
        raise ValueError(f"hkernels.{op}: cos and sin have no rows (P = 0) for position_ids to select")


def check_position_values(cos: Tensor, position_ids: Tensor, op: str = OP) -> None:
    check_range(op, "position_ids", position_ids, 0, cos.shape[0], why=f" (the tables have P = {cos.shape[0]} rows)")


def _check(q: Any, k: Any, cos: Any, sin: Any) -> None:
    check_tables(q, k, cos, sin)


def _check_m(q: Any, k: Any, cos: Any, sin: Any, section: tuple[int, ...]) -> None:
    """Multimodal rope's call: q, k and three streams' tables [3, S, D] or [3, B, S, D] for them."""
    _check_section(cos, sin, section, q)
    check_tables(q, k, cos[0], sin[0])
    if cos.shape != sin.shape:
        raise ValueError(f"hkernels.{OP}: cos and sin must have the same shape, got {list(cos.shape)} and "
                         f"{list(sin.shape)}")


def _check_at(q: Any, k: Any, cos: Any, sin: Any, position_ids: Any) -> None:
    check_positions(q, k, cos, sin, position_ids)


def _values_at(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, position_ids: Tensor) -> None:
    check_position_values(cos, position_ids)


def _table(t: Tensor) -> Tensor:
    """[S, D] or [B, S, D] -> [1 or B, S, D], contiguous."""
    return (t if t.dim() == 3 else t.unsqueeze(0)).contiguous()


def _at(cos: Tensor, sin: Tensor, position_ids: Tensor) -> tuple[Tensor, Tensor]:
    """The tables' rows at the positions: [P, D] -> [..., S, D], a NaN row for a position outside [0, P) (clamped
    for the gather, so nothing is read out of bounds; found without a host sync, so it cannot raise)."""
    index = position_ids.clamp(0, cos.shape[0] - 1)
    outside = (index != position_ids).unsqueeze(-1)
    return cos[index].masked_fill(outside, math.nan), sin[index].masked_fill(outside, math.nan)


def _body(request: str, q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    return call(_fwd, q, k, _table(cos), _table(sin), request)


def _streams_table(t: Tensor) -> Tensor:
    """[3, S, D] or [3, B, S, D] -> [3, 1 or B, S, D], contiguous."""
    return (t if t.dim() == 4 else t.unsqueeze(1)).contiguous()


def _splits(section: tuple[int, ...]) -> tuple[int, int]:
    """Where streams 1 and 2 start in each half of the head dim (sections [a, b, c]: columns [0, a) of each half
    from stream 0, [a, a + b) from stream 1, the rest from stream 2)."""
    return section[0], section[0] + section[1]


def _body_m(request: str, q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, section: tuple[int, ...]
            ) -> tuple[Tensor, Tensor]:
    return call(_fwd_m, q, k, _streams_table(cos), _streams_table(sin), *_splits(section), request)


def _body_at(request: str, q: Tensor, k: Tensor, cos: Tensor, sin: Tensor,
             position_ids: Tensor) -> tuple[Tensor, Tensor]:
    # The gathered rows [1 or B, S, D] are the tables the kernels take without positions: the same kernels, and the
    # tables' gradients (when wanted) flow back through the gather by PyTorch's autograd.
    c, s = _at(cos, sin, position_ids)
    return call(_fwd, q, k, _table(c), _table(s), request)


# ------------------------------------------------------------------------------------------------------ autograd


def _d_unit(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _run_rotation(fn: str, x: Tensor, y: Tensor, backend: str, *tables: Any) -> tuple[Tensor, Tensor]:
    """The body of each rotation op (rope's and mRoPE's, forward and backward): backend ``fn`` on x and y (unit
    stride along D) and the tables; an empty x or y leaves nothing for a kernel (the torch backend takes it)."""
    if x.numel() == 0 or y.numel() == 0:
        return dispatch.run(OP, fn, "torch", x, y, *tables)
    return dispatch.run(OP, fn, backend, _d_unit(x), _d_unit(y), *tables)


@torch.library.custom_op("hkernels::rope_fwd", mutates_args=())
def _fwd(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, backend: str) -> tuple[Tensor, Tensor]:
    return _run_rotation("rope_fwd", q, k, backend, cos, sin)


@_fwd.register_fake
def _(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, backend: str) -> tuple[Tensor, Tensor]:
    return q.new_empty(q.shape), k.new_empty(k.shape)


@torch.library.custom_op("hkernels::rope_bwd", mutates_args=())
def _bwd(dq: Tensor, dk: Tensor, cos: Tensor, sin: Tensor, backend: str) -> tuple[Tensor, Tensor]:
    return _run_rotation("rope_bwd", dq, dk, backend, cos, sin)


@_bwd.register_fake
def _(dq: Tensor, dk: Tensor, cos: Tensor, sin: Tensor, backend: str) -> tuple[Tensor, Tensor]:
    return dq.new_empty(dq.shape), dk.new_empty(dk.shape)


def _setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
    q, k, cos, sin, backend = inputs
    tables_need_grad = cos.requires_grad or sin.requires_grad
    ctx.save_for_backward(cos, sin, *((q, k) if tables_need_grad else ()))
    ctx.backend = backend
    ctx.q_shape, ctx.k_shape, ctx.q_dtype = q.shape, k.shape, q.dtype
    ctx.set_materialize_grads(False)


def _backward(ctx: Any, dq_rot: Tensor | None, dk_rot: Tensor | None) -> tuple[Tensor | None, ...]:
    cos, sin, *qk = ctx.saved_tensors
    dq_rot = dq_rot if dq_rot is not None else cos.new_zeros(ctx.q_shape, dtype=ctx.q_dtype)
    dk_rot = dk_rot if dk_rot is not None else cos.new_zeros(ctx.k_shape, dtype=ctx.q_dtype)
    dq, dk = call(_bwd, dq_rot, dk_rot, cos, sin, ctx.backend)
    dcos = dsin = None
    if qk:
        # Learned rotary tables (rare): their gradients by PyTorch ops, summed over heads (and the batch when shared).
        q, k = qk
        dcos, dsin = _table_grads(q, k, dq_rot, dk_rot, cos)
    return dq, dk, dcos, dsin, None


def _table_grads(q: Tensor, k: Tensor, dq: Tensor, dk: Tensor, cos: Tensor) -> tuple[Tensor, Tensor]:
    ct = torch.promote_types(cos.dtype, torch.float32)
    qf, kf, dqf, dkf = (t.to(ct) for t in (q, k, dq, dk))
    dcos = (dqf * qf).sum(1) + (dkf * kf).sum(1)  # [B, S, D]
    dsin = (dqf * _rotate_half(qf)).sum(1) + (dkf * _rotate_half(kf)).sum(1)
    if cos.shape[0] == 1:
        dcos, dsin = dcos.sum(0, keepdim=True), dsin.sum(0, keepdim=True)
    return dcos.to(cos.dtype), dsin.to(cos.dtype)


autograd(_fwd, _backward, _setup)


# Multimodal rope: cos, sin [3, 1 or B, S, D] contiguous, three streams; columns [0, split_a) of each half of the
# head dim from stream 0, [split_a, split_b) from stream 1, [split_b, D/2) from stream 2. The tables need no gradient
# (calls whose tables do take the gather path).
@torch.library.custom_op("hkernels::rope_mrope_fwd", mutates_args=())
def _fwd_m(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, split_a: int, split_b: int, backend: str
           ) -> tuple[Tensor, Tensor]:
    return _run_rotation("rope_mrope_fwd", q, k, backend, cos, sin, split_a, split_b)


@_fwd_m.register_fake
def _(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, split_a: int, split_b: int, backend: str
      ) -> tuple[Tensor, Tensor]:
    return q.new_empty(q.shape), k.new_empty(k.shape)


@torch.library.custom_op("hkernels::rope_mrope_bwd", mutates_args=())
def _bwd_m(dq: Tensor, dk: Tensor, cos: Tensor, sin: Tensor, split_a: int, split_b: int, backend: str
           ) -> tuple[Tensor, Tensor]:
    return _run_rotation("rope_mrope_bwd", dq, dk, backend, cos, sin, split_a, split_b)


@_bwd_m.register_fake
def _(dq: Tensor, dk: Tensor, cos: Tensor, sin: Tensor, split_a: int, split_b: int, backend: str
      ) -> tuple[Tensor, Tensor]:
    return dq.new_empty(dq.shape), dk.new_empty(dk.shape)


def _setup_m(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
    q, k, cos, sin, split_a, split_b, backend = inputs
    ctx.save_for_backward(cos, sin)
    ctx.backend, ctx.splits = backend, (split_a, split_b)
    ctx.q_shape, ctx.k_shape, ctx.q_dtype = q.shape, k.shape, q.dtype
    ctx.set_materialize_grads(False)


def _backward_m(ctx: Any, dq_rot: Tensor | None, dk_rot: Tensor | None) -> tuple[Tensor | None, ...]:
    cos, sin = ctx.saved_tensors
    dq_rot = dq_rot if dq_rot is not None else cos.new_zeros(ctx.q_shape, dtype=ctx.q_dtype)
    dk_rot = dk_rot if dk_rot is not None else cos.new_zeros(ctx.k_shape, dtype=ctx.q_dtype)
    dq, dk = call(_bwd_m, dq_rot, dk_rot, cos, sin, *ctx.splits, ctx.backend)
    return dq, dk, None, None, None, None, None


autograd(_fwd_m, _backward_m, _setup_m)


# ------------------------------------------------------------------------------- reference and the torch backend


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def reference(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, position_ids: Tensor | None = None,
              mrope_section: list[int] | tuple[int, ...] | None = None) -> tuple[Tensor, Tensor]:
    """Rotary embedding, Hugging Face's rotate_half form: x·cos + rotate_half(x)·sin for x in (q, k).

    q [B, Hq, S, D], k [B, Hk, S, D], cos/sin [S, D] or [B, S, D] (broadcast over heads); with position_ids [S] or
    [B, S], cos/sin [P, D] are tables read at those rows (NaN rows for positions outside [0, P)); with
    mrope_section, cos/sin [3, (B,) S, D] of three streams, chunk i of the head dim (chunks of mrope_section * 2)
    from stream i mod 3, as transformers' apply_multimodal_rotary_pos_emb.
    """
    if mrope_section is not None:
        split = list(mrope_section) * 2
        cos = torch.cat([c[i % 3] for i, c in enumerate(cos.split(split, dim=-1))], dim=-1)
        sin = torch.cat([c[i % 3] for i, c in enumerate(sin.split(split, dim=-1))], dim=-1)
    if position_ids is not None:
        cos, sin = _at(cos, sin, position_ids)
    ct = compute_dtype(q.dtype)
    c = cos.to(ct).unsqueeze(-3)  # [.., 1, S, D]: the same angle for every head
    s = sin.to(ct).unsqueeze(-3)
    qf, kf = q.to(ct), k.to(ct)
    return (qf * c + _rotate_half(qf) * s).to(q.dtype), (kf * c + _rotate_half(kf) * s).to(k.dtype)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor, transpose: bool) -> Tensor:
    # out1 = x1·c1 − x2·s1, out2 = x2·c2 + x1·s2; the transpose: dx1 = y1·c1 + y2·s2, dx2 = y2·c2 − y1·s1
    ct = compute_dtype(x.dtype)
    half = x.shape[-1] // 2
    xf = x.to(ct)
    c, s = cos.to(ct).unsqueeze(1), sin.to(ct).unsqueeze(1)  # [Bc, 1, S, D]
    x1, x2 = xf[..., :half], xf[..., half:]
    c1, c2, s1, s2 = c[..., :half], c[..., half:], s[..., :half], s[..., half:]
    if transpose:
        out = torch.cat([x1 * c1 + x2 * s2, x2 * c2 - x1 * s1], dim=-1)
    else:
        out = torch.cat([x1 * c1 - x2 * s1, x2 * c2 + x1 * s2], dim=-1)
    return out.to(x.dtype)


def rope_fwd(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """q [B, Hq, S, D], k [B, Hk, S, D], cos/sin [Bc, S, D] (Bc = 1 or B) -> (q_rot, k_rot)."""
    return _rotate(q, cos, sin, False), _rotate(k, cos, sin, False)


def rope_bwd(dq: Tensor, dk: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """The transposed rotation of the upstream gradients."""
    return _rotate(dq, cos, sin, True), _rotate(dk, cos, sin, True)


def mrope_select(t: Tensor, split_a: int, split_b: int) -> Tensor:
    """Three streams' table [3, Bc, S, D] -> the selected table [Bc, S, D]: columns [0, split_a) of each half from
    stream 0, [split_a, split_b) from stream 1, the rest from stream 2."""
    half = t.shape[-1] // 2
    bounds = ((0, split_a, 0), (split_a, split_b, 1), (split_b, half, 2))
    parts = [t[i, ..., lo + h:hi + h] for h in (0, half) for lo, hi, i in bounds]
    return torch.cat(parts, dim=-1)


def rope_mrope_fwd(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, split_a: int, split_b: int
                   ) -> tuple[Tensor, Tensor]:
    """Multimodal rope: cos, sin [3, Bc, S, D] of three streams (see ``_fwd_m``) -> (q_rot, k_rot)."""
    return rope_fwd(q, k, mrope_select(cos, split_a, split_b), mrope_select(sin, split_a, split_b))


def rope_mrope_bwd(dq: Tensor, dk: Tensor, cos: Tensor, sin: Tensor, split_a: int, split_b: int
                   ) -> tuple[Tensor, Tensor]:
    """The transposed rotation of the upstream gradients, with three streams' tables."""
    return rope_bwd(dq, dk, mrope_select(cos, split_a, split_b), mrope_select(sin, split_a, split_b))


def _fast(plan: Any, request: str, q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> Any:
    """Calls of this signature in one step: the kernel function the plan ran (through a Lane when a gradient is
    wanted)."""
    run = bound(plan, "rope_fwd")
    if run is None or q.stride(-1) != 1 or k.stride(-1) != 1 or not (q.numel() and k.numel()):
        return None
    if wants_grad(q, k, cos, sin):
        if cos.requires_grad or sin.requires_grad:
            return None  # (the tables' own gradients: the plan's path)
        run = Lane(run, _setup, _backward, request, 4).apply
    if cos.dim() == 3 and cos.is_contiguous() and sin.is_contiguous():
        return run
    return lambda q, k, cos, sin: run(q, k, _table(cos), _table(sin))


def _fast_m(plan: Any, request: str, q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, section: tuple[int, ...]
            ) -> Any:
    """Multimodal rope's calls of this signature in one step (as ``_fast``)."""
    run = bound(plan, "rope_mrope_fwd")
    if run is None or q.stride(-1) != 1 or k.stride(-1) != 1 or not (q.numel() and k.numel()):
        return None
    split_a, split_b = _splits(section)
    if wants_grad(q, k):
        run = Lane(run, _setup_m, _backward_m, request, 6).apply
    if cos.dim() == 4 and cos.is_contiguous() and sin.is_contiguous():
        return lambda q, k, cos, sin, section: run(q, k, cos, sin, split_a, split_b)
    return lambda q, k, cos, sin, section: run(q, k, _streams_table(cos), _streams_table(sin), split_a, split_b)


_CALLS = Public(OP, _check, _body, _fast)
_CALLS_M = Public(OP, _check_m, _body_m, _fast_m)
_CALLS_AT = Public(OP, _check_at, _body_at, values=_values_at)  # calls with position_ids: a path of their own
