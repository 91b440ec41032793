"""Flash attention, forward and backward, in Helion (the twin of ``triton_fallback/attention.py``), for fixed-length
batches and for packed sequences (``attention_varlen``).

Math, per (sequence, query head), with scores S = scale · q kᵀ, capped to S = c·tanh(scale · q kᵀ / c) under a
softcap c, and masked to −∞ outside the window: query i keeps key j when i + off − left ≤ j ≤ i + off + right
(off = Skv − S, 0 for fixed-length windows, which need S = Skv; causal is right = 0; −1 leaves a side unbounded):
    forward   lse_i = log Σ_j exp(S_ij),  P = exp(S − lse),  o = P v   (a query that keeps no key: o = 0, lse = −∞)
    backward  δ_i = Σ_d do_id · o_id,  dv = Pᵀ do,  dP = do vᵀ,  dS = P ∘ (dP − δ) (∘ (1 − tanh²) under a cap),
              dq = scale · dS k,  dk = scale · dSᵀ q   (dk, dv summed over the query heads of a key/value head)

Shapes: q, do: [B, Hq, S, D]; k, v: [B, Hk, Skv, D] with Hq = G·Hk (query head h reads key/value head h // G);
any strides with unit stride along D (transposed views of [B, S, H, D] projections are read in place); D is
specialised. The kernels see q-like tensors as [B, Hk, G, S, D] views, so a program's key/value head is its own
index, not a division. Packed: q [Tq, Hq, D], k, v [Tk, Hk, D], sequence b being rows cu_q[b]:cu_q[b+1] and
cu_k[b]:cu_k[b+1] (int32 on the device, never read on the host), seen by the kernels as [1, Hk, G, Tq, D] views.
Softmax runs in base 2 (log2 e folded into the scale: P = exp2((S' − m)·scale·log2 e) with S' = q kᵀ and m its
running row max; under a cap S' is the capped score and the scale is log2 e alone), float32 throughout; P and dS
are rounded to the input dtype for their matmuls, as every flash kernel does. tanh is 1 − 2/(exp2(2x·log2 e) + 1).

Two families of kernels:
- ``_attention_fwd``, ``_attention_bwd_dq``, ``_attention_bwd_dkdv``: no window, no cap, fixed length, optionally
  causal (the diagonal block of a tile is masked, blocks left of it are not).
- ``_attention_masked_*``: a window, a cap or packed sequences. A program takes one sequence and walks only the
  keys (queries, for dk/dv) its block keeps, in three loops: a masked head, the whole blocks every row of the block
  keeps (no per-element mask, no select in the row reductions), a masked tail. Packed programs whose query block
  starts past their sequence's end return at once; every packed load is masked to the sequence's rows, so nothing
  of another sequence (a NaN included) reaches a program's sums.

Work and traffic, N = B·Hq·S·Skv score elements (half of them when causal; with a window of W keys, N = B·Hq·S·W
plus at most two partial blocks per query block):
- forward: 4·N·D flops; one program per block of BM queries keeps its q on chip and streams K/V once (online
  softmax: a running max m and sum l rescale the accumulator when the max grows); writes o and lse once. Programs
  of one head run next to each other (the query-block index varies fastest) so K/V come from L2. Per score the
  main loop spends a subtract, a multiply, one exp2, a max and an add beside the matmuls (and one more exp2 and a
  division under a cap): its full key blocks need no masks, so its two row reductions are written in Triton
  (Helion's own would select per element). The running max is of the raw scores, p = exp2((s − m)·scale·log2 e):
  a row's top score gets p = 1 exactly (the fused exp2(s·c − m·c), one FMA, gives it exp2 of a rounding error,
  ±1% at scores ~1e5, which the backward's exact cancellation at that key turns into an error of |q| times an ulp
  in dk).
- backward: two kernels, no S × Skv matrix and no atomics (deterministic):
  ``*_dq`` (one program per query block): δ = rowsum(do ∘ o), stored for the other kernel, then a pass over the
  keys recomputing P and dP: dq. 3 matmuls per score block.
  ``*_dkdv`` (one program per key block): a pass over the queries of every head of its group that keep its keys,
  recomputing Pᵀ and dPᵀ: dk, dv, each written once. 4 matmuls per score block.
  So the backward does 7 matmuls where a dq-by-atomics kernel does 5, in exchange for no float32 dq buffer, no
  atomics and a reproducible result.
Packed calls read their rows by pointer (a descriptor's box would reach past a sequence's end) and zero-fill o, lse
(−∞), dq, dk, dv first: rows of no sequence are never written by a program. The masked kernels' shipped configs
read by pointer for fixed-length calls too: with ``indexing="tensor_descriptor"`` (host descriptors) their code,
as Helion 1.5.0 generates it for triton 3.6, stops on the H200 with an illegal instruction.

Helion 1.5.0 takes a dim of size 1 for a broadcast and drops the mask of a multi-row tile over it (every lane
loads and stores row 0): a length-1 query sequence is bound at two queries (code that reads the length as it runs,
the same for every length), and a packed tensor of one row is padded with a zero row and the extra row sliced off.
One key (Skv = 1) runs no kernel, forward or backward: its softmax weight is p = exp(score − score), 1 or NaN for a
non-finite score, so o = p·v and lse = the (capped) score, and the gradients follow in a few lines on the host.
"""

from __future__ import annotations

import math

import helion
import helion.language as hl
import torch

from hkernels.ops import _helion

Tensor = torch.Tensor
LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
_INT32_LIMIT = 2**31 - 1
MAX_HEAD_DIM = 128
# traced at a symbolic sequence length (see hkernels/ops/rms_norm.py): configs by D alone, one binding for every length
SYMBOLIC = frozenset({"attention_fwd", "attention_bwd"})


# Row reductions of full key blocks, written in Triton: Helion masks a torch.amax/sum over a tile element-wise
# (a select per score for each, as a dynamic-size block might be partial), which the main loop's blocks never are.
_ROW_MAX = "tl.max({0}, 1)"
_ROW_SUM = "tl.sum({0}, 1)"


