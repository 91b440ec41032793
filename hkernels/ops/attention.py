"""Flash attention, forward and backward, in Helion (the twin of ``triton_fallback/attention.py``).

Math, per (batch, query head), with scores S = scale · q kᵀ (key j > query i set to −∞ when causal):
    forward   lse_i = log Σ_j exp(S_ij),  P = exp(S − lse),  o = P v
    backward  δ_i = Σ_d do_id · o_id,  dv = Pᵀ do,  dP = do vᵀ,  dS = P ∘ (dP − δ),  dq = scale · dS k,
              dk = scale · dSᵀ q   (dk, dv summed over the query heads that share the key/value head)

Shapes: q, do: [B, Hq, S, D]; k, v: [B, Hk, Skv, D] with Hq = G·Hk (query head h reads key/value head h // G);
any strides with unit stride along D (transposed views of [B, S, H, D] projections are read in place); D is
specialised. The kernels see q-like tensors as [B, Hk, G, S, D] views, so a program's key/value head is its own
index, not a division. Causal masking is for S = Skv (the diagonal block of a tile is masked, blocks left of it
are not). Softmax runs in base 2 (log2 e folded into the scale: P = exp2((S' − m)·scale·log2 e) with S' = q kᵀ and m
its running row max), float32 throughout; P and dS are rounded to the input dtype for their matmuls, as every flash
kernel does.

Work and traffic, N = B·Hq·S·Skv score elements (half of them when causal):
- forward: 4·N·D flops; one program per block of BM queries keeps its q on chip and streams K/V once (online
  softmax: a running max m and sum l rescale the accumulator when the max grows); writes o and lse once. Programs
  of one head run next to each other (the query-block index varies fastest) so K/V come from L2. Per score the
  main loop spends a subtract, a multiply, one exp2, a max and an add beside the matmuls: its full key blocks
  need no masks, so its two row reductions are written in Triton (Helion's own would select per element). The
  running max is of the raw scores, p = exp2((s − m)·scale·log2 e): a row's top score gets p = 1 exactly (the
  fused exp2(s·c − m·c), one FMA, gives it exp2 of a rounding error, ±1% at scores ~1e5, which the backward's
  exact cancellation at that key turns into an error of |q| times an ulp in dk).
- backward: two kernels, no S × Skv matrix and no atomics (deterministic):
  ``_attention_bwd_dq`` (one program per query block): δ = rowsum(do ∘ o), stored for the other kernel, then a
  pass over K/V recomputing P and dP: dq. 3 matmuls per score block.
  ``_attention_bwd_dkdv`` (one program per key block): a pass over the queries of every head of its group,
  recomputing Pᵀ and dPᵀ: dk, dv, each written once. 4 matmuls per score block.
  So the backward does 7 matmuls where a dq-by-atomics kernel does 5, in exchange for no float32 dq buffer, no
  atomics and a reproducible result.

Helion 1.5.0 takes a dim of size 1 for a broadcast and drops the mask of a multi-row tile over it (every lane
loads and stores row 0): a length-1 query sequence is padded with a zero row (q is tiny then) and the extra row
sliced off. One key (Skv = 1) runs no kernel, forward or backward: its softmax weight is p = exp(score − score), 1
or NaN for a non-finite score, so o = p·v and lse = the score, and the gradients follow in a few lines on the host.
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
        di = torch.sum(doi.to(torch.float32) * o[bi, hi, gi, tile_m, :].to(torch.float32), -1)
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


def _max_offset(x: Tensor) -> int:
    return sum((n - 1) * st for n, st in zip(x.shape, x.stride(), strict=True) if n > 0)


def _prepare(x: Tensor) -> Tensor:
    """x itself, or a contiguous copy where the kernels cannot read it in place: Helion picks 32-bit offsets from
    element counts, and a view into a larger buffer (q sliced out of a fused qkv projection) can reach past 2^31
    with fewer elements; a broadcast (stride 0, e.g. an expanded gradient) has no tensor-memory descriptor."""
    overflow = _max_offset(x) > _INT32_LIMIT and x.numel() <= _INT32_LIMIT
    broadcast = any(st == 0 and n > 1 for n, st in zip(x.shape, x.stride(), strict=True))
    return x.contiguous() if overflow or broadcast else x


def _pad_row(x: Tensor) -> Tensor:
    """[..., 1, D] -> [..., 2, D] with a zero second row (see the module docstring: size-1 dims)."""
    return torch.cat([x, x.new_zeros(x.shape)], dim=-2)


def _groups(x: Tensor, hk: int) -> Tensor:
    """[B, Hq, S, ...] -> the view [B, Hk, G, S, ...]."""
    return x.unflatten(1, (hk, x.shape[1] // hk))


def attention_fwd(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    """q: [B, Hq, S, D]; k, v: [B, Hk, Skv, D] (unit stride along D; Hq a multiple of Hk; causal needs S = Skv)
    -> (o [B, Hq, S, D] contiguous in q's dtype, lse [B, Hq, S] float32, natural-log logsumexp of the scores)."""
    B, Hq, S, D = q.shape
    Hk, Skv = k.shape[1], k.shape[2]
    assert k.shape == v.shape == (B, Hk, Skv, D) and Hq % Hk == 0 and (Skv == S or not causal)
    if Skv == 1:
        # One key: its softmax weight p = exp(score − score) is 1, or NaN for a non-finite score (as PyTorch's
        # softmax gives), so o = p·v and lse = the score (see the module docstring): o stays NaN where PyTorch's
        # is (a NaN in q), which a plain o = v would not.
        kf = k.float().repeat_interleave(Hq // Hk, 1)
        score = (q.float() * kf).sum(-1, keepdim=True) * scale
        o = (torch.exp(score - score) * v.float().repeat_interleave(Hq // Hk, 1)).to(q.dtype)
        return o.expand(B, Hq, S, D).contiguous(), score.squeeze(-1)
    q, k, v = (_prepare(t) for t in (q, k, v))
    causal = causal and S > 1  # one query, one key: nothing to mask
    if scale < 0:  # the kernel takes row maxima before scaling: give it (−q, −scale), the same scores
        q, scale = -q, -scale
    if S == 1:
        q = _pad_row(q)
    o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
    args = (_groups(q, Hk), k, v, _groups(o, Hk), _groups(lse, Hk), scale * LOG2E, causal)
    _helion.run(_attention_fwd, args, D, q.device)
    if S == 1:
        o, lse = o[:, :, :1].contiguous(), lse[:, :, :1].contiguous()
    return o, lse


def attention_bwd(
    do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, causal: bool, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    """do, q, o: [B, Hq, S, D]; k, v: [B, Hk, Skv, D] (unit stride along D); lse: [B, Hq, S] float32 from
    :func:`attention_fwd` -> (dq, dk, dv), contiguous, in the dtypes and shapes of q, k, v (dk, dv summed over
    each group's query heads). dq comes from its own kernel over query blocks (no atomics)."""
    B, Hq, S, D = q.shape
    Hk, Skv = k.shape[1], k.shape[2]
    assert k.shape == v.shape == (B, Hk, Skv, D) and Hq % Hk == 0 and (Skv == S or not causal)
    assert do.shape == o.shape == q.shape and lse.shape == q.shape[:-1]
    if Skv == 1:
        # One key: its softmax weight p = exp(score − lse) is 1 (NaN for a non-finite score), so dS = p·(do·v − do·o)
        # is 0 and dv sums p·do over the group's queries; written out, no kernel. (Through the kernels, a zero
        # second key row would get p = exp2(−lse·log2 e), inf once the scores are large and negative, and
        # inf·0 = NaN in dq.)
        group = Hq // Hk
        kf, vf = (t.float().repeat_interleave(group, 1) for t in (k, v))
        p = torch.exp((q.float() * kf).sum(-1, keepdim=True) * scale - lse.unsqueeze(-1))
        dof = do.float()
        ds = p * ((dof * vf).sum(-1, keepdim=True) - (dof * o.float()).sum(-1, keepdim=True))
        per_kv = lambda t: t.unflatten(1, (Hk, group)).sum((2, 3)).unsqueeze(2)
        return ((ds * kf * scale).to(q.dtype), per_kv(ds * q.float() * scale).to(k.dtype),
                per_kv(p * dof).to(v.dtype))
    do, q, k, v, o, lse = (_prepare(t) for t in (do, q, k, v, o, lse))
    causal = causal and S > 1
    if S == 1:  # a zero query row: q = do = 0, so its terms in dk, dv vanish; its dq row is sliced off
        do, q, o = _pad_row(do), _pad_row(q), _pad_row(o)
        lse = torch.cat([lse, lse.new_zeros(lse.shape)], dim=-1)
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    delta = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
    qg, dog, lseg, deltag = (_groups(t, Hk) for t in (q, do, lse, delta))
    # dq first: it writes δ, which the dk/dv kernel reads
    dq_args = (dog, qg, k, v, _groups(o, Hk), lseg, _groups(dq, Hk), deltag, scale * LOG2E, scale, causal)
    _helion.run(_attention_bwd_dq, dq_args, D, q.device)
    _helion.run(_attention_bwd_dkdv, (dog, qg, k, v, lseg, deltag, dk, dv, scale * LOG2E, scale, causal), D, q.device)
    if S == 1:
        dq = dq[:, :, :1].contiguous()
    return dq, dk, dv
