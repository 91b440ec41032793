"""Rotary position embedding (Hugging Face's rotate_half convention) in hand-written Triton: the twin of
``hkernels/ops/rope.py``, whose docstring gives the math, the shapes and the bytes moved.

A program is a block of tokens × a block of heads of q or of k, each tensor with its own block shape (``_tile_shape``),
and reads its tokens' cos/sin; the other programs of those tokens re-read them from L2.

Multimodal rope (``rope_mrope_fwd`` / ``_bwd``: three streams' tables [3, Bc, S, D], Qwen2-VL's and Qwen2.5-VL's
sections) is the same kernel reading each table element from its stream: column d of each half of the head dim
from stream 0 below SPLIT_A, stream 1 below SPLIT_B, stream 2 above, a per-column offset of the table pointer, so
it reads what rope reads (no selected tables made first).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl

from hkernels.runtime.device import cdiv, memo, next_pow2, num_sms
from hkernels.runtime.interpret import interpreting
from hkernels.runtime.launch import Bound
from triton_fallback._common import searching, tuned_settings

# The custom ops whose launches these host functions record at a symbolic length (see triton_fallback/rms_norm.py).
SYMBOLIC = frozenset({"rope_fwd", "rope_bwd", "rope_mrope_fwd", "rope_mrope_bwd"})

Tensor = torch.Tensor


@triton.jit
def _rope_tile(
    x_ptr, y_ptr, cos_ptr, sin_ptr,  # x [B, H, S, D] (unit stride along D); y its contiguous output; cos, sin
    pid, T, S, H, stride_xb, stride_xh, stride_xs, stride_cb,
    stride_stream,  # multimodal rope: elements per stream of the tables (unused otherwise)
    HALF: tl.constexpr, BACKWARD: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
    SPLIT_A: tl.constexpr, SPLIT_B: tl.constexpr,  # multimodal rope's stream boundaries; SPLIT_A = 0: plain rope
):
    # Tile pid = (token block, head block), head blocks fastest (neighbours share the tokens' cos/sin in cache):
    # reads BLOCK_S tokens' cos and sin and the tile's rows of x once, writes the rows of y once. No loop: every
    # load is issued before the first store (a store between them would keep later loads from moving up, since
    # x might alias y), so a program has all its bytes in flight. Tokens are flattened over (b, s), so S = 1
    # with many batches still fills a block.
    head_blocks = tl.cdiv(H, BLOCK_H)
    tok = (pid // head_blocks) * BLOCK_S + tl.arange(0, BLOCK_S)
    heads = (pid % head_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)
    tok_ok = tok < T
    tok64 = tok.to(tl.int64)
    b = tok64 // S
    s = tok64 - b * S
    cols = tl.arange(0, BLOCK_HALF)
    # With BLOCK_HALF == HALF the column mask is all true and constant along D: loads stay vectorised.
    col_ok = cols < (BLOCK_HALF if BLOCK_HALF == HALF else HALF)
    tab_mask = tok_ok[:, None] & col_ok[None, :]
    tab = (b * stride_cb + s * (2 * HALF))[:, None] + cols[None, :]
    if SPLIT_A > 0:  # column d (and d + HALF) reads stream 0, 1 or 2: the same stream in both halves
        stream = (cols >= SPLIT_A).to(tl.int64) + (cols >= SPLIT_B).to(tl.int64)
        tab = tab + (stream * stride_stream)[None, :]
    mask = (heads < H)[:, None, None] & tab_mask[None, :, :]
    heads64 = heads.to(tl.int64)
    x_off = (heads64 * stride_xh)[:, None, None] + (b * stride_xb + s * stride_xs)[None, :, None] + cols
    x1 = tl.load(x_ptr + x_off, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + x_off + HALF, mask=mask, other=0.0).to(tl.float32)
    c1 = tl.load(cos_ptr + tab, mask=tab_mask, other=0.0).to(tl.float32)[None, :, :]
    c2 = tl.load(cos_ptr + tab + HALF, mask=tab_mask, other=0.0).to(tl.float32)[None, :, :]
    s_lo = tl.load(sin_ptr + tab, mask=tab_mask, other=0.0).to(tl.float32)[None, :, :]
    s_hi = tl.load(sin_ptr + tab + HALF, mask=tab_mask, other=0.0).to(tl.float32)[None, :, :]
    if BACKWARD:  # the transposed map: (s1, s2) -> (-s2, -s1)
        s1 = -s_hi
        s2 = -s_lo
    else:
        s1 = s_lo
        s2 = s_hi
    # Contiguous output: row (b, h, s) starts at ((b·H + h)·S + s)·D.
    y_off = ((b * H * S + s) * (2 * HALF))[None, :, None] + (heads64 * S * (2 * HALF))[:, None, None] + cols
    ty = y_ptr.dtype.element_ty
    tl.store(y_ptr + y_off, (x1 * c1 - x2 * s1).to(ty), mask=mask)
    tl.store(y_ptr + y_off + HALF, (x2 * c2 + x1 * s2).to(ty), mask=mask)


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr, cos_ptr, sin_ptr,  # q [B, Hq, S, D], k [B, Hk, S, D] (unit stride along D); cos, sin [Bc, S, D]
    qo_ptr, ko_ptr,  # outputs, contiguous [B, Hq, S, D] and [B, Hk, S, D]
    T, S, Hq, Hk,  # T = B·S tokens
    stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks,
    stride_cb,  # 0 when the tables are shared by the batch (Bc = 1), else S·D
    stride_stream,  # multimodal rope (tables [3, Bc, S, D]): Bc·S·D, the elements of one stream
    HALF: tl.constexpr, BACKWARD: tl.constexpr, BLOCK_HALF: tl.constexpr,
    BLOCK_SQ: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_SK: tl.constexpr, BLOCK_HK: tl.constexpr,
    SPLIT_A: tl.constexpr, SPLIT_B: tl.constexpr,
):
    # One launch for both tensors: the first programs take tiles of q, the rest tiles of k, each with its own
    # block shape (k has fewer heads: Hk = 8 in Llama-3), so that both load full 16-byte vectors.
    pid = tl.program_id(0)
    q_tiles = tl.cdiv(T, BLOCK_SQ) * tl.cdiv(Hq, BLOCK_HQ)
    if pid < q_tiles:
        _rope_tile(q_ptr, qo_ptr, cos_ptr, sin_ptr, pid, T, S, Hq, stride_qb, stride_qh, stride_qs, stride_cb,
                   stride_stream, HALF, BACKWARD, BLOCK_SQ, BLOCK_HQ, BLOCK_HALF, SPLIT_A, SPLIT_B)
    else:
        _rope_tile(k_ptr, ko_ptr, cos_ptr, sin_ptr, pid - q_tiles, T, S, Hk, stride_kb, stride_kh, stride_ks,
                   stride_cb, stride_stream, HALF, BACKWARD, BLOCK_SK, BLOCK_HK, BLOCK_HALF, SPLIT_A, SPLIT_B)


# Elements of x per program (both halves) and warps: 2 KB of 16-bit data, 4 elements per thread per load; the best
# of the tune command's search over Llama-3 8B/70B heads (see bench/results/h200/README.md).
TILE_ELEMENTS = 1024
TILE_WARPS = 4


def _tile_shape(T: int, H: int, D: int, programs_wanted: int, elements: int = TILE_ELEMENTS) -> tuple[int, int]:
    """(BLOCK_S, BLOCK_H) of about ``elements`` elements for one tensor: all heads of a token block when they fit,
    fewer tokens and then fewer heads when the tensor would otherwise give fewer than ``programs_wanted`` tiles."""
    row = 2 * next_pow2(D // 2)
    block_h = min(next_pow2(H), max(1, elements // row))
    block_s = min(next_pow2(T), max(1, elements // (row * block_h)))
    while block_s > 1 and cdiv(T, block_s) * cdiv(H, block_h) < programs_wanted:
        block_s //= 2
    while block_h > 1 and cdiv(T, block_s) * cdiv(H, block_h) < programs_wanted:
        block_h //= 2
    return block_s, block_h


def _launch_settings(T: int, Hq: int, Hk: int, D: int, device: torch.device) -> tuple[int, ...]:
    """(BLOCK_SQ, BLOCK_HQ, BLOCK_SK, BLOCK_HK, num_warps) for T tokens; remembered, except while the tune command
    searches. A symbolic T (a compiled graph whose length varies) takes the full tiles: only the grid depends on
    it."""
    if type(T) is not int:
        T = 1 << 40
    if searching:
        return _settings(T, Hq, Hk, D, device)
    return _settings_memo(T, Hq, Hk, D, device)


@memo(4096)
def _settings_memo(T: int, Hq: int, Hk: int, D: int, device: torch.device) -> tuple[int, ...]:
    return _settings(T, Hq, Hk, D, device)


def _settings(T: int, Hq: int, Hk: int, D: int, device: torch.device) -> tuple[int, ...]:
    if interpreting():
        # The interpreter runs programs one after another: few, large ones run fastest.
        row = 2 * next_pow2(D // 2)
        hq, hk = next_pow2(Hq), next_pow2(Hk)
        s = min(next_pow2(T), max(1, 65536 // (row * hq)))
        return s, hq, s, hk, 4
    # Few tokens (decoding, short prompts): smaller tiles, so the GPU gets a few programs per multiprocessor.
    # The tile size and warps may come from python -m hkernels.tune (per head dim D, on this arch).
    tuned = tuned_settings("rope", D, device)
    elements, warps = (tuned["tile_elements"], tuned["num_warps"]) if tuned else (TILE_ELEMENTS, TILE_WARPS)
    wanted = 4 * num_sms(device)
    return (*_tile_shape(T, Hq, D, wanted * Hq // (Hq + Hk), elements),
            *_tile_shape(T, Hk, D, wanted * Hk // (Hq + Hk), elements), warps)


def _bind(x_q: Tensor, x_k: Tensor, cos: Tensor, sin: Tensor, backward: bool, splits: tuple[int, int] = (0, 0)
          ) -> Callable[..., Any]:
    """The rotation (or its transpose, ``backward``) for arguments of this signature: ``run(x_q, x_k, cos, sin) ->
    (q_out, k_out)``. With ``splits`` (multimodal rope's stream boundaries, see the module's docstring): cos and sin
    are three streams' tables [3, Bc, S, D]."""
    B, Hq, S, D = x_q.shape
    Hq, D, Hk = int(Hq), int(D), int(x_k.shape[1])  # (specialised where a graph made them symbolic)
    assert D % 2 == 0 and x_k.shape == (B, Hk, S, D) and x_q.stride(3) == 1 and x_k.stride(3) == 1
    streams = splits[0] > 0
    table = cos[0] if streams else cos  # [Bc, S, D]
    assert cos.shape == sin.shape and table.shape[0] in (1, B) and table.shape[1:] == (S, D)
    assert not streams or (cos.shape[0] == 3 and 0 < splits[0] < splits[1] < D // 2)
    qdtype, kdtype, device = x_q.dtype, x_k.dtype, x_q.device
    T = B * S
    tables_ok = cos.is_contiguous() and sin.is_contiguous()
    strides = (*x_q.stride()[:3], *x_k.stride()[:3], 0 if table.shape[0] == 1 else S * D,
               table.shape[0] * S * D if streams else 0)
    k = None
    if type(T) is not int or T:  # (a symbolic T is 2 or more)
        bsq, bhq, bsk, bhk, warps = _launch_settings(T, Hq, Hk, D, device)
        tiles = cdiv(T, bsq) * cdiv(Hq, bhq) + cdiv(T, bsk) * cdiv(Hk, bhk)
        k = Bound(_rope_kernel, (tiles,), HALF=D // 2, BACKWARD=backward, BLOCK_HALF=next_pow2(D // 2),
                  BLOCK_SQ=bsq, BLOCK_HQ=bhq, BLOCK_SK=bsk, BLOCK_HK=bhk, SPLIT_A=splits[0], SPLIT_B=splits[1],
                  num_warps=warps)

    def run(x_q: Tensor, x_k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        qo = torch.empty((B, Hq, S, D), dtype=qdtype, device=device)
        ko = torch.empty((B, Hk, S, D), dtype=kdtype, device=device)
        if k is not None:
            if not tables_ok:
                cos, sin = cos.contiguous(), sin.contiguous()
            k.go(x_q, x_k, cos, sin, qo, ko, T, S, Hq, Hk, *strides)
        return qo, ko
    return run


def rope_fwd(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """q: [B, Hq, S, D], k: [B, Hk, S, D] (unit stride along D), cos, sin: [1 or B, S, D] -> (q_rot, k_rot),
    contiguous, in q's and k's dtype."""
    return _bind(q, k, cos, sin, backward=False)(q, k, cos, sin)


def rope_bwd(dq_rot: Tensor, dk_rot: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """dq_rot: [B, Hq, S, D], dk_rot: [B, Hk, S, D] (unit stride along D), cos, sin: [1 or B, S, D] -> (dq, dk),
    contiguous, in dq_rot's and dk_rot's dtype."""
    return _bind(dq_rot, dk_rot, cos, sin, backward=True)(dq_rot, dk_rot, cos, sin)


# Binders (see hkernels/runtime/plan.py): the same function for every call of one signature, set up once.
rope_fwd.bind = lambda q, k, cos, sin: _bind(q, k, cos, sin, False)  # type: ignore[attr-defined]
rope_bwd.bind = lambda dq, dk, cos, sin: _bind(dq, dk, cos, sin, True)  # type: ignore[attr-defined]


def rope_mrope_fwd(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, split_a: int, split_b: int
                   ) -> tuple[Tensor, Tensor]:
    """q, k as :func:`rope_fwd`'s; cos, sin: [3, 1 or B, S, D], three streams (columns [0, split_a) of each half of
    the head dim from stream 0, [split_a, split_b) from stream 1, the rest from stream 2) -> (q_rot, k_rot)."""
    return _bind(q, k, cos, sin, False, (split_a, split_b))(q, k, cos, sin)


def rope_mrope_bwd(dq_rot: Tensor, dk_rot: Tensor, cos: Tensor, sin: Tensor, split_a: int, split_b: int
                   ) -> tuple[Tensor, Tensor]:
    """The transposed rotation of the upstream gradients, with three streams' tables."""
    return _bind(dq_rot, dk_rot, cos, sin, True, (split_a, split_b))(dq_rot, dk_rot, cos, sin)


def _bind_mrope(x_q: Tensor, x_k: Tensor, cos: Tensor, sin: Tensor, split_a: int, split_b: int, backward: bool
                ) -> Callable[..., Any]:
    run = _bind(x_q, x_k, cos, sin, backward, (split_a, split_b))
    return lambda x_q, x_k, cos, sin, split_a, split_b: run(x_q, x_k, cos, sin)


rope_mrope_fwd.bind = lambda q, k, cos, sin, a, b: _bind_mrope(q, k, cos, sin, a, b, False)  # type: ignore[attr-defined]
rope_mrope_bwd.bind = lambda dq, dk, cos, sin, a, b: _bind_mrope(dq, dk, cos, sin, a, b, True)  # type: ignore[attr-defined]
