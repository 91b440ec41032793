"""A Llama-style decoder for end-to-end measurements (random init, no downloads).

Module names and layout follow Hugging Face's LlamaForCausalLM (``model.embed_tokens``, ``model.layers[i].
{input_layernorm, self_attn.{q,k,v,o}_proj, post_attention_layernorm, mlp.{gate,up,down}_proj}``, ``model.norm``,
``lm_head``), with plain torch parts (``torch.nn.RMSNorm``, SDPA attention, a module-level
``apply_rotary_pos_emb``), so that ``hkernels.patch`` and Liger's modules can be swapped in as they would be in a
real model. The loss is Hugging Face's causal-LM loss: position t predicts token t + 1, logits in float32. Configs
with experts ("moe", "tiny_moe") put Qwen3-MoE's block in every layer's place of the MLP (``mlp.gate`` router,
``mlp.experts`` computed as transformers' default ``grouped_mm`` experts).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hkernels.nn import RotaryEmbedding  # Llama's cos/sin tables, plain torch (no kernel)

Tensor = torch.Tensor


@dataclass(frozen=True)
class Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    rope_base: float = 500000.0
    rms_eps: float = 1e-5
    tie_word_embeddings: bool = False
    num_experts: int = 0  # > 0: every layer's MLP is a mixture of experts (Qwen3-MoE's block)
    experts_per_token: int = 0
    moe_intermediate_size: int = 0


CONFIGS = {
    # Llama-3.2-1B's shape (1.24 B parameters with tied embeddings): vocabulary 128256, 16 layers of 2048.
    "1b": Config(128256, 2048, 8192, 16, 32, 8, tie_word_embeddings=True),
    # A few-layer model for tests and CPU smoke runs.
    "tiny": Config(256, 64, 176, 2, 4, 2),
    # Qwen3-30B-A3B's attention and experts (128 experts of 768, 8 per token, hidden 2048, vocabulary 151936) in 4
    # layers: 2.7 B parameters, 0.55 B active per token.
    "moe": Config(151936, 2048, 6144, 4, 32, 4, rope_base=1000000.0, rms_eps=1e-6, num_experts=128,
                  experts_per_token=8, moe_intermediate_size=768),
    "tiny_moe": Config(256, 64, 176, 2, 4, 2, num_experts=4, experts_per_token=2, moe_intermediate_size=32),
}


@dataclass
class CausalLMOutput:
    loss: Tensor | None = None
    logits: Tensor | None = None


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, position_ids: object = None,
                         unsqueeze_dim: int = 1) -> tuple[Tensor, Tensor]:
    """Hugging Face's rotary embedding: q, k [B, H, S, D]; cos, sin [B, S, D]. (hkernels.patch replaces it.)"""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


apply_rotary_pos_emb.hkernels_rope = "rotate_half"  # hkernels.patch may replace it (the full rotate_half rotation)


def causal_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Causal self-attention, q [B, Hq, S, D], k/v [B, Hk, S, D] (GQA) -> [B, Hq, S, D], by SDPA.
    (hkernels.patch(ops=[..., "attention"]) may replace it.)"""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])


causal_attention.hkernels_attention = "causal"


class Attention(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.heads, self.kv_heads = cfg.num_heads, cfg.num_kv_heads
        self.head_dim = cfg.hidden_size // cfg.num_heads
        self.q_proj = nn.Linear(cfg.hidden_size, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        B, S, _ = x.shape
        q = self.q_proj(x).view(B, S, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, S, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, S, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)  # looked up at call time: patchable
        out = causal_attention(q, k, v)
        return self.o_proj(out.transpose(1, 2).reshape(B, S, -1))


class MLP(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class Experts(nn.Module):
    """Hugging Face's experts module (Qwen3-MoE's parameters, ``gate_up_proj`` [E, 2·I, H] and ``down_proj``
    [E, H, I]) computed as its default ``grouped_mm`` experts implementation: the (token, slot) pairs sorted by
    expert, two ``torch._grouped_mm`` with SwiGLU between, the weighted rows summed back per token."""

    hkernels_experts = "swiglu"  # what hkernels.patch may put on hkernels.moe: this exact computation

    def __init__(self, cfg: Config) -> None:
        super().__init__()
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))
        self.act_fn = nn.SiLU()

    def forward(self, x: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        k = top_k_index.shape[1]
        ids, perm = torch.sort(top_k_index.reshape(-1))
        experts = self.gate_up_proj.shape[0]
        counts = torch.histc(ids.float() if ids.device.type == "cpu" else ids.int(), bins=experts, min=0,
                             max=experts - 1)
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        gate, up = torch._grouped_mm(x[perm // k], self.gate_up_proj.transpose(1, 2), offs=offs).chunk(2, -1)
        y = torch._grouped_mm(self.act_fn(gate) * up, self.down_proj.transpose(1, 2), offs=offs)
        y = y * top_k_weights.reshape(-1)[perm, None]
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(perm.numel(), device=perm.device)
        return y[inv].view(x.shape[0], k, -1).sum(1).to(x.dtype)


class SparseMoE(nn.Module):
    """Qwen3-MoE's block: a linear router, softmax, the top-k experts with their probabilities renormalised."""

    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.top_k = cfg.experts_per_token
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = Experts(cfg)

    def forward(self, x: Tensor) -> Tensor:
        rows = x.reshape(-1, x.shape[-1])
        probs = torch.softmax(self.gate(rows).float(), -1)
        weights, index = torch.topk(probs, self.top_k, dim=-1)
        weights = (weights / weights.sum(-1, keepdim=True)).to(x.dtype)
        return self.experts(rows, index, weights).view(x.shape)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.input_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_eps)
        self.mlp = SparseMoE(cfg) if cfg.num_experts else MLP(cfg)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_eps)
        self.rotary_emb = RotaryEmbedding(cfg.hidden_size // cfg.num_heads, base=cfg.rope_base)

    def forward(self, input_ids: Tensor) -> Tensor:
        x = self.embed_tokens(input_ids)
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)[None].expand(input_ids.shape[0], -1)
        cos, sin = self.rotary_emb(x, positions)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.norm(x)


class LlamaLike(nn.Module):
    """``forward(input_ids [B, S], labels=None)`` -> CausalLMOutput(loss, logits [B, S, V])."""

    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.config = cfg
        self.model = Decoder(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, Experts):
            nn.init.normal_(m.gate_up_proj, std=0.02)
            nn.init.normal_(m.down_proj, std=0.02)

    def forward(self, input_ids: Tensor, labels: Tensor | None = None) -> CausalLMOutput:
        logits = self.lm_head(self.model(input_ids))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten())
        return CausalLMOutput(loss=loss, logits=logits)

    def hkernels_loss_inputs(self, input_ids: Tensor, labels: Tensor) -> tuple[Tensor, Tensor, type]:
        """For hkernels.patch's fused loss: the final hidden states that predict, the labels they predict, and
        the output type."""
        hidden = self.model(input_ids)
        return hidden[:, :-1], labels[:, 1:], CausalLMOutput


def build(name: str, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
          seed: int = 0) -> LlamaLike:
    """A model of config ``name`` (see CONFIGS), initialised from ``seed``."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaLike(CONFIGS[name])
    return model.to(dtype)
