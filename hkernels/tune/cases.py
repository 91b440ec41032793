"""What the tune command and the benchmark run per op: how to make its inputs at a shape, which inputs get
gradients, and the call of hkernels' public op (the benchmark, ``bench/ops.py``, adds its peers and byte counts).

Every op is measured at a shape (M, N, K). For the memory-bound ops K is 0 and M is tokens, N the model dimension
the op works over (hidden size, MLP intermediate size or vocabulary; for rope, the hidden size, as heads of 128; for
fused_linear_cross_entropy, the hidden size, with Llama-3's vocabulary of 128256). For matmul, a [M, K] activation
times a [N, K] weight, transposed (``x @ weight.t()``, as nn.Linear computes it). For attention, M is the sequence
length S, N the width Hq·D of the queries (heads of D = 128, or 64 for the ``_d64`` variants; as many key/value
heads as query heads) and K the batch B. For decode_attention, M is the cache length L, N the width Hq·D of the
one new token's queries (Llama-3's 8 key/value heads of 128) and K the batch B.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

import hkernels

Tensor = torch.Tensor

HEAD_DIM, KV_HEADS = 128, 8  # Llama-3 attention: 128-wide heads, 8 key/value heads (GQA)
SMALL_HEAD_DIM = 64  # the _d64 attention variants: Llama-3.2 1B's, GPT-2's and gpt-oss's head width
FLCE_VOCAB = 128256  # Llama-3's vocabulary: the linear loss's weight is [FLCE_VOCAB, N]

Make = Callable[[int, int, int, torch.dtype, torch.device, torch.Generator], list[Tensor]]
Shape = tuple[int, int, int]  # (M, N, K): K is 0 for ops that have no third size


@dataclass(frozen=True)
class OpInputs:
    name: str
    make: Make  # inputs at shape (M, N, K); floating ones in the dtype under test
    diff: tuple[int, ...]  # which inputs get gradients
    call: Callable[..., object]  # hkernels' public op on those inputs


def _rows(*params: int) -> Make:
    """x [M, N] and ``params`` more [N]-shaped parameters (weights ~1, biases ~0)."""

    def make(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device, g: torch.Generator) -> list[Tensor]:
        x = torch.randn((m, n), generator=g, device=device, dtype=dtype)
        return [x] + [torch.randn(n, generator=g, device=device, dtype=dtype) * 0.5 + 1 - p for p in params]

    return make


def _gated(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device, g: torch.Generator) -> list[Tensor]:
    return [torch.randn((m, n), generator=g, device=device, dtype=dtype) for _ in range(2)]


def _add_norm(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device, g: torch.Generator) -> list[Tensor]:
    x, r = (torch.randn((m, n), generator=g, device=device, dtype=dtype) for _ in range(2))
    return [x, r, torch.randn(n, generator=g, device=device, dtype=dtype) * 0.5 + 1]


def _add_norm_gemma(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device, g: torch.Generator
                    ) -> list[Tensor]:
    x, r, w = _add_norm(m, n, k, dtype, device, g)
    return [x, r, w - 1]  # (Gemma's weights near 0: the scale 1 + w)


def _rope(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device, g: torch.Generator) -> list[Tensor]:
    # one sequence of M tokens; q and k laid out as HF makes them: [B, S, H, D] projections viewed as [B, H, S, D]
    heads = n // HEAD_DIM
    q = torch.randn((1, m, heads, HEAD_DIM), generator=g, device=device, dtype=dtype).transpose(1, 2)
    k = torch.randn((1, m, KV_HEADS, HEAD_DIM), generator=g, device=device, dtype=dtype).transpose(1, 2)
    inv = 1.0 / 500000.0 ** (torch.arange(0, HEAD_DIM, 2, device=device, dtype=torch.float32) / HEAD_DIM)
    angles = torch.outer(torch.arange(m, device=device, dtype=torch.float32), inv)
    angles = torch.cat([angles, angles], dim=-1)[None]  # [1, S, D], HF's layout
    return [q, k, angles.cos().to(dtype), angles.sin().to(dtype)]


MROPE_SECTION = (16, 24, 24)  # Qwen2-VL's and Qwen2.5-VL's split of the 64 rotary pairs of a 128-wide head


def _mrope(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device, g: torch.Generator) -> list[Tensor]:
    # rope's q and k, and the tables of three position streams [3, 1, S, D] (temporal, height, width) as Qwen2.5-VL
    # makes them for an image of 32-wide rows: the time index, the row and the column of each token
    q, kk, _, _ = _rope(m, n, k, dtype, device, g)
    s = torch.arange(m, device=device)
    inv = 1.0 / 1000000.0 ** (torch.arange(0, HEAD_DIM, 2, device=device, dtype=torch.float32) / HEAD_DIM)
    angles = torch.stack([torch.outer(pos.float(), inv) for pos in (s // 1024, s // 32, s % 32)])
    angles = torch.cat([angles, angles], dim=-1)[:, None]  # [3, 1, S, D]
    return [q, kk, angles.cos().to(dtype), angles.sin().to(dtype)]


def _qk_norm_rope(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device, g: torch.Generator
                  ) -> list[Tensor]:
    # rope's inputs and the two per-head norm weights (near 1, as trained ones are)
    q, kk, cos, sin = _rope(m, n, k, dtype, device, g)
    weights = [(1.0 + 0.1 * torch.randn((HEAD_DIM,), generator=g, device=device)).to(dtype) for _ in range(2)]
    return [q, kk, *weights, cos, sin]


def _targets(m: int, v: int, device: torch.device, g: torch.Generator) -> Tensor:
    target = torch.randint(0, v, (m,), generator=g, device=device)
    return torch.where(torch.rand(m, generator=g, device=device) < 0.1, -100, target)  # some padding


def _logits(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device, g: torch.Generator) -> list[Tensor]:
    return [torch.randn((m, n), generator=g, device=device, dtype=dtype) * 2, _targets(m, n, device, g)]


def _linear_ce(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device, g: torch.Generator) -> list[Tensor]:
    vocab = FLCE_VOCAB if device.type == "cuda" else 512  # interpreted on CPU: a check, not a measurement
    hidden = torch.randn((m, n), generator=g, device=device, dtype=dtype)
    weight = torch.randn((vocab, n), generator=g, device=device, dtype=dtype) * n**-0.5
    return [hidden, weight, _targets(m, vocab, device, g)]


def _matmul(bias: bool) -> Make:
    def make(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device, g: torch.Generator) -> list[Tensor]:
        a = torch.randn((m, k), generator=g, device=device, dtype=dtype)
        weight = torch.randn((n, k), generator=g, device=device, dtype=dtype) * k**-0.5
        b = [torch.randn(n, generator=g, device=device, dtype=dtype) * 0.1] if bias else []
        return [a, weight.t(), *b]  # b read in place as the transposed view of an nn.Linear weight

    return make


def _attention(head_dim: int) -> Make:
    def make(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device, g: torch.Generator) -> list[Tensor]:
        shape = (k, n // head_dim, m, head_dim)  # [B, H, S, D]
        return [torch.randn(shape, generator=g, device=device, dtype=dtype) for _ in range(3)]

    return make


# Gemma 3's local layers: a causal sliding window of 1024 keys (each query sees itself and the 1023 before it);
# Gemma 2's attention logit cap.
WINDOW, SOFTCAP = 1024, 50.0
# Mixed documents, as a packing collator makes them: lengths as these fractions of the longest, over and over.
_DOC_FRACTIONS = (1.0, 0.375, 0.625, 0.125, 0.875, 0.25, 0.5, 0.0625)


def doc_lengths(m: int, k: int, mixed: bool) -> list[int]:
    """The documents packed into M·K tokens: K of M tokens each, or (mixed) lengths of up to M in
    ``_DOC_FRACTIONS``' pattern, the last one cut to fit."""
    if not mixed:
        return [m] * k
    total, lens = m * k, []
    while sum(lens) < total:
        lens.append(min(max(1, int(_DOC_FRACTIONS[len(lens) % len(_DOC_FRACTIONS)] * m)), total - sum(lens)))
    return lens