@helion.kernel(static_shapes=False, dot_precision="ieee")
def _attention_fwd(
    q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, qk_scale: float, causal: hl.constexpr
) -> None:
    # q, o: [B, Hk, G, S, D]; k, v: [B, Hk, Skv, D]; lse: [B, Hk, G, S] float32 (natural log). qk_scale ≥ 0.
    # A program: BM queries of one head; reads its q block once and K/V once (blocks of BN keys), writes its o block
    # and lse once. The main loop walks full key blocks only: those left of the program's first query when causal,
    # else all but a partial last block. The second loop, with Helion's masks, takes the rest: the diagonal block
    # (masked causally; keys right of it are never read) or the partial last block.
    b, hk, g, s, d = q.size()
    skv = k.size(2)
    d = hl.specialize(d)
    block_n = hl.register_block_size(skv)
    for tile_m, tile_g, tile_h, tile_b in hl.tile([s, g, hk, b], block_size=[None, 1, 1, 1]):
        bi = tile_b.begin
        hi = tile_h.begin
        gi = tile_g.begin
        qi = q[bi, hi, gi, tile_m, :]
        # m_i: the running max of the raw scores; p = exp2((score − m)·qk_scale) is exactly 1 at a row's top score
        # (the fused exp2(score·qk_scale − m·qk_scale) gives it exp2 of the product's rounding error, ±1% at scores
        # ~1e5: o = v_top then misses by an ulp and dk by an ulp of dp times |q|; module docstring)
        m_i = hl.full([tile_m], float("-inf"), dtype=torch.float32)
        l_i = hl.zeros([tile_m], dtype=torch.float32)  # running Σ exp2((score − m_i)·qk_scale)
        acc = hl.zeros([tile_m, d], dtype=torch.float32)
        n_full = (tile_m.begin if causal else skv) // block_n * block_n
        for tile_n in hl.tile(0, n_full, block_size=block_n):
            kj = k[bi, hi, tile_n, :]
            sc = hl.dot(qi, kj.T, out_dtype=torch.float32)
            m_new = torch.maximum(m_i, hl.inline_triton(_ROW_MAX, [sc], m_i))
            p = torch.exp2((sc - m_new[:, None]) * qk_scale)
            # the accumulators' rescale; NaN only in the first block (m_i = −inf times a zero scale): 0 there
            dm = (m_i - m_new) * qk_scale
            alpha = torch.exp2(torch.where(dm == dm, dm, float("-inf")))
            l_i = l_i * alpha + hl.inline_triton(_ROW_SUM, [p], l_i)
            vj = v[bi, hi, tile_n, :]
            acc = hl.dot(p.to(vj.dtype), vj, acc=acc * alpha[:, None])
            m_i = m_new
        n_end = tile_m.end if causal else skv
        for tile_c in hl.tile(n_full, n_end, block_size=block_n):
            kc = k[bi, hi, tile_c, :]
            sc = hl.dot(qi, kc.T, out_dtype=torch.float32)
            if causal:  # noqa: SIM108 (a constexpr branch: Helion compiles one side)
                keep = tile_m.index[:, None] >= tile_c.index[None, :]
            else:
                # Keys past Skv: Helion masks the reductions but not the dot, and their score 0 (zero rows) gives
                # p = exp2(−m·qk_scale) = inf once every real score of a row is below about −88, then inf·0 = NaN
                # in p·v (|q| ~ 1e3 is enough). Causal blocks never reach past a real query's key.
                keep = tile_c.index[None, :] < skv
            sc = torch.where(keep, sc, float("-inf"))
            # Helion masks both reductions to the keys that exist. Key n_full <= every query of the tile, so the
            # first block leaves no row's max at −∞ (rows past S, never stored, may turn NaN)
            m_new = torch.maximum(m_i, torch.amax(sc, -1))
            # p selected, not left to exp2(−inf): with a zero scale (−inf)·0 is NaN
            p = torch.where(keep, torch.exp2((sc - m_new[:, None]) * qk_scale), 0.0)
            dm = (m_i - m_new) * qk_scale
            alpha = torch.exp2(torch.where(dm == dm, dm, float("-inf")))
            l_i = l_i * alpha + torch.sum(p, -1)
            vc = v[bi, hi, tile_c, :]
            acc = hl.dot(p.to(vc.dtype), vc, acc=acc * alpha[:, None])
            m_i = m_new
        o[bi, hi, gi, tile_m, :] = (acc / l_i[:, None]).to(o.dtype)
        lse[bi, hi, gi, tile_m] = (m_i * qk_scale + torch.log2(l_i)) * LN2


# Backward, with p_ij = exp2(qk_scale·q_i·k_j − lse_i·log2 e) = P_ij (the forward's softmax, recomputed):
#   dq_i = scale · Σ_j p_ij (dP_ij − δ_i) k_j,  dP_ij = do_i · v_j,  δ_i = do_i · o_i
#   dv_j = Σ_i p_ij do_i,  dk_j = scale · Σ_i p_ij (dP_ij − δ_i) q_i   (i over every query head of the group)
# Rows past the end load as zeros: their q and do are 0, so their p·do and dS·q terms vanish. Keys past the end load
# as zeros too, but their p = exp2(−lse_i·log2 e) is inf where every real score of a row is below about −88, and
# inf·0 = NaN in dS·k: dq masks them. dk, dv rows of such keys are never stored.
@helion.kernel(static_shapes=False, dot_precision="ieee")
def _attention_bwd_dq(
    do: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    o: Tensor,
    lse: Tensor,
    dq: Tensor,
    delta: Tensor,
    qk_scale: float,
    scale: float,
    causal: hl.constexpr,
) -> None:
    # do, q, o, dq: [B, Hk, G, S, D]; k, v: [B, Hk, Skv, D]; lse, delta: [B, Hk, G, S] float32.
    # A program: BM queries of one head; reads its q, do, o blocks and lse once, K/V once; writes dq and δ once.
    b, hk, g, s, d = q.size()
    skv = k.size(2)
    d = hl.specialize(d)
    for tile_m, tile_g, tile_h, tile_b in hl.tile([s, g, hk, b], block_size=[None, 1, 1, 1]):
        bi = tile_b.begin
        hi = tile_h.begin
        gi = tile_g.begin
        qi = q[bi, hi, gi, tile_m, :]
        doi = do[bi, hi, gi, tile_m, :]
        di = _delta(doi, o[bi, hi, gi, tile_m, :], tile_m.index)
        delta[bi, hi, gi, tile_m] = di
        lse2 = lse[bi, hi, gi, tile_m] * LOG2E
        acc = hl.zeros([tile_m, d], dtype=torch.float32)
        n_end = tile_m.begin if causal else skv
        for tile_n in hl.tile(0, n_end):
            kj = k[bi, hi, tile_n, :]
            p = torch.exp2(hl.dot(qi, kj.T, out_dtype=torch.float32) * qk_scale - lse2[:, None])
            p = torch.where(tile_n.index[None, :] < skv, p, 0.0)  # keys past Skv (see above)
            dp = hl.dot(doi, v[bi, hi, tile_n, :].T, out_dtype=torch.float32)
            ds = p * (dp - di[:, None])
            acc = hl.dot(ds.to(kj.dtype), kj, acc=acc)
        if causal:
            for tile_c in hl.tile(tile_m.begin, tile_m.end):
                kc = k[bi, hi, tile_c, :]
                p = torch.exp2(hl.dot(qi, kc.T, out_dtype=torch.float32) * qk_scale - lse2[:, None])
                p = torch.where(tile_m.index[:, None] >= tile_c.index[None, :], p, 0.0)
                dp = hl.dot(doi, v[bi, hi, tile_c, :].T, out_dtype=torch.float32)
                ds = p * (dp - di[:, None])
                acc = hl.dot(ds.to(kc.dtype), kc, acc=acc)
        dq[bi, hi, gi, tile_m, :] = (acc * scale).to(dq.dtype)


