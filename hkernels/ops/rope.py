"""Rotary position embedding (Hugging Face's rotate_half convention) in Helion (the twin of
``triton_fallback/rope.py``).

Math, per head row x of D elements, x1 = x[:D/2], x2 = x[D/2:], and the same halves c1, c2 of cos and s1, s2 of sin
at the row's (batch, position):
    forward   y1 = x1·c1 − x2·s1,   y2 = x2·c2 + x1·s2      (= x·cos + rotate_half(x)·sin)
    backward  dx1 = dy1·c1 + dy2·s2,  dx2 = dy2·c2 − dy1·s1  (the transposed map)
The backward is the forward with (s1, s2) replaced by (−s2, −s1): one kernel serves both, a constexpr picks.

Shapes: q [B, Hq, S, D], k [B, Hk, S, D] (any strides with unit stride along D, e.g. transposed views of
[B, S, H, D] projections), cos and sin [Bc, S, D] contiguous with Bc = 1 (shared by the batch) or B.
Bytes for T = B·S tokens of b-byte elements: reads and writes T·(Hq + Hk)·D·b each, plus the tables from memory
once (2·T·D·bc bytes when Bc = B; one [S, D] pair when shared by the batch). A program is a block of tokens × a
block of heads of q or of k, each tensor with its own block shape (k has fewer heads: 8 in Llama-3), so that
both load 16-byte vectors. Each program reads its tokens' cos/sin; the other programs of those tokens re-read them
from L2 (Llama-3 8B, float32 tables: 2 KB of table reads per token beside 20 KB of q and k traffic).

Multimodal rope (three position streams, ``rope_mrope_fwd`` / ``_bwd``) selects each table's elements from their
streams first (``hkernels.functional.rope.mrope_select``, PyTorch ops) and rotates with the same kernel: Helion 1.5
has no per-column choice of the row a load reads (Triton's twin reads each element from its stream).

The kernel sees every tensor as [B, H, S, 2, D/2] views (the two halves as an index), the tables expanded to
[B, S, 2, D/2] (stride 0 along B when shared) and outputs allocated by the host: so the host may swap the roles
of B and S (a view of all of them), and blocks of positions fill up also when S = 1 and B is large.
"""

from __future__ import annotations

from collections.abc import Callable

import helion
import helion.language as hl
import torch

from hkernels.functional.rope import mrope_select
from hkernels.ops import _helion
from hkernels.runtime import plan as _plan
from hkernels.runtime.launch import bound_launcher

Tensor = torch.Tensor
_INT32_LIMIT = 2**31 - 1
# traced at a symbolic length (see hkernels/ops/rms_norm.py): the config and the block shapes follow from the head
# counts and D; a symbolic token count takes the bucket of many tokens
SYMBOLIC = frozenset({"rope_fwd", "rope_bwd", "rope_mrope_fwd", "rope_mrope_bwd"})
_MANY_TOKENS = 1 << 20


