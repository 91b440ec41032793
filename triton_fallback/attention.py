"""Flash attention, forward and backward, in hand-written Triton: the twin of ``hkernels/ops/attention.py``, whose
docstring gives the math, the shapes and the work and traffic of both directions.

Specific to these kernels:
- D in 16, 32, 64, 128, 256. o comes out contiguous [B, Hq, S, D], lse [B, Hq, S] float32 (natural log); inside, each
  exponential is one exp2 (log2 e folded into the scale, or applied after the cap).
- Masks (causal, a window) and packed sequences share one walk: a query block sees keys [lo, hi) of its sequence;
  key blocks inside the window of every query of the block run without a mask, the blocks at the window's edges
  (the diagonal, a partial last block) with one, so causal attention masks only its diagonal blocks and a window
  of W keys reads about W + BLOCK_M of them per query block. Query blocks with a right bound (causal) run longest
  first. A query that keeps no key (packed, more queries than keys) gets o = 0 and lse = −inf.
- softcap: s' = c·tanh(scale·q·k / c), tanh from one exp2; the backward multiplies dS by 1 − tanh².
- Packed sequences (``attention_varlen_*``): the [T, H, D] tensors are read as [1, H, T, D] views; a program per
  (sequence, head, block) up to the longest sequence, those past their sequence's end return at once; the
  sequence bounds are read on the device. A sequence's partial last block selects the neighbour's rows away
  (not multiplied by 0: a NaN there stays there; the blocks before it need no select), and they store by
  pointer (a TMA store clips only at the tensor's end). Rows of no sequence (before the first, after the last)
  get o = 0, lse = −∞ and zero gradients from a kernel that writes only those rows.
- Backward (FA2): (1) delta = rowsum(do·o) per query row (prescaled by ``scale``), written with lse·log2 e as one
  (lse, delta) pair per row, so that the walks below read a row's two numbers in one aligned 8-byte load wherever a
  packed sequence starts (with a cap, as two planes: see the dk/dv walk); (2) a program per (kv block, kv head) holds
  its K/V tile and dk, dv accumulators in registers and walks the query blocks of every query head of its group that
  see its keys; (3) dq by a separate kernel over query blocks (7 matmuls per tile, bitwise deterministic: the
  default), or, as a launch option, by float32 atomics from the same walk into a zeroed [B, Hq, S, D] buffer (5
  matmuls per tile; the summation order is not fixed, so dq may differ in the last bits from run to run; smaller dk/dv
  tiles at D = 128). dk and dv are deterministic either way.
- Loads go through TMA descriptors (4-D [B, H, S, D], boxes of [1, 1, rows, D], out-of-range rows read as zeros)
  when every tensor is 16-byte aligned, else through masked pointer loads. Rows past S or Skv read as zeros:
  their scores are finite, and masks or a lse of +inf keep them out of every stored result.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from hkernels.runtime import launch as _launch
from hkernels.runtime.device import cdiv
from hkernels.runtime.interpret import interpreting
from hkernels.runtime.launch import launch

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # older triton: pointer loads only
    TensorDescriptor = None

Tensor = torch.Tensor

LOG2E = 1.4426950408889634
HEAD_DIMS = (16, 32, 64, 128, 256)
# traced at a symbolic sequence length (see triton_fallback/rms_norm.py): tiles, warps and stages follow from D, the
# dtype and the mask alone; the grid counts blocks of the length; in a graph the tiles load through pointers
SYMBOLIC = frozenset({"attention_fwd", "attention_bwd", "attention_varlen_fwd", "attention_varlen_bwd"})


# ----------------------------------------------------------------------------------------------- tile access


@triton.jit
def _load_tile(
    t,  # [B, H, rows, D] tensor (TMA descriptor, or pointer with unit stride along D)
    b, h, row0, n_rows, stride_b, stride_h, stride_s,
    BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, TMA: tl.constexpr, CLIP: tl.constexpr,
):
    # Rows row0 .. row0+BLOCK of head (b, h) as [BLOCK, HEAD_DIM]; rows at or past n_rows read as zeros (TMA reads
    # the next packed sequence's rows there: CLIP selects them away, so that no value of one sequence, NaN
    # included, reaches another's sums).
    if TMA:
        tile = t.load([b, h, row0, 0]).reshape(BLOCK, HEAD_DIM)
        if CLIP:
            tile = tl.where((row0 + tl.arange(0, BLOCK) < n_rows)[:, None], tile, 0.0)
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
    # Rows at or past n_rows are dropped (TMA clips them at the tensor's bound only: packed sequences store by
    # pointer).
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


@triton.jit
def _tanh(x):
    # 1 − 2 / (e^{2x} + 1): exact limits at ±inf, one exp2; tl math only (the interpreter has no libdevice)
    return 1.0 - 2.0 / (tl.math.exp2(x * 2.8853900817779268) + 1.0)


@triton.jit
def _keep(rows, cols, Sk, off, left, right, LEFT: tl.constexpr, RIGHT: tl.constexpr):
    # [len(rows), len(cols)]: key col < Sk is kept for query row when col ≥ row + off − left (LEFT) and
    # col ≤ row + off + right (RIGHT); rows, cols are positions inside their sequence.
    keep = (cols < Sk)[None, :]
    if LEFT:
        keep = keep & (cols[None, :] >= rows[:, None] + (off - left))
    if RIGHT:
        keep = keep & (cols[None, :] <= rows[:, None] + (off + right))
    return keep


@triton.jit
def _blocks(lo, hi, flo, fhi, BLOCK: tl.constexpr):
    # Blocks of BLOCK on a grid from 0 covering [lo, hi): masked ones [a, u0) and [u1, hi), unmasked ones [u0, u1)
    # (the whole blocks inside [flo, fhi), where every score is kept).
    a = lo // BLOCK * BLOCK
    u0 = tl.cdiv(flo, BLOCK) * BLOCK
    u1 = tl.maximum(fhi, 0) // BLOCK * BLOCK
    none = u1 <= u0
    return a, tl.where(none, a, u0), tl.where(none, a, u1)


@triton.jit
def _reach(p0, p_last, n, off, before, after, BEFORE: tl.constexpr, AFTER: tl.constexpr):
    # Positions p0 .. p_last keep the targets t < n with p + off − before ≤ t (BEFORE) and t ≤ p + off + after
    # (AFTER): (lo, hi) holds every target one of them keeps, (flo, fhi) the targets every one of them keeps. Queries
    # keep keys with (off, left, right); keys are kept by queries with (−off, right, left).
    lo = 0
    flo = 0
    hi = n
    fhi = n
    if BEFORE:
        lo = tl.maximum(p0 + off - before, 0)
        flo = tl.maximum(p_last + off - before, 0)
    if AFTER:
        hi = tl.maximum(tl.minimum(p_last + off + after + 1, n), 0)
        fhi = tl.minimum(p0 + off + after + 1, n)
    return lo, hi, flo, fhi


@triton.jit
def _key_blocks(m0, Sq, Sk, off, left, right,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, LEFT: tl.constexpr, RIGHT: tl.constexpr):
    # The key blocks queries m0 .. m0+BLOCK_M of a sequence see (see _blocks), and the end of the keys they see.
    lo, hi, flo, fhi = _reach(m0, tl.minimum(m0 + BLOCK_M, Sq) - 1, Sk, off, left, right, LEFT, RIGHT)
    a, u0, u1 = _blocks(lo, hi, flo, fhi, BLOCK_N)
    return a, u0, u1, hi


@triton.jit
def _clip_from(u1, hi, n, BLOCK: tl.constexpr, VARLEN: tl.constexpr):
    # Where the last masked loop [u1, hi) over a sequence of n rows reaches its partial last block: packed, that
    # block's rows past n are the next sequence's, and only it needs CLIP (a select on every tile it loads). Every
    # block before it lies inside the sequence: the unmasked blocks end at or before n // BLOCK · BLOCK, and blocks
    # left of them before that. Fixed length: hi (rows past n read as zeros).
    if VARLEN:  # noqa: SIM108 (a constexpr branch: one side is compiled)
        mid = tl.minimum(tl.maximum(n // BLOCK * BLOCK, u1), hi)
    else:
        mid = hi
    return mid


@triton.jit
def _span(first, end, T):
    # (first row, length) of a packed sequence from its bounds, clamped to [0, T]
    start = tl.minimum(tl.maximum(first, 0), T)
    return start, tl.minimum(tl.maximum(end, start), T) - start


@triton.jit
def _program(pid, n_blocks, H, S, Skv, bounds, REVERSE: tl.constexpr, VARLEN: tl.constexpr):
    # A program's (batch, head, block index, query rows' start and count, key rows' start and count): blocks of a
    # head are neighbours in launch order (they share K/V, or q/do, in L2); REVERSE runs the last block first.
    # bounds: VARLEN only, the program's sequence i's (cu_q[i], cu_q[i + 1], cu_k[i], cu_k[i + 1]), read by the
    # kernel itself: torch.compile's analysis of which arguments a kernel writes counts every pointer passed to a
    # helper whose result addresses a store as written.
    bh = pid // n_blocks
    blk = pid % n_blocks
    if REVERSE:
        blk = n_blocks - 1 - blk
    h = bh % H
    if VARLEN:  # packed: [1, H, T, D] tensors, batch = sequence
        q0, Sq = _span(bounds[0], bounds[1], S)
        k0, Sk = _span(bounds[2], bounds[3], Skv)
        b = 0
    else:
        q0 = 0
        k0 = 0
        Sq = S
        Sk = Skv
        b = bh // H
    return b, h, blk, q0, Sq, k0, Sk


# ----------------------------------------------------------------------------------------------- forward


@triton.jit
def _attention_fwd_inner(
    acc, l_i, m_i, q_tile, rows,  # running output [BLOCK_M, D] f32, row sum, row max (base 2), q tile, row ids
    k, v, b, hk, k0, lo, hi, Sk, off, left, right, qk_scale, cap_in, cap_out,
    stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, MASK: tl.constexpr, LEFT: tl.constexpr, RIGHT: tl.constexpr,
    SOFTCAP: tl.constexpr, SCALE_NONNEG: tl.constexpr, TMA: tl.constexpr, CLIP: tl.constexpr, DOT: tl.constexpr,
):
    # Streams key blocks lo .. hi of the sequence whose keys start at row k0 (reads each K and V row once). MASK:
    # keep the keys _keep keeps (else every key is in: no select per score). A row may keep no key of a masked
    # block (a window): its max stays ∓inf and alpha's NaN guard holds it at l = 0 until a block has one.
    # m_i is the running max of the raw scores (the min for a negative scale), and p = exp2((s − m)·qk_scale):
    # a row's top score gets p = 1 exactly. The fused form exp2(s·qk_scale − m·qk_scale) gives it exp2 of the
    # product's rounding error, up to ±1% at scores ~1e5 (|q| ~ 1e5): the bf16 p of the p·v matmul then differs
    # from the float32 l it is divided by, o = v_top misses by an ulp, and the backward's p·(dp − δ), exactly 0
    # there, becomes an ulp of dp times |q| in dk (far above PyTorch's own error).
    for n0 in range(lo, hi, BLOCK_N):
        k_tile = _load_tile(k, b, hk, k0 + n0, k0 + Sk, stride_kb, stride_kh, stride_ks, BLOCK_N, HEAD_DIM, TMA,
                            CLIP)
        s = _dot(q_tile, tl.trans(k_tile), None, DOT)
        if SOFTCAP:
            s = cap_out * _tanh(s * cap_in)
        if MASK:
            keep = _keep(rows, n0 + tl.arange(0, BLOCK_N), Sk, off, left, right, LEFT, RIGHT)
            if SCALE_NONNEG:
                m_new = tl.maximum(m_i, tl.max(tl.where(keep, s, -float("inf")), 1))
            else:
                m_new = tl.minimum(m_i, tl.min(tl.where(keep, s, float("inf")), 1))
            # masked keys (zero rows past Sk score 0) may overflow exp2: selected away, never multiplied
            p = tl.where(keep, tl.math.exp2((s - m_new[:, None]) * qk_scale), 0.0)
        else:
            # full blocks: no select per score
            if SCALE_NONNEG:  # noqa: SIM108 (a constexpr branch: one side is compiled)
                m_new = tl.maximum(m_i, tl.max(s, 1))
            else:
                m_new = tl.minimum(m_i, tl.min(s, 1))
            p = tl.math.exp2((s - m_new[:, None]) * qk_scale)
        # m_i = ∓inf (no key yet): its product with a zero scale, or ∓inf − ∓inf, is NaN; alpha then rescales zeros
        d = (m_i - m_new) * qk_scale
        alpha = tl.math.exp2(tl.where(d == d, d, -float("inf")))
        l_i = l_i * alpha + tl.sum(p, 1)
        v_tile = _load_tile(v, b, hk, k0 + n0, k0 + Sk, stride_vb, stride_vh, stride_vs, BLOCK_N, HEAD_DIM, TMA,
                            CLIP)
        acc = _dot(p.to(v_tile.dtype), v_tile, acc * alpha[:, None], DOT)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attention_fwd_kernel(
    q, k, v, o,  # q [B, Hq, S, D], k/v [B, Hk, Skv, D], o [B, Hq, S, D] out: descriptors or pointers
    lse_ptr,  # [B, Hq, S] float32 out, contiguous
    cu_q, cu_k,  # VARLEN: [N + 1] int32 sequence bounds of the packed rows (B = 1)
    stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
    stride_ob, stride_oh, stride_os,
    Hq, GROUP, S, Skv, n_m, qk_scale, left, right, cap_in, cap_out,  # qk_scale = scale·log2(e), or log2(e) capped
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    LEFT: tl.constexpr, RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, SCALE_NONNEG: tl.constexpr,
    TMA: tl.constexpr, OUT_TMA: tl.constexpr, VARLEN: tl.constexpr, DOT: tl.constexpr,
):
    # float32 scalars (a compiled graph's launch types floats as float64)
    qk_scale = tl.cast(qk_scale, tl.float32)
    cap_in = tl.cast(cap_in, tl.float32)
    cap_out = tl.cast(cap_out, tl.float32)
    # One query block of one head: reads its q rows once and the K/V rows its queries can see once; writes its o
    # rows and lse once. With a right bound (causal) the last query blocks, which see the most keys, run first so
    # the short ones fill the tail of the launch.
    # VARLEN: the sequence's bounds (see _program)
    bounds = (0, 0, 0, 0)
    if VARLEN:
        seq = tl.program_id(0) // n_m // Hq
        bounds = (tl.load(cu_q + seq), tl.load(cu_q + seq + 1),
                  tl.load(cu_k + seq), tl.load(cu_k + seq + 1))
    b, h, pid_m, q0, Sq, k0, Sk = _program(tl.program_id(0), n_m, Hq, S, Skv, bounds, RIGHT, VARLEN)
    m0 = pid_m * BLOCK_M
    if m0 >= Sq:  # packed: past this sequence's end
        return
    hk = h // GROUP
    off = Sk - Sq  # masks align at the sequence's end
    rows = m0 + tl.arange(0, BLOCK_M)
    q_tile = _load_tile(q, b, h, q0 + m0, q0 + Sq, stride_qb, stride_qh, stride_qs, BLOCK_M, HEAD_DIM, TMA, False)

    if SCALE_NONNEG:  # the running max of the raw scores (the min for a negative scale)
        m_i = tl.full([BLOCK_M], -float("inf"), dtype=tl.float32)
    else:
        m_i = tl.full([BLOCK_M], float("inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    a, u0, u1, hi = _key_blocks(m0, Sq, Sk, off, left, right, BLOCK_M, BLOCK_N, LEFT, RIGHT)
    # masked blocks left of the interior (a window's left edge, so only with LEFT), the interior, masked blocks
    # right of it (the diagonal, a window's right edge, a partial last block)
    if LEFT:
        acc, l_i, m_i = _attention_fwd_inner(
            acc, l_i, m_i, q_tile, rows, k, v, b, hk, k0, a, u0, Sk, off, left, right, qk_scale, cap_in, cap_out,
            stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
            BLOCK_N, HEAD_DIM, True, LEFT, RIGHT, SOFTCAP, SCALE_NONNEG, TMA, False, DOT,
        )
    acc, l_i, m_i = _attention_fwd_inner(
        acc, l_i, m_i, q_tile, rows, k, v, b, hk, k0, u0, u1, Sk, off, left, right, qk_scale, cap_in, cap_out,
        stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
        BLOCK_N, HEAD_DIM, False, LEFT, RIGHT, SOFTCAP, SCALE_NONNEG, TMA, False, DOT,
    )
    mid = _clip_from(u1, hi, Sk, BLOCK_N, VARLEN)
    acc, l_i, m_i = _attention_fwd_inner(
        acc, l_i, m_i, q_tile, rows, k, v, b, hk, k0, u1, mid, Sk, off, left, right, qk_scale, cap_in, cap_out,
        stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
        BLOCK_N, HEAD_DIM, True, LEFT, RIGHT, SOFTCAP, SCALE_NONNEG, TMA, False, DOT,
    )
    if VARLEN:
        acc, l_i, m_i = _attention_fwd_inner(
            acc, l_i, m_i, q_tile, rows, k, v, b, hk, k0, mid, hi, Sk, off, left, right, qk_scale, cap_in, cap_out,
            stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
            BLOCK_N, HEAD_DIM, True, LEFT, RIGHT, SOFTCAP, SCALE_NONNEG, TMA, True, DOT,
        )
    # A query that keeps no key (packed, Sq > Sk): o = 0, lse = −inf. (l != 0, not l > 0: a NaN row stays NaN.)
    seen = l_i != 0.0
    out = (acc / tl.where(seen, l_i, 1.0)[:, None]).to(q_tile.dtype)  # o has q's dtype
    _store_tile(o, out, b, h, q0 + m0, q0 + Sq, stride_ob, stride_oh, stride_os, BLOCK_M, HEAD_DIM, OUT_TMA)
    lse = tl.where(seen, (m_i * qk_scale + tl.math.log2(l_i)) * 0.6931471805599453, -float("inf"))  # natural log
    tl.store(lse_ptr + (b * Hq + h).to(tl.int64) * S + q0 + rows, lse, mask=rows < Sq)


# ----------------------------------------------------------------------------------------------- backward


@triton.jit
def _attention_bwd_delta_kernel(
    o, do,  # [B, Hq, S, D] pointers, unit stride along D
    lse_ptr,  # [B, Hq, S] float32: the forward's lse (natural log)
    ld_ptr,  # 2·B·Hq·S float32 out: lse·log2 e and delta = scale · rowsum(do·o) per query row (see PAIRS)
    stride_ob, stride_oh, stride_os, stride_db, stride_dh, stride_ds,
    Hq, S, PLANE, scale,  # PLANE = B·Hq·S
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, PAIRS: tl.constexpr, DOT: tl.constexpr,
):
    scale = tl.cast(scale, tl.float32)  # float32 scalars (a compiled graph's launch types floats as float64)
    # Reads BLOCK_M rows of o and do and BLOCK_M floats of lse once, writes 2·BLOCK_M floats: PAIRS, one
    # (lse, delta) pair per row ([B, Hq, S, 2]), which the dk/dv walk reads in one 8-byte load at any row (a packed
    # sequence starts anywhere); else two planes, lse's [B, Hq, S] then delta's. With float32 dots (DOT "ieee",
    # and the interpreter's "upcast") delta is the diagonal of do·oᵀ, multiplied by the walks' own dot: where a
    # query keeps one key (o = v of that key) delta equals that key's dp = do·v bit for bit, and ds = p·(dp −
    # delta) is exactly 0, as in exact arithmetic (a row sum adds the same products in another order and leaves
    # rounding noise in dq and dk, above float32's tolerance for a zero); 16-bit tensor-core dots keep the row sum.
    pid = tl.program_id(0)
    n_m = tl.cdiv(S, BLOCK_M)
    bh = pid // n_m
    m0 = (pid % n_m) * BLOCK_M
    b = bh // Hq
    h = bh % Hq
    o_tile = _load_tile(o, b, h, m0, S, stride_ob, stride_oh, stride_os, BLOCK_M, HEAD_DIM, False, False)
    do_tile = _load_tile(do, b, h, m0, S, stride_db, stride_dh, stride_ds, BLOCK_M, HEAD_DIM, False, False)
    if DOT == "native":
        delta = tl.sum(o_tile.to(tl.float32) * do_tile.to(tl.float32), 1) * scale
    else:
        both = _dot(do_tile, tl.trans(o_tile), None, DOT)  # [BLOCK_M, BLOCK_M]: its diagonal
        diagonal = tl.arange(0, BLOCK_M)[:, None] == tl.arange(0, BLOCK_M)[None, :]
        delta = tl.sum(tl.where(diagonal, both, 0.0), 1) * scale
    rows = m0 + tl.arange(0, BLOCK_M)
    row_off = bh.to(tl.int64) * S + rows
    lse2 = tl.load(lse_ptr + row_off, mask=rows < S, other=0.0) * 1.4426950408889634
    if PAIRS:
        pairs = row_off[:, None] * 2 + tl.arange(0, 2)[None, :]
        tl.store(ld_ptr + pairs, tl.join(lse2, delta), mask=(rows < S)[:, None])
    else:
        tl.store(ld_ptr + row_off, lse2, mask=rows < S)
        tl.store(ld_ptr + PLANE + row_off, delta, mask=rows < S)


@triton.jit
def _attention_bwd_dkdv_inner(
    dk, dv, k_tile, v_tile,  # dk, dv [BLOCK_N, D] float32 accumulators; this program's K and V tiles
    q, do, ld_ptr, dq_ptr,
    b, hk, GROUP, Hq, n0, lo, n_steps, shift, q0, Sq, S, PLANE, Sk, off, left, right, qk_scale, scale, cap_in, cap_out,
    stride_qb, stride_qh, stride_qs, stride_db, stride_dh, stride_ds,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, MASK: tl.constexpr,
    LEFT: tl.constexpr, RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, DQ_ATOMIC: tl.constexpr, TMA: tl.constexpr,
    CLIP: tl.constexpr, INSIDE: tl.constexpr, DOT: tl.constexpr,
):
    # Walks n_steps query blocks from row lo of the sequence whose queries start at row q0, for each of the GROUP
    # query heads of kv head hk, in one flat loop (one software pipeline, no nested loop state). Within a head the
    # blocks start at `shift`, so that programs of one head start at different blocks and their dq atomics do not
    # pile onto the same rows. Per block: reads q, do (BLOCK_M rows), lse, delta; adds to dk, dv; with DQ_ATOMIC
    # adds ds·k to the float32 dq rows. Scores are computed transposed, sᵀ = k·qᵀ [BLOCK_N, BLOCK_M], so that
    # dv += pᵀ·do and dk += dsᵀ·q need no transposition. MASK: keep the scores _keep keeps; without it, keys
    # past Sk (zero rows of k, v, fixed-length only) still get finite p, whose dk, dv rows are never stored, and
    # their zero k rows add 0 to dq. INSIDE: every query row walked lies inside the sequence (no row mask).
    cols = n0 + tl.arange(0, BLOCK_N)
    # (a loop of no steps still has its first addresses computed ahead by the software pipeline: never divide by 0)
    steps = tl.maximum(n_steps, 1)
    # lse·log2 e and delta: without a cap, the pairs of the group's first head's rows from one 64-bit base (32-bit
    # offsets in the loop); with one, the planes by full offsets (a base held across the loop spills registers
    # beside the cap's tanh tile)
    if SOFTCAP:  # noqa: SIM108 (a constexpr branch: one side is compiled)
        ld_base = ld_ptr
    else:
        ld_base = ld_ptr + ((b * Hq + hk * GROUP).to(tl.int64) * S + q0) * 2
    for t in range(0, GROUP * n_steps):
        g = t // steps
        h = hk * GROUP + g
        m0 = lo + ((t - g * steps + shift) % steps) * BLOCK_M
        rows = m0 + tl.arange(0, BLOCK_M)
        if SOFTCAP:  # noqa: SIM108 (a constexpr branch: one side is compiled)
            row_off = (b * Hq + h).to(tl.int64) * S + q0 + rows
        else:
            row_off = g * S + rows  # from ld_base
        q_tile = _load_tile(q, b, h, q0 + m0, q0 + Sq, stride_qb, stride_qh, stride_qs, BLOCK_M, HEAD_DIM, TMA,
                            CLIP)
        # Rows past Sq: lse = +inf makes their p zero. With a cap, whose tanh tile stays live to the end, lse and
        # delta come from their planes, delta where it is used (a pair held from the start spills registers there).
        if SOFTCAP:
            if INSIDE:
                lse2 = tl.load(ld_base + row_off)
            else:
                lse2 = tl.load(ld_base + row_off, mask=rows < Sq, other=float("inf"))
        else:
            pairs = row_off[:, None] * 2 + tl.arange(0, 2)[None, :]
            if INSIDE:
                lse2, delta = tl.split(tl.load(ld_base + pairs))
            else:
                lse2, delta = tl.split(tl.load(ld_base + pairs, mask=(rows < Sq)[:, None], other=0.0))
                lse2 = tl.where(rows < Sq, lse2, float("inf"))
        s_t = _dot(k_tile, tl.trans(q_tile), None, DOT)
        if SOFTCAP:
            tanh_t = _tanh(s_t * cap_in)
            s_t = cap_out * tanh_t
        p_t = tl.math.exp2(s_t * qk_scale - lse2[None, :])
        if MASK:
            p_t = tl.where(tl.trans(_keep(rows, cols, Sk, off, left, right, LEFT, RIGHT)), p_t, 0.0)
        do_tile = _load_tile(do, b, h, q0 + m0, q0 + Sq, stride_db, stride_dh, stride_ds, BLOCK_M, HEAD_DIM, TMA,
                             CLIP)
        dv = _dot(p_t.to(do_tile.dtype), do_tile, dv, DOT)
        if SOFTCAP:
            if INSIDE:
                delta = tl.load(ld_base + PLANE + row_off)
            else:
                delta = tl.load(ld_base + PLANE + row_off, mask=rows < Sq, other=0.0)
        dp_t = _dot(v_tile, tl.trans(do_tile), None, DOT)
        # ds prescaled by `scale` (delta already is): dk and dq need no scaling afterwards
        ds_t = p_t * (dp_t * scale - delta[None, :])
        if SOFTCAP:  # through the cap: d(c·tanh(z/c))/dz = 1 − tanh²
            ds_t = ds_t * (1.0 - tanh_t * tanh_t)
        ds_t = ds_t.to(q_tile.dtype)
        dk = _dot(ds_t, q_tile, dk, DOT)
        if DQ_ATOMIC:
            dq_part = _dot(tl.trans(ds_t), k_tile, None, DOT)
            dq_row = (b * Hq + h).to(tl.int64) * S + q0 + rows
            ptrs = dq_ptr + dq_row[:, None] * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :]
            tl.atomic_add(ptrs, dq_part, mask=(rows < Sq)[:, None], sem="relaxed")
    return dk, dv


@triton.jit
def _attention_bwd_dkdv_kernel(
    q, k, v, do, dk_out, dv_out,  # q, do [B, Hq, S, D]; k, v, dk_out, dv_out [B, Hk, Skv, D]
    ld_ptr,  # lse·log2 e and scale · rowsum(do·o) per query row: [B, Hq, S, 2] pairs, planes with SOFTCAP
    dq_ptr,  # [B, Hq, S, D] float32, contiguous, zeroed (used only with DQ_ATOMIC)
    cu_q, cu_k,  # VARLEN: [N + 1] int32 sequence bounds (B = 1)
    stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
    stride_db, stride_dh, stride_ds, stride_gb, stride_gh, stride_gs,  # g: dk_out and dv_out (same layout)
    Hk, GROUP, S, Skv, n_n, PLANE, qk_scale, scale, left, right, cap_in, cap_out,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    LEFT: tl.constexpr, RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, DQ_ATOMIC: tl.constexpr,
    TMA: tl.constexpr, OUT_TMA: tl.constexpr, VARLEN: tl.constexpr, WALK: tl.constexpr, ROWS_IN: tl.constexpr,
    DOT: tl.constexpr,
):
    # float32 scalars (a compiled graph's launch types floats as float64)
    qk_scale = tl.cast(qk_scale, tl.float32)
    scale = tl.cast(scale, tl.float32)
    cap_in = tl.cast(cap_in, tl.float32)
    cap_out = tl.cast(cap_out, tl.float32)
    # One key block of one kv head: reads its K/V rows once, the q/do rows of every query head of the group that
    # can see them, writes its dk, dv rows once. Key blocks of a head are neighbours in launch order (they share
    # q/do in L2); with a right bound (causal) the first blocks are seen by the most queries and run first.
    # ROWS_IN: the unmasked walks reach no row past a sequence's end (packed: they stop at its last whole block;
    # fixed length: S is a multiple of BLOCK_M), so they read lse and delta without a row mask.
    # VARLEN: the sequence's bounds (see _program)
    bounds = (0, 0, 0, 0)
    if VARLEN:
        seq = tl.program_id(0) // n_n // Hk
        bounds = (tl.load(cu_q + seq), tl.load(cu_q + seq + 1),
                  tl.load(cu_k + seq), tl.load(cu_k + seq + 1))
    b, hk, pid_n, q0, Sq, k0, Sk = _program(tl.program_id(0), n_n, Hk, S, Skv, bounds, False, VARLEN)
    n0 = pid_n * BLOCK_N
    if n0 >= Sk:  # packed: past this sequence's end
        return
    k_tile = _load_tile(k, b, hk, k0 + n0, k0 + Sk, stride_kb, stride_kh, stride_ks, BLOCK_N, HEAD_DIM, TMA, False)
    v_tile = _load_tile(v, b, hk, k0 + n0, k0 + Sk, stride_vb, stride_vh, stride_vs, BLOCK_N, HEAD_DIM, TMA, False)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    Hq = Hk * GROUP
    off = Sk - Sq
    if WALK:
        # The queries that see keys n0 .. n_last: lo .. hi; every key of the block is kept for queries flo .. fhi.
        # A partial key block is masked throughout (a very negative lse could make the p of its missing keys
        # overflow, and 0·inf reach dq; packed, its missing keys are the next sequence's).
        lo, hi, flo, fhi = _reach(n0, tl.minimum(n0 + BLOCK_N, Sk) - 1, Sq, -off, right, left, RIGHT, LEFT)
        if not VARLEN:
            # fixed length: the partial last query block needs no mask (rows past S read zeros, lse +inf: p = 0)
            fhi = tl.where(fhi == Sq, tl.cdiv(Sq, BLOCK_M) * BLOCK_M, fhi)
        fhi = tl.where(n0 + BLOCK_N <= Sk, fhi, 0)
        a, u0, u1 = _blocks(lo, hi, flo, fhi, BLOCK_M)
        hi = tl.maximum(hi, u1)
        dk, dv = _attention_bwd_dkdv_inner(
            dk, dv, k_tile, v_tile, q, do, ld_ptr, dq_ptr,
            b, hk, GROUP, Hq, n0, a, (u0 - a) // BLOCK_M, 0, q0, Sq, S, PLANE, Sk, off, left, right, qk_scale, scale,
            cap_in, cap_out, stride_qb, stride_qh, stride_qs, stride_db, stride_dh, stride_ds,
            BLOCK_M, BLOCK_N, HEAD_DIM, True, LEFT, RIGHT, SOFTCAP, DQ_ATOMIC, TMA, False, False, DOT,
        )
        dk, dv = _attention_bwd_dkdv_inner(
            dk, dv, k_tile, v_tile, q, do, ld_ptr, dq_ptr,
            b, hk, GROUP, Hq, n0, u0, (u1 - u0) // BLOCK_M, pid_n, q0, Sq, S, PLANE, Sk, off, left, right, qk_scale,
            scale, cap_in, cap_out, stride_qb, stride_qh, stride_qs, stride_db, stride_dh, stride_ds,
            BLOCK_M, BLOCK_N, HEAD_DIM, False, LEFT, RIGHT, SOFTCAP, DQ_ATOMIC, TMA, False, ROWS_IN, DOT,
        )
        mid = _clip_from(u1, hi, Sq, BLOCK_M, VARLEN)
        dk, dv = _attention_bwd_dkdv_inner(
            dk, dv, k_tile, v_tile, q, do, ld_ptr, dq_ptr,
            b, hk, GROUP, Hq, n0, u1, tl.cdiv(mid - u1, BLOCK_M), 0, q0, Sq, S, PLANE, Sk, off, left, right, qk_scale,
            scale, cap_in, cap_out, stride_qb, stride_qh, stride_qs, stride_db, stride_dh, stride_ds,
            BLOCK_M, BLOCK_N, HEAD_DIM, True, LEFT, RIGHT, SOFTCAP, DQ_ATOMIC, TMA, False, False, DOT,
        )
        if VARLEN:
            dk, dv = _attention_bwd_dkdv_inner(
                dk, dv, k_tile, v_tile, q, do, ld_ptr, dq_ptr,
                b, hk, GROUP, Hq, n0, mid, tl.cdiv(hi - mid, BLOCK_M), 0, q0, Sq, S, PLANE, Sk, off, left, right,
                qk_scale, scale, cap_in, cap_out, stride_qb, stride_qh, stride_qs, stride_db, stride_dh, stride_ds,
                BLOCK_M, BLOCK_N, HEAD_DIM, True, LEFT, RIGHT, SOFTCAP, DQ_ATOMIC, TMA, True, False, DOT,
            )
    else:
        # No mask: every query sees the block; a partial key block is masked (a very negative lse could make the
        # p of its missing keys overflow, and 0·inf reach dq)
        n_m = tl.cdiv(Sq, BLOCK_M)
        if n0 + BLOCK_N <= Sk:
            dk, dv = _attention_bwd_dkdv_inner(
                dk, dv, k_tile, v_tile, q, do, ld_ptr, dq_ptr,
                b, hk, GROUP, Hq, n0, 0, n_m, pid_n, q0, Sq, S, PLANE, Sk, off, left, right, qk_scale, scale,
                cap_in, cap_out, stride_qb, stride_qh, stride_qs, stride_db, stride_dh, stride_ds,
                BLOCK_M, BLOCK_N, HEAD_DIM, False, LEFT, RIGHT, SOFTCAP, DQ_ATOMIC, TMA, False, ROWS_IN, DOT,
            )
        else:
            dk, dv = _attention_bwd_dkdv_inner(
                dk, dv, k_tile, v_tile, q, do, ld_ptr, dq_ptr,
                b, hk, GROUP, Hq, n0, 0, n_m, pid_n, q0, Sq, S, PLANE, Sk, off, left, right, qk_scale, scale,
                cap_in, cap_out, stride_qb, stride_qh, stride_qs, stride_db, stride_dh, stride_ds,
                BLOCK_M, BLOCK_N, HEAD_DIM, True, LEFT, RIGHT, SOFTCAP, DQ_ATOMIC, TMA, False, False, DOT,
            )
    _store_tile(dk_out, dk.to(k_tile.dtype), b, hk, k0 + n0, k0 + Sk, stride_gb, stride_gh, stride_gs,
                BLOCK_N, HEAD_DIM, OUT_TMA)
    _store_tile(dv_out, dv.to(v_tile.dtype), b, hk, k0 + n0, k0 + Sk, stride_gb, stride_gh, stride_gs,
                BLOCK_N, HEAD_DIM, OUT_TMA)


@triton.jit
def _attention_bwd_dq_inner(
    dq, q_tile, do_tile, lse2, delta, rows,  # dq [BLOCK_M, D] f32 accumulator; this block's q, do, lse·log2(e)
    k, v, b, hk, k0, lo, hi, Sk, off, left, right, qk_scale, scale, cap_in, cap_out,
    stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, MASK: tl.constexpr, LEFT: tl.constexpr, RIGHT: tl.constexpr,
    SOFTCAP: tl.constexpr, TMA: tl.constexpr, CLIP: tl.constexpr, DOT: tl.constexpr,
):
    # Streams key blocks lo .. hi (reads each K and V row once); MASK: keep the scores _keep keeps.
    for n0 in range(lo, hi, BLOCK_N):
        k_tile = _load_tile(k, b, hk, k0 + n0, k0 + Sk, stride_kb, stride_kh, stride_ks, BLOCK_N, HEAD_DIM, TMA,
                            CLIP)
        v_tile = _load_tile(v, b, hk, k0 + n0, k0 + Sk, stride_vb, stride_vh, stride_vs, BLOCK_N, HEAD_DIM, TMA,
                            CLIP)
        s = _dot(q_tile, tl.trans(k_tile), None, DOT)
        if SOFTCAP:
            tanh_s = _tanh(s * cap_in)
            s = cap_out * tanh_s
        p = tl.math.exp2(s * qk_scale - lse2[:, None])
        if MASK:
            p = tl.where(_keep(rows, n0 + tl.arange(0, BLOCK_N), Sk, off, left, right, LEFT, RIGHT), p, 0.0)
        dp = _dot(do_tile, tl.trans(v_tile), None, DOT)
        ds = p * (dp * scale - delta[:, None])
        if SOFTCAP:
            ds = ds * (1.0 - tanh_s * tanh_s)
        dq = _dot(ds.to(k_tile.dtype), k_tile, dq, DOT)
    return dq


@triton.jit
def _attention_bwd_dq_kernel(
    q, k, v, do, dq_out,  # q, do, dq_out [B, Hq, S, D]; k, v [B, Hk, Skv, D]
    ld_ptr,  # lse·log2 e and delta per query row: [B, Hq, S, 2] pairs, planes with SOFTCAP
    cu_q, cu_k,  # VARLEN: [N + 1] int32 sequence bounds (B = 1)
    stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
    stride_db, stride_dh, stride_ds, stride_gb, stride_gh, stride_gs,  # g: dq_out
    Hq, GROUP, S, Skv, n_m, PLANE, qk_scale, scale, left, right, cap_in, cap_out,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    LEFT: tl.constexpr, RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
    TMA: tl.constexpr, OUT_TMA: tl.constexpr, VARLEN: tl.constexpr, DOT: tl.constexpr,
):
    # float32 scalars (a compiled graph's launch types floats as float64)
    qk_scale = tl.cast(qk_scale, tl.float32)
    scale = tl.cast(scale, tl.float32)
    cap_in = tl.cast(cap_in, tl.float32)
    cap_out = tl.cast(cap_out, tl.float32)
    # One query block of one head (the deterministic dq): reads its q, do rows once and the K/V rows its queries
    # see once, writes its dq rows once. Blocks as in the forward.
    # VARLEN: the sequence's bounds (see _program)
    bounds = (0, 0, 0, 0)
    if VARLEN:
        seq = tl.program_id(0) // n_m // Hq
        bounds = (tl.load(cu_q + seq), tl.load(cu_q + seq + 1),
                  tl.load(cu_k + seq), tl.load(cu_k + seq + 1))
    b, h, pid_m, q0, Sq, k0, Sk = _program(tl.program_id(0), n_m, Hq, S, Skv, bounds, RIGHT, VARLEN)
    m0 = pid_m * BLOCK_M
    if m0 >= Sq:
        return
    hk = h // GROUP
    off = Sk - Sq
    rows = m0 + tl.arange(0, BLOCK_M)
    q_tile = _load_tile(q, b, h, q0 + m0, q0 + Sq, stride_qb, stride_qh, stride_qs, BLOCK_M, HEAD_DIM, TMA, False)
    do_tile = _load_tile(do, b, h, q0 + m0, q0 + Sq, stride_db, stride_dh, stride_ds, BLOCK_M, HEAD_DIM, TMA,
                         False)
    row_off = (b * Hq + h).to(tl.int64) * S + q0 + rows
    if SOFTCAP:
        lse2 = tl.load(ld_ptr + row_off, mask=rows < Sq, other=float("inf"))
        delta = tl.load(ld_ptr + PLANE + row_off, mask=rows < Sq, other=0.0)
    else:
        pairs = row_off[:, None] * 2 + tl.arange(0, 2)[None, :]
        lse2, delta = tl.split(tl.load(ld_ptr + pairs, mask=(rows < Sq)[:, None], other=0.0))
        lse2 = tl.where(rows < Sq, lse2, float("inf"))
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    a, u0, u1, hi = _key_blocks(m0, Sq, Sk, off, left, right, BLOCK_M, BLOCK_N, LEFT, RIGHT)
    if LEFT:  # masked blocks at a window's left edge
        dq = _attention_bwd_dq_inner(
            dq, q_tile, do_tile, lse2, delta, rows, k, v, b, hk, k0, a, u0, Sk, off, left, right, qk_scale, scale,
            cap_in, cap_out, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
            BLOCK_N, HEAD_DIM, True, LEFT, RIGHT, SOFTCAP, TMA, False, DOT,
        )
    dq = _attention_bwd_dq_inner(
        dq, q_tile, do_tile, lse2, delta, rows, k, v, b, hk, k0, u0, u1, Sk, off, left, right, qk_scale, scale,
        cap_in, cap_out, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
        BLOCK_N, HEAD_DIM, False, LEFT, RIGHT, SOFTCAP, TMA, False, DOT,
    )
    mid = _clip_from(u1, hi, Sk, BLOCK_N, VARLEN)
    dq = _attention_bwd_dq_inner(
        dq, q_tile, do_tile, lse2, delta, rows, k, v, b, hk, k0, u1, mid, Sk, off, left, right, qk_scale, scale,
        cap_in, cap_out, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
        BLOCK_N, HEAD_DIM, True, LEFT, RIGHT, SOFTCAP, TMA, False, DOT,
    )
    if VARLEN:
        dq = _attention_bwd_dq_inner(
            dq, q_tile, do_tile, lse2, delta, rows, k, v, b, hk, k0, mid, hi, Sk, off, left, right, qk_scale, scale,
            cap_in, cap_out, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
            BLOCK_N, HEAD_DIM, True, LEFT, RIGHT, SOFTCAP, TMA, True, DOT,
        )
    _store_tile(dq_out, dq.to(q_tile.dtype), b, h, q0 + m0, q0 + Sq, stride_gb, stride_gh, stride_gs,
                BLOCK_M, HEAD_DIM, OUT_TMA)


@triton.jit
def _fill_outside_kernel(
    t,  # [T, W] rows (any strides): the rows of no packed sequence get `value`
    cu, n_seq, T, W, stride_t, stride_w, value,
    BLOCK_T: tl.constexpr, BLOCK_W: tl.constexpr,
):
    value = tl.cast(value, tl.float32)  # float32 scalars (a compiled graph's launch types floats as float64)
    # Rows before cu[0] and from cu[n_seq] on belong to no sequence, and no attention program writes them; reads
    # two bounds, writes only those rows (none in the usual call, where the sequences cover every row).
    first = tl.minimum(tl.maximum(tl.load(cu), 0), T)
    last = tl.minimum(tl.maximum(tl.load(cu + n_seq), first), T)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    outside = (rows < T) & ((rows < first) | (rows >= last))
    # (no early return: torch's analysis of which arguments a kernel writes, under torch.compile, reads a kernel
    # with one as writing every argument, cu included)
    if tl.max(outside.to(tl.int32), 0) > 0:
        for w0 in range(0, W, BLOCK_W):
            cols = w0 + tl.arange(0, BLOCK_W)
            ptrs = t + rows.to(tl.int64)[:, None] * stride_t + cols[None, :].to(tl.int64) * stride_w
            fill = tl.full([BLOCK_T, BLOCK_W], value, t.dtype.element_ty)
            tl.store(ptrs, fill, mask=outside[:, None] & (cols < W)[None, :])


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
    - D = 256, 8 warps, 2 stages, chosen by ptxas's register counts (not by a sweep): fwd 128 × 64 (247
      registers), dkdv 32 query rows a step over 64 keys (255 registers, a 16-byte stack frame), dq 64 × 64 (214).
      Through pointers these tiles spill (kilobytes of stack): correct, slower.
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
            return AttentionSettings(32, 32 if head_dim > 128 else 64, 8, 1 if head_dim > 128 else 2)
        return AttentionSettings(32 if head_dim > 128 and kernel == "dq" else 64, 32, 8, 2)
    if head_dim > 128:
        # D = 256 (Gemma): [rows, 256] float32 accumulators take twice the registers of D = 128, so every tile
        # halves along the rows; two stages fit shared memory.
        return {"fwd": AttentionSettings(128, 64, 8, 2), "dkdv": AttentionSettings(32, 64, 8, 2),
                "dq": AttentionSettings(64, 64, 8, 2)}[kernel]
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
    if TensorDescriptor is None or not _launch.descriptors_ok():
        return False
    dev = tensors[0].device
    if dev.type == "cuda" and torch.cuda.get_device_capability(dev)[0] < 9:
        return False
    def aligned(n: int, st: int, size: int) -> bool:
        return n == 1 or (st > 0 and st * size % 16 == 0)

    return all(
        _launch.aligned(t)
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




@dataclass(frozen=True)
class _Mask:
    """The kernels' mask and score options (see the functional module): launch arguments and constexprs."""

    left: int  # keys a query sees before it (LEFT), else 0
    right: int  # keys a query sees after it (RIGHT; 0 when causal), else 0
    LEFT: bool
    RIGHT: bool
    SOFTCAP: bool
    qk_scale: float  # scores' factor inside exp2: scale·log2 e, or log2 e after the cap
    cap_in: float  # cap: s' = cap_out·tanh(cap_in·q·k)
    cap_out: float
    nonneg: bool  # the scores' factor is ≥ 0 (the forward tracks a running max, else a min)