@helion.kernel(static_shapes=False, dot_precision="ieee")
def _attention_bwd_dkdv(
    do: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    lse: Tensor,
    delta: Tensor,
    dk: Tensor,
    dv: Tensor,
    qk_scale: float,
    scale: float,
    causal: hl.constexpr,
) -> None:
    # do, q: [B, Hk, G, S, D]; k, v, dk, dv: [B, Hk, Skv, D]; lse, delta: [B, Hk, G, S] float32.
    # A program: BN keys of one key/value head; reads its k, v blocks once and, for each of the G query heads of
    # the group, q, do, lse and δ once (blocks of BM queries); writes dk and dv once. Works transposed (keys as
    # rows: Sᵀ = k qᵀ) so that Pᵀ and dSᵀ feed their matmuls without a transpose. Causal: queries after the
    # program's keys need no mask, the diagonal block (queries at its own positions) is masked, queries before
    # it are never read. (The unmasked loop comes first so that its block size is the config's second entry
    # with or without causal.)
    b, hk, g, s, d = q.size()
    skv = k.size(2)
    d = hl.specialize(d)
    for tile_n, tile_h, tile_b in hl.tile([skv, hk, b], block_size=[None, 1, 1]):
        bi = tile_b.begin
        hi = tile_h.begin
        kj = k[bi, hi, tile_n, :]
        vj = v[bi, hi, tile_n, :]
        dk_acc = hl.zeros([tile_n, d], dtype=torch.float32)
        dv_acc = hl.zeros([tile_n, d], dtype=torch.float32)
        for gi in hl.grid(g):
            m_begin = tile_n.end if causal else 0
            for tile_m in hl.tile(m_begin, s):
                qi = q[bi, hi, gi, tile_m, :]
                doi = do[bi, hi, gi, tile_m, :]
                lse2 = lse[bi, hi, gi, tile_m] * LOG2E
                pt = torch.exp2(hl.dot(kj, qi.T, out_dtype=torch.float32) * qk_scale - lse2[None, :])
                dv_acc = hl.dot(pt.to(doi.dtype), doi, acc=dv_acc)
                dpt = hl.dot(vj, doi.T, out_dtype=torch.float32)
                dst = pt * (dpt - delta[bi, hi, gi, tile_m][None, :])
                dk_acc = hl.dot(dst.to(qi.dtype), qi, acc=dk_acc)
            if causal:
                for tile_c in hl.tile(tile_n.begin, tile_n.end):
                    qc = q[bi, hi, gi, tile_c, :]
                    doc = do[bi, hi, gi, tile_c, :]
                    lse2 = lse[bi, hi, gi, tile_c] * LOG2E
                    pt = torch.exp2(hl.dot(kj, qc.T, out_dtype=torch.float32) * qk_scale - lse2[None, :])
                    pt = torch.where(tile_c.index[None, :] >= tile_n.index[:, None], pt, 0.0)
                    dv_acc = hl.dot(pt.to(doc.dtype), doc, acc=dv_acc)
                    dpt = hl.dot(vj, doc.T, out_dtype=torch.float32)
                    dst = pt * (dpt - delta[bi, hi, gi, tile_c][None, :])
                    dk_acc = hl.dot(dst.to(qc.dtype), qc, acc=dk_acc)
        dk[bi, hi, tile_n, :] = (dk_acc * scale).to(dk.dtype)
        dv[bi, hi, tile_n, :] = dv_acc.to(dv.dtype)


# ------------------------------------------------------------------ windows, the logit cap and packed sequences
# The kernels below serve every call with a window or a cap, and every packed (varlen) call. A program works
# within one sequence: rows qa:qe of q and ka:ke of k, v (packed: cu_q, cu_k clamped to the rows that exist; else
# a whole batch entry, qa = ka = 0). Loops run over positions within the sequence; query i keeps key j when
# i + off − left ≤ j ≤ i + off + right, off = Sk − Sq (an unbounded side comes as a bound no position reaches).
# Packed rows are index vectors (qa + position), read by pointer under the loop's mask: nothing past the loop's
# end, so nothing of another sequence (a NaN included), enters a program's sums. Fixed-length rows are the tiles
# themselves, which a descriptor may read whole: rows past a loop's end are then the same batch entry's, dropped by
# the masks, or past the tensor, read as zeros. The helpers are traced op by op (torch's make_fx), where a
# ``[:, None]`` subscript does not lower: they unsqueeze.


def _tanh(x: Tensor) -> Tensor:
    """tanh by exp2 (the Triton interpreter has no libdevice.tanh); saturates to ±1 for large |x|."""
    return 1.0 - 2.0 / (torch.exp2(x * (2.0 * LOG2E)) + 1.0)


