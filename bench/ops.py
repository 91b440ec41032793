"""What the benchmark runs per op, beyond its inputs and its call (``hkernels.tune.cases``, shared with the
tune command): plain PyTorch and peers to measure against, the float64 reference, the bytes (or flops) each mode
must move, one callable per backend, and the shapes of each preset. What M, N and K mean per op:
``hkernels.tune.cases``.
"""

from __future__ import annotations

import itertools
import os
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

import hkernels
from hkernels import references
from hkernels.tune import cases
from hkernels.tune.cases import (
    FLCE_VOCAB,
    HEAD_DIM,
    KV_HEADS,
    MROPE_SECTION,
    SMALL_HEAD_DIM,
    SOFTCAP,
    WINDOW,
    Make,
    Shape,
    doc_lengths,
)

Tensor = torch.Tensor

MODES = ("fwd", "bwd", "fwd_bwd")


@dataclass(frozen=True)
class OpBench:
    name: str
    make: Make  # inputs at shape (M, N, K); floating ones in the dtype under test (from hkernels.tune.cases)
    diff: tuple[int, ...]  # which inputs get gradients (from hkernels.tune.cases)
    kernel: Callable[..., object]  # hkernels' public op (from hkernels.tune.cases)
    eager: Callable[..., object]  # plain PyTorch, as a user would write it (also what torch.compile compiles)
    ref: Callable[..., object]  # reference (run on float64 inputs)
    dim: str  # what N is: "hidden", "inter" or "vocab"
    passes: tuple[int, int] | None = None  # [M, N]-sized tensors the forward and the backward must move
    params: int = 0  # [N]-shaped parameters (read by the forward; their gradients written by the backward)
    # instead of passes: (mode, M, N, itemsize, K) -> bytes
    bytes_fn: Callable[[str, int, int, int, int], int] | None = None
    flops_fn: Callable[[str, int, int, int], float] | None = None  # compute-bound ops: (mode, M, N, K) -> flops
    tokens: tuple[int, ...] = (1, 256, 4096, 16384)
    extra: tuple[tuple[int, int], ...] = ()  # more (M, N) in the model presets (e.g. softmax over a vocabulary)
    peers: dict[str, Callable[..., object]] = field(default_factory=dict)  # liger, sdpa_flash, ...: other libraries
    compile: bool = True  # also time torch.compile of ``eager`` (False where it would only call the same library op)
    shapes: Callable[[str], list[Shape]] | None = None  # the presets' shapes, where tokens × model size do not fit
    # The float64 reference is computed on this view of every input, output and gradient (None: on all of it).
    # Attention's [B, H, S, S] scores in float64 do not fit in memory at S = 16k; each (batch, head) is separate.
    ref_view: Callable[[Tensor], Tensor] | None = None


def _liger() -> dict[str, Callable[..., object]]:
    """Liger-Kernel's ops, when it is importable: a peer to measure against, never a dependency."""
    try:
        from liger_kernel.ops.cross_entropy import LigerCrossEntropyFunction
        from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction
        from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction
        from liger_kernel.ops.geglu import LigerGELUMulFunction
        from liger_kernel.ops.layer_norm import LigerLayerNormFunction
        from liger_kernel.ops.qwen2vl_mrope import LigerQwen2VLMRopeFunction
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
        from liger_kernel.ops.rope import LigerRopeFunction
        from liger_kernel.ops.softmax import LigerSoftmaxFunction
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction
    except Exception:
        return {}
    return {
        "rms_norm": lambda x, w: LigerRMSNormFunction.apply(x, w, 1e-6),
        "layer_norm": lambda x, w, b: LigerLayerNormFunction.apply(x, w, b, 1e-5),
        "softmax": lambda x: LigerSoftmaxFunction.apply(x),
        "swiglu": lambda g, u: LigerSiLUMulFunction.apply(g, u),
        "geglu": lambda g, u: LigerGELUMulFunction.apply(g, u),  # tanh form, as hkernels.geglu's default
        "rope": lambda q, k, c, s: LigerRopeFunction.apply(q, k, c, s),
        "rms_norm_gemma": lambda x, w: LigerRMSNormFunction.apply(x, w, 1e-6, 1.0, "gemma"),
        "add_rms_norm_gemma": lambda x, r, w: LigerFusedAddRMSNormFunction.apply(x, r, w, 1e-6, 1.0, "gemma"),
        "rope_mrope": lambda q, k, c, s: LigerQwen2VLMRopeFunction.apply(q, k, c, s, list(MROPE_SECTION)),
        "add_rms_norm": lambda x, r, w: LigerFusedAddRMSNormFunction.apply(x, r, w, 1e-6),
        # Liger's cross-entropy writes the gradient over the logits (the caller's tensor): allowed for a peer.
        "cross_entropy": lambda x, t: LigerCrossEntropyFunction.apply(x, t, None, -100)[0],
        "fused_linear_cross_entropy": lambda h, w, t: LigerFusedLinearCrossEntropyFunction.apply(h, w, t)[0],
    }


LIGER = _liger()


def _rope_bytes(mode: str, m: int, n: int, itemsize: int, k: int = 0) -> int:
    qk = m * (n + KV_HEADS * HEAD_DIM) * itemsize  # q and k, all heads
    tables = 2 * m * HEAD_DIM * itemsize
    return {"fwd": 2 * qk + tables, "bwd": 2 * qk + tables, "fwd_bwd": 4 * qk + 2 * tables}[mode]


