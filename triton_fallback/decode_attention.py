"""Decode attention, split-K ("flash decoding"), in hand-written Triton: the twin of
``hkernels/ops/decode_attention.py``.

Math, per sequence b and query row (query head h, new token t at position pos = L_b − Sq + t):
    x_j = scale · q·k_j   (softcap c: x_j = c · tanh(scale · q·k_j / c)),   key j kept iff pos − left ≤ j ≤ pos
    o = Σ_j softmax(x)_j v_j over the kept keys;  none kept: o = 0.
Split-K: the cache of each (sequence, key/value head) is cut into NS chunks of CHUNK keys. One program takes one
chunk and every query row of its key/value head, G = Hq / Hk heads × Sq tokens packed as the rows of one tile (at
least 16, for tl.dot), and writes per row a float32 partial output o_s (normalised) and partial logsumexp lse_s
(base 2); the combine kernel then gives
    lse = log2 Σ_s 2^lse_s,   o = Σ_s 2^(lse_s − lse) · o_s.
A chunk wholly past L_b (or before every row's window) reads nothing: lse_s = −inf, o_s = 0. With one chunk the
first kernel writes o itself and no combine runs. Softmax in base 2 (log2 e folded into the scale), float32
accumulation; the softcap's tanh is 1 − 2 / (2^(2x·log2 e) + 1).

Shapes: q [B, Hq, Sq, D]; k, v [B, Hk, S_max, D], any strides with unit stride along D (transposed views of
[B, S_max, Hk, D] caches are read in place); cache_seqlens [B] int32 or int64, clamped to [0, S_max]; o [B, Hq, Sq,
D] contiguous in q's dtype; partials [B, Hq, Sq, NS, D] and [B, Hq, Sq, NS] float32, one allocation.

Work and traffic: 4·B·Hq·Sq·L·D flops against 2·B·Hk·L·D elements of K/V, each read once (rows past L_b and, with a
window, before it never): G·Sq flops per cache element, far below what the tensor cores could use, so the kernel
is bound by the cache's bytes and its speed is how many programs stream it at once. NS is chosen on the host from
B·Hk and S_max (L_b would need a host sync), for about three programs per multiprocessor: one sequence of 128k
tokens with 8 key/value heads runs 8 × 50 programs of 2.6k keys. The partials, B·Hq·Sq·NS·(D + 1) floats written
and read once, are a few hundred kB beside hundreds of MB of cache.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from hkernels.runtime.device import cdiv, next_pow2, num_sms
from hkernels.runtime.interpret import interpreting
from hkernels.runtime.launch import Bound

Tensor = torch.Tensor

LOG2E = 1.4426950408889634
HEAD_DIMS = (16, 32, 64, 128, 256)
# traced at a symbolic cache length (see triton_fallback/rms_norm.py): settings from D and the dtype, the count of
# splits from the programs alone there (see split_plan)
SYMBOLIC = frozenset({"decode_attention_fwd"})
MAX_SPLITS = 64  # the combine kernel holds [MAX_SPLITS, D] float32 partials of one row in registers


@triton.jit
def _dot(a, b, acc, DOT: tl.constexpr):
    # a·b (+ acc) with float32 accumulation; "ieee": float32 operands multiplied in float32 (no tf32)
    if DOT == "ieee":  # noqa: SIM108 (a constexpr branch: one side is compiled)
        out = tl.dot(a, b, acc, input_precision="ieee")
    else:
        out = tl.dot(a, b, acc)
    return out


@triton.jit
def _decode_attention_split_kernel(
    q, k, v,  # q [B, Hq, Sq, D], k/v [B, Hk, S_max, D]: unit stride along D
    seqlens,  # [B] int32 or int64: valid cache rows per sequence
    o_part, lse_part,  # SPLIT: [B, Hq, Sq, NS, D] and, from lse_part + LSE_OFF, [B, Hq, Sq, NS] float32 out; else
    # o_part is o [B, Hq, Sq, D]
    stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
    Hk, GROUP, SQ, S_MAX, NS, CHUNK, N_RB, LSE_OFF,  # N_RB: row blocks per key/value head (G·Sq > BLOCK_M)
    window_left, qk_scale, cap_in, cap_out,  # qk_scale: log2 e times the scale (1 with a softcap); cap_in = scale/c
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SOFTCAP: tl.constexpr, WINDOW: tl.constexpr, SPLIT: tl.constexpr, DOT: tl.constexpr,
):
    # float32 scalars (a compiled graph's launch types floats as float64)
    qk_scale = tl.cast(qk_scale, tl.float32)
    cap_in = tl.cast(cap_in, tl.float32)
    cap_out = tl.cast(cap_out, tl.float32)
    # One chunk of one (sequence, key/value head) against up to BLOCK_M of its G·Sq query rows: reads the rows' q
    # once and the chunk's K and V rows below L_b once each; writes each row's partial (or, unsplit, its output).
    pid = tl.program_id(0)
    split = tl.program_id(1)
    rb = pid % N_RB
    bh = pid // N_RB
    hk = bh % Hk
    b = bh // Hk
    L = tl.load(seqlens + b).to(tl.int32)
    L = tl.minimum(tl.maximum(L, 0), S_MAX)
    rows = rb * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < GROUP * SQ
    g = rows // SQ
    t = rows - g * SQ
    pos = L - SQ + t  # each row's position; it sees keys j <= pos (< L_b)
    h = hk * GROUP + g
    dims = tl.arange(0, HEAD_DIM)
    q_ptrs = (q + b.to(tl.int64) * stride_qb + h.to(tl.int64)[:, None] * stride_qh
              + t.to(tl.int64)[:, None] * stride_qs + dims[None, :])
    q_tile = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)

    lo = split * CHUNK
    hi = tl.minimum(lo + CHUNK, L)
    if WINDOW:  # keys before every row's window are never read
        lo = tl.maximum(lo, L - SQ - window_left)
    k_base = k + b.to(tl.int64) * stride_kb + hk.to(tl.int64) * stride_kh
    v_base = v + b.to(tl.int64) * stride_vb + hk.to(tl.int64) * stride_vh

    m_i = tl.full([BLOCK_M], -float("inf"), dtype=tl.float32)  # running max of the (capped) scores
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # running Σ 2^((x − m)·qk_scale)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        loaded = cols < hi  # rows at or past L_b are never read: they may hold anything
        k_tile = tl.load(k_base + cols.to(tl.int64)[:, None] * stride_ks + dims[None, :], mask=loaded[:, None],
                         other=0.0)
        s = _dot(q_tile, tl.trans(k_tile), None, DOT)
        if SOFTCAP:  # c·tanh(scale·s / c), tanh(x) = 1 − 2 / (e^2x + 1): ±1 at the extremes, never NaN
            e2x = tl.math.exp2(s * cap_in * 2.8853900817779268)
            s = (1.0 - 2.0 / (e2x + 1.0)) * cap_out
        keep = loaded[None, :] & (cols[None, :] <= pos[:, None])
        if WINDOW:
            keep = keep & (cols[None, :] >= pos[:, None] - window_left)
        s = tl.where(keep, s, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # The running max is of the unscaled scores: (s − m)·qk_scale is exactly 0 at a row's top score (p = 1),
        # which a fused s·qk_scale − m·qk_scale is not. Masked keys are selected away, never multiplied: a row
        # with no key yet has m = −inf, and (−inf) − (−inf) is NaN.
        p = tl.where(keep, tl.math.exp2((s - m_new[:, None]) * qk_scale), 0.0)
        # the rescale of what came before; NaN only while a row has seen no key (m = −inf): 0 then
        dm = (m_i - m_new) * qk_scale
        alpha = tl.math.exp2(tl.where(dm == dm, dm, -float("inf")))
        l_i = l_i * alpha + tl.sum(p, 1)
        v_tile = tl.load(v_base + cols.to(tl.int64)[:, None] * stride_vs + dims[None, :], mask=loaded[:, None],
                         other=0.0)
        acc = _dot(p.to(v_tile.dtype), v_tile, acc * alpha[:, None], DOT)
        m_i = m_new

    empty = l_i == 0.0  # no key kept (a NaN score keeps l NaN: the row stays NaN)
    out = tl.where(empty[:, None], 0.0, acc / l_i[:, None])
    row = (b * Hk * GROUP + h).to(tl.int64) * SQ + t  # flat (b, h, t)
    if SPLIT:
        lse = tl.where(empty, -float("inf"), m_i * qk_scale + tl.math.log2(l_i))
        tl.store(lse_part + LSE_OFF + row * NS + split, lse, mask=row_ok)
        tl.store(o_part + (row * NS + split)[:, None] * HEAD_DIM + dims[None, :], out, mask=row_ok[:, None])
    else:
        tl.store(o_part + row[:, None] * HEAD_DIM + dims[None, :], out.to(o_part.dtype.element_ty),
                 mask=row_ok[:, None])


@triton.jit
def _decode_attention_combine_kernel(
    o_part, lse_part,  # [R, NS, D] and, from lse_part + LSE_OFF, [R, NS] float32: R = B·Hq·Sq rows
    o,  # [R, D] out, q's dtype
    NS, LSE_OFF,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr,
):
    # One row: reads its NS partials once, writes its output once. o = Σ_s 2^(lse_s − m) o_s / Σ_s 2^(lse_s − m).
    row = tl.program_id(0).to(tl.int64)
    splits = tl.arange(0, BLOCK_S)
    dims = tl.arange(0, HEAD_DIM)
    lse = tl.load(lse_part + LSE_OFF + row * NS + splits, mask=splits < NS, other=-float("inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == -float("inf"), 0.0, m)  # every chunk empty: weights 0, output 0
    w = tl.math.exp2(lse - m)
    den = tl.sum(w, 0)
    parts = tl.load(o_part + (row * NS + splits)[:, None] * HEAD_DIM + dims[None, :],
                    mask=(splits < NS)[:, None], other=0.0)
    acc = tl.sum(parts * w[:, None], 0)
    out = tl.where(den == 0.0, 0.0, acc / den)
    tl.store(o + row * HEAD_DIM + dims, out.to(o.dtype.element_ty))


# ----------------------------------------------------------------------------------------------- host side


@dataclass(frozen=True)
class DecodeSettings:
    block_n: int  # cache rows per step
    max_rows: int  # query rows per tile, at most (more rows: another row block, which reads the chunk again)
    num_warps: int
    num_stages: int
    programs_per_sm: int  # the split count aims for this many programs per multiprocessor
    min_chunk: int  # cache rows per split, at least


def decode_attention_settings(head_dim: int, dtype: torch.dtype) -> DecodeSettings:
    """Launch settings of the split kernel.

    Interpreter (CPU): programs run one after another; chunks of one 16-row step and a stand-in of 4
    multiprocessors, so that a cache of a few dozen rows already takes several splits, a partial last step and
    the combine.

    sm_90 (bf16/fp16), from a sweep of steps (64, 128), stages (2-4), warps (4, 8) and programs per multiprocessor
    (2-4) and of the smallest chunk at Hq 32, Hk 8, D 128, one new token, caches of B × L from 1 × 1k to 64 × 1k and
    1 × 128k (bench/results/h200/README.md): 64 cache rows a step, 4 warps, 2 stages of K/V in flight (2 × 64 × D ×
    2 bytes a stage, 64 kB in all at D = 128, so three programs share a multiprocessor and one's start and end
    overlap the others' streaming), about three programs per multiprocessor, chunks of at least 128 rows (two steps:
    one sequence of 1k-8k keys is latency-bound, and shorter chains of steps over more splits win there). At D =
    256, 32 rows a step (not measured). A tile of up to 64 query rows (Llama's 4 heads per key/value head, 16
    speculative tokens). At D = 256 and in float32 (tests only: smaller steps) chunks of at least 256 rows.
    """
    if interpreting():
        return DecodeSettings(block_n=16, max_rows=32, num_warps=4, num_stages=1, programs_per_sm=2, min_chunk=16)
    if dtype == torch.float32:
        return DecodeSettings(block_n=32, max_rows=32, num_warps=4, num_stages=2, programs_per_sm=2, min_chunk=256)
    if head_dim >= 256:
        return DecodeSettings(block_n=32, max_rows=32, num_warps=4, num_stages=3, programs_per_sm=2, min_chunk=256)
    return DecodeSettings(block_n=64, max_rows=64, num_warps=4, num_stages=2, programs_per_sm=3, min_chunk=128)


def split_plan(programs: int, s_max: int, block_n: int, min_chunk: int, per_sm: int, device: torch.device
               ) -> tuple[int, int]:
    """(NS, CHUNK): ``programs`` programs per split (B·Hk·row blocks), so about ``per_sm`` programs per
    multiprocessor in all; chunks a multiple of ``block_n``, at least ``min_chunk`` rows, at most MAX_SPLITS of
    them. From S_max, not the lengths (reading those would sync the host); a symbolic S_max keeps NS constant."""
    want = cdiv(per_sm * num_sms(device), max(programs, 1)) if type(programs) is int else 1
    if type(s_max) is not int:
        # a symbolic cache length (a compiled graph's, growing a row a step): a count of splits from the programs
        # alone, each a chunk of the length's share (splits that start past it find no key, as past a short
        # sequence), so that no launch setting follows the length
        ns = max(1, min(want, MAX_SPLITS))
        return ns, cdiv(cdiv(s_max, ns), block_n) * block_n
    ns = max(1, min(want, cdiv(s_max, max(min_chunk, block_n)), MAX_SPLITS))
    chunk = cdiv(cdiv(s_max, ns), block_n) * block_n
    return cdiv(s_max, chunk), chunk


def _check(q: Tensor, k: Tensor, v: Tensor, cache_seqlens: Tensor) -> tuple[int, int, int, int, int, int]:
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape:
        raise ValueError(f"decode_attention: q [B, Hq, Sq, D], k and v [B, Hk, S_max, D]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    B, Hq, Sq, D = q.shape
    Hk, S = k.shape[1], k.shape[2]
    if k.shape[0] != B or k.shape[3] != D or Hk == 0 or Hq % Hk:
        raise ValueError(f"decode_attention: k/v {tuple(k.shape)} do not fit q {tuple(q.shape)} (Hq a multiple of "
                         "Hk)")
    if D not in HEAD_DIMS:
        raise ValueError(f"decode_attention: head dim {D} not supported (one of {HEAD_DIMS})")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"decode_attention: q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("decode_attention: q, k, v need unit stride along D")
    if cache_seqlens.shape != (B,) or cache_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"decode_attention: cache_seqlens must be [B] int32/int64, got {cache_seqlens.dtype} "
                         f"{tuple(cache_seqlens.shape)}")
    return B, Hq, Hk, Sq, S, D


def decode_attention_fwd(q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Tensor, scale: float,
                         window_left: int, softcap: float) -> Tensor:
    """q [B, Hq, Sq, D], k_cache/v_cache [B, Hk, S_max, D] (unit stride along D), cache_seqlens [B] int32/int64 on
    q's device; window_left < 0: no window; softcap 0: none -> o [B, Hq, Sq, D] contiguous in q's dtype."""
    return _bind(q, k_cache, v_cache, cache_seqlens, scale, window_left, softcap)(
        q, k_cache, v_cache, cache_seqlens, scale, window_left, softcap)


def _bind(q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Tensor, scale: float, window_left: int,
          softcap: float) -> Callable[..., Tensor]:
    """decode_attention_fwd for every call of this signature (shapes, strides, dtypes, the options' values): the
    checks, the split plan and both launches' settings found once; a call allocates and launches."""
    B, Hq, Hk, Sq, S, D = _check(q, k_cache, v_cache, cache_seqlens)
    dtype, device = q.dtype, q.device
    if B * Hq * Sq * D == 0 or S == 0:
        # nothing to compute; no cache: no query sees a key
        return lambda q, *_: torch.zeros((B, Hq, Sq, D), dtype=dtype, device=device)
    flip = softcap == 0.0 and scale < 0  # the running max is of unscaled scores: (−q, −scale) gives the same scores
    scale = -scale if flip else scale
    st = decode_attention_settings(D, dtype)
    G = Hq // Hk
    block_m = max(16, next_pow2(min(G * Sq, st.max_rows)))
    n_rb = cdiv(G * Sq, block_m)
    ns, chunk = split_plan(B * Hk * n_rb, S, st.block_n, st.min_chunk, st.programs_per_sm, device)
    if softcap > 0.0:
        qk_scale, cap_in, cap_out = LOG2E, scale / softcap, softcap
    else:
        qk_scale, cap_in, cap_out = scale * LOG2E, 1.0, 1.0
    split = ns > 1
    q_strides = (-q if flip else q).stride()[:3]  # (a negated view with gaps comes out dense)
    strides = (*q_strides, *k_cache.stride()[:3], *v_cache.stride()[:3])
    # the partials: o's [B, Hq, Sq, NS, D] then lse's [B, Hq, Sq, NS], float32, in one allocation
    lse_off = B * Hq * Sq * ns * D
    parts = lse_off + B * Hq * Sq * ns
    rest = (Hk, G, Sq, S, ns, chunk, n_rb, lse_off if ns > 1 else 0, max(window_left, 0), qk_scale, cap_in, cap_out)
    attend = Bound(_decode_attention_split_kernel, (B * Hk * n_rb, ns), HEAD_DIM=D, BLOCK_M=block_m,
                   BLOCK_N=st.block_n, SOFTCAP=softcap > 0.0, WINDOW=window_left >= 0, SPLIT=split,
                   DOT="ieee" if dtype == torch.float32 else "native", num_warps=st.num_warps,
                   num_stages=st.num_stages)
    combine = Bound(_decode_attention_combine_kernel, (B * Hq * Sq,), HEAD_DIM=D, BLOCK_S=max(2, next_pow2(ns)),
                    num_warps=4 if D <= 128 else 8)

    def run(q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Tensor, *_: object) -> Tensor:
        o = torch.empty((B, Hq, Sq, D), dtype=dtype, device=device)
        seqlens = cache_seqlens if cache_seqlens.stride(0) == 1 else cache_seqlens.contiguous()
        if flip:
            q = -q
        if not split:
            attend.go(q, k_cache, v_cache, seqlens, o, o, *strides, *rest)  # (the lse slot is unused)
            return o
        part = torch.empty(parts, dtype=torch.float32, device=device)
        attend.go(q, k_cache, v_cache, seqlens, part, part, *strides, *rest)
        combine.go(part, part, o, ns, lse_off)
        return o

    return run


# Binder (see hkernels/runtime/plan.py): the same function for every call of one signature, set up once.
decode_attention_fwd.bind = _bind  # type: ignore[attr-defined]