@helion.kernel(static_shapes=False)
def _rope(
    q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, q_out: Tensor, k_out: Tensor, backward: hl.constexpr
) -> None:
    # q, q_out: [B, Hq, S, 2, D/2]; k, k_out: [B, Hk, S, 2, D/2]; cos, sin: [B, S, 2, D/2].
    # Two loops, one launch (Helion gives each loop its own programs): a program rotates a block of positions ×
    # a block of heads of q, or of k, reading the positions' cos and sin and its rows once, writing its rows once.
    # Each tensor gets its own block shape (k has fewer heads: Hk = 8 in Llama-3), and no program loops, so all
    # its loads are in flight together. The tables are re-read by each head block of a position: from L2.
    b, hq, s, _, half = q.size()
    hk = k.size(1)
    half = hl.specialize(half)
    for tile_b, tile_s, tile_h in hl.tile([b, s, hq], block_size=[1, None, None]):
        c1 = cos[tile_b, tile_s, 0, :].to(torch.float32)[:, None, :, :]
        c2 = cos[tile_b, tile_s, 1, :].to(torch.float32)[:, None, :, :]
        if backward:  # the transposed map: (s1, s2) -> (-s2, -s1)
            s1 = -sin[tile_b, tile_s, 1, :].to(torch.float32)[:, None, :, :]
            s2 = -sin[tile_b, tile_s, 0, :].to(torch.float32)[:, None, :, :]
        else:
            s1 = sin[tile_b, tile_s, 0, :].to(torch.float32)[:, None, :, :]
            s2 = sin[tile_b, tile_s, 1, :].to(torch.float32)[:, None, :, :]
        x1 = q[tile_b, tile_h, tile_s, 0, :].to(torch.float32)
        x2 = q[tile_b, tile_h, tile_s, 1, :].to(torch.float32)
        q_out[tile_b, tile_h, tile_s, 0, :] = (x1 * c1 - x2 * s1).to(q_out.dtype)
        q_out[tile_b, tile_h, tile_s, 1, :] = (x2 * c2 + x1 * s2).to(q_out.dtype)
    for tile_b, tile_s, tile_h in hl.tile([b, s, hk], block_size=[1, None, None]):
        c1 = cos[tile_b, tile_s, 0, :].to(torch.float32)[:, None, :, :]
        c2 = cos[tile_b, tile_s, 1, :].to(torch.float32)[:, None, :, :]
        if backward:  # the transposed map: (s1, s2) -> (-s2, -s1)
            s1 = -sin[tile_b, tile_s, 1, :].to(torch.float32)[:, None, :, :]
            s2 = -sin[tile_b, tile_s, 0, :].to(torch.float32)[:, None, :, :]
        else:
            s1 = sin[tile_b, tile_s, 0, :].to(torch.float32)[:, None, :, :]
            s2 = sin[tile_b, tile_s, 1, :].to(torch.float32)[:, None, :, :]
        x1 = k[tile_b, tile_h, tile_s, 0, :].to(torch.float32)
        x2 = k[tile_b, tile_h, tile_s, 1, :].to(torch.float32)
        k_out[tile_b, tile_h, tile_s, 0, :] = (x1 * c1 - x2 * s1).to(k_out.dtype)
        k_out[tile_b, tile_h, tile_s, 1, :] = (x2 * c2 + x1 * s2).to(k_out.dtype)


def _max_offset(x: Tensor) -> int:
    return sum((n - 1) * st for n, st in zip(x.shape, x.stride(), strict=True) if n > 0)


def _stride_kind(st: int) -> int:
    return st if st in (0, 1) else 2


# Compiled kernels by a key at least as fine as Helion's own specialisation (dtypes, sizes bucketed 0/1/many,
# element counts past int32, D, strides that are 0 or 1, the direction, the config): a call whose key was seen
# skips Helion's bind(), whose guard checks over six 5-D tensors cost a few hundred µs per call.
_COMPILED: dict[tuple[object, ...], Callable[..., None]] = {}


def _blocks(config: helion.Config, q5: Tensor, k5: Tensor) -> list[int]:
    """The config's block sizes, each over a dim of size 1 made 1: Helion 1.5.0 takes a dim of size 1 for a
    broadcast and drops its mask and stride from the stores, so every lane of a larger block over it would write the
    one row (one position; one head of k, as in multi-query attention). (A symbolic size is at least 2.)"""
    sizes = [q5.shape[2], q5.shape[1], k5.shape[2], k5.shape[1]]
    return [1 if size == 1 else block for size, block in zip(sizes, config.block_sizes, strict=True)]