def _eager_ce_options(logits: Tensor, target: Tensor) -> Tensor:
    """PyTorch's cross-entropy with the *_softcap_z cases' options: softcap·tanh(z / softcap) on the logits (in
    float32, as Gemma's head does), then the mean of CE + λ·lse² over the tokens not ignored."""
    cap, lam = cases.LOSS_OPTIONS["softcap"], cases.LOSS_OPTIONS["lse_square_scale"]
    z = cap * torch.tanh(logits.float() / cap)
    valid = target != -100
    per_token = F.cross_entropy(z, target, reduction="none") + lam * torch.logsumexp(z, -1).square() * valid
    return per_token.sum() / valid.sum()


def _liger_ce_options(linear: bool = False) -> dict[str, Callable[..., object]]:
    """Liger's losses with the same options (None where Liger is not importable)."""
    cap, lam = cases.LOSS_OPTIONS["softcap"], cases.LOSS_OPTIONS["lse_square_scale"]
    try:
        from liger_kernel.ops.cross_entropy import LigerCrossEntropyFunction
        from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction
    except Exception:
        return {}
    if linear:
        return {"liger": lambda h, w, t: LigerFusedLinearCrossEntropyFunction.apply(
            h, w, t, None, None, -100, lam, 0.0, "mean", cap)[0]}
    return {"liger": lambda x, t: LigerCrossEntropyFunction.apply(x, t, None, -100, lam, 0.0, "mean", cap)[0]}


def _ce_bytes(mode: str, m: int, n: int, itemsize: int, k: int = 0) -> int:
    # forward alone (no gradient wanted): read the logits; with the gradient: read them, write their gradient
    return {"fwd": 1, "bwd": 1, "fwd_bwd": 2}[mode] * m * n * itemsize


def _flce_flops(mode: str, m: int, n: int, k: int) -> float:
    one = 2.0 * m * n * FLCE_VOCAB  # one [M, H] x [H, V] matmul
    return {"fwd": one, "bwd": 2 * one, "fwd_bwd": 3 * one}[mode]


def _eager_rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)

    def rot(x: Tensor) -> Tensor:
        half = x.shape[-1] // 2
        return torch.cat([-x[..., half:], x[..., :half]], dim=-1)

    return q * c + rot(q) * s, k * c + rot(k) * s


def _eager_gemma_norm(x: Tensor, w: Tensor) -> Tensor:
    """Gemma's RMSNorm as transformers writes it: float32 throughout, the scale 1 + w."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * (1.0 + w.float())).to(x.dtype)


def _eager_add_gemma_norm(x: Tensor, r: Tensor, w: Tensor) -> tuple[Tensor, Tensor]:
    """Gemma's residual add, then its RMSNorm (float32 throughout, the scale 1 + w)."""
    s = x + r
    return _eager_gemma_norm(s, w), s


def _eager_mrope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """transformers' ``apply_multimodal_rotary_pos_emb``: each chunk of the head dim from its stream's table."""
    split = list(MROPE_SECTION) * 2
    cos = torch.cat([c[i % 3] for i, c in enumerate(cos.split(split, dim=-1))], dim=-1)
    sin = torch.cat([t[i % 3] for i, t in enumerate(sin.split(split, dim=-1))], dim=-1)
    return _eager_rope(q, k, cos, sin)


def _eager_qk_norm_rope(q: Tensor, k: Tensor, qw: Tensor, kw: Tensor, cos: Tensor, sin: Tensor
                        ) -> tuple[Tensor, Tensor]:
    """Qwen3's attention: each head's row normalised (F.rms_norm over D), then rotated."""
    d = q.shape[-1]
    return _eager_rope(F.rms_norm(q, (d,), qw, 1e-6), F.rms_norm(k, (d,), kw, 1e-6), cos, sin)


def _unfused_qk_norm_rope(q: Tensor, k: Tensor, qw: Tensor, kw: Tensor, cos: Tensor, sin: Tensor
                          ) -> tuple[Tensor, Tensor]:
    """The hkernels calls qk_norm_rope replaces: rms_norm of q and of k, then rope."""
    return hkernels.rope(hkernels.rms_norm(q, qw, 1e-6), hkernels.rms_norm(k, kw, 1e-6), cos, sin)


def _eager_add_norm(x: Tensor, r: Tensor, w: Tensor) -> tuple[Tensor, Tensor]:
    s = x + r
    return F.rms_norm(s, (s.shape[-1],), w, 1e-6), s


# A decoder layer's MLP half, as a model runs it (x: [M, H] the attention's output, r: the residual stream; w: the
# norm's weight; the SwiGLU MLP's gate, up [I, H] and down [H, I]): the residual add and norm, the MLP, the second
# residual add. Not an op: a block of ops and matmuls, to compare whole (hkernels inside torch.compile against
# torch.compile alone, where Inductor fuses across the ops).


def _make_block(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device, g: torch.Generator) -> list[Tensor]:
    def t(*shape: int, scale: float = 1.0) -> Tensor:
        return (torch.randn(shape, generator=g, device=device) * scale).to(dtype)

    return [t(m, n), t(m, n), t(n) + 1, t(k, n, scale=n ** -0.5), t(k, n, scale=n ** -0.5), t(n, k, scale=k ** -0.5)]


def _eager_block(x: Tensor, r: Tensor, w: Tensor, gate: Tensor, up: Tensor, down: Tensor) -> Tensor:
    s = x + r
    h = F.rms_norm(s, (s.shape[-1],), w, 1e-6)
    return (F.silu(h @ gate.T) * (h @ up.T)) @ down.T + s


