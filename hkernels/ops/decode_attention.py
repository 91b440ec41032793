"""Decode attention, split-K ("flash decoding"), in Helion: the twin of ``triton_fallback/decode_attention.py``,
whose docstring gives the math, the split and combine, and the work and traffic.

Specific to these kernels: q is seen as [B, Hk, R, D] with R = G·Sq rows (query head hk·G + r // Sq, token r % Sq):
a view where q's layout allows it, else a copy (q is small); o comes out the same way, contiguous. The split
kernel's grid is (row block of up to 64 rows, split, key/value head, sequence); the chunk of a split is walked in
steps of the config's block size (configs are bucketed by D), loaded with Helion's masks below min(chunk end, L_b),
so rows past L_b are never read. With one split the same kernel writes o itself, in q's dtype, and no combine runs.
Helion picks 32-bit offsets from element counts: a cache that is a view into a larger buffer reaching past 2^31
elements with fewer of its own (a slice of a cache pool) is copied first.

Helion 1.5.0 takes a dim of size 1 for a broadcast and drops the mask of a multi-row tile over it: one query row
(R = 1) binds at two rows (code that reads the row count as it runs), and a one-row cache (S_max = 1) is padded
with a zero row, which no query sees.
"""

from __future__ import annotations

import math

import helion
import helion.language as hl
import torch

from hkernels.ops import _helion
from triton_fallback.decode_attention import split_plan

Tensor = torch.Tensor
LOG2E = math.log2(math.e)

# Recorded with a symbolic cache length (a compiled decode loop's, growing a row a step): the split count from the
# programs alone (``split_plan``), an unbounded window side as 2^30 rather than the length.
SYMBOLIC = frozenset({"decode_attention_fwd"})
_TWO_LOG2E = 2.0 * LOG2E
_INT32_LIMIT = 2**31 - 1


@helion.kernel(static_shapes=False, dot_precision="ieee")
def _decode_attention_split(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    seqlens: Tensor,
    o_part: Tensor,
    lse_part: Tensor,
    sq: int,
    chunk: int,
    window_left: int,
    qk_scale: float,
    cap_in: float,
    cap_out: float,
    rows_per_tile: hl.constexpr,
    softcap: hl.constexpr,
    window: hl.constexpr,
    split: hl.constexpr,
) -> None:
    # q: [B, Hk, R, D]; k, v: [B, Hk, S_max, D]; seqlens: [B] integer; o_part: [B, Hk, R, NS, D] float32 (split) or
    # o [B, Hk, R, 1, D] in q's dtype; lse_part: [B, Hk, R, NS] float32 (split only).
    # A program: one block of query rows of one key/value head, one chunk of its sequence's cache; reads the rows'
    # q once and the chunk's K and V rows below L_b once each; writes each row's partial (or output) once.
    b, hk, r, d = q.size()
    s_max = k.size(2)
    ns = o_part.size(3)
    d = hl.specialize(d)
    block_n = hl.register_block_size(s_max)
    for tile_r, tile_s, tile_h, tile_b in hl.tile([r, ns, hk, b], block_size=[rows_per_tile, 1, 1, 1]):
        bi = tile_b.begin
        hi = tile_h.begin
        si = tile_s.begin
        length = torch.clamp(seqlens[bi].to(torch.int32), 0, s_max)
        qi = q[bi, hi, tile_r, :]
        pos = length - sq + tile_r.index % sq  # each row's position: it sees keys j <= pos (< L_b)
        # keys before every row's window are never read (no window: window_left is past every position)
        end = torch.clamp(length - si * chunk, 0, chunk)  # this chunk's keys below L_b, from its first
        skip = torch.minimum(torch.clamp(length - sq - window_left - si * chunk, 0, chunk), end)
        m_i = hl.full([tile_r], float("-inf"), dtype=torch.float32)  # running max of the (capped) scores
        l_i = hl.zeros([tile_r], dtype=torch.float32)  # running Σ 2^((x − m)·qk_scale)
        acc = hl.zeros([tile_r, d], dtype=torch.float32)
        for tile_n in hl.tile(end - skip, block_size=block_n):
            cols = si * chunk + skip + tile_n.index
            kj = k[bi, hi, cols, :]
            sc = hl.dot(qi, kj.T, out_dtype=torch.float32)
            if softcap:  # c·tanh(scale·s / c), tanh(x) = 1 − 2 / (e^2x + 1): ±1 at the extremes, never NaN
                sc = (1.0 - 2.0 / (torch.exp2(sc * (cap_in * _TWO_LOG2E)) + 1.0)) * cap_out
            keep = (cols[None, :] <= pos[:, None]) & (tile_n.index[None, :] < end - skip)
            if window:
                keep = keep & (cols[None, :] >= pos[:, None] - window_left)
            sc = torch.where(keep, sc, float("-inf"))
            m_new = torch.maximum(m_i, torch.amax(sc, -1))
            # max of the unscaled scores: (s − m)·qk_scale is exactly 0 at a row's top score (p = 1); masked keys
            # selected away, never multiplied (a row with no key yet has m = −inf, and −inf − −inf is NaN)
            p = torch.where(keep, torch.exp2((sc - m_new[:, None]) * qk_scale), 0.0)
            dm = (m_i - m_new) * qk_scale  # NaN only while a row has seen no key: its rescale is 0 then
            alpha = torch.exp2(torch.where(dm == dm, dm, float("-inf")))
            l_i = l_i * alpha + torch.sum(p, -1)
            vj = v[bi, hi, cols, :]
            acc = hl.dot(p.to(vj.dtype), vj, acc=acc * alpha[:, None])
            m_i = m_new
        empty = l_i == 0.0  # no key kept (a NaN score keeps l NaN: the row stays NaN)
        out = torch.where(empty[:, None], 0.0, acc / l_i[:, None])
        o_part[bi, hi, tile_r, si, :] = out.to(o_part.dtype)
        if split:
            lse_part[bi, hi, tile_r, si] = torch.where(empty, float("-inf"), m_i * qk_scale + torch.log2(l_i))