def _compiled_for(args: tuple[object, ...], n: int, device: torch.device) -> Callable[..., None]:
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if _plan.TRACING:  # (Helion's bindings for a graph: on stand-ins, and at a symbolic length for every length)
        n = n if isinstance(n, int) else _MANY_TOKENS
        config = _helion.config_for("_rope", n, device, tensors[0].dtype)
        return _helion.compiled(_rope, args, n, device, tuple(_blocks(config, tensors[0], tensors[1])))
    config = _helion.config_for("_rope", n, device, tensors[0].dtype)
    key = (args[-1], device, config, *(
        (t.dtype, tuple(min(d, 2) for d in t.shape), t.numel() > _INT32_LIMIT, t.shape[-1],
         tuple(_stride_kind(st) for st in t.stride()))
        for t in tensors
    ))
    fn = _COMPILED.get(key)
    if fn is None:
        config = helion.Config(**{**config.config, "block_sizes": _blocks(config, tensors[0], tensors[1])})
        with _helion.COMPILING:
            bound = _rope.bind(args)
            fn = bound.compile_config(_helion._fit(config, bound.config_spec.default_config()), allow_print=False)
        _COMPILED[key] = fn
    return fn


def _bind(x_q: Tensor, x_k: Tensor, cos: Tensor, sin: Tensor, backward: bool
          ) -> Callable[[Tensor, Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]:
    """The rotation for arguments of this signature: its views, copies and compiled function found once;
    ``run(x_q, x_k, cos, sin)``."""
    B, Hq, S, D = x_q.shape
    D = int(D)  # (the kernel specialises on D / 2: a constant of a graph with every size symbolic)
    Hk = x_k.shape[1]
    assert D % 2 == 0 and x_k.shape == (B, Hk, S, D) and x_q.stride(3) == 1 and x_k.stride(3) == 1
    assert cos.shape == sin.shape and cos.shape[0] in (1, B) and cos.shape[1:] == (S, D)
    dq, dk, device = x_q.dtype, x_k.dtype, x_q.device
    T = B * S
    if T == 0:
        def empty(x_q: Tensor, x_k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
            return (torch.empty((B, Hq, S, D), dtype=dq, device=device),
                    torch.empty((B, Hk, S, D), dtype=dk, device=device))
        return empty
    # Helion picks 32-bit offsets from element counts; a view into a larger buffer (q sliced out of a fused qkv
    # projection) can reach past 2^31 with fewer elements: such an input is copied first.
    copy_q = _max_offset(x_q) > _INT32_LIMIT and x_q.numel() <= _INT32_LIMIT
    copy_k = _max_offset(x_k) > _INT32_LIMIT and x_k.numel() <= _INT32_LIMIT
    half = D // 2
    # Head dim 2: Helion 1.5.0's code for halves of one element does not compile when Triton also specialises
    # every other size to 1 (it stores a [1, 1, 1, 1] block reshaped to a scalar). Each half is seen as two lanes
    # over one element (stride 0): they load it twice and store one value twice.
    lanes = 2 if half == 1 else half
    # The kernel blocks positions, not batches: with fewer positions than batches (decoding: S = 1) the two swap
    # roles, a view of every tensor (outputs included, which keep their contiguous [B, H, S, D] layout). A graph
    # with symbolic sizes never swaps (a speed choice: no guard on the length for it).
    swap = type(S) is int and type(B) is int and S < B

    def views(x_q: Tensor, x_k: Tensor, cos: Tensor, sin: Tensor, qo: Tensor, ko: Tensor) -> tuple[object, ...]:
        if copy_q:
            x_q = x_q.contiguous()
        if copy_k:
            x_k = x_k.contiguous()
        q5, k5, qo5, ko5 = (t.view(*t.shape[:3], 2, half) for t in (x_q, x_k, qo, ko))
        c4, s4 = (t.contiguous().view(t.shape[0], S, 2, half).expand(B, S, 2, half) for t in (cos, sin))
        if lanes != half:
            q5, k5, qo5, ko5, c4, s4 = (t.expand(*t.shape[:-1], lanes) for t in (q5, k5, qo5, ko5, c4, s4))
        if swap:
            q5, k5, qo5, ko5 = (t.transpose(0, 2) for t in (q5, k5, qo5, ko5))
            c4, s4 = c4.transpose(0, 1), s4.transpose(0, 1)
        return q5, k5, c4, s4, qo5, ko5, backward

    qo = torch.empty((B, Hq, S, D), dtype=dq, device=device)
    ko = torch.empty((B, Hk, S, D), dtype=dk, device=device)
    fn = _compiled_for(views(x_q, x_k, cos, sin, qo, ko), T, device)
    launcher = bound_launcher()

    def run(x_q: Tensor, x_k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        qo = torch.empty((B, Hq, S, D), dtype=dq, device=device)
        ko = torch.empty((B, Hk, S, D), dtype=dk, device=device)
        fn(*views(x_q, x_k, cos, sin, qo, ko), _launcher=launcher)
        return qo, ko
    return run


def rope_fwd(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """q: [B, Hq, S, D], k: [B, Hk, S, D] (unit stride along D), cos, sin: [1 or B, S, D] -> (q_rot, k_rot),
    contiguous, in q's and k's dtype."""
    return _bind(q, k, cos, sin, False)(q, k, cos, sin)


def rope_bwd(dq_rot: Tensor, dk_rot: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """dq_rot: [B, Hq, S, D], dk_rot: [B, Hk, S, D] (unit stride along D), cos, sin: [1 or B, S, D] -> (dq, dk),
    contiguous, in dq_rot's and dk_rot's dtype."""
    return _bind(dq_rot, dk_rot, cos, sin, True)(dq_rot, dk_rot, cos, sin)


# Binders (see hkernels/runtime/plan.py): the same function for every call of one signature, set up once.
rope_fwd.bind = lambda q, k, cos, sin: _bind(q, k, cos, sin, False)  # type: ignore[attr-defined]
rope_bwd.bind = lambda dq, dk, cos, sin: _bind(dq, dk, cos, sin, True)  # type: ignore[attr-defined]


def _bind_mrope(x_q: Tensor, x_k: Tensor, cos: Tensor, sin: Tensor, split_a: int, split_b: int, backward: bool
                ) -> Callable[..., tuple[Tensor, Tensor]]:
    """Multimodal rope for arguments of this signature: ``run(x_q, x_k, cos, sin, split_a, split_b)``, the three
    streams' tables [3, Bc, S, D] selected, then rotated."""
    run = _bind(x_q, x_k, mrope_select(cos, split_a, split_b), mrope_select(sin, split_a, split_b), backward)

    def run_mrope(x_q: Tensor, x_k: Tensor, cos: Tensor, sin: Tensor, split_a: int, split_b: int
                  ) -> tuple[Tensor, Tensor]:
        return run(x_q, x_k, mrope_select(cos, split_a, split_b), mrope_select(sin, split_a, split_b))
    return run_mrope


def rope_mrope_fwd(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, split_a: int, split_b: int
                   ) -> tuple[Tensor, Tensor]:
    """q, k as :func:`rope_fwd`'s; cos, sin: [3, 1 or B, S, D] contiguous, three streams (columns [0, split_a) of
    each half of the head dim from stream 0, [split_a, split_b) from stream 1, the rest from stream 2)."""
    return _bind_mrope(q, k, cos, sin, split_a, split_b, False)(q, k, cos, sin, split_a, split_b)


def rope_mrope_bwd(dq_rot: Tensor, dk_rot: Tensor, cos: Tensor, sin: Tensor, split_a: int, split_b: int
                   ) -> tuple[Tensor, Tensor]:
    """The transposed rotation of the upstream gradients, with three streams' tables."""
    return _bind_mrope(dq_rot, dk_rot, cos, sin, split_a, split_b, True)(dq_rot, dk_rot, cos, sin, split_a, split_b)


rope_mrope_fwd.bind = lambda q, k, cos, sin, a, b: _bind_mrope(q, k, cos, sin, a, b, False)  # type: ignore[attr-defined]
rope_mrope_bwd.bind = lambda dq, dk, cos, sin, a, b: _bind_mrope(dq, dk, cos, sin, a, b, True)  # type: ignore[attr-defined]