def _hkernels_block(x: Tensor, r: Tensor, w: Tensor, gate: Tensor, up: Tensor, down: Tensor) -> Tensor:
    h, s = hkernels.add_rms_norm(x, r, w, 1e-6)
    return hkernels.swiglu(h @ gate.T, h @ up.T) @ down.T + s


def _reference_block(x: Tensor, r: Tensor, w: Tensor, gate: Tensor, up: Tensor, down: Tensor) -> Tensor:
    h, s = references.add_rms_norm(x, r, w, 1e-6)
    return references.swiglu(h @ gate.T, h @ up.T) @ down.T + s


def _block_flops(mode: str, m: int, n: int, k: int) -> float:
    fwd = 6.0 * m * n * k  # three matmuls of 2·M·H·I
    return {"fwd": fwd, "bwd": 2 * fwd, "fwd_bwd": 3 * fwd}[mode]


def _matmul_flops(mode: str, m: int, n: int, k: int) -> float:
    one = 2.0 * m * n * k
    return {"fwd": one, "bwd": 2 * one, "fwd_bwd": 3 * one}[mode]  # backward: dA = dY Bᵀ and dB = Aᵀ dY


def _attention_flops(causal: bool) -> Callable[[str, int, int, int], float]:
    def count(mode: str, m: int, n: int, k: int) -> float:
        fwd = 4.0 * k * n * m * m * (0.5 if causal else 1.0)  # Q Kᵀ and P V: 2 · 2·B·H·S²·D (half under the mask)
        return {"fwd": fwd, "bwd": 2.5 * fwd, "fwd_bwd": 3.5 * fwd}[mode]  # backward: 5 matmuls (S recomputed)

    return count


def _sdpa(backend: str, causal: bool) -> Callable[..., object]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    chosen = getattr(SDPBackend, backend)

    def run(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        with sdpa_kernel(chosen):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return run


def _head0(t: Tensor) -> Tensor:
    return t[:1, :1]  # batch 0, head 0 (as many key/value heads as query heads: an independent problem)


_PROJECTIONS = {  # nn.Linear (N, K) of a Llama-3 layer: fused q/k/v, o, fused gate/up, down
    "llama3-8b": ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)),
    "llama3-70b": ((10240, 8192), (8192, 8192), (57344, 8192), (8192, 28672)),
}
_MATMUL_TOKENS = {"llama3-8b": (4096, 16384), "llama3-70b": (4096,), "decode": (1, 64), "prefill": (4096, 16384)}


def _matmul_shapes(act: bool) -> Callable[[str], list[Shape]]:
    """Squares 4096³ and 8192³, and a Llama-3 layer's projections (for a fused activation: the up projection only);
    at decode (1 and 64 tokens), the output projection of each model (the up projection, for a fused activation)."""

    def shapes(preset: str) -> list[Shape]:
        if preset == "decode":
            projections = [p[2 if act else 1] for p in _PROJECTIONS.values()]
            return [(m, n, k) for n, k in projections for m in _MATMUL_TOKENS["decode"]]
        models = ("llama3-8b", "llama3-70b") if preset in ("llama3", "decode", "prefill") else (preset,)
        out: list[Shape] = [(4096, 4096, 4096), (8192, 8192, 8192)] if preset == "llama3" else []
        for model in (m for m in models if m in _PROJECTIONS):  # (no shapes for the other models)
            projections = _PROJECTIONS[model][2:3] if act else _PROJECTIONS[model]
            tokens = _MATMUL_TOKENS[preset if preset in ("decode", "prefill") else model]
            out += [(m, n, k) for n, k in projections for m in tokens]
        return out

    return shapes