@helion.kernel(static_shapes=False)
def _decode_attention_combine(o_part: Tensor, lse_part: Tensor, o: Tensor) -> None:
    # o_part: [N, NS, D], lse_part: [N, NS] float32 (N = B·Hk·R rows); o: [N, D] out in q's dtype.
    # A program: a block of rows; reads their NS partials once, writes their outputs once.
    # o = Σ_s 2^(lse_s − m) o_s / Σ_s 2^(lse_s − m), m = max_s lse_s (0 when every chunk is empty: o = 0).
    n, ns, d = o_part.size()
    d = hl.specialize(d)
    ns = hl.specialize(ns)
    for tile_n in hl.tile(n):
        lse = lse_part[tile_n, :]
        m = torch.amax(lse, -1)
        m = torch.where(m == float("-inf"), 0.0, m)
        w = torch.exp2(lse - m[:, None])
        den = torch.sum(w, -1)
        acc = torch.sum(o_part[tile_n, :, :] * w[:, :, None], 1)
        o[tile_n, :] = torch.where(den[:, None] == 0.0, 0.0, acc / den[:, None]).to(o.dtype)


def _max_offset(x: Tensor) -> int:
    return sum((n - 1) * st for n, st in zip(x.shape, x.stride(), strict=True) if n > 0)


def _prepare(x: Tensor) -> Tensor:
    """x itself, or a contiguous copy where 32-bit offsets cannot reach all of it (see the module docstring)."""
    return x.contiguous() if _max_offset(x) > _INT32_LIMIT and x.numel() <= _INT32_LIMIT else x


# Where the split kernel's arguments hold the query rows per cache head (dim 2 of q, o or its partials, and the
# partials' lse): one row binds at two (see _helion.compiled), as does a combine over one row.
_SPLIT_ROWS = ((0, 2), (4, 2), (5, 2))