def _mask(causal: bool, scale: float, left: int, right: int, softcap: float) -> _Mask:
    right = 0 if causal else right
    if softcap:
        return _Mask(max(left, 0), max(right, 0), left >= 0, right >= 0, True, LOG2E, scale / softcap, softcap, True)
    return _Mask(max(left, 0), max(right, 0), left >= 0, right >= 0, False, scale * LOG2E, 1.0, 1.0, scale >= 0)


def _packed(t: Tensor) -> Tensor:
    """A packed [T, H, D] as the [1, H, T, D] view the kernels read (batch 0, the sequences' rows along T)."""
    return t.transpose(0, 1).unsqueeze(0)


def _fwd(q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, m: _Mask, rows_q: int,
         cu: tuple[Tensor, Tensor] | None) -> None:
    """Launch the forward over q [B, Hq, S, D] (or packed [1, Hq, Tq, D] with ``cu`` = (cu_q, cu_k) and
    ``rows_q`` the longest sequence) into o and lse [B, Hq, S]."""
    B, Hq, S, D = q.shape
    Hk, Skv = k.shape[1], k.shape[2]
    tma = _tma_ok(q, k, v, o)
    s = attention_settings(D, q.dtype, m.RIGHT, "fwd", tma)
    tma = tma and s.tma
    n_m = cdiv(rows_q, s.block_m)
    n_seq = B if cu is None else cu[0].shape[0] - 1
    cu_q, cu_k = cu if cu is not None else (lse, lse)  # (unread without VARLEN)
    launch(_attention_fwd_kernel, (n_seq * Hq * n_m,),
        _arg(q, s.block_m, tma), _arg(k, s.block_n, tma), _arg(v, s.block_n, tma),
        _arg(o, s.block_m, tma and cu is None), lse, cu_q, cu_k,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o.stride()[:3],
        Hq, Hq // Hk, S, Skv, n_m, m.qk_scale, m.left, m.right, m.cap_in, m.cap_out,
        HEAD_DIM=D, BLOCK_M=s.block_m, BLOCK_N=s.block_n, LEFT=m.LEFT, RIGHT=m.RIGHT, SOFTCAP=m.SOFTCAP,
        SCALE_NONNEG=m.nonneg, TMA=tma, OUT_TMA=tma and cu is None, VARLEN=cu is not None,
        DOT=_dot_mode(q.dtype), num_warps=s.num_warps, num_stages=s.num_stages,
    )