def _attention_shapes(head_dim: int) -> Callable[[str], list[Shape]]:
    """Sequences of 1k-16k at 16384 tokens per batch (B = 16384 / S), 32 heads of ``head_dim`` (Llama-3 8B's
    queries at 128, Llama-3.2 1B's at 64; 64 heads for 70B); for decode, one sequence of 1 and of 64 tokens (the
    per-call latency of a short prompt). None for other models."""

    def shapes(preset: str) -> list[Shape]:
        seqs = {"llama3": (1024, 2048, 4096, 8192, 16384), "llama3-8b": (1024, 4096, 16384),
                "llama3-70b": (4096, 16384), "prefill": (4096, 16384), "decode": (1, 64)}
        width = (64 if preset == "llama3-70b" else 32) * head_dim
        return [(s, width, 1 if preset == "decode" else max(1, 16384 // s)) for s in seqs.get(preset, ())]

    return shapes


def _attention_bench(name: str, causal: bool, head_dim: int) -> OpBench:
    """SDPA (whichever backend it picks) as eager, and SDPA with its flash and cuDNN backends forced as peers."""
    return _bench(
        name,
        eager=lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
        ref=lambda q, k, v: references.attention(q, k, v, causal=causal),
        dim="hidden", flops_fn=_attention_flops(causal), compile=False, shapes=_attention_shapes(head_dim),
        ref_view=_head0,
        peers={"sdpa_flash": _sdpa("FLASH_ATTENTION", causal), "sdpa_cudnn": _sdpa("CUDNN_ATTENTION", causal)},
    )


def _window_flops(mode: str, m: int, n: int, k: int) -> float:
    keys = sum(min(i + 1, WINDOW) for i in range(m))  # causal, each query sees at most WINDOW keys
    fwd = 4.0 * k * n * keys
    return {"fwd": fwd, "bwd": 2.5 * fwd, "fwd_bwd": 3.5 * fwd}[mode]


def _varlen_flops(mixed: bool) -> Callable[[str, int, int, int], float]:
    def count(mode: str, m: int, n: int, k: int) -> float:
        fwd = 4.0 * n * sum(d * (d + 1) / 2 for d in doc_lengths(m, max(k, 1), mixed))  # causal per document
        return {"fwd": fwd, "bwd": 2.5 * fwd, "fwd_bwd": 3.5 * fwd}[mode]

    return count


_MASKS: dict[tuple, Tensor] = {}


def _window_mask(s: int, device: torch.device) -> Tensor:
    """[S, S] bool: causal within the last WINDOW keys (SDPA's attn_mask: True = attend)."""
    key = ("window", s, device)
    if key not in _MASKS:
        i = torch.arange(s, device=device)
        _MASKS[key] = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - WINDOW)
    return _MASKS[key]


def _eager_window(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    return F.scaled_dot_product_attention(q, k, v, attn_mask=_window_mask(q.shape[2], q.device))


def _capped_chunk(q: Tensor, k: Tensor, v: Tensor, first: int) -> Tensor:
    """Queries first .. first + len(q) of a causal, soft-capped attention, written out in PyTorch."""
    s = torch.matmul(q, k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    s = SOFTCAP * torch.tanh(s / SOFTCAP)
    i = torch.arange(first, first + q.shape[2], device=q.device)[:, None]
    s = s.masked_fill(torch.arange(k.shape[2], device=q.device)[None, :] > i, float("-inf"))
    return torch.matmul(torch.softmax(s.float(), -1).to(q.dtype), v)


def _eager_softcap(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Soft-capped causal attention in PyTorch, 2048 queries at a time with each chunk recomputed in the backward
    (torch.utils.checkpoint): the [S, S] scores of every head at once do not fit at S = 16k."""
    from torch.utils.checkpoint import checkpoint

    chunk = 2048
    outs = [checkpoint(_capped_chunk, q[:, :, a:a + chunk], k[:, :, :a + chunk], v[:, :, :a + chunk], a,
                       use_reentrant=False) for a in range(0, q.shape[2], chunk)]
    return torch.cat(outs, 2)


def _eager_varlen(q: Tensor, k: Tensor, v: Tensor, cu: Tensor, cu_host: Tensor) -> Tensor:
    """One SDPA call per document (its flash/cuDNN kernels take no packed batch)."""
    b = cu_host.tolist()
    outs = [F.scaled_dot_product_attention(*(t[a:e].transpose(0, 1) for t in (q, k, v)), is_causal=True)
            .transpose(0, 1) for a, e in itertools.pairwise(b)]
    return torch.cat(outs)


_FLEX: dict[str, Any] = {}


def _flex_call() -> Callable[..., Tensor]:
    if "fn" not in _FLEX:
        from torch.nn.attention.flex_attention import flex_attention

        _FLEX["fn"] = torch.compile(flex_attention, dynamic=False)
    return _FLEX["fn"]


def _flex(kind: str) -> Callable[..., object]:
    """torch.nn.attention.flex_attention, compiled, with its block mask (built once per shape, outside the timed
    call): ``window`` (causal within WINDOW keys), ``softcap`` (causal, SOFTCAP·tanh(s / SOFTCAP) as score_mod) or
    ``varlen`` (causal within each packed document, on the [1, H, T, D] view)."""
    from torch.nn.attention.flex_attention import create_block_mask

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def window(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < WINDOW)

    def cap(score, b, h, q_idx, kv_idx):
        return SOFTCAP * torch.tanh(score / SOFTCAP)

    def run(q: Tensor, k: Tensor, v: Tensor, *packed: Tensor) -> Tensor:
        if kind == "varlen":
            cu, cu_host = packed
            key = ("flex", kind, q.shape, tuple(cu_host.tolist()))  # (an address may be reused by other bounds)
            if key not in _MASKS:
                doc = torch.repeat_interleave(torch.arange(cu.shape[0] - 1, device=q.device), cu.diff())

                def document(b, h, q_idx, kv_idx):
                    return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

                _MASKS[key] = create_block_mask(document, None, None, q.shape[0], q.shape[0], device=q.device)
            out = _flex_call()(*(t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)), block_mask=_MASKS[key])
            return out[0].transpose(0, 1)
        key = ("flex", kind, q.shape[2], q.device)
        if key not in _MASKS:
            mod = window if kind == "window" else causal
            _MASKS[key] = create_block_mask(mod, None, None, q.shape[2], q.shape[2], device=q.device)
        return _flex_call()(q, k, v, score_mod=cap if kind == "softcap" else None, block_mask=_MASKS[key])

    return run


def _mixed_shapes(head_dim: int) -> Callable[[str], list[Shape]]:
    """Attention's shapes with more than one document in the 16384 tokens (mixed lengths up to M)."""
    return lambda preset: [s for s in _attention_shapes(head_dim)(preset) if s[0] < 16384 and s[2] > 1]


def _varlen_bench(name: str, mixed: bool, head_dim: int = HEAD_DIM) -> OpBench:
    return _bench(
        name,
        eager=_eager_varlen,
        ref=lambda q, k, v, cu, cu_host: references.attention_varlen(q, k, v, cu, causal=True),
        dim="hidden", flops_fn=_varlen_flops(mixed), compile=False,
        shapes=_mixed_shapes(head_dim) if mixed else _attention_shapes(head_dim),
        ref_view=lambda t: t[:, :1],  # head 0 of [T, H, D]
        peers={"flex": _flex("varlen")},
    )


def _decode_shapes(preset: str) -> list[Shape]:
    """One new token per sequence (Llama-3 8B's 32 query heads, 8 key/value heads): one sequence over caches of 1k,
    8k and 128k, 16 over 8k and 64 over 1k (the decode preset; none for the model presets)."""
    if preset not in ("decode", "llama3"):
        return []
    return [(1024, 4096, 1), (8192, 4096, 1), (131072, 4096, 1), (8192, 4096, 16), (1024, 4096, 64)]


def _decode_bytes(mode: str, m: int, n: int, itemsize: int, k: int) -> int:
    return 2 * k * KV_HEADS * m * HEAD_DIM * itemsize  # the K and V cache rows read (the rest is tiny)


def _eager_decode(q: Tensor, k: Tensor, v: Tensor, lengths: Tensor) -> Tensor:
    """SDPA over the whole cache (every length is the cache's here), the key/value heads shared by their groups."""
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


# Mixture-of-experts projections (N, K) per expert and rows M = tokens × experts per token: Mixtral-8x7B (8 experts,
# 2 per token, H 4096, I 14336) and Qwen3-30B-A3B (128 experts, 8 per token, H 2048, I 768); gate and up fused.
_MOE = {8: ((2 * 14336, 4096), (4096, 14336), 2), 128: ((2 * 768, 2048), (2048, 768), 8)}


def _grouped_shapes(experts: int) -> Callable[[str], list[Shape]]:
    """The gate/up and the down projection at 16384 tokens (prefill presets; 4096 and 16384 for llama3) and at 1 and
    64 tokens (decode)."""

    def shapes(preset: str) -> list[Shape]:
        up, down, per_token = _MOE[experts]
        tokens = {"decode": (1, 64), "llama3": (4096, 16384)}.get(preset, (16384,))
        return [(t * per_token, n, k) for t in tokens for n, k in (up, down)]

    return shapes


def _eager_grouped(x: Tensor, weight: Tensor, group_sizes: Tensor) -> Tensor:
    """Hugging Face's "eager" experts: a loop over the experts, one matmul each (a host sync for the sizes)."""
    out = x.new_empty((x.shape[0], weight.shape[1]))
    start = 0
    for e, size in enumerate(group_sizes.tolist()):
        out[start:start + size] = x[start:start + size] @ weight[e].T
        start += size
    return out


def _grouped_mm(x: Tensor, weight: Tensor, group_sizes: Tensor) -> Tensor:
    """torch._grouped_mm (Hugging Face's "grouped_mm" experts): offsets are the groups' ends, int32."""
    return torch._grouped_mm(x, weight.transpose(1, 2), offs=torch.cumsum(group_sizes, 0, dtype=torch.int32))


def _dense_mm(x: Tensor, weight: Tensor, group_sizes: Tensor) -> Tensor:
    """One cuBLAS matmul of the same flops (every row times expert 0): the bar for a grouped kernel."""
    return x @ weight[0].T


def _moe_bench_shapes(name: str) -> Callable[[str], list[Shape]]:
    """(tokens, H, I): training at 8192 and 16384 tokens (prefill presets), decode at 1 and 64 tokens."""
    hidden, inter = (4096, 14336) if name == "moe_mixtral" else (2048, 768)
    return lambda preset: [(t, hidden, inter) for t in {"decode": (1, 64)}.get(preset, (8192, 16384))]


def _moe_flops(top_k: int) -> Callable[[str, int, int, int], float]:
    def count(mode: str, m: int, n: int, k: int) -> float:
        fwd = 6.0 * m * top_k * n * k  # gate_up (2·I outputs) and down, per token and slot
        return {"fwd": fwd, "bwd": 2 * fwd, "fwd_bwd": 3 * fwd}[mode]

    return count


def _eager_moe(x: Tensor, gate_up: Tensor, down: Tensor, ids: Tensor, weights: Tensor) -> Tensor:
    """Hugging Face's "eager" experts: a loop over the experts that got tokens (a host sync), index_add_ back."""
    out = torch.zeros_like(x)
    with torch.no_grad():
        hit = torch.unique(ids).tolist()
    for e in hit:
        token, slot = torch.where(ids == e)
        g, u = F.linear(x[token], gate_up[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(g) * u, down[e]) * weights[token, slot, None]
        out.index_add_(0, token, y.to(out.dtype))
    return out


def _hf_grouped_mm_moe() -> Callable[..., Tensor]:
    """Hugging Face's "grouped_mm" experts (transformers.integrations.moe, on torch._grouped_mm) on a stand-in for
    its experts module; the same steps written here where that transformers has no experts interface."""
    try:
        from transformers.integrations.moe import grouped_mm_experts_forward
    except Exception:
        grouped_mm_experts_forward = None

    def call(x: Tensor, gate_up: Tensor, down: Tensor, ids: Tensor, weights: Tensor) -> Tensor:
        if grouped_mm_experts_forward is not None:
            module = types.SimpleNamespace(
                num_experts=gate_up.shape[0], gate_up_proj=gate_up, down_proj=down, has_gate=True, has_bias=False,
                is_transposed=False, is_concatenated=True, has_post_expert_norm=False, _is_expert_parallel=False,
                _apply_gate=lambda t: F.silu(t.chunk(2, -1)[0]) * t.chunk(2, -1)[1])
            return grouped_mm_experts_forward(module, x, ids, weights)
        k = ids.shape[1]
        ids_sorted, perm = torch.sort(ids.reshape(-1))
        offs = torch.cumsum(torch.histc(ids_sorted.int(), bins=gate_up.shape[0], min=0, max=gate_up.shape[0] - 1),
                            0, dtype=torch.int32)
        h = torch._grouped_mm(x[perm // k], gate_up.transpose(1, 2), offs=offs)
        g, u = h.chunk(2, -1)
        y = torch._grouped_mm(F.silu(g) * u, down.transpose(1, 2), offs=offs) * weights.reshape(-1)[perm, None]
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(perm.numel(), device=perm.device)
        return y[inv].view(x.shape[0], k, -1).sum(1).to(x.dtype)

    return call


def _liger_moe() -> dict[str, Callable[..., object]]:
    try:
        from liger_kernel.ops.fused_moe import LigerFusedMoEFunction
    except Exception:
        return {}
    return {"liger": lambda x, gu, dn, ids, w: LigerFusedMoEFunction.apply(x, gu, dn, ids.to(torch.int32), w)}


def _bench(name: str, **fields: Any) -> OpBench:
    """``name``'s benchmark: its inputs, gradients and call from ``hkernels.tune.cases``, and ``fields``."""
    op = cases.OPS[name]
    return OpBench(name, op.make, op.diff, op.call, **fields)


BLOCK = OpBench(
    "block", _make_block, (0, 1, 2, 3, 4, 5), _hkernels_block, eager=_eager_block, ref=_reference_block, dim="hidden",
    flops_fn=_block_flops,
    # a 1B Llama's width (H 2048, I 5632): a decode step's 16 tokens, a small step's 1024, a large one's 8192
    shapes=lambda preset: [(16, 2048, 5632), (1024, 2048, 5632), (8192, 2048, 5632)],
)

OPS: dict[str, OpBench] = {
    "rms_norm": _bench(
        "rms_norm",
        eager=lambda x, w: F.rms_norm(x, (x.shape[-1],), w, 1e-6),
        ref=lambda x, w: references.rms_norm(x, w, 1e-6),
        dim="hidden", passes=(2, 3), params=1,  # read x, write y; read dy and x, write dx
    ),
    "layer_norm": _bench(
        "layer_norm",
        eager=lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b, 1e-5),
        ref=lambda x, w, b: references.layer_norm(x, w, b, 1e-5),
        dim="hidden", passes=(2, 3), params=2,
    ),
    "softmax": _bench(
        "softmax",
        eager=lambda x: torch.softmax(x, -1),
        ref=lambda x: references.softmax(x, -1),
        dim="hidden", passes=(2, 3),  # read x, write y; read dy and y, write dx
        extra=((1024, 128256), (4096, 128256)),
    ),
    "add_rms_norm": _bench(
        "add_rms_norm",
        eager=_eager_add_norm,
        ref=lambda x, r, w: references.add_rms_norm(x, r, w, 1e-6),
        dim="hidden", passes=(4, 4), params=1,  # read x, r, write y, s; read dy, ds, s, write the one shared gradient
    ),
    "swiglu": _bench(
        "swiglu",
        eager=lambda g, u: F.silu(g) * u,
        ref=references.swiglu,
        dim="inter", passes=(3, 5),  # read gate, up, write y; read dy, gate, up, write dgate, dup
    ),
    "geglu": _bench(
        "geglu",
        eager=lambda g, u: F.gelu(g, approximate="tanh") * u,
        ref=lambda g, u: references.geglu(g, u, "tanh"),
        dim="inter", passes=(3, 5),
    ),
    "rms_norm_gemma": _bench(
        "rms_norm_gemma",
        eager=_eager_gemma_norm,
        ref=lambda x, w: references.rms_norm(x, w, 1e-6, offset=1.0),
        dim="hidden", passes=(2, 3), params=1,
    ),
    "add_rms_norm_gemma": _bench(
        "add_rms_norm_gemma",
        eager=_eager_add_gemma_norm,
        ref=lambda x, r, w: references.add_rms_norm(x, r, w, 1e-6, offset=1.0),
        dim="hidden", passes=(4, 4), params=1,
    ),
    "rope_mrope": _bench(
        "rope_mrope",
        eager=_eager_mrope,
        ref=lambda q, k, c, s: references.rope(q, k, c, s, mrope_section=list(MROPE_SECTION)),
        # (rope's bytes: each element of the tables comes from one stream, so the op need read no more of them)
        dim="hidden", bytes_fn=_rope_bytes,
    ),
    "rope": _bench(
        "rope",
        eager=_eager_rope,
        ref=references.rope,
        dim="hidden", bytes_fn=_rope_bytes,
    ),
    "qk_norm_rope": _bench(
        "qk_norm_rope",
        eager=_eager_qk_norm_rope,
        ref=lambda q, k, qw, kw, c, s: references.qk_norm_rope(q, k, qw, kw, c, s, 1e-6),
        dim="hidden", bytes_fn=_rope_bytes, peers={"unfused": _unfused_qk_norm_rope},
    ),
    "cross_entropy": _bench(
        "cross_entropy",
        eager=lambda x, t: F.cross_entropy(x, t),
        ref=lambda x, t: references.cross_entropy(x, t),
        dim="vocab", bytes_fn=_ce_bytes,
        tokens=(256, 4096, 8192), extra=((4096, 262144), (8192, 262144)),
    ),
    "fused_linear_cross_entropy": _bench(
        "fused_linear_cross_entropy",
        eager=lambda h, w, t: F.cross_entropy(F.linear(h, w), t),
        ref=lambda h, w, t: references.fused_linear_cross_entropy(h, w, t),
        dim="hidden", flops_fn=_flce_flops, tokens=(1024, 4096, 8192),
    ),
    "cross_entropy_softcap_z": _bench(
        "cross_entropy_softcap_z",
        eager=lambda x, t: _eager_ce_options(x, t),
        ref=lambda x, t: references.cross_entropy(x, t, **cases.LOSS_OPTIONS),
        dim="vocab", bytes_fn=_ce_bytes, tokens=(8192,),
        peers=_liger_ce_options(),
    ),
    "fused_linear_cross_entropy_softcap_z": _bench(
        "fused_linear_cross_entropy_softcap_z",
        eager=lambda h, w, t: _eager_ce_options(F.linear(h, w), t),
        ref=lambda h, w, t: references.fused_linear_cross_entropy(h, w, t, **cases.LOSS_OPTIONS),
        dim="hidden", flops_fn=_flce_flops, tokens=(8192,),
        peers=_liger_ce_options(linear=True),
    ),
    "fused_linear_cross_entropy_softcap_z_chunk256": _bench(
        "fused_linear_cross_entropy_softcap_z_chunk256",
        eager=lambda h, w, t: _eager_ce_options(F.linear(h, w), t),
        ref=lambda h, w, t: references.fused_linear_cross_entropy(h, w, t, **cases.LOSS_OPTIONS),
        dim="hidden", flops_fn=_flce_flops, tokens=(8192,),
        peers=_liger_ce_options(linear=True),
    ),
    "matmul": _bench(
        "matmul",
        eager=torch.matmul,  # cuBLAS
        ref=references.matmul,
        dim="hidden", flops_fn=_matmul_flops, compile=False, shapes=_matmul_shapes(False),
    ),
    "matmul_gelu": _bench(  # bias + tanh-gelu in the epilogue; the peer is cuBLAS (bias in its epilogue) + gelu
        "matmul_gelu",
        eager=lambda a, b, bias: F.gelu(torch.addmm(bias, a, b), approximate="tanh"),
        ref=lambda a, b, bias: references.matmul(a, b, bias, "gelu_tanh"),
        dim="hidden", flops_fn=_matmul_flops, shapes=_matmul_shapes(True),
    ),
    **{name: _bench(
        name,
        eager=_eager_grouped,
        ref=references.grouped_matmul,
        dim="hidden", flops_fn=_matmul_flops, shapes=_grouped_shapes(experts), compile=False,
        peers={"grouped_mm": _grouped_mm, "dense_mm": _dense_mm},
    ) for name, experts in (("grouped_matmul", 8), ("grouped_matmul_e128", 128))},
    **{name: _bench(
        name,
        eager=_eager_moe,
        ref=references.moe,
        dim="hidden", flops_fn=_moe_flops(cases.MOE[name][1]), shapes=_moe_bench_shapes(name), compile=False,
        peers={"grouped_mm": _hf_grouped_mm_moe(), **_liger_moe()},
    ) for name in cases.MOE},
    "attention": _attention_bench("attention", False, HEAD_DIM),
    "attention_causal": _attention_bench("attention_causal", True, HEAD_DIM),
    "attention_d64": _attention_bench("attention_d64", False, SMALL_HEAD_DIM),
    "attention_d64_causal": _attention_bench("attention_d64_causal", True, SMALL_HEAD_DIM),
    **{name: _bench(
        name,
        eager=_eager_window,
        ref=lambda q, k, v: references.attention(q, k, v, causal=True, window=(WINDOW - 1, 0)),
        dim="hidden", flops_fn=_window_flops, compile=False, shapes=_attention_shapes(d), ref_view=_head0,
        peers={"flex": _flex("window")},
    ) for name, d in (("attention_window", HEAD_DIM), ("attention_d64_window", SMALL_HEAD_DIM))},
    **{name: _bench(
        name,
        eager=_eager_softcap,
        ref=lambda q, k, v: references.attention(q, k, v, causal=True, softcap=SOFTCAP),
        dim="hidden", flops_fn=_attention_flops(True), compile=False, shapes=_attention_shapes(d),
        ref_view=_head0, peers={"flex": _flex("softcap")},
    ) for name, d in (("attention_softcap", HEAD_DIM), ("attention_d64_softcap", SMALL_HEAD_DIM))},
    "attention_varlen": _varlen_bench("attention_varlen", False),
    "attention_varlen_mixed": _varlen_bench("attention_varlen_mixed", True),
    "attention_d64_varlen": _varlen_bench("attention_d64_varlen", False, SMALL_HEAD_DIM),
    "attention_d64_varlen_mixed": _varlen_bench("attention_d64_varlen_mixed", True, SMALL_HEAD_DIM),
    "decode_attention": _bench(
        "decode_attention",
        eager=_eager_decode,
        ref=references.decode_attention,
        dim="hidden", bytes_fn=_decode_bytes, compile=False, shapes=_decode_shapes,
    ),
    "block": BLOCK,
}
for _name, _fn in LIGER.items():
    OPS[_name] = OpBench(**{**OPS[_name].__dict__, "peers": {"liger": _fn}})

MODELS = {
    "llama3-8b": {"hidden": 4096, "inter": 14336, "vocab": 128256},
    "llama3-70b": {"hidden": 8192, "inter": 28672, "vocab": 128256},
    "qwen": {"hidden": 3584, "inter": 18944, "vocab": 152064},  # Qwen2-7B
}
PRESETS = ("llama3", *MODELS, "decode", "prefill")
QUICK_SHAPES = {"cpu": ((4, 64), (3, 300)), "cuda": ((256, 4096), (4096, 4096))}


def preset_shapes(preset: str, op: OpBench) -> list[Shape]:
    """(M, N, K) shapes of ``preset`` for ``op``: llama3 (8B and 70B), one model, decode (few tokens), prefill
    (many)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown shape preset {preset!r}; presets: {', '.join(PRESETS)}, or sizes like 4096x8192")
    if op.shapes is not None:
        return op.shapes(preset)
    if preset == "llama3":
        both = preset_shapes("llama3-8b", op) + preset_shapes("llama3-70b", op)
        return sorted(set(both), key=lambda s: (s[1], s[0]))
    if preset in MODELS:
        return [(m, MODELS[preset][op.dim], 0) for m in op.tokens] + [(m, n, 0) for m, n in op.extra]
    tokens = (1, 64) if preset == "decode" else (4096, 16384)
    return list(dict.fromkeys((m, MODELS[model][op.dim], 0) for model in ("llama3-8b", "llama3-70b") for m in tokens))


def quick_shapes(op: OpBench, device: torch.device) -> list[Shape]:
    """The smoke pass: small shapes (rope's N must be a multiple of the head size)."""
    cpu = device.type == "cpu"
    if op.name.startswith("matmul"):
        return [(4, 64, 32), (3, 33, 17)] if cpu else [(256, 4096, 4096), (4096, 4096, 4096)]
    if op.name.startswith("attention"):
        return [(16, HEAD_DIM, 1)] if cpu else [(1024, 4096, 2)]
    if op.name == "decode_attention":  # (as many query heads as key/value heads, at least)
        return [(40, KV_HEADS * HEAD_DIM, 2)] if cpu else [(8192, 4096, 4)]
    if op.name.startswith("grouped_matmul"):
        return [(16, 32, 24)] if cpu else [(8192, 4096, 4096)]
    if op.name.startswith("moe"):
        return [(16, 32, 24)] if cpu else [(4096, 2048, 768)]
    if op.name == "block":
        return [(8, 32, 48)] if cpu else [(1024, 2048, 5632)]
    shapes = QUICK_SHAPES[device.type]
    if op.name in ("rope", "rope_mrope", "qk_norm_rope") or op.name.startswith("fused_linear_cross_entropy"):
        return [(m, max(HEAD_DIM, n // HEAD_DIM * HEAD_DIM), 0) for m, n in shapes][: 1 if cpu else 2]
    return [(m, n, 0) for m, n in shapes]


def bytes_moved(op: OpBench, mode: str, m: int, n: int, itemsize: int, k: int = 0) -> int | None:
    """The fewest bytes ``mode`` must move (None for compute-bound ops): each [M, N] tensor once, plus the [N]
    parameters (read, and their gradients written)."""
    if op.bytes_fn is not None:
        return op.bytes_fn(mode, m, n, itemsize, k)
    if op.passes is None:
        return None
    fwd, bwd = op.passes
    passes = {"fwd": fwd, "bwd": bwd, "fwd_bwd": fwd + bwd}[mode]
    params = op.params * n * itemsize * {"fwd": 1, "bwd": 2, "fwd_bwd": 2}[mode]
    return passes * m * n * itemsize + params


def flops(op: OpBench, mode: str, m: int, n: int, k: int) -> float | None:
    return op.flops_fn(mode, m, n, k) if op.flops_fn is not None else None


def callable_for(op: OpBench, backend: str, compiled: dict[str, Any], dynamic: bool = False
                 ) -> Callable[..., object] | None:
    """``op``'s forward on ``backend``: hkernels' backends inside a ``use_backend`` scope per call, PyTorch eager,
    torch.compile of eager or of hkernels' call (``auto_compile``; each compiled once per op, kept in
    ``compiled``), or a peer (None where it lacks the op). ``dynamic``: the compiled ones with torch.compile's
    default ``dynamic=None`` (a size that changes between calls becomes symbolic), else ``dynamic=False``."""
    if backend == "auto" and not os.environ.get("HKERNELS_BACKEND"):
        return op.kernel  # the default: no scope per call (a user calling the op plainly enters none)
    if backend in ("helion", "triton", "auto", "hk_torch"):  # hk_torch: hkernels' torch backend
        name = "torch" if backend == "hk_torch" else backend

        def run(*a: Tensor) -> object:
            with hkernels.use_backend(name):
                return op.kernel(*a)
        return run
    if backend == "torch":
        return op.eager
    world = " dynamic" if dynamic else ""
    if backend == "torch_compile":
        if op.name + world not in compiled:
            compiled[op.name + world] = torch.compile(op.eager, dynamic=None if dynamic else False)
        return compiled[op.name + world]
    if backend == "auto_compile":  # hkernels (auto) inside torch.compile: what a compiled model with it runs
        key = f"{op.name} hkernels{world}"
        if key not in compiled:
            compiled[key] = torch.compile(op.kernel, dynamic=None if dynamic else False)
        return compiled[key]
    return op.peers.get(backend)