def _rows(t: Tensor, hk: int) -> Tensor:
    """[B, Hq, Sq, D] -> [B, Hk, G·Sq, D]: a view where the layout allows it, else a copy."""
    B, Hq, Sq, D = t.shape
    return t.reshape(B, hk, (Hq // hk) * Sq, D)


def decode_attention_fwd(q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Tensor, scale: float,
                         window_left: int, softcap: float) -> Tensor:
    """q [B, Hq, Sq, D], k_cache/v_cache [B, Hk, S_max, D] (unit stride along D), cache_seqlens [B] int32/int64 on
    q's device; window_left < 0: no window; softcap 0: none -> o [B, Hq, Sq, D] contiguous in q's dtype."""
    B, Hq, Sq, D = q.shape
    Hk, S = k_cache.shape[1], k_cache.shape[2]
    assert k_cache.shape == v_cache.shape == (B, Hk, S, D) and Hq % Hk == 0 and cache_seqlens.shape == (B,)
    if q.numel() == 0:
        return torch.empty((B, Hq, Sq, D), dtype=q.dtype, device=q.device)
    if S == 0:
        return torch.zeros((B, Hq, Sq, D), dtype=q.dtype, device=q.device)
    if softcap == 0.0 and scale < 0:  # the running max is of unscaled scores: give it (−q, −scale), the same scores
        q, scale = -q, -scale
    if S == 1:  # a zero second row, never seen (see the module docstring)
        k_cache, v_cache = (torch.cat([t, t.new_zeros(t.shape)], dim=2) for t in (k_cache, v_cache))
    k_cache, v_cache = _prepare(k_cache), _prepare(v_cache)
    qr = _rows(q, Hk)
    R = qr.shape[2]
    seqlens = cache_seqlens if cache_seqlens.stride(0) == 1 else cache_seqlens.contiguous()
    if softcap > 0.0:
        qk_scale, cap_in, cap_out = LOG2E, scale / softcap, softcap
    else:
        qk_scale, cap_in, cap_out = scale * LOG2E, 1.0, 1.0
    # The grid's programs: row blocks of up to 64 query rows (16 at least, for the dot); chunks a multiple of the
    # config's step (its block size), as many as fill the GPU (triton_fallback/decode_attention.py's split_plan)
    rows_per_tile = max(16, 1 << (min(R, 64) - 1).bit_length())
    (block_n,) = _helion.config_for(_decode_attention_split.name, D, q.device, q.dtype).config["block_sizes"]
    bucket = _helion._bucket(_helion.arch_of(q.device), _decode_attention_split.name, D, q.dtype)
    ns, chunk = split_plan(B * Hk * -(-R // rows_per_tile), k_cache.shape[2], block_n,
                           int(bucket.get("min_chunk", 256)), int(bucket.get("programs_per_sm", 2)), q.device)
    flags = (rows_per_tile, softcap > 0.0, window_left >= 0, ns > 1)
    unbounded = S + Sq if type(S) is int else 1 << 30
    numbers = (Sq, chunk, window_left if window_left >= 0 else unbounded, qk_scale, cap_in, cap_out)
    if ns == 1:
        o = torch.empty((B, Hk, R, 1, D), dtype=q.dtype, device=q.device)
        unused = torch.empty((B, Hk, R, 1), dtype=torch.float32, device=q.device)
        _helion.run(_decode_attention_split, (qr, k_cache, v_cache, seqlens, o, unused, *numbers, *flags), D,
                    q.device, rows=_SPLIT_ROWS)
    else:
        o_part = torch.empty((B, Hk, R, ns, D), dtype=torch.float32, device=q.device)
        lse_part = torch.empty((B, Hk, R, ns), dtype=torch.float32, device=q.device)
        _helion.run(_decode_attention_split, (qr, k_cache, v_cache, seqlens, o_part, lse_part, *numbers, *flags),
                    D, q.device, rows=_SPLIT_ROWS)
        o = torch.empty((B, Hk, R, 1, D), dtype=q.dtype, device=q.device)
        rows = B * Hk * R
        _helion.run(_decode_attention_combine, (o_part.view(rows, ns, D), lse_part.view(rows, ns),
                                                o.view(rows, D)), D, q.device, rows=(0, 1, 2))
    o = o.select(3, 0)
    return o.reshape(B, Hq, Sq, D)