def _packed(head_dim: int, mixed: bool) -> Make:
    """q, k, v [T, H, D] packed from ``doc_lengths`` (T = M·K tokens, H = N / D heads), the int32 bounds on the
    device and again on the host (for a per-document loop; its longest for the launch)."""

    def make(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device, g: torch.Generator) -> list[Tensor]:
        lens = doc_lengths(m, max(k, 1), mixed)
        shape = (sum(lens), n // head_dim, head_dim)
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        return [*(torch.randn(shape, generator=g, device=device, dtype=dtype) for _ in range(3)), cu.to(device), cu]

    return make


def _varlen(q: Tensor, k: Tensor, v: Tensor, cu: Tensor, cu_host: Tensor) -> Tensor:
    longest = int((cu_host[1:] - cu_host[:-1]).max())
    return hkernels.attention_varlen(q, k, v, cu, max_seqlen_q=longest, max_seqlen_k=longest, causal=True)


def _decode(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device, g: torch.Generator) -> list[Tensor]:
    """One new token per sequence against a full cache (decode): q [K, H, 1, D] (H = N / D), k/v caches [K, KV_HEADS,
    M, D], the lengths [K] = M."""
    q = torch.randn((k, n // HEAD_DIM, 1, HEAD_DIM), generator=g, device=device, dtype=dtype)
    kv = [torch.randn((k, KV_HEADS, m, HEAD_DIM), generator=g, device=device, dtype=dtype) for _ in range(2)]
    return [q, *kv, torch.full((k,), m, dtype=torch.int32, device=device)]


def _grouped(experts: int) -> Make:
    """x [M, K] (M = tokens × experts per token), weight [E, N, K], balanced routing: M / E rows per expert."""

    def make(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device, g: torch.Generator) -> list[Tensor]:
        x = torch.randn((m, k), generator=g, device=device, dtype=dtype)
        weight = torch.randn((experts, n, k), generator=g, device=device, dtype=dtype) * k**-0.5
        sizes = torch.full((experts,), m // experts, dtype=torch.int32)
        sizes[: m % experts] += 1
        return [x, weight, sizes.to(device)]

    return make


def _moe(experts: int, top_k: int, zipf: float = 0.0) -> Make:
    """x [M, N] (M tokens, N = H), gate_up [E, 2K, N], down [E, N, K] (K = I), routing: each token's top_k distinct
    experts drawn with probability ∝ 1 / (rank + 1)^zipf (0: uniform), weights a softmax over the chosen scores."""

    def make(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device, g: torch.Generator) -> list[Tensor]:
        x = torch.randn((m, n), generator=g, device=device, dtype=dtype)
        gate_up = torch.randn((experts, 2 * k, n), generator=g, device=device, dtype=dtype) * n**-0.5
        down = torch.randn((experts, n, k), generator=g, device=device, dtype=dtype) * k**-0.5
        ranks = torch.arange(1, experts + 1, device=device, dtype=torch.float32)
        uniform = torch.rand((m, experts), generator=g, device=device).clamp_min(1e-12)
        gumbel = -torch.log(-torch.log(uniform))  # top-k of log p + Gumbel noise: k draws without replacement
        scores, ids = torch.topk(-zipf * torch.log(ranks) + gumbel, top_k, dim=1)
        return [x, gate_up, down, ids, torch.softmax(scores, 1).to(dtype)]

    return make


# Cases that are variants of one op (another head dim, causal, a fused activation): the op the dispatcher routes
# them as, whose auto buckets they share (their times are summed per shape).
OP_OF = {"attention_causal": "attention", "attention_d64": "attention", "attention_d64_causal": "attention",
         "attention_window": "attention", "attention_softcap": "attention", "attention_d64_window": "attention",
         "attention_d64_softcap": "attention", "attention_varlen_mixed": "attention_varlen",
         "attention_d64_varlen": "attention_varlen", "attention_d64_varlen_mixed": "attention_varlen",
         "matmul_gelu": "matmul", "grouped_matmul_e128": "grouped_matmul", "moe_zipf": "moe", "moe_mixtral": "moe",
         "rms_norm_gemma": "rms_norm", "add_rms_norm_gemma": "add_rms_norm", "rope_mrope": "rope",
         "cross_entropy_softcap_z": "cross_entropy",
         "fused_linear_cross_entropy_softcap_z": "fused_linear_cross_entropy",
         "fused_linear_cross_entropy_softcap_z_chunk256": "fused_linear_cross_entropy"}
# The loss options of the *_softcap_z cases: Gemma 2's final logit softcap and a z-loss.
LOSS_OPTIONS = {"softcap": 30.0, "lse_square_scale": 1e-4}
# Variants the dispatcher routes by buckets of their own, "<op>:<name>_fwd" and "<op>:<name>_bwd" (attention's
# window and cap run other kernels than its plain calls): bench op -> name.
ROUTE_OF = {name: "attention_masked" for name in ("attention_window", "attention_softcap", "attention_d64_window",
                                                   "attention_d64_softcap")}
MOE = {"moe": (128, 8, 0.0), "moe_zipf": (128, 8, 1.2), "moe_mixtral": (8, 2, 0.0)}  # experts, top-k, Zipf exponent

OPS: dict[str, OpInputs] = {
    op.name: op
    for op in (
        OpInputs("rms_norm", _rows(0), (0, 1), lambda x, w: hkernels.rms_norm(x, w, 1e-6)),
        OpInputs("layer_norm", _rows(0, 1), (0, 1, 2), lambda x, w, b: hkernels.layer_norm(x, w, b, 1e-5)),
        OpInputs("softmax", _rows(), (0,), lambda x: hkernels.softmax(x, -1)),
        OpInputs("add_rms_norm", _add_norm, (0, 1, 2), lambda x, r, w: hkernels.add_rms_norm(x, r, w, 1e-6)),
        OpInputs("swiglu", _gated, (0, 1), hkernels.swiglu),
        OpInputs("geglu", _gated, (0, 1), lambda g, u: hkernels.geglu(g, u, "tanh")),
        # Gemma's norm: x̂ · (1 + w), the scale taken in float32 (weights near 0, as Gemma's are)
        OpInputs("rms_norm_gemma", _rows(1), (0, 1), lambda x, w: hkernels.rms_norm(x, w, 1e-6, offset=1.0)),
        OpInputs("add_rms_norm_gemma", _add_norm_gemma, (0, 1, 2),
                 lambda x, r, w: hkernels.add_rms_norm(x, r, w, 1e-6, offset=1.0)),
        OpInputs("rope", _rope, (0, 1), hkernels.rope),
        OpInputs("rope_mrope", _mrope, (0, 1), lambda q, k, c, s: hkernels.rope(q, k, c, s,
                                                                                 mrope_section=list(MROPE_SECTION))),
        OpInputs("qk_norm_rope", _qk_norm_rope, (0, 1, 2, 3), hkernels.qk_norm_rope),
        OpInputs("cross_entropy", _logits, (0,), lambda x, t: hkernels.cross_entropy(x, t)),
        OpInputs("fused_linear_cross_entropy", _linear_ce, (0, 1),
                 lambda h, w, t: hkernels.fused_linear_cross_entropy(h, w, t)),
        # the loss options Gemma 2/3 and z-loss training add (a logit softcap, lse² · λ): the same passes
        OpInputs("cross_entropy_softcap_z", _logits, (0,),
                 lambda x, t: hkernels.cross_entropy(x, t, **LOSS_OPTIONS)),
        OpInputs("fused_linear_cross_entropy_softcap_z", _linear_ce, (0, 1),
                 lambda h, w, t: hkernels.fused_linear_cross_entropy(h, w, t, **LOSS_OPTIONS)),
        # the same in Liger's memory: its chunks at 8192 × 4096 × 128256 are 256 tokens
        OpInputs("fused_linear_cross_entropy_softcap_z_chunk256", _linear_ce, (0, 1),
                 lambda h, w, t: hkernels.fused_linear_cross_entropy(h, w, t, **LOSS_OPTIONS, chunk_size=256)),
        OpInputs("matmul", _matmul(False), (0, 1), hkernels.matmul),
        # bias + tanh-gelu in the matmul's epilogue
        OpInputs("matmul_gelu", _matmul(True), (0, 1, 2), lambda a, b, bias: hkernels.matmul(a, b, bias, "gelu_tanh")),
        OpInputs("attention", _attention(HEAD_DIM), (0, 1, 2), hkernels.attention),
        OpInputs("attention_causal", _attention(HEAD_DIM), (0, 1, 2),
                 lambda q, k, v: hkernels.attention(q, k, v, causal=True)),
        OpInputs("grouped_matmul", _grouped(8), (0, 1), hkernels.grouped_matmul),  # Mixtral's 8 experts
        OpInputs("grouped_matmul_e128", _grouped(128), (0, 1), hkernels.grouped_matmul),  # Qwen3-MoE's 128
        # Qwen3-30B-A3B's experts (uniform and Zipf-skewed routing) and Mixtral-8x7B's
        *(OpInputs(name, _moe(*spec), (0, 1, 2, 4), hkernels.moe) for name, spec in MOE.items()),
        OpInputs("attention_d64", _attention(SMALL_HEAD_DIM), (0, 1, 2), hkernels.attention),
        OpInputs("attention_d64_causal", _attention(SMALL_HEAD_DIM), (0, 1, 2),
                 lambda q, k, v: hkernels.attention(q, k, v, causal=True)),
        *(OpInputs(f"attention{tag}_window", _attention(d), (0, 1, 2),
                   lambda q, k, v: hkernels.attention(q, k, v, causal=True, window=(WINDOW - 1, 0)))
          for tag, d in (("", HEAD_DIM), ("_d64", SMALL_HEAD_DIM))),
        *(OpInputs(f"attention{tag}_softcap", _attention(d), (0, 1, 2),
                   lambda q, k, v: hkernels.attention(q, k, v, causal=True, softcap=SOFTCAP))
          for tag, d in (("", HEAD_DIM), ("_d64", SMALL_HEAD_DIM))),
        # causal documents packed into one row: K of M tokens (against attention_causal's [K, H, M, D] batch), and
        # mixed lengths of up to M
        OpInputs("attention_varlen", _packed(HEAD_DIM, False), (0, 1, 2), _varlen),
        OpInputs("attention_varlen_mixed", _packed(HEAD_DIM, True), (0, 1, 2), _varlen),
        OpInputs("attention_d64_varlen", _packed(SMALL_HEAD_DIM, False), (0, 1, 2), _varlen),
        OpInputs("attention_d64_varlen_mixed", _packed(SMALL_HEAD_DIM, True), (0, 1, 2), _varlen),
        OpInputs("decode_attention", _decode, (), hkernels.decode_attention),  # forward only
    )
}


class _HasMake(Protocol):
    make: Make


def make_inputs(op: _HasMake, shape: Shape, dtype: torch.dtype, device: torch.device, seed: int = 0) -> list[Tensor]:
    """``op``'s inputs at ``shape`` (M, N, K), from a generator seeded with ``seed``."""
    m, n, k = shape
    return op.make(m, n, k, dtype, device, torch.Generator(device=device).manual_seed(seed))


class Case:
    """One op at one shape and dtype: its inputs and the calls that run it."""

    def __init__(self, op: str, shape: Shape, dtype: torch.dtype, device: torch.device) -> None:
        if op not in OPS:
            raise ValueError(f"hkernels.tune: unknown op {op!r}; ops are: {', '.join(sorted(OPS))}")
        self.op, self.shape, self.spec = op, shape, OPS[op]
        self.inputs = make_inputs(self.spec, shape, dtype, device)
        self.name = f"{op} {'x'.join(str(s) for s in shape if s)} {str(dtype).removeprefix('torch.')}"

    def forward(self) -> object:
        with torch.no_grad():
            return self.spec.call(*self.inputs)

    def forward_backward(self) -> object:
        leaves = [t.detach().requires_grad_(i in self.spec.diff) for i, t in enumerate(self.inputs)]
        out = self.spec.call(*leaves)
        outs = out if isinstance(out, tuple) else (out,)
        total = sum(o.float().sum() for o in outs if isinstance(o, torch.Tensor) and o.requires_grad)
        if isinstance(total, torch.Tensor):
            total.backward()
        return out

    def rows_n(self) -> tuple[int, int]:
        """(rows, n) of the first input: how the auto table buckets a call (see hkernels.configs.shape_key)."""
        t = self.inputs[0]
        return t.numel() // t.shape[-1], t.shape[-1]