def _span(p0: Tensor, p1: Tensor, n: Tensor, off: Tensor, before: int, after: int, block: int
          ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """For positions p in [p0, p1) that keep the targets t with p + off − before ≤ t ≤ p + off + after and
    0 ≤ t < n: (lo, a, c, hi) with every kept target in [lo, hi) and [a, c), whole blocks, kept by every
    position (lo ≤ a ≤ c ≤ hi)."""
    lo = torch.clamp(p0 + off - before, min=0)
    hi = torch.clamp(torch.minimum(p1 + off + after, n), min=lo)
    a = torch.clamp(torch.maximum(p1 - 1 + off - before, lo), max=hi)
    c = torch.clamp(torch.minimum(p0 + off + after + 1, hi), min=a)
    return lo, a, a + (c - a) // block * block, hi


def _fwd_block(qi: Tensor, kj: Tensor, vj: Tensor, m_i: Tensor, l_i: Tensor, acc: Tensor, keep: Tensor | None,
               qk_scale: float, cap_scale: float, cap: float, softcap: bool) -> tuple[Tensor, Tensor, Tensor]:
    # One key block of the online softmax (the plain kernel's loop bodies, with the cap); keep: the scores kept,
    # or None for a block every query keeps (row reductions in Triton, no select).
    sc = hl.dot(qi, kj.T, out_dtype=torch.float32)
    if softcap:
        sc = cap * _tanh(sc * cap_scale)
    if keep is None:
        m_new = torch.maximum(m_i, hl.inline_triton(_ROW_MAX, [sc], m_i))
        p = torch.exp2((sc - m_new.unsqueeze(1)) * qk_scale)
        row_sum = hl.inline_triton(_ROW_SUM, [p], l_i)
    else:
        sc = torch.where(keep, sc, float("-inf"))
        # a row that keeps no key of the block keeps its max (−∞ before its first key); p is selected, not left
        # to exp2(−∞ − (−∞)) = NaN
        m_new = torch.maximum(m_i, torch.amax(sc, -1))
        p = torch.where(keep, torch.exp2((sc - m_new.unsqueeze(1)) * qk_scale), 0.0)
        row_sum = torch.sum(p, -1)
    dm = (m_i - m_new) * qk_scale
    alpha = torch.exp2(torch.where(dm == dm, dm, float("-inf")))
    acc = hl.dot(p.to(vj.dtype), vj, acc=acc * alpha.unsqueeze(1))
    return m_new, l_i * alpha + row_sum, acc


def _delta(doi: Tensor, oi: Tensor, index: Tensor) -> Tensor:
    # δ = rowsum(do ∘ o). In float32, as the diagonal of do·oᵀ: the very dot that gives dP = do·vᵀ, so where a
    # query keeps one key (o = v of that key) δ equals that key's dP bit for bit and dS = P ∘ (dP − δ) is exactly
    # 0, as in exact arithmetic (a row sum adds the same products in another order and leaves rounding noise in dq
    # and dk, above float32's tolerance for a zero). 16-bit inputs keep the row sum: their tolerance absorbs that
    # noise, and a [BM, BM] float32 tile would cost the tensor-core kernel registers.
    if doi.dtype != torch.float32:
        return torch.sum(doi.to(torch.float32) * oi.to(torch.float32), -1)
    both = hl.dot(doi, oi.T, out_dtype=torch.float32)
    return torch.sum(torch.where(index.unsqueeze(1) == index.unsqueeze(0), both, 0.0), -1)


def _dq_block(qi: Tensor, doi: Tensor, kj: Tensor, vj: Tensor, lse2: Tensor, di: Tensor, acc: Tensor,
              keep: Tensor | None, qk_scale: float, cap_scale: float, cap: float, softcap: bool) -> Tensor:
    # dq += dS k for one key block, dS = P ∘ (dP − δ) (∘ (1 − tanh²) under the cap); p selected where not kept:
    # a row that keeps no key has lse = −∞ and exp2 gives inf there.
    sc = hl.dot(qi, kj.T, out_dtype=torch.float32)
    if softcap:
        th = _tanh(sc * cap_scale)
        sc = cap * th
    p = torch.exp2(sc * qk_scale - lse2.unsqueeze(1))
    if keep is not None:
        p = torch.where(keep, p, 0.0)
    ds = p * (hl.dot(doi, vj.T, out_dtype=torch.float32) - di.unsqueeze(1))
    if softcap:
        ds = ds * (1.0 - th * th)
    return hl.dot(ds.to(kj.dtype), kj, acc=acc)


def _dkdv_block(kj: Tensor, vj: Tensor, qi: Tensor, doi: Tensor, lse2: Tensor, di: Tensor, dk_acc: Tensor,
                dv_acc: Tensor, keep: Tensor | None, qk_scale: float, cap_scale: float, cap: float, softcap: bool
                ) -> tuple[Tensor, Tensor]:
    # dv += Pᵀ do, dk += dSᵀ q for one query block, transposed (keys as rows).
    st = hl.dot(kj, qi.T, out_dtype=torch.float32)
    if softcap:
        th = _tanh(st * cap_scale)
        st = cap * th
    pt = torch.exp2(st * qk_scale - lse2.unsqueeze(0))
    if keep is not None:
        pt = torch.where(keep, pt, 0.0)
    dv_acc = hl.dot(pt.to(doi.dtype), doi, acc=dv_acc)
    dst = pt * (hl.dot(vj, doi.T, out_dtype=torch.float32) - di.unsqueeze(0))
    if softcap:
        dst = dst * (1.0 - th * th)
    return hl.dot(dst.to(qi.dtype), qi, acc=dk_acc), dv_acc


@helion.kernel(static_shapes=False, dot_precision="ieee")
def _attention_masked_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    o: Tensor,
    lse: Tensor,
    cu_q: Tensor,
    cu_k: Tensor,
    rows_q: int,
    rows_k: int,
    seqs: int,
    tq: int,
    tk: int,
    qk_scale: float,
    left: int,
    right: int,
    cap_scale: float,
    cap: float,
    packed: hl.constexpr,
    softcap: hl.constexpr,
) -> None:
    # q, o: [B, Hk, G, Tq, D]; k, v: [B, Hk, Tk, D]; lse: [B, Hk, G, Tq] float32. Packed: B = 1 and sequence s is
    # rows cu_q[s]:cu_q[s+1] of q, cu_k[s]:cu_k[s+1] of k, v; else sequence s is batch entry s (cu_q, cu_k unread).
    # tq, tk: the rows that exist; rows_q, rows_k: at most that many queries, keys of a sequence are seen
    # (max_seqlen: the grid's rows); seqs: N or B. Scores: (cap·tanh(cap_scale·q kᵀ) if softcap else q kᵀ),
    # p = exp2((score − m)·qk_scale).
    # A program: BM queries of one sequence and head; reads its q block once and the keys its rows keep once:
    # a masked head block or two, whole blocks every query keeps (no mask), a masked tail; writes o, lse once
    # (o = 0, lse = −∞ for a query that keeps no key). Programs past their sequence's end return at once.
    _, hk, g, _, d = q.size()
    d = hl.specialize(d)
    block_n = hl.register_block_size(k.size(2))
    for tile_m, tile_g, tile_h, tile_b in hl.tile([rows_q, g, hk, seqs], block_size=[None, 1, 1, 1]):
        gi = tile_g.begin
        hi = tile_h.begin
        if packed:
            bi = 0
            qa = torch.clamp(cu_q[tile_b.begin], 0, tq)
            qe = torch.clamp(torch.maximum(cu_q[tile_b.begin + 1], qa), max=tq)
            ka = torch.clamp(cu_k[tile_b.begin], 0, tk)
            ke = torch.clamp(torch.maximum(cu_k[tile_b.begin + 1], ka), max=tk)
        else:
            bi = tile_b.begin
            qa = hl.zeros([], dtype=torch.int32)
            qe = hl.full([], tq, dtype=torch.int32)
            ka = hl.zeros([], dtype=torch.int32)
            ke = hl.full([], tk, dtype=torch.int32)
        sq = qe - qa
        sk = ke - ka
        off = sk - sq
        if tile_m.begin < sq:
            in_seq = tile_m.index < sq
            qi = hl.load(q, [bi, hi, gi, qa + tile_m.index, slice(None)], extra_mask=in_seq[:, None])
            m_i = hl.full([tile_m], float("-inf"), dtype=torch.float32)
            l_i = hl.zeros([tile_m], dtype=torch.float32)
            acc = hl.zeros([tile_m, d], dtype=torch.float32)
            # keys past rows_k (max_seqlen_k) are not seen, as the dk/dv kernel's grid does not reach them
            lo, a, c, hi_n = _span(tile_m.begin, torch.clamp(sq, max=tile_m.end), torch.clamp(sk, max=rows_k), off,
                                   left, right, block_n)
            pos = (tile_m.index + off)[:, None]  # each query's position among the keys
            for tile_n in hl.tile(lo, a, block_size=block_n):
                kr = ka + tile_n.index if packed else tile_n
                keep = (tile_n.index[None, :] >= pos - left) & (tile_n.index[None, :] <= pos + right) & (
                    tile_n.index < a)[None, :]
                m_i, l_i, acc = _fwd_block(qi, k[bi, hi, kr, :], v[bi, hi, kr, :], m_i, l_i, acc, keep, qk_scale,
                                           cap_scale, cap, softcap)
            for tile_n in hl.tile(a, c, block_size=block_n):
                kr = ka + tile_n.index if packed else tile_n
                m_i, l_i, acc = _fwd_block(qi, k[bi, hi, kr, :], v[bi, hi, kr, :], m_i, l_i, acc, None, qk_scale,
                                           cap_scale, cap, softcap)
            for tile_n in hl.tile(c, hi_n, block_size=block_n):
                kr = ka + tile_n.index if packed else tile_n
                keep = (tile_n.index[None, :] >= pos - left) & (tile_n.index[None, :] <= pos + right) & (
                    tile_n.index < hi_n)[None, :]
                m_i, l_i, acc = _fwd_block(qi, k[bi, hi, kr, :], v[bi, hi, kr, :], m_i, l_i, acc, keep, qk_scale,
                                           cap_scale, cap, softcap)
            none = m_i == float("-inf")  # the query keeps no key
            out = torch.where(none[:, None], 0.0, acc / l_i[:, None])
            hl.store(o, [bi, hi, gi, qa + tile_m.index, slice(None)], out.to(o.dtype), extra_mask=in_seq[:, None])
            row_lse = torch.where(none, float("-inf"), (m_i * qk_scale + torch.log2(l_i)) * LN2)
            hl.store(lse, [bi, hi, gi, qa + tile_m.index], row_lse, extra_mask=in_seq)


