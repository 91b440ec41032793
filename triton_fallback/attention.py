"""Flash attention, forward and backward, in hand-written Triton: the twin of ``hkernels/ops/attention.py``, whose
docstring gives the math, the shapes and the work and traffic of both directions.

Specific to these kernels:
- D in 16, 32, 64, 128. o comes out contiguous [B, Hq, S, D], lse [B, Hq, S] float32 (natural log); inside, each
  exponential is one exp2 (log2 e folded into the scale).
- Forward: causal blocks are split into those left of the diagonal (no mask) and the diagonal blocks (masked); a
  non-causal Skv that is not a multiple of BLOCK_N gets one masked tail block; query blocks of a causal head run
  longest first.
- Backward (FA2): (1) delta = rowsum(do·o) per query row (prescaled by ``scale``); (2) a program per (kv block, kv
  head) holds its K/V tile and dk, dv accumulators in registers and walks the query blocks of every query head of
  its group; (3) dq by a separate kernel over query blocks (7 matmuls per tile, bitwise deterministic: the
  default), or, as a launch option, by float32 atomics from the same walk into a zeroed [B, Hq, S, D] buffer (5
  matmuls per tile; the summation order is not fixed, so dq may differ in the last bits from run to run; smaller
  dk/dv tiles at D = 128). dk and dv are deterministic either way.
- Loads go through TMA descriptors (4-D [B, H, S, D], boxes of [1, 1, rows, D], out-of-range rows read as zeros)
  when every tensor is 16-byte aligned, else through masked pointer loads. Rows past S or Skv read as zeros:
  their scores are finite, and masks or a lse of +inf keep them out of every stored result.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from triton_fallback._common import cdiv, interpreting
from triton_fallback._launch import launch

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # older triton: pointer loads only
    TensorDescriptor = None

Tensor = torch.Tensor

LOG2E = 1.4426950408889634
HEAD_DIMS = (16, 32, 64, 128)


# ----------------------------------------------------------------------------------------------- tile access


@triton.jit
def _load_tile(
    t,  # [B, H, rows, D] tensor (TMA descriptor, or pointer with unit stride along D)
    b, h, row0, n_rows, stride_b, stride_h, stride_s,
    BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, TMA: tl.constexpr,
):
    # Rows row0 .. row0+BLOCK of head (b, h) as [BLOCK, HEAD_DIM]; rows at or past n_rows read as zeros.
    if TMA:
        tile = t.load([b, h, row0, 0]).reshape(BLOCK, HEAD_DIM)
    else:
        base = t + tl.cast(b, tl.int64) * stride_b + tl.cast(h, tl.int64) * stride_h
        base += tl.cast(row0, tl.int64) * stride_s
        rows = tl.arange(0, BLOCK)
        ptrs = base + rows[:, None] * stride_s + tl.arange(0, HEAD_DIM)[None, :]
        tile = tl.load(ptrs, mask=(row0 + rows < n_rows)[:, None], other=0.0)
    return tile


@triton.jit
def _store_tile(
    t, value,  # t: [B, H, rows, D] (TMA descriptor or pointer); value: [BLOCK, HEAD_DIM] in t's dtype
    b, h, row0, n_rows, stride_b, stride_h, stride_s,
    BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, TMA: tl.constexpr,
):
    # Rows at or past n_rows are dropped (TMA clips them at the tensor's bound).
    if TMA:
        t.store([b, h, row0, 0], value.reshape(1, 1, BLOCK, HEAD_DIM))
    else:
        base = t + tl.cast(b, tl.int64) * stride_b + tl.cast(h, tl.int64) * stride_h
        base += tl.cast(row0, tl.int64) * stride_s
        rows = tl.arange(0, BLOCK)
        ptrs = base + rows[:, None] * stride_s + tl.arange(0, HEAD_DIM)[None, :]
        tl.store(ptrs, value, mask=(row0 + rows < n_rows)[:, None])


@triton.jit
def _dot(a, b, acc, DOT: tl.constexpr):
    # a·b (+ acc) with float32 accumulation. DOT: "native" (16-bit operands), "ieee" (float32 operands, no tf32),
    # "upcast" (bfloat16 operands widened to float32 first, exactly: triton 3.6's interpreter multiplies bfloat16
    # tiles as raw integers).
    if DOT == "ieee":
        out = tl.dot(a, b, acc, input_precision="ieee")
    elif DOT == "upcast":
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        out = tl.dot(a, b, acc)
    return out


# ----------------------------------------------------------------------------------------------- forward


@triton.jit
def _query_block(pid, S, Hq, GROUP, BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr):
    # The program's query block: (batch·head, batch, query head, kv head, first row). Blocks of a head are
    # neighbours in launch order (they share K/V in L2); causal ones run longest (last) first.
    n_m = tl.cdiv(S, BLOCK_M)
    bh = pid // n_m
    pid_m = pid % n_m
    if CAUSAL:
        pid_m = n_m - 1 - pid_m
    h = bh % Hq
    return bh, bh // Hq, h, h // GROUP, pid_m * BLOCK_M


@triton.jit
def _attention_fwd_inner(
    acc, l_i, m_i, q_tile, rows,  # running output [BLOCK_M, D] f32, row sum, row max (base 2), q tile, row ids
    k, v, b, hk, lo, hi, Skv, qk_scale,
    stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    MASK: tl.constexpr, CAUSAL: tl.constexpr, SCALE_NONNEG: tl.constexpr, TMA: tl.constexpr,
    DOT: tl.constexpr,
):
    # Streams key blocks lo .. hi (reads each K and V row once). MASK: keep keys j < Skv (and j ≤ i if CAUSAL).
    # A row is never fully masked in the first block it sees (its key 0, or key lo ≤ i on the diagonal, is in),
    # so m_i is finite after the first block.
    # m_i is the running max of the raw scores (the min for a negative scale), and p = exp2((s − m)·qk_scale):
    # a row's top score gets p = 1 exactly. The fused form exp2(s·qk_scale − m·qk_scale) gives it exp2 of the
    # product's rounding error, up to ±1% at scores ~1e5 (|q| ~ 1e5): the bf16 p of the p·v matmul then differs
    # from the float32 l it is divided by, o = v_top misses by an ulp, and the backward's p·(dp − δ), exactly 0
    # there, becomes an ulp of dp times |q| in dk (far above PyTorch's own error).
    for n0 in range(lo, hi, BLOCK_N):
        k_tile = _load_tile(k, b, hk, n0, Skv, stride_kb, stride_kh, stride_ks, BLOCK_N, HEAD_DIM, TMA)
        s = _dot(q_tile, tl.trans(k_tile), None, DOT)
        if MASK:
            cols = n0 + tl.arange(0, BLOCK_N)
            keep = (cols < Skv)[None, :]
            if CAUSAL:
                keep = keep & (cols[None, :] <= rows[:, None])
            if SCALE_NONNEG:
                m_new = tl.maximum(m_i, tl.max(tl.where(keep, s, -float("inf")), 1))
            else:
                m_new = tl.minimum(m_i, tl.min(tl.where(keep, s, float("inf")), 1))
            # masked keys (zero rows past Skv score 0) may overflow exp2: selected away, never multiplied
            p = tl.where(keep, tl.math.exp2((s - m_new[:, None]) * qk_scale), 0.0)
        else:
            # full blocks: no select per score
            if SCALE_NONNEG:  # noqa: SIM108 (a constexpr branch: one side is compiled)
                m_new = tl.maximum(m_i, tl.max(s, 1))
            else:
                m_new = tl.minimum(m_i, tl.min(s, 1))
            p = tl.math.exp2((s - m_new[:, None]) * qk_scale)
        # the first block: m_i = ∓inf, whose product with a zero scale is NaN; alpha then rescales zeros
        d = (m_i - m_new) * qk_scale
        alpha = tl.math.exp2(tl.where(d == d, d, -float("inf")))
        l_i = l_i * alpha + tl.sum(p, 1)
        v_tile = _load_tile(v, b, hk, n0, Skv, stride_vb, stride_vh, stride_vs, BLOCK_N, HEAD_DIM, TMA)
        acc = _dot(p.to(v_tile.dtype), v_tile, acc * alpha[:, None], DOT)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attention_fwd_kernel(
    q, k, v, o,  # q [B, Hq, S, D], k/v [B, Hk, Skv, D], o [B, Hq, S, D] out: descriptors or pointers
    lse_ptr,  # [B, Hq, S] float32 out, contiguous
    stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
    stride_ob, stride_oh, stride_os,
    Hq, GROUP, S, Skv, qk_scale,  # qk_scale = scale·log2(e)
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, SCALE_NONNEG: tl.constexpr, TMA: tl.constexpr, DOT: tl.constexpr,
):
    # One query block of one head: reads its q rows once and its head's K/V once (up to the diagonal when
    # causal); writes its o rows and lse once. Query blocks of a head are neighbours in launch order (they
    # share K/V in L2); causal ones run longest (last) first, so the short ones fill the tail of the launch.
    bh, b, h, hk, m0 = _query_block(tl.program_id(0), S, Hq, GROUP, BLOCK_M, CAUSAL)
    rows = m0 + tl.arange(0, BLOCK_M)
    q_tile = _load_tile(q, b, h, m0, S, stride_qb, stride_qh, stride_qs, BLOCK_M, HEAD_DIM, TMA)

    if SCALE_NONNEG:  # the running max of the raw scores (the min for a negative scale)
        m_i = tl.full([BLOCK_M], -float("inf"), dtype=tl.float32)
    else:
        m_i = tl.full([BLOCK_M], float("inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    if CAUSAL:
        # Left of the diagonal (keys < m0; BLOCK_M is a multiple of BLOCK_N): every score is kept.
        acc, l_i, m_i = _attention_fwd_inner(
            acc, l_i, m_i, q_tile, rows, k, v, b, hk, 0, m0, Skv, qk_scale,
            stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
            BLOCK_N, HEAD_DIM, False, CAUSAL, SCALE_NONNEG, TMA, DOT,
        )
        # The diagonal blocks: key j ≤ query i.
        acc, l_i, m_i = _attention_fwd_inner(
            acc, l_i, m_i, q_tile, rows, k, v, b, hk, m0, tl.minimum(m0 + BLOCK_M, Skv), Skv, qk_scale,
            stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
            BLOCK_N, HEAD_DIM, True, CAUSAL, SCALE_NONNEG, TMA, DOT,
        )
    else:
        n_full = (Skv // BLOCK_N) * BLOCK_N
        acc, l_i, m_i = _attention_fwd_inner(
            acc, l_i, m_i, q_tile, rows, k, v, b, hk, 0, n_full, Skv, qk_scale,
            stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
            BLOCK_N, HEAD_DIM, False, CAUSAL, SCALE_NONNEG, TMA, DOT,
        )
        # The partial last key block, if any (0 or 1 iteration).
        acc, l_i, m_i = _attention_fwd_inner(
            acc, l_i, m_i, q_tile, rows, k, v, b, hk, n_full, Skv, Skv, qk_scale,
            stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
            BLOCK_N, HEAD_DIM, True, CAUSAL, SCALE_NONNEG, TMA, DOT,
        )
    out = (acc / l_i[:, None]).to(q_tile.dtype)  # o has q's dtype
    _store_tile(o, out, b, h, m0, S, stride_ob, stride_oh, stride_os, BLOCK_M, HEAD_DIM, TMA)
    lse = (m_i * qk_scale + tl.math.log2(l_i)) * 0.6931471805599453  # back to the natural log
    tl.store(lse_ptr + bh.to(tl.int64) * S + rows, lse, mask=rows < S)


# ----------------------------------------------------------------------------------------------- backward


@triton.jit
def _attention_bwd_delta_kernel(
    o, do,  # [B, Hq, S, D] pointers, unit stride along D
    delta_ptr,  # [B, Hq, S] float32 out: scale · rowsum(do·o)
    stride_ob, stride_oh, stride_os, stride_db, stride_dh, stride_ds,
    Hq, S, scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
):
    # Reads BLOCK_M rows of o and do once, writes BLOCK_M floats.
    pid = tl.program_id(0)
    n_m = tl.cdiv(S, BLOCK_M)
    bh = pid // n_m
    m0 = (pid % n_m) * BLOCK_M
    b = bh // Hq
    h = bh % Hq
    o_tile = _load_tile(o, b, h, m0, S, stride_ob, stride_oh, stride_os, BLOCK_M, HEAD_DIM, False)
    do_tile = _load_tile(do, b, h, m0, S, stride_db, stride_dh, stride_ds, BLOCK_M, HEAD_DIM, False)
    delta = tl.sum(o_tile.to(tl.float32) * do_tile.to(tl.float32), 1) * scale
    rows = m0 + tl.arange(0, BLOCK_M)
    tl.store(delta_ptr + bh.to(tl.int64) * S + rows, delta, mask=rows < S)


@triton.jit
def _attention_bwd_dkdv_inner(
    dk, dv, k_tile, v_tile,  # dk, dv [BLOCK_N, D] float32 accumulators; this program's K and V tiles
    q, do, lse_ptr, delta_ptr, dq_ptr,
    b, hk, GROUP, Hq, n0, lo, n_steps, shift, S, Skv, qk_scale, scale,
    stride_qb, stride_qh, stride_qs, stride_db, stride_dh, stride_ds,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    MASK: tl.constexpr, CAUSAL: tl.constexpr, DQ_ATOMIC: tl.constexpr, TMA: tl.constexpr,
    DOT: tl.constexpr,
):
    # Walks n_steps query blocks from row lo, for each of the GROUP query heads of kv head hk, in one flat loop
    # (one software pipeline, no nested loop state). Within a head the blocks start at `shift`, so that programs
    # of one head start at different blocks and their dq atomics do not pile onto the same rows. Per block:
    # reads q, do (BLOCK_M rows), lse, delta; adds to dk, dv; with DQ_ATOMIC adds ds·k to the float32 dq rows.
    # Scores are computed transposed, sᵀ = k·qᵀ [BLOCK_N, BLOCK_M], so that dv += pᵀ·do and dk += dsᵀ·q need
    # no transposition. MASK: keep keys j < Skv (and j ≤ i if CAUSAL); without it, keys past Skv (zero rows of
    # k, v) still get finite p, whose dk, dv rows are never stored, and their zero k rows add 0 to dq.
    cols = n0 + tl.arange(0, BLOCK_N)
    for t in range(0, GROUP * n_steps):
        g = t // n_steps
        h = hk * GROUP + g
        m0 = lo + ((t - g * n_steps + shift) % n_steps) * BLOCK_M
        rows = m0 + tl.arange(0, BLOCK_M)
        row_off = (b * Hq + h).to(tl.int64) * S + rows  # into [B, Hq, S]
        q_tile = _load_tile(q, b, h, m0, S, stride_qb, stride_qh, stride_qs, BLOCK_M, HEAD_DIM, TMA)
        # Rows past S: lse = +inf makes their p zero.
        lse2 = tl.load(lse_ptr + row_off, mask=rows < S, other=float("inf")) * 1.4426950408889634
        s_t = _dot(k_tile, tl.trans(q_tile), None, DOT)
        p_t = tl.math.exp2(s_t * qk_scale - lse2[None, :])
        if MASK:
            keep = (cols < Skv)[:, None]
            if CAUSAL:
                keep = keep & (rows[None, :] >= cols[:, None])
            p_t = tl.where(keep, p_t, 0.0)
        do_tile = _load_tile(do, b, h, m0, S, stride_db, stride_dh, stride_ds, BLOCK_M, HEAD_DIM, TMA)
        dv = _dot(p_t.to(do_tile.dtype), do_tile, dv, DOT)
        delta = tl.load(delta_ptr + row_off, mask=rows < S, other=0.0)
        dp_t = _dot(v_tile, tl.trans(do_tile), None, DOT)
        # ds prescaled by `scale` (delta already is): dk and dq need no scaling afterwards.
        ds_t = (p_t * (dp_t * scale - delta[None, :])).to(q_tile.dtype)
        dk = _dot(ds_t, q_tile, dk, DOT)
        if DQ_ATOMIC:
            dq_part = _dot(tl.trans(ds_t), k_tile, None, DOT)
            ptrs = dq_ptr + row_off[:, None] * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :]
            tl.atomic_add(ptrs, dq_part, mask=(rows < S)[:, None], sem="relaxed")
    return dk, dv


@triton.jit
def _attention_bwd_dkdv_kernel(
    q, k, v, do, dk_out, dv_out,  # q, do [B, Hq, S, D]; k, v, dk_out, dv_out [B, Hk, Skv, D]
    lse_ptr, delta_ptr,  # [B, Hq, S] float32: lse (natural log), scale · rowsum(do·o)
    dq_ptr,  # [B, Hq, S, D] float32, contiguous, zeroed (used only with DQ_ATOMIC)
    stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
    stride_db, stride_dh, stride_ds, stride_gb, stride_gh, stride_gs,  # g: dk_out and dv_out (same layout)
    Hk, GROUP, S, Skv, qk_scale, scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, DQ_ATOMIC: tl.constexpr, TMA: tl.constexpr, DOT: tl.constexpr,
):
    # One key block of one kv head: reads its K/V rows once, the q/do rows of every query head of the group
    # that can see them, writes its dk, dv rows once. Key blocks of a head are neighbours in launch order (they
    # share q/do in L2); causal ones (only query rows i ≥ key block start see them) run longest (first) first.
    pid = tl.program_id(0)
    n_n = tl.cdiv(Skv, BLOCK_N)
    bhk = pid // n_n
    pid_n = pid % n_n
    b = bhk // Hk
    hk = bhk % Hk
    n0 = pid_n * BLOCK_N
    k_tile = _load_tile(k, b, hk, n0, Skv, stride_kb, stride_kh, stride_ks, BLOCK_N, HEAD_DIM, TMA)
    v_tile = _load_tile(v, b, hk, n0, Skv, stride_vb, stride_vh, stride_vs, BLOCK_N, HEAD_DIM, TMA)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    Hq = Hk * GROUP
    if CAUSAL:
        # The diagonal query blocks (BLOCK_N is a multiple of BLOCK_M): key j ≤ query i, j < Skv.
        n_diag = tl.cdiv(tl.minimum(n0 + BLOCK_N, S) - n0, BLOCK_M)
        dk, dv = _attention_bwd_dkdv_inner(
            dk, dv, k_tile, v_tile, q, do, lse_ptr, delta_ptr, dq_ptr,
            b, hk, GROUP, Hq, n0, n0, n_diag, 0, S, Skv, qk_scale, scale,
            stride_qb, stride_qh, stride_qs, stride_db, stride_dh, stride_ds,
            BLOCK_M, BLOCK_N, HEAD_DIM, True, CAUSAL, DQ_ATOMIC, TMA, DOT,
        )
        # Below the diagonal every score is kept (a key block reaching past Skv = S has nothing below).
        lo = n0 + BLOCK_N
        dk, dv = _attention_bwd_dkdv_inner(
            dk, dv, k_tile, v_tile, q, do, lse_ptr, delta_ptr, dq_ptr,
            b, hk, GROUP, Hq, n0, lo, tl.cdiv(tl.maximum(S - lo, 0), BLOCK_M), 0, S, Skv, qk_scale, scale,
            stride_qb, stride_qh, stride_qs, stride_db, stride_dh, stride_ds,
            BLOCK_M, BLOCK_N, HEAD_DIM, False, CAUSAL, DQ_ATOMIC, TMA, DOT,
        )
    else:
        n_m = tl.cdiv(S, BLOCK_M)
        if n0 + BLOCK_N <= Skv:
            dk, dv = _attention_bwd_dkdv_inner(
                dk, dv, k_tile, v_tile, q, do, lse_ptr, delta_ptr, dq_ptr,
                b, hk, GROUP, Hq, n0, 0, n_m, pid_n, S, Skv, qk_scale, scale,
                stride_qb, stride_qh, stride_qs, stride_db, stride_dh, stride_ds,
                BLOCK_M, BLOCK_N, HEAD_DIM, False, CAUSAL, DQ_ATOMIC, TMA, DOT,
            )
        else:
            # The partial last key block: keys past Skv are masked, so that a very negative lse cannot make
            # their p overflow (and 0·inf reach dq).
            dk, dv = _attention_bwd_dkdv_inner(
                dk, dv, k_tile, v_tile, q, do, lse_ptr, delta_ptr, dq_ptr,
                b, hk, GROUP, Hq, n0, 0, n_m, pid_n, S, Skv, qk_scale, scale,
                stride_qb, stride_qh, stride_qs, stride_db, stride_dh, stride_ds,
                BLOCK_M, BLOCK_N, HEAD_DIM, True, CAUSAL, DQ_ATOMIC, TMA, DOT,
            )
    _store_tile(dk_out, dk.to(k_tile.dtype), b, hk, n0, Skv, stride_gb, stride_gh, stride_gs,
                BLOCK_N, HEAD_DIM, TMA)
    _store_tile(dv_out, dv.to(v_tile.dtype), b, hk, n0, Skv, stride_gb, stride_gh, stride_gs,
                BLOCK_N, HEAD_DIM, TMA)


@triton.jit
def _attention_bwd_dq_inner(
    dq, q_tile, do_tile, lse2, delta, rows,  # dq [BLOCK_M, D] f32 accumulator; this block's q, do, lse·log2(e)
    k, v, b, hk, lo, hi, Skv, qk_scale, scale,
    stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, MASK: tl.constexpr, CAUSAL: tl.constexpr,
    TMA: tl.constexpr, DOT: tl.constexpr,
):
    # Streams key blocks lo .. hi (reads each K and V row once); MASK: keep keys j < Skv (and j ≤ i if CAUSAL).
    for n0 in range(lo, hi, BLOCK_N):
        k_tile = _load_tile(k, b, hk, n0, Skv, stride_kb, stride_kh, stride_ks, BLOCK_N, HEAD_DIM, TMA)
        v_tile = _load_tile(v, b, hk, n0, Skv, stride_vb, stride_vh, stride_vs, BLOCK_N, HEAD_DIM, TMA)
        s = _dot(q_tile, tl.trans(k_tile), None, DOT)
        p = tl.math.exp2(s * qk_scale - lse2[:, None])
        if MASK:
            cols = n0 + tl.arange(0, BLOCK_N)
            keep = (cols < Skv)[None, :]
            if CAUSAL:
                keep = keep & (cols[None, :] <= rows[:, None])
            p = tl.where(keep, p, 0.0)
        dp = _dot(do_tile, tl.trans(v_tile), None, DOT)
        ds = (p * (dp * scale - delta[:, None])).to(k_tile.dtype)
        dq = _dot(ds, k_tile, dq, DOT)
    return dq


@triton.jit
def _attention_bwd_dq_kernel(
    q, k, v, do, dq_out,  # q, do, dq_out [B, Hq, S, D]; k, v [B, Hk, Skv, D]
    lse_ptr, delta_ptr,  # [B, Hq, S] float32
    stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
    stride_db, stride_dh, stride_ds, stride_gb, stride_gh, stride_gs,  # g: dq_out
    Hq, GROUP, S, Skv, qk_scale, scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, TMA: tl.constexpr, DOT: tl.constexpr,
):
    # One query block of one head (the deterministic dq): reads its q, do rows once and its head's K/V once
    # (up to the diagonal when causal), writes its dq rows once. Launch order as in the forward.
    bh, b, h, hk, m0 = _query_block(tl.program_id(0), S, Hq, GROUP, BLOCK_M, CAUSAL)
    rows = m0 + tl.arange(0, BLOCK_M)
    q_tile = _load_tile(q, b, h, m0, S, stride_qb, stride_qh, stride_qs, BLOCK_M, HEAD_DIM, TMA)
    do_tile = _load_tile(do, b, h, m0, S, stride_db, stride_dh, stride_ds, BLOCK_M, HEAD_DIM, TMA)
    lse2 = tl.load(lse_ptr + bh.to(tl.int64) * S + rows, mask=rows < S, other=float("inf")) * 1.4426950408889634
    delta = tl.load(delta_ptr + bh.to(tl.int64) * S + rows, mask=rows < S, other=0.0)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    if CAUSAL:
        dq = _attention_bwd_dq_inner(
            dq, q_tile, do_tile, lse2, delta, rows, k, v, b, hk, 0, m0, Skv, qk_scale, scale,
            stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
            BLOCK_N, HEAD_DIM, False, CAUSAL, TMA, DOT,
        )
        dq = _attention_bwd_dq_inner(
            dq, q_tile, do_tile, lse2, delta, rows, k, v, b, hk, m0, tl.minimum(m0 + BLOCK_M, Skv), Skv,
            qk_scale, scale, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
            BLOCK_N, HEAD_DIM, True, CAUSAL, TMA, DOT,
        )
    else:
        n_full = (Skv // BLOCK_N) * BLOCK_N
        dq = _attention_bwd_dq_inner(
            dq, q_tile, do_tile, lse2, delta, rows, k, v, b, hk, 0, n_full, Skv, qk_scale, scale,
            stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
            BLOCK_N, HEAD_DIM, False, CAUSAL, TMA, DOT,
        )
        dq = _attention_bwd_dq_inner(
            dq, q_tile, do_tile, lse2, delta, rows, k, v, b, hk, n_full, Skv, Skv, qk_scale, scale,
            stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
            BLOCK_N, HEAD_DIM, True, CAUSAL, TMA, DOT,
        )
    _store_tile(dq_out, dq.to(q_tile.dtype), b, h, m0, S, stride_gb, stride_gh, stride_gs,
                BLOCK_M, HEAD_DIM, TMA)


# ----------------------------------------------------------------------------------------------- host side


@dataclass(frozen=True)
class AttentionSettings:
    block_m: int  # query rows per tile
    block_n: int  # key rows per tile
    num_warps: int
    num_stages: int
    tma: bool = True  # TMA descriptor loads where the tensors allow them (else masked pointer loads)
    dq_atomic: bool = False  # backward: dq by float32 atomics from the dk/dv kernel (else the separate dq kernel)


def attention_settings(head_dim: int, dtype: torch.dtype, causal: bool, kernel: str,
                       tma: bool = True) -> AttentionSettings:
    """Launch settings for one kernel: ``kernel`` is "fwd", "dkdv" (backward over key blocks) or "dq" (backward
    over query blocks, run when the dkdv settings say ``dq_atomic=False``: always, as shipped); the delta pre-pass
    has fixed settings. ``tma``: the tensors take TMA descriptors (else masked pointer loads). dq comes from the
    separate, bitwise reproducible dq kernel, which is also the faster (see bench/results/h200/README.md).

    Interpreter (CPU): programs run one after another, numpy does the tile math; small tiles with BLOCK_M ≠
    BLOCK_N keep a [1, 2, 100, 64] test under a second and exercise every loop (full blocks, tails, diagonal).

    sm_90 (bf16/fp16), from a sweep of the forward's tiles, warps and stages against SDPA's cuDNN backend
    (bench/results/h200/README.md) and, for the backward, ``python -m bench sweep-llm``; ptxas spills none:
    - fwd, D = 128 with TMA: 128 × 128 tiles, 8 warps (one warpgroup per 64 query rows), 3 stages of K/V in
      flight (225 KB of the 227 KB of shared memory; one program per SM). Through pointers (no TMA), whose
      staging needs more shared memory, and for D ≤ 32: 128 × 64, 3 stages.
    - fwd, D = 64: 64 query rows a program, 4 warps, 2 stages (two programs per SM), over 128 keys a step, or 64
      when causal (the diagonal loop needs BLOCK_M a multiple of BLOCK_N).
    - dkdv: BLOCK_M 64 query rows a step; the key block holds dk, dv ([BLOCK_N, D] float32 each, the largest
      register cost): 128 rows (with dq atomics, 64 at D = 128: 128 rows spill there: 255 registers and 200+
      bytes of stack). 8 warps, 2 stages.
    - dq: BLOCK_M 128, BLOCK_N 64, 3 stages (8 warps at D = 128, 4 below).
    float32 (tests only) multiplies without tensor cores (true float32 products): small tiles; ptxas spills there.
    """
    if kernel not in ("fwd", "dkdv", "dq"):
        raise ValueError(f"attention_settings: kernel must be 'fwd', 'dkdv' or 'dq', got {kernel!r}")
    if interpreting():
        if kernel == "dkdv":
            return AttentionSettings(32, 64, 4, 1)
        return AttentionSettings(64, 32, 4, 1)
    wide = head_dim >= 128
    if dtype == torch.float32:  # no tensor cores (true float32 products): small tiles, correctness only
        if kernel == "dkdv":
            return AttentionSettings(32, 64, 8, 2)
        return AttentionSettings(64, 32, 8, 2)
    if kernel == "fwd":
        if wide and tma:
            return AttentionSettings(128, 128, 8, 3)
        if head_dim == 64:
            return AttentionSettings(64, 64 if causal else 128, 4, 2)
        return AttentionSettings(128, 64, 8 if wide else 4, 3)
    if kernel == "dkdv":
        # The separate dq kernel beside 64×128 dk/dv tiles: the fastest of ``python -m bench sweep-llm``'s candidates
        # (see bench/results/h200/README.md); 128×128 dk/dv tiles or 3 stages run out of shared memory.
        return AttentionSettings(64, 128, 8, 2)
    return AttentionSettings(128, 64, 8 if wide else 4, 3)


def _check(q: Tensor, k: Tensor, v: Tensor, causal: bool) -> tuple[int, int, int, int, int, int]:
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape:
        raise ValueError(f"attention: q [B, Hq, S, D], k and v [B, Hk, Skv, D]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    B, Hq, S, D = q.shape
    Hk, Skv = k.shape[1], k.shape[2]
    if k.shape[0] != B or k.shape[3] != D or Hk == 0 or Hq % Hk:
        raise ValueError(f"attention: k/v {tuple(k.shape)} do not fit q {tuple(q.shape)} (Hq a multiple of Hk)")
    if D not in HEAD_DIMS:
        raise ValueError(f"attention: head dim {D} not supported (one of {HEAD_DIMS})")
    if causal and Skv != S:
        raise ValueError(f"attention: causal needs S == Skv, got {S} and {Skv}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"attention: q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("attention: q, k, v need unit stride along D")
    return B, Hq, Hk, S, Skv, D


def _tma_ok(*tensors: Tensor) -> bool:
    """TMA descriptors (Hopper and later, or the interpreter) need 16-byte aligned bases and strides; a stride of
    0 (an expanded gradient) goes through pointers. Dims of size 1 are never stepped: their stride is free."""
    if TensorDescriptor is None:
        return False
    dev = tensors[0].device
    if dev.type == "cuda" and torch.cuda.get_device_capability(dev)[0] < 9:
        return False
    def aligned(n: int, st: int, size: int) -> bool:
        return n == 1 or (st > 0 and st * size % 16 == 0)

    return all(
        t.data_ptr() % 16 == 0
        and all(aligned(n, st, t.element_size()) for n, st in zip(t.shape[:-1], t.stride()[:-1], strict=True))
        for t in tensors
    )


def _arg(t: Tensor, rows: int, tma: bool) -> Tensor | TensorDescriptor:
    """``t`` [B, H, S, D] as the kernel reads it: a TMA descriptor with boxes of [1, 1, rows, D], or itself."""
    if not tma:
        return t
    # The stride of a size-1 dim is never used: any aligned value will do.
    strides = [st if n > 1 else t.shape[3] for n, st in zip(t.shape[:3], t.stride()[:3], strict=True)] + [1]
    return TensorDescriptor(t, list(t.shape), strides, [1, 1, rows, t.shape[3]])


def _dot_mode(dtype: torch.dtype) -> str:
    """How the kernels multiply tiles (see ``_dot``): float32 inputs in true float32, never tf32."""
    if dtype == torch.float32:
        return "ieee"
    return "upcast" if dtype == torch.bfloat16 and interpreting() else "native"


def attention_fwd(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    """q [B, Hq, S, D], k/v [B, Hk, Skv, D] (unit stride along D) -> (o [B, Hq, S, D] contiguous in q's dtype,
    lse [B, Hq, S] float32: natural logsumexp of scale·q·kᵀ per query row, after the causal mask)."""
    B, Hq, Hk, S, Skv, D = _check(q, k, v, causal)
    o = torch.empty((B, Hq, S, D), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, Hq, S), dtype=torch.float32, device=q.device)
    if o.numel() == 0:
        return o, lse
    if Skv == 0:
        return o.zero_(), lse.fill_(-float("inf"))  # no keys: zeros, as torch's SDPA
    tma = _tma_ok(q, k, v, o)
    s = attention_settings(D, q.dtype, causal, "fwd", tma)
    tma = tma and s.tma
    grid = (B * Hq * cdiv(S, s.block_m),)
    launch(_attention_fwd_kernel, grid,
        _arg(q, s.block_m, tma), _arg(k, s.block_n, tma), _arg(v, s.block_n, tma), _arg(o, s.block_m, tma), lse,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o.stride()[:3],
        Hq, Hq // Hk, S, Skv, scale * LOG2E,
        HEAD_DIM=D, BLOCK_M=s.block_m, BLOCK_N=s.block_n, CAUSAL=causal, SCALE_NONNEG=scale >= 0, TMA=tma,
        DOT=_dot_mode(q.dtype), num_warps=s.num_warps, num_stages=s.num_stages,
    )
    return o, lse


def attention_bwd(
    do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, causal: bool, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    """do, o [B, Hq, S, D]; q, k, v as in ``attention_fwd``; lse [B, Hq, S] float32 from it -> (dq, dk, dv), each
    contiguous in its input's dtype and shape (dk, dv summed over the query heads of each kv head's group)."""
    B, Hq, Hk, S, Skv, D = _check(q, k, v, causal)
    if do.stride(-1) != 1:
        do = do.contiguous()
    if o.stride(-1) != 1:
        o = o.contiguous()
    lse = lse.contiguous()
    dk = torch.empty((B, Hk, Skv, D), dtype=k.dtype, device=k.device)
    dv = torch.empty((B, Hk, Skv, D), dtype=v.dtype, device=v.device)
    if q.numel() == 0 or Skv == 0:
        return torch.zeros_like(q, memory_format=torch.contiguous_format), dk.zero_(), dv.zero_()
    delta = torch.empty((B, Hq, S), dtype=torch.float32, device=q.device)
    block = 64 if interpreting() else 128
    launch(_attention_bwd_delta_kernel, (B * Hq * cdiv(S, block),),
        o, do, delta, *o.stride()[:3], *do.stride()[:3], Hq, S, scale,
        HEAD_DIM=D, BLOCK_M=block, num_warps=4,
    )
    qk_scale = scale * LOG2E
    dot = _dot_mode(q.dtype)
    s = attention_settings(D, q.dtype, causal, "dkdv")
    tma = s.tma and _tma_ok(q, k, v, do, dk, dv)
    dq32 = torch.zeros((B, Hq, S, D), dtype=torch.float32, device=q.device) if s.dq_atomic else delta
    launch(_attention_bwd_dkdv_kernel, (B * Hk * cdiv(Skv, s.block_n),),
        _arg(q, s.block_m, tma), _arg(k, s.block_n, tma), _arg(v, s.block_n, tma), _arg(do, s.block_m, tma),
        _arg(dk, s.block_n, tma), _arg(dv, s.block_n, tma), lse, delta, dq32,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *do.stride()[:3], *dk.stride()[:3],
        Hk, Hq // Hk, S, Skv, qk_scale, scale,
        HEAD_DIM=D, BLOCK_M=s.block_m, BLOCK_N=s.block_n, CAUSAL=causal, DQ_ATOMIC=s.dq_atomic, TMA=tma,
        DOT=dot, num_warps=s.num_warps, num_stages=s.num_stages,
    )
    if s.dq_atomic:
        return dq32.to(q.dtype), dk, dv
    dq = torch.empty((B, Hq, S, D), dtype=q.dtype, device=q.device)
    s = attention_settings(D, q.dtype, causal, "dq")
    tma = s.tma and _tma_ok(q, k, v, do, dq)
    launch(_attention_bwd_dq_kernel, (B * Hq * cdiv(S, s.block_m),),
        _arg(q, s.block_m, tma), _arg(k, s.block_n, tma), _arg(v, s.block_n, tma), _arg(do, s.block_m, tma),
        _arg(dq, s.block_m, tma), lse, delta,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *do.stride()[:3], *dq.stride()[:3],
        Hq, Hq // Hk, S, Skv, qk_scale, scale,
        HEAD_DIM=D, BLOCK_M=s.block_m, BLOCK_N=s.block_n, CAUSAL=causal, TMA=tma,
        DOT=dot, num_warps=s.num_warps, num_stages=s.num_stages,
    )
    return dq, dk, dv