def _bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, dq: Tensor, dk: Tensor, dv: Tensor,
         scale: float, m: _Mask, rows_q: int, rows_k: int, cu: tuple[Tensor, Tensor] | None) -> None:
    """Launch the backward (delta, dk/dv, dq) over [B, H, S, D] tensors (or packed [1, H, T, D] with ``cu`` and the
    longest sequences rows_q, rows_k) into dq, dk, dv."""
    B, Hq, S, D = q.shape
    Hk, Skv = k.shape[1], k.shape[2]
    varlen = cu is not None
    n_seq = B if cu is None else cu[0].shape[0] - 1
    ld = torch.empty((B, Hq, S, 2), dtype=torch.float32, device=q.device)
    cu_q, cu_k = cu if cu is not None else (ld, ld)  # (unread without VARLEN)
    dot = _dot_mode(q.dtype)
    block = 128 if dot == "native" and not interpreting() else 64  # rows per delta program (float32 do·oᵀ: 64²)
    launch(_attention_bwd_delta_kernel, (B * Hq * cdiv(S, block),),
        o, do, lse, ld, *o.stride()[:3], *do.stride()[:3], Hq, S, B * Hq * S, scale,
        HEAD_DIM=D, BLOCK_M=block, PAIRS=not m.SOFTCAP, DOT=dot, num_warps=4,
    )
    s = attention_settings(D, q.dtype, m.RIGHT, "dkdv")
    tma = s.tma and _tma_ok(q, k, v, do, dk, dv)
    dq32 = torch.zeros((B, Hq, S, D), dtype=torch.float32, device=q.device) if s.dq_atomic else ld
    n_n = cdiv(rows_k, s.block_n)
    launch(_attention_bwd_dkdv_kernel, (n_seq * Hk * n_n,),
        _arg(q, s.block_m, tma), _arg(k, s.block_n, tma), _arg(v, s.block_n, tma), _arg(do, s.block_m, tma),
        _arg(dk, s.block_n, tma and not varlen), _arg(dv, s.block_n, tma and not varlen), ld, dq32,
        cu_q, cu_k,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *do.stride()[:3], *dk.stride()[:3],
        Hk, Hq // Hk, S, Skv, n_n, B * Hq * S, m.qk_scale, scale, m.left, m.right, m.cap_in, m.cap_out,
        HEAD_DIM=D, BLOCK_M=s.block_m, BLOCK_N=s.block_n, LEFT=m.LEFT, RIGHT=m.RIGHT, SOFTCAP=m.SOFTCAP,
        DQ_ATOMIC=s.dq_atomic, TMA=tma, OUT_TMA=tma and not varlen, VARLEN=varlen,
        WALK=m.LEFT or m.RIGHT or varlen, DOT=dot, num_warps=s.num_warps,
        # (a symbolic length: the masked walks, no guard on its remainder)
        ROWS_IN=varlen or (type(S) is int and S % s.block_m == 0),
        num_stages=s.num_stages,
    )
    if s.dq_atomic:
        dq.copy_(dq32)
        return
    s = attention_settings(D, q.dtype, m.RIGHT, "dq")
    tma = s.tma and _tma_ok(q, k, v, do, dq)
    n_m = cdiv(rows_q, s.block_m)
    launch(_attention_bwd_dq_kernel, (n_seq * Hq * n_m,),
        _arg(q, s.block_m, tma), _arg(k, s.block_n, tma), _arg(v, s.block_n, tma), _arg(do, s.block_m, tma),
        _arg(dq, s.block_m, tma and not varlen), ld, cu_q, cu_k,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *do.stride()[:3], *dq.stride()[:3],
        Hq, Hq // Hk, S, Skv, n_m, B * Hq * S, m.qk_scale, scale, m.left, m.right, m.cap_in, m.cap_out,
        HEAD_DIM=D, BLOCK_M=s.block_m, BLOCK_N=s.block_n, LEFT=m.LEFT, RIGHT=m.RIGHT, SOFTCAP=m.SOFTCAP,
        TMA=tma, OUT_TMA=tma and not varlen, VARLEN=varlen,
        DOT=dot, num_warps=s.num_warps, num_stages=s.num_stages,
    )