@helion.kernel(static_shapes=False, dot_precision="ieee")
def _attention_masked_bwd_dq(
    do: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    o: Tensor,
    lse: Tensor,
    dq: Tensor,
    delta: Tensor,
    cu_q: Tensor,
    cu_k: Tensor,
    rows_q: int,
    rows_k: int,
    seqs: int,
    tq: int,
    tk: int,
    qk_scale: float,
    scale: float,
    left: int,
    right: int,
    cap_scale: float,
    cap: float,
    packed: hl.constexpr,
    softcap: hl.constexpr,
) -> None:
    # do, q, o, dq: [B, Hk, G, Tq, D]; k, v: [B, Hk, Tk, D]; lse, delta: [B, Hk, G, Tq] float32; the rest as in
    # _attention_masked_fwd. A program: BM queries of one sequence and head; reads its q, do, o blocks and lse
    # once and the keys its rows keep once (masked head, unmasked whole blocks, masked tail); writes dq and δ once.
    _, hk, g, _, d = q.size()
    d = hl.specialize(d)
    block_n = hl.register_block_size(k.size(2))
    for tile_m, tile_g, tile_h, tile_b in hl.tile([rows_q, g, hk, seqs], block_size=[None, 1, 1, 1]):
        gi = tile_g.begin
        hi = tile_h.begin
        if packed:
            bi = 0
            qa = torch.clamp(cu_q[tile_b.begin], 0, tq)
            qe = torch.clamp(torch.maximum(cu_q[tile_b.begin + 1], qa), max=tq)
            ka = torch.clamp(cu_k[tile_b.begin], 0, tk)
            ke = torch.clamp(torch.maximum(cu_k[tile_b.begin + 1], ka), max=tk)
        else:
            bi = tile_b.begin
            qa = hl.zeros([], dtype=torch.int32)
            qe = hl.full([], tq, dtype=torch.int32)
            ka = hl.zeros([], dtype=torch.int32)
            ke = hl.full([], tk, dtype=torch.int32)
        sq = qe - qa
        sk = ke - ka
        off = sk - sq
        if tile_m.begin < sq:
            in_seq = tile_m.index < sq
            rows = qa + tile_m.index
            qi = hl.load(q, [bi, hi, gi, rows, slice(None)], extra_mask=in_seq[:, None])
            doi = hl.load(do, [bi, hi, gi, rows, slice(None)], extra_mask=in_seq[:, None])
            oi = hl.load(o, [bi, hi, gi, rows, slice(None)], extra_mask=in_seq[:, None])
            di = _delta(doi, oi, rows)
            hl.store(delta, [bi, hi, gi, rows], di, extra_mask=in_seq)
            lse2 = hl.load(lse, [bi, hi, gi, rows], extra_mask=in_seq) * LOG2E
            acc = hl.zeros([tile_m, d], dtype=torch.float32)
            lo, a, c, hi_n = _span(tile_m.begin, torch.clamp(sq, max=tile_m.end), torch.clamp(sk, max=rows_k), off,
                                   left, right, block_n)
            pos = (tile_m.index + off)[:, None]
            for tile_n in hl.tile(lo, a, block_size=block_n):
                kr = ka + tile_n.index if packed else tile_n
                keep = (tile_n.index[None, :] >= pos - left) & (tile_n.index[None, :] <= pos + right) & (
                    tile_n.index < a)[None, :]
                acc = _dq_block(qi, doi, k[bi, hi, kr, :], v[bi, hi, kr, :], lse2, di, acc, keep, qk_scale,
                                cap_scale, cap, softcap)
            for tile_n in hl.tile(a, c, block_size=block_n):
                kr = ka + tile_n.index if packed else tile_n
                acc = _dq_block(qi, doi, k[bi, hi, kr, :], v[bi, hi, kr, :], lse2, di, acc, None, qk_scale,
                                cap_scale, cap, softcap)
            for tile_n in hl.tile(c, hi_n, block_size=block_n):
                kr = ka + tile_n.index if packed else tile_n
                keep = (tile_n.index[None, :] >= pos - left) & (tile_n.index[None, :] <= pos + right) & (
                    tile_n.index < hi_n)[None, :]
                acc = _dq_block(qi, doi, k[bi, hi, kr, :], v[bi, hi, kr, :], lse2, di, acc, keep, qk_scale,
                                cap_scale, cap, softcap)
            hl.store(dq, [bi, hi, gi, rows, slice(None)], (acc * scale).to(dq.dtype), extra_mask=in_seq[:, None])