def attention_fwd(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, left: int = -1, right: int = -1,
                  softcap: float = 0.0) -> tuple[Tensor, Tensor]:
    """q [B, Hq, S, D], k/v [B, Hk, Skv, D] (unit stride along D; S == Skv with causal or a window) -> (o [B, Hq,
    S, D] contiguous in q's dtype, lse [B, Hq, S] float32: natural logsumexp of each query's kept scores)."""
    B, Hq, _, S, Skv, D = _check(q, k, v, causal or left >= 0 or right >= 0)
    o = torch.empty((B, Hq, S, D), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, Hq, S), dtype=torch.float32, device=q.device)
    if o.numel() == 0:
        return o, lse
    if Skv == 0:
        return o.zero_(), lse.fill_(-float("inf"))  # no keys: zeros, as torch's SDPA
    _fwd(q, k, v, o, lse, _mask(causal, scale, left, right, softcap), S, None)
    return o, lse


def attention_bwd(
    do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, causal: bool, scale: float,
    left: int = -1, right: int = -1, softcap: float = 0.0,
) -> tuple[Tensor, Tensor, Tensor]:
    """do, o [B, Hq, S, D]; q, k, v as in ``attention_fwd``; lse [B, Hq, S] float32 from it -> (dq, dk, dv), each
    contiguous in its input's dtype and shape (dk, dv summed over the query heads of each kv head's group)."""
    B, Hq, Hk, S, Skv, D = _check(q, k, v, causal or left >= 0 or right >= 0)
    if do.stride(-1) != 1:
        do = do.contiguous()
    if o.stride(-1) != 1:
        o = o.contiguous()
    lse = lse.contiguous()
    dk = torch.empty((B, Hk, Skv, D), dtype=k.dtype, device=k.device)
    dv = torch.empty((B, Hk, Skv, D), dtype=v.dtype, device=v.device)
    if q.numel() == 0 or Skv == 0:
        return torch.zeros_like(q, memory_format=torch.contiguous_format), dk.zero_(), dv.zero_()
    dq = torch.empty((B, Hq, S, D), dtype=q.dtype, device=q.device)
    _bwd(do, q, k, v, o, lse, dq, dk, dv, scale, _mask(causal, scale, left, right, softcap), S, Skv, None)
    return dq, dk, dv