@helion.kernel(static_shapes=False, dot_precision="ieee")
def _attention_masked_bwd_dkdv(
    do: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    lse: Tensor,
    delta: Tensor,
    dk: Tensor,
    dv: Tensor,
    cu_q: Tensor,
    cu_k: Tensor,
    rows_q: int,
    rows_k: int,
    seqs: int,
    tq: int,
    tk: int,
    qk_scale: float,
    scale: float,
    left: int,
    right: int,
    cap_scale: float,
    cap: float,
    packed: hl.constexpr,
    softcap: hl.constexpr,
) -> None:
    # do, q: [B, Hk, G, Tq, D]; k, v, dk, dv: [B, Hk, Tk, D]; lse, delta: [B, Hk, G, Tq] float32; the rest as in
    # _attention_masked_fwd. A program: BN keys of one sequence and key/value head; reads its k, v blocks once and,
    # for each query head of the group, the queries that keep any of its keys once: query j − off − right .. j −
    # off + left for key j (masked head, unmasked whole blocks, masked tail); writes dk, dv once.
    _, hk, g, _, d = q.size()
    d = hl.specialize(d)
    block_m = hl.register_block_size(q.size(3))
    for tile_n, tile_h, tile_b in hl.tile([rows_k, hk, seqs], block_size=[None, 1, 1]):
        hi = tile_h.begin
        if packed:
            bi = 0
            qa = torch.clamp(cu_q[tile_b.begin], 0, tq)
            qe = torch.clamp(torch.maximum(cu_q[tile_b.begin + 1], qa), max=tq)
            ka = torch.clamp(cu_k[tile_b.begin], 0, tk)
            ke = torch.clamp(torch.maximum(cu_k[tile_b.begin + 1], ka), max=tk)
        else:
            bi = tile_b.begin
            qa = hl.zeros([], dtype=torch.int32)
            qe = hl.full([], tq, dtype=torch.int32)
            ka = hl.zeros([], dtype=torch.int32)
            ke = hl.full([], tk, dtype=torch.int32)
        sq = qe - qa
        sk = ke - ka
        off = sk - sq
        if tile_n.begin < sk:
            in_seq = tile_n.index < sk
            rows = ka + tile_n.index
            kj = hl.load(k, [bi, hi, rows, slice(None)], extra_mask=in_seq[:, None])
            vj = hl.load(v, [bi, hi, rows, slice(None)], extra_mask=in_seq[:, None])
            dk_acc = hl.zeros([tile_n, d], dtype=torch.float32)
            dv_acc = hl.zeros([tile_n, d], dtype=torch.float32)
            # queries past rows_q (max_seqlen_q) are not seen: the forward's grid does not reach them
            lo, a, c, hi_m = _span(tile_n.begin, torch.clamp(sk, max=tile_n.end), torch.clamp(sq, max=rows_q), -off,
                                   right, left, block_m)
            j = tile_n.index[:, None]
            for gi in hl.grid(g):
                for tile_m in hl.tile(lo, a, block_size=block_m):
                    qr = qa + tile_m.index if packed else tile_m
                    pos = (tile_m.index + off)[None, :]
                    keep = (j >= pos - left) & (j <= pos + right) & (tile_m.index < a)[None, :]
                    dk_acc, dv_acc = _dkdv_block(kj, vj, q[bi, hi, gi, qr, :], do[bi, hi, gi, qr, :],
                                                 lse[bi, hi, gi, qr] * LOG2E, delta[bi, hi, gi, qr], dk_acc, dv_acc,
                                                 keep, qk_scale, cap_scale, cap, softcap)
                for tile_m in hl.tile(a, c, block_size=block_m):
                    qr = qa + tile_m.index if packed else tile_m
                    dk_acc, dv_acc = _dkdv_block(kj, vj, q[bi, hi, gi, qr, :], do[bi, hi, gi, qr, :],
                                                 lse[bi, hi, gi, qr] * LOG2E, delta[bi, hi, gi, qr], dk_acc, dv_acc,
                                                 None, qk_scale, cap_scale, cap, softcap)
                for tile_m in hl.tile(c, hi_m, block_size=block_m):
                    qr = qa + tile_m.index if packed else tile_m
                    pos = (tile_m.index + off)[None, :]
                    keep = (j >= pos - left) & (j <= pos + right) & (tile_m.index < hi_m)[None, :]
                    dk_acc, dv_acc = _dkdv_block(kj, vj, q[bi, hi, gi, qr, :], do[bi, hi, gi, qr, :],
                                                 lse[bi, hi, gi, qr] * LOG2E, delta[bi, hi, gi, qr], dk_acc, dv_acc,
                                                 keep, qk_scale, cap_scale, cap, softcap)
            hl.store(dk, [bi, hi, rows, slice(None)], (dk_acc * scale).to(dk.dtype), extra_mask=in_seq[:, None])
            hl.store(dv, [bi, hi, rows, slice(None)], dv_acc.to(dv.dtype), extra_mask=in_seq[:, None])


def _head_dim_refused(d: int) -> str | None:
    # [rows, D] float32 accumulators of D = 256 with the shipped tiles need more registers and shared memory than
    # an SM has; Triton's twin takes D = 256 with tiles of its own.
    if d > MAX_HEAD_DIM:
        return f"the Helion kernels take head dims up to {MAX_HEAD_DIM}, got {d} (the Triton backend runs D = 256)"
    return None


def refuses(fn: str, tensors: tuple[Tensor, ...]) -> str | None:
    """Why these kernels refuse a call of ``fn`` on ``tensors`` (q, or the gradient, first: its last dim is D)
    before trying it, or None: the dispatcher's auto routes such calls to another backend without a warning."""
    return _head_dim_refused(tensors[0].shape[-1]) if tensors and tensors[0].dim() else None


def _check_head_dim(d: int) -> None:
    reason = _head_dim_refused(d)
    if reason is not None:
        raise ValueError(f"attention: {reason}")


def _max_offset(x: Tensor) -> int:
    return sum((n - 1) * st for n, st in zip(x.shape, x.stride(), strict=True) if n > 0)


def _prepare(x: Tensor) -> Tensor:
    """x itself, or a contiguous copy where the kernels cannot read it in place: Helion picks 32-bit offsets from
    element counts, and a view into a larger buffer (q sliced out of a fused qkv projection) can reach past 2^31
    with fewer elements; a broadcast (stride 0, e.g. an expanded gradient) has no tensor-memory descriptor."""
    overflow = _max_offset(x) > _INT32_LIMIT and x.numel() <= _INT32_LIMIT
    broadcast = any(st == 0 and n > 1 for n, st in zip(x.shape, x.stride(), strict=True))
    return x.contiguous() if overflow or broadcast else x


# Where the kernels' arguments hold the query length (their dim 3: [B, Hk, G, S, ...]): a call of one query binds
# at two (see _helion.compiled), so a decode step launches its kernels alone.
_FWD_ROWS = ((0, 3), (3, 3), (4, 3))  # q, o, lse
_DQ_ROWS = ((0, 3), (1, 3), (4, 3), (5, 3), (6, 3), (7, 3))  # do, q, o, lse, dq, delta
_DKDV_ROWS = ((0, 3), (1, 3), (4, 3), (5, 3))  # do, q, lse, delta


def _pad_row(x: Tensor, dim: int = -2) -> Tensor:
    """[..., 1, D] -> [..., 2, D] with a zero second row (see the module docstring: size-1 dims)."""
    return torch.cat([x, x.new_zeros(x.shape)], dim=dim)


def _groups(x: Tensor, hk: int) -> Tensor:
    """[B, Hq, S, ...] -> the view [B, Hk, G, S, ...]."""
    return x.unflatten(1, (hk, x.shape[1] // hk))


def _packed(x: Tensor, hk: int | None = None) -> Tensor:
    """Packed [T, Hq, D] -> the view [1, Hk, G, T, D]; without hk (k, v): [T, Hk, D] -> [1, Hk, T, D]."""
    if hk is None:
        return x.transpose(0, 1).unsqueeze(0)
    return x.unflatten(1, (hk, x.shape[1] // hk)).permute(1, 2, 0, 3).unsqueeze(0)


def _options(causal: bool, scale: float, left: int, right: int, softcap: float, bound: int
             ) -> tuple[float, int, int, float, float]:
    """The masked kernels' (qk_scale, left, right, cap_scale, cap): an unbounded side (−1) becomes ``bound``, a
    distance no position reaches (and a larger one is cut to it: the kernels' int32 sums stay in range); under a
    cap the score is cap·tanh(scale·q kᵀ / cap) in natural units, so qk_scale is log2 e."""
    right = 0 if causal else right
    left, right = (min(w, bound) if w >= 0 else bound for w in (left, right))
    if softcap > 0:
        return LOG2E, left, right, scale / softcap, softcap
    return scale * LOG2E, left, right, 0.0, 0.0


def _bound(S: int, Skv: int) -> int:
    """A distance no position of these lengths reaches: S + Skv, or at a symbolic length (a graph whose length
    varies) 2^30, which no position reaches either and whose sums with a position stay within int32."""
    return S + Skv if type(S) is int and type(Skv) is int else 1 << 30


def _one_key(q: Tensor, k: Tensor, scale: float, softcap: float) -> tuple[Tensor, Tensor]:
    """Skv = 1: (the (capped) score [B, Hq, S, 1] float32, k in float32 repeated to the query heads)."""
    kf = k.float().repeat_interleave(q.shape[1] // k.shape[1], 1)
    score = (q.float() * kf).sum(-1, keepdim=True) * scale
    if softcap > 0:
        score = softcap * torch.tanh(score / softcap)
    return score, kf


def attention_fwd(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, left: int = -1, right: int = -1,
                  softcap: float = 0.0) -> tuple[Tensor, Tensor]:
    """q: [B, Hq, S, D]; k, v: [B, Hk, Skv, D] (unit stride along D; Hq a multiple of Hk; causal or a window needs
    S = Skv); left, right: the window (−1 unbounded; causal: right = 0); softcap: the cap c (0: none)
    -> (o [B, Hq, S, D] contiguous in q's dtype, lse [B, Hq, S] float32, natural-log logsumexp of the scores)."""
    B, Hq, S, D = q.shape
    Hk, Skv = k.shape[1], k.shape[2]
    Hq, Hk, D = int(Hq), int(Hk), int(D)  # (static dims: constants of a graph with every size symbolic)
    right = 0 if causal else right
    assert k.shape == v.shape == (B, Hk, Skv, D) and Hq % Hk == 0 and (Skv == S or (left < 0 and right < 0))
    _check_head_dim(D)
    if Skv == 1:
        # One key: its softmax weight p = exp(score − score) is 1, or NaN for a non-finite score (as PyTorch's
        # softmax gives), so o = p·v and lse = the score (see the module docstring): o stays NaN where PyTorch's
        # is (a NaN in q), which a plain o = v would not. (A window keeps key 0 for query 0, the only one.)
        score, _ = _one_key(q, k, scale, softcap)
        o = (torch.exp(score - score) * v.float().repeat_interleave(Hq // Hk, 1)).to(q.dtype)
        return o.expand(B, Hq, S, D).contiguous(), score.squeeze(-1)
    q, k, v = (_prepare(t) for t in (q, k, v))
    masked = left >= 0 or right > 0 or softcap > 0  # right = 0 alone is causal, which the plain kernel takes
    causal = right == 0 and bool(S > 1)  # one query, one key: nothing to mask (a bool also at a symbolic S)
    if scale < 0 and softcap == 0:  # the kernel takes row maxima before scaling: give it (−q, −scale), the same scores
        q, scale = -q, -scale
    o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
    if masked:
        qk_scale, lo, hi, cap_scale, cap = _options(False, scale, left, right, softcap, _bound(S, Skv))
        # lse stands in for the unread cu_seqlens
        args = (_groups(q, Hk), k, v, _groups(o, Hk), _groups(lse, Hk), lse, lse, S, Skv, B, S, Skv, qk_scale, lo,
                hi, cap_scale, cap, False, softcap > 0)
        _helion.run(_attention_masked_fwd, args, D, q.device, rows=(*_FWD_ROWS, (5, 2), (6, 2)))
    else:
        args = (_groups(q, Hk), k, v, _groups(o, Hk), _groups(lse, Hk), scale * LOG2E, causal)
        _helion.run(_attention_fwd, args, D, q.device, rows=_FWD_ROWS)
    return o, lse


def attention_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, causal: bool, scale: float,
                  left: int = -1, right: int = -1, softcap: float = 0.0) -> tuple[Tensor, Tensor, Tensor]:
    """do, q, o: [B, Hq, S, D]; k, v: [B, Hk, Skv, D] (unit stride along D); lse: [B, Hq, S] float32 from
    :func:`attention_fwd` with the same options -> (dq, dk, dv), contiguous, in the dtypes and shapes of q, k, v
    (dk, dv summed over each group's query heads). dq comes from its own kernel over query blocks (no atomics)."""
    B, Hq, S, D = q.shape
    Hk, Skv = k.shape[1], k.shape[2]
    Hq, Hk, D = int(Hq), int(Hk), int(D)  # (static dims: constants of a graph with every size symbolic)
    right = 0 if causal else right
    assert k.shape == v.shape == (B, Hk, Skv, D) and Hq % Hk == 0 and (Skv == S or (left < 0 and right < 0))
    _check_head_dim(D)
    assert do.shape == o.shape == q.shape and lse.shape == q.shape[:-1]
    if Skv == 1:
        # One key: its softmax weight p = exp(score − lse) is 1 (NaN for a non-finite score), so dS = p·(do·v − do·o)
        # is 0 and dv sums p·do over the group's queries; written out, no kernel. (Through the kernels, a zero
        # second key row would get p = exp2(−lse·log2 e), inf once the scores are large and negative, and
        # inf·0 = NaN in dq.) Under a cap dS is scaled by 1 − tanh², still 0.
        group = Hq // Hk
        score, kf = _one_key(q, k, scale, softcap)
        vf = v.float().repeat_interleave(group, 1)
        p = torch.exp(score - lse.unsqueeze(-1))
        dof = do.float()
        ds = p * ((dof * vf).sum(-1, keepdim=True) - (dof * o.float()).sum(-1, keepdim=True))
        if softcap > 0:
            ds = ds * (1 - (score / softcap) ** 2)
        per_kv = lambda t: t.unflatten(1, (Hk, group)).sum((2, 3)).unsqueeze(2)
        return ((ds * kf * scale).to(q.dtype), per_kv(ds * q.float() * scale).to(k.dtype),
                per_kv(p * dof).to(v.dtype))
    do, q, k, v, o, lse = (_prepare(t) for t in (do, q, k, v, o, lse))
    masked = left >= 0 or right > 0 or softcap > 0
    causal = right == 0 and bool(S > 1)
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    delta = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
    qg, dog, lseg, deltag = (_groups(t, Hk) for t in (q, do, lse, delta))
    # dq first: it writes δ, which the dk/dv kernel reads
    if masked:
        qk_scale, lo, hi, cap_scale, cap = _options(False, scale, left, right, softcap, _bound(S, Skv))
        rest = (lse, lse, S, Skv, B, S, Skv, qk_scale, scale, lo, hi, cap_scale, cap, False, softcap > 0)
        _helion.run(_attention_masked_bwd_dq, (dog, qg, k, v, _groups(o, Hk), lseg, _groups(dq, Hk), deltag, *rest),
                    D, q.device, rows=(*_DQ_ROWS, (8, 2), (9, 2)))
        _helion.run(_attention_masked_bwd_dkdv, (dog, qg, k, v, lseg, deltag, dk, dv, *rest), D, q.device,
                    rows=(*_DKDV_ROWS, (8, 2), (9, 2)))
    else:
        dq_args = (dog, qg, k, v, _groups(o, Hk), lseg, _groups(dq, Hk), deltag, scale * LOG2E, scale, causal)
        _helion.run(_attention_bwd_dq, dq_args, D, q.device, rows=_DQ_ROWS)
        dkdv_args = (dog, qg, k, v, lseg, deltag, dk, dv, scale * LOG2E, scale, causal)
        _helion.run(_attention_bwd_dkdv, dkdv_args, D, q.device, rows=_DKDV_ROWS)
    return dq, dk, dv


# Calls with a window or a cap, under names of their own: auto routes them by their own measurements.
attention_masked_fwd = attention_fwd
attention_masked_bwd = attention_bwd


def attention_varlen_fwd(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int,
                         causal: bool, scale: float, left: int = -1, right: int = -1, softcap: float = 0.0
                         ) -> tuple[Tensor, Tensor]:
    """Packed q: [Tq, Hq, D]; k, v: [Tk, Hk, D] (unit stride along D); cu_q, cu_k: [N + 1] int32 on the device
    (never read on the host); max_q, max_k: the longest sequences (the grid), options as in :func:`attention_fwd`
    with the masks aligned at each sequence's end -> (o [Tq, Hq, D] in q's dtype, lse [Hq, Tq] float32; o = 0 and
    lse = −∞ for rows of no sequence or that keep no key)."""
    Tq, Hq, D = q.shape
    Tk, Hk = k.shape[0], k.shape[1]
    assert k.shape == v.shape == (Tk, Hk, D) and Hq % Hk == 0 and cu_q.shape == cu_k.shape
    _check_head_dim(D)
    assert cu_q.dtype == cu_k.dtype == torch.int32
    q, k, v = (_prepare(t) for t in (q, k, v))
    if scale < 0 and softcap == 0:  # row maxima are taken before scaling (see attention_fwd)
        q, scale = -q, -scale
    if Tq == 1:  # size-1 dims (module docstring): padded rows lie past tq, tk, so no sequence reaches them
        q = _pad_row(q, 0)
    if Tk == 1:
        k, v = _pad_row(k, 0), _pad_row(v, 0)
    o = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.full((Hq, q.shape[0]), float("-inf"), dtype=torch.float32, device=q.device)
    rows_q, rows_k = min(max_q, Tq), min(max_k, Tk)
    if rows_q > 0 and rows_k > 0 and cu_q.shape[0] > 1:
        qk_scale, lo, hi, cap_scale, cap = _options(causal, scale, left, right, softcap, Tq + Tk)
        args = (_packed(q, Hk), _packed(k), _packed(v), _packed(o, Hk), lse.unflatten(0, (Hk, -1))[None],
                cu_q, cu_k, rows_q, rows_k, cu_q.shape[0] - 1, Tq, Tk, qk_scale, lo, hi, cap_scale, cap, True,
                softcap > 0)
        _helion.run(_attention_masked_fwd, args, D, q.device)
    if Tq == 1:  # (row 0 as a tensor of its own, not a view: a caller may write into the result in place)
        o, lse = torch.ops.aten._unsafe_view(o[:1], (1, *o.shape[1:])), lse[:, :1].contiguous()
    return o, lse


def attention_varlen_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, cu_q: Tensor,
                         cu_k: Tensor, max_q: int, max_k: int, causal: bool, scale: float, left: int = -1,
                         right: int = -1, softcap: float = 0.0) -> tuple[Tensor, Tensor, Tensor]:
    """do, q, o: [Tq, Hq, D]; k, v: [Tk, Hk, D]; lse: [Hq, Tq] float32 from :func:`attention_varlen_fwd` with the
    same options -> (dq, dk, dv) in the dtypes and shapes of q, k, v (zeros for rows of no sequence)."""
    Tq, Hq, D = q.shape
    Tk, Hk = k.shape[0], k.shape[1]
    assert k.shape == v.shape == (Tk, Hk, D) and Hq % Hk == 0 and cu_q.shape == cu_k.shape
    _check_head_dim(D)
    assert do.shape == o.shape == q.shape and lse.shape == (Hq, Tq) and cu_q.dtype == cu_k.dtype == torch.int32
    do, q, k, v, o, lse = (_prepare(t) for t in (do, q, k, v, o, lse))
    if Tq == 1:
        do, q, o = _pad_row(do, 0), _pad_row(q, 0), _pad_row(o, 0)
        lse = torch.cat([lse, lse.new_zeros(lse.shape)], dim=-1)
    if Tk == 1:
        k, v = _pad_row(k, 0), _pad_row(v, 0)
    dq = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.zeros(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.zeros(v.shape, dtype=v.dtype, device=v.device)
    rows_q, rows_k = min(max_q, Tq), min(max_k, Tk)
    if rows_q > 0 and rows_k > 0 and cu_q.shape[0] > 1:
        delta = torch.empty(lse.shape, dtype=torch.float32, device=q.device)
        lse_g, delta_g = (t.unflatten(0, (Hk, -1))[None] for t in (lse, delta))
        qk_scale, lo, hi, cap_scale, cap = _options(causal, scale, left, right, softcap, Tq + Tk)
        rest = (cu_q, cu_k, rows_q, rows_k, cu_q.shape[0] - 1, Tq, Tk, qk_scale, scale, lo, hi, cap_scale, cap, True,
                softcap > 0)
        qp, dop, kp, vp = _packed(q, Hk), _packed(do, Hk), _packed(k), _packed(v)
        # dq first: it writes δ, which the dk/dv kernel reads
        _helion.run(_attention_masked_bwd_dq, (dop, qp, kp, vp, _packed(o, Hk), lse_g, _packed(dq, Hk), delta_g,
                                               *rest), D, q.device)
        _helion.run(_attention_masked_bwd_dkdv, (dop, qp, kp, vp, lse_g, delta_g, _packed(dk), _packed(dv),
                                                 *rest), D, q.device)
    return dq[:Tq], dk[:Tk], dv[:Tk]