def _fill_outside(t: Tensor, cu: Tensor, value: float = 0.0, dim: int = 0) -> Tensor:
    """t, whose dim ``dim`` runs over the packed rows, with ``value`` in the rows of no sequence (before cu[0], from
    cu[-1] on); the rows inside the sequences are left for the attention kernels to write."""
    rows = t.movedim(dim, 0).flatten(1)
    launch(_fill_outside_kernel, (cdiv(rows.shape[0], 64),), rows, cu, cu.shape[0] - 1, rows.shape[0],
           rows.shape[1], rows.stride(0), rows.stride(1), value, BLOCK_T=64, BLOCK_W=256, num_warps=4)
    return t


# Calls with a window or a cap, under names of their own: auto routes them by their own measurements.
attention_masked_fwd = attention_fwd
attention_masked_bwd = attention_bwd


def _check_packed(q: Tensor, k: Tensor, v: Tensor) -> None:
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape or q.shape[2] != k.shape[2]:
        raise ValueError(f"attention_varlen: q [Tq, Hq, D], k and v [Tk, Hk, D]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    _check(_packed(q), _packed(k), _packed(v), False)


def attention_varlen_fwd(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int,
                         causal: bool, scale: float, left: int = -1, right: int = -1, softcap: float = 0.0
                         ) -> tuple[Tensor, Tensor]:
    """Packed q [Tq, Hq, D], k/v [Tk, Hk, D], int32 cu_q, cu_k [N + 1] on the device, max_q / max_k at least the
    longest sequence (it sizes the grid) -> (o [Tq, Hq, D] contiguous in q's dtype, lse [Hq, Tq] float32; rows of
    no sequence and queries that keep no key: o = 0, lse = −inf)."""
    _check_packed(q, k, v)
    o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((q.shape[1], q.shape[0]), dtype=torch.float32, device=q.device)
    if q.numel() == 0 or k.shape[0] == 0 or max_q == 0 or cu_q.shape[0] < 2:
        return o.zero_(), lse.fill_(-float("inf"))
    _fill_outside(o, cu_q)
    _fill_outside(lse, cu_q, -float("inf"), dim=1)
    _fwd(_packed(q), _packed(k), _packed(v), _packed(o), lse.unsqueeze(0),
         _mask(causal, scale, left, right, softcap), max_q, (cu_q, cu_k))
    return o, lse


def attention_varlen_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, cu_q: Tensor,
                         cu_k: Tensor, max_q: int, max_k: int, causal: bool, scale: float, left: int = -1,
                         right: int = -1, softcap: float = 0.0) -> tuple[Tensor, Tensor, Tensor]:
    """do, o [Tq, Hq, D]; the rest as in ``attention_varlen_fwd``; lse [Hq, Tq] from it -> (dq, dk, dv) contiguous
    in q's, k's, v's shapes and dtypes (zeros for rows of no sequence)."""
    _check_packed(q, k, v)
    do = do if do.stride(-1) == 1 else do.contiguous()
    o = o if o.stride(-1) == 1 else o.contiguous()
    dq, dk, dv = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
    if q.numel() == 0 or k.shape[0] == 0 or max_q == 0 or max_k == 0 or cu_q.shape[0] < 2:
        return dq.zero_(), dk.zero_(), dv.zero_()
    _fill_outside(dq, cu_q)
    _fill_outside(dk, cu_k)
    _fill_outside(dv, cu_k)
    _bwd(_packed(do), _packed(q), _packed(k), _packed(v), _packed(o), lse.contiguous().unsqueeze(0), _packed(dq),
         _packed(dk), _packed(dv), scale, _mask(causal, scale, left, right, softcap), max_q, max_k, (cu_q, cu_k))
    return dq, dk, dv
