"""``hkernels.patch(model)``: swap hkernels' ops into an existing model, in place; ``hkernels.unpatch(model)``
puts everything back.

What is replaced (``ops`` picks; default all but attention, ``"all"`` everything):
- ``rms_norm``: ``torch.nn.RMSNorm`` modules, and Hugging Face's RMSNorm of Llama, Mistral, Mixtral, Qwen2,
  Qwen2-VL, Qwen2.5-VL, Qwen3, Qwen3-MoE, Phi-3, Granite and DeepSeek-V3 (:data:`HF_RMS_NORMS`) and every class
  transformers marks ``use_kernel_forward_from_hub("RMSNorm")`` (its name for this computation; the mark is there
  only with the ``kernels`` package installed), and the norms that scale by 1 + weight in float32 (Gemma's, Gemma
  2's, Gemma 3's, Qwen3-Next's: ``offset=1.0``; other look-alikes are left alone) -> :class:`hkernels.nn.RMSNorm`
  holding the same Parameter objects;
- ``layer_norm``: ``torch.nn.LayerNorm`` -> :class:`hkernels.nn.LayerNorm` (same Parameters);
- ``swiglu`` / ``geglu``: the forward of Llama-style MLPs (``gate_proj``, ``up_proj``, ``down_proj`` Linears and an
  ``act_fn`` that is SiLU, or GELU with tanh approximation) -> the gate on :func:`hkernels.swiglu` /
  :func:`hkernels.geglu`; Falcon-H1's, with its ``gate_multiplier`` and ``down_multiplier``, on swiglu's
  multipliers;
- ``rope``: the module-level ``apply_rotary_pos_emb(q, k, cos, sin, ...)`` of the modules that define the model's
  classes, where it is known to be the full rotate_half rotation (Hugging Face's Llama, Mistral, Qwen2, Qwen3,
  Qwen2-VL and Qwen2.5-VL modules, the function itself or the module ``kernels`` wraps it in under transformers 5;
  or a function marked ``hkernels_rope = "rotate_half"``, as ``bench.model``'s) -> :func:`hkernels.rope`; and
  Qwen2-VL's and Qwen2.5-VL's ``apply_multimodal_rotary_pos_emb`` (transformers 4.x's mRoPE) -> :func:`hkernels.rope`
  with ``mrope_section``;
- ``qk_norm_rope``: the forward of Qwen3's, Qwen3-MoE's and Gemma 3's attention (:data:`HF_QK_NORM_ATTENTIONS`): its
  per-head ``q_norm`` / ``k_norm`` and the rope after them run as one :func:`hkernels.qk_norm_rope` (the cache
  update, the attention function and ``o_proj`` as transformers runs them);
- ``cross_entropy``: ``torch.nn.CrossEntropyLoss`` modules (class weights included) -> :class:`hkernels.nn.
  CrossEntropyLoss`;
- ``fused_linear_cross_entropy``: the forward of causal LMs, given labels: the loss of ``lm_head`` without its
  logits (the output's ``logits`` is None). Hugging Face's Llama, Mistral, Qwen2, Qwen3 and Gemma 1/2/3
  ``*ForCausalLM`` (their shifted loss, ``num_items_in_batch``, ``shift_labels``, Gemma's final logit softcap), and
  modules that declare how their loss is
  computed (``hkernels_loss_inputs(input_ids, labels) -> (hidden [..., H], shifted labels [...], output_cls)``,
  as ``bench.model`` does). Calls without labels run the model's own forward.
- ``moe``: the experts of Hugging Face's mixture-of-experts layers (Mixtral, Qwen2-MoE, Qwen3-MoE and any experts
  class built on transformers' experts interface, ``@use_experts_implementation``) -> :func:`hkernels.moe`, through
  that interface: an ``"hkernels"`` experts implementation is registered and the model's config selects it
  (a config whose experts have biases, transposed or interleaved weights, a post-expert norm, expert parallelism or
  an activation other than SiLU keeps its implementation; a call with hidden states in another dtype than the
  weights runs the implementation selected before). Transformers without the interface: nothing is replaced. Experts
  modules that declare ``hkernels_experts = "swiglu"`` (``bench.model``'s) -> :class:`hkernels.nn.MoEExperts`
  holding the same Parameters.
- ``attention`` (opt-in: not in the default set): Hugging Face's "sdpa" attention function and the
  ``eager_attention_forward`` of its Llama, Mistral, Qwen2, Qwen3, Gemma 2 and Gemma 3 modules (Gemma 2 runs eager)
  -> :func:`hkernels.attention` for causal self-attention, with the call's ``sliding_window`` W (a query sees W
  keys, its own included: ``window=(W - 1, 0)``) and Gemma 2's logit ``softcap``, and
  -> :func:`hkernels.attention_varlen` for documents packed in a row (``position_ids`` restarting, as
  ``DataCollatorWithFlattening`` gives; a document starts where they do not go up by one, as in transformers'
  masks, which it builds only without a KV cache: ``use_cache=False``, as its Trainer sets). A mask is left out only
  when it is exactly the causal, windowed, per-document mask those imply (read once per mask tensor; under
  torch.compile a call with a mask keeps its function). Calls with any other mask (padding), dropout, a position
  bias, attention weights that are read (``output_attentions``), decoding (fewer queries than keys) or a head dim
  outside 16, 32, 64, 128, 256 run the original function. And module-level ``causal_attention(q, k, v)`` functions
  marked ``hkernels_attention = "causal"`` (``bench.model``'s).

Parameters are shared, not copied: an optimizer built before patching keeps working, and the state_dict keys are
unchanged. Every replacement is recorded on the model; :func:`unpatch` undoes them in reverse order. An op named
in ``ops`` that replaces nothing (and finds nothing already on hkernels) raises, saying why, and the call replaces
nothing; ``strict=False`` makes that a warning. :func:`hkernels.hub.kernelize` shares this module's passes.
"""

from __future__ import annotations

import functools
import inspect
import math
import sys
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hkernels import nn as hnn
from hkernels.functional import attention as _attention
from hkernels.functional import attention_varlen as _attention_varlen
from hkernels.functional import fused_linear_cross_entropy as _linear_loss
from hkernels.functional import geglu as _geglu
from hkernels.functional import moe as _moe
from hkernels.functional import qk_norm_rope as _qk_norm_rope
from hkernels.functional import rope as _rope
from hkernels.functional import swiglu as _swiglu

Tensor = torch.Tensor

OPS = ("rms_norm", "layer_norm", "swiglu", "geglu", "rope", "qk_norm_rope", "cross_entropy",
       "fused_linear_cross_entropy", "moe", "attention")
# What ops=None patches: attention is opt-in (ops=[..., "attention"]): its effect on whole models is unmeasured.
DEFAULT_OPS = tuple(o for o in OPS if o != "attention")
_RECORD = "_hkernels_patches"


@dataclass
class Replacement:
    """One change made by :func:`patch` or :func:`hkernels.hub.kernelize`: ``where`` (a module path, or
    ``module.function``), the op, ``kind`` ("module", "forward", "function", "registry", "experts": a config's
    experts implementation, or "kernelized": a forward set by ``kernels.kernelize``, ``new`` the module it was set
    on), and the objects before and after."""

    where: str
    op: str
    kind: str
    old: Any
    new: Any

    def __repr__(self) -> str:
        if self.kind == "kernelized":
            now = getattr(self.new.__dict__.get("forward"), "__func__", None)
            layer = now.__qualname__.rpartition(".")[0] if _kernelized(self.new) else "its own forward again"
            return f"Replacement({self.where!r}: {self.op}, {_name(self.old)} -> {layer} (kernels.kernelize))"
        return f"Replacement({self.where!r}: {self.op}, {_name(self.old)} -> {_name(self.new)})"


def _name(o: Any) -> str:
    o = getattr(o, "__func__", o)  # a bound forward: its function
    if not hasattr(o, "__qualname__"):
        o = type(o)  # a module instance: its class
    return f"{o.__module__}.{o.__qualname__}"


# Hugging Face RMSNorm classes known to compute x / rms(x) * weight (normalised in float32, cast, then scaled).
# By name, not by shape: several look the same and scale by (1 + weight) (Gemma, Qwen3-Next, ...), where a
# replacement would be silently wrong. Named even where transformers marks them for its kernel mapping: without the
# `kernels` package that mark is not set.
HF_RMS_NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "MixtralRMSNorm", "Qwen2RMSNorm", "Qwen2VLRMSNorm",
                "Qwen2_5_VLRMSNorm", "Qwen3RMSNorm", "Qwen3MoeRMSNorm", "Phi3RMSNorm", "GraniteRMSNorm",
                "DeepseekV3RMSNorm")
# ... and those known to compute x / rms(x) · (1 + weight), all in float32, then cast to x's dtype: offset 1.
HF_OFFSET_RMS_NORMS = ("GemmaRMSNorm", "Gemma2RMSNorm", "Gemma3RMSNorm", "Qwen3NextRMSNorm")
# Hugging Face modeling modules whose apply_rotary_pos_emb is the full rotate_half rotation (not interleaved, not
# partial): replaced by hkernels.rope. Other modules opt in by marking the function hkernels_rope = "rotate_half".
HF_ROPE_MODULES = tuple(f"transformers.models.{m}.modeling_{m}" for m in ("llama", "mistral", "qwen2", "qwen3",
                                                                          "qwen2_vl", "qwen2_5_vl"))
# ... and those whose apply_multimodal_rotary_pos_emb is mRoPE over three position streams (transformers 4.x;
# transformers 5 selects the streams in the rotary embedding and calls apply_rotary_pos_emb).
HF_MROPE_MODULES = tuple(f"transformers.models.{m}.modeling_{m}" for m in ("qwen2_vl", "qwen2_5_vl"))


def _hf_rms_norm(m: nn.Module) -> tuple[float, float] | None:
    """(eps, offset) of a known Hugging Face RMSNorm (weight over the last dim), else None: one of
    :data:`HF_RMS_NORMS`, or a class transformers marks ``use_kernel_forward_from_hub("RMSNorm")``, the name its
    kernel mapping gives Llama's computation (every class it marks so computes it): offset 0; one of
    :data:`HF_OFFSET_RMS_NORMS`: offset 1."""
    cls = type(m)
    if not cls.__module__.startswith("transformers."):
        return None
    if cls.__name__ in HF_OFFSET_RMS_NORMS:
        offset = 1.0
    elif cls.__name__ in HF_RMS_NORMS or getattr(cls, "kernel_layer_name", None) == "RMSNorm":
        offset = 0.0
    else:
        return None
    w = getattr(m, "weight", None)
    eps = getattr(m, "variance_epsilon", getattr(m, "eps", None))
    if not isinstance(w, nn.Parameter) or w.dim() != 1 or not isinstance(eps, float):
        return None
    return eps, offset


def _new_rms_norm(m: nn.Module) -> nn.Module | None:
    if isinstance(m, nn.RMSNorm):
        new = hnn.RMSNorm(m.normalized_shape, m.eps, m.elementwise_affine, device="meta")
        new.weight = m.weight
        return new
    known = _hf_rms_norm(m)
    if known is None:
        return None
    # (the Llama form rounds the normalised x to x's dtype before the weight: its result has their promoted dtype)
    new = hnn.RMSNorm(m.weight.shape[0], known[0], True, device="meta", offset=known[1],
                      casting="float32" if known[1] else "llama")
    new.weight = m.weight
    return new


def _new_layer_norm(m: nn.Module) -> nn.Module | None:
    if not isinstance(m, nn.LayerNorm) or isinstance(m, hnn.LayerNorm):
        return None
    new = hnn.LayerNorm(m.normalized_shape, m.eps, m.elementwise_affine, m.bias is not None, device="meta")
    new.weight, new.bias = m.weight, m.bias
    return new


def _new_experts(m: nn.Module) -> nn.Module | None:
    if getattr(type(m), "hkernels_experts", None) != "swiglu" or not _hf_experts_ok(m):
        return None
    return hnn.MoEExperts.sharing(m)


def _new_loss(m: nn.Module) -> nn.Module | None:
    if type(m) is not nn.CrossEntropyLoss:
        return None
    return hnn.CrossEntropyLoss(m.ignore_index, m.reduction, m.label_smoothing, m.weight)


def _mlp_gate(m: nn.Module) -> str | None:
    """"swiglu" / "geglu" for a Llama-style MLP whose activation hkernels has, else None. An MLP with Falcon-H1's
    ``gate_multiplier`` and ``down_multiplier`` is a SwiGLU with those multipliers, where its down projection has
    no bias (the result's multiplier is fused before it); else None."""
    if not all(isinstance(getattr(m, p, None), nn.Linear) for p in ("gate_proj", "up_proj", "down_proj")):
        return None
    act = getattr(m, "act_fn", None)
    silu = isinstance(act, nn.SiLU) or type(act).__name__ in ("SiLUActivation", "SiLU")
    if hasattr(m, "gate_multiplier") or hasattr(m, "down_multiplier"):
        multipliers = (getattr(m, "gate_multiplier", 1.0), getattr(m, "down_multiplier", 1.0))
        numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in multipliers)
        return "swiglu" if silu and numbers and (m.down_proj.bias is None or multipliers[1] == 1) else None
    if silu:
        return "swiglu"
    if (isinstance(act, nn.GELU) and act.approximate == "tanh") or type(act).__name__ in (
            "GELUTanh", "PytorchGELUTanh", "NewGELUActivation", "GELUPytorchTanh"):
        return "geglu"
    return None


def _swiglu_forward(self: nn.Module, x: Tensor) -> Tensor:
    return self.down_proj(_swiglu.swiglu(self.gate_proj(x), self.up_proj(x)))


def _swiglu_multiplied_forward(self: nn.Module, x: Tensor) -> Tensor:
    """Falcon-H1's MLP: ``down_proj(up · silu(gate · gate_multiplier)) · down_multiplier``, the multipliers fused."""
    return self.down_proj(_swiglu.swiglu(self.gate_proj(x), self.up_proj(x), getattr(self, "gate_multiplier", 1.0),
                                         getattr(self, "down_multiplier", 1.0)))


def _geglu_forward(self: nn.Module, x: Tensor) -> Tensor:
    return self.down_proj(_geglu.geglu(self.gate_proj(x), self.up_proj(x), "tanh"))


# Hugging Face attention classes whose forward is q_norm and k_norm on each head, then apply_rotary_pos_emb
# (Qwen3's; Gemma 3's with its 1 + weight norms): their forward runs the two as one hkernels.qk_norm_rope.
HF_QK_NORM_ATTENTIONS = ("Qwen3Attention", "Qwen3MoeAttention", "Gemma3Attention")
_CACHES = ("cache", "past_key_values", "past_key_value")


def _head_norm(m: nn.Module) -> tuple[float | None, float] | None:
    """(eps, offset) of a per-head norm qk_norm_rope can take (a known Hugging Face RMSNorm, or hkernels' over one
    dim with a weight), else None. eps None: the input dtype's machine epsilon (hkernels.nn.RMSNorm's default)."""
    if isinstance(m, hnn.RMSNorm):
        if len(m.normalized_shape) != 1 or m.weight is None:
            return None
        return m.eps, m.offset
    known = _hf_rms_norm(m)
    return None if known is None else (known[0], known[1])


def _qk_norm_attention(m: nn.Module) -> bool:
    if type(m).__name__ not in HF_QK_NORM_ATTENTIONS or not type(m).__module__.startswith("transformers."):
        return False
    if not all(isinstance(getattr(m, n, None), nn.Linear) for n in ("q_proj", "k_proj", "v_proj", "o_proj")):
        return False
    norms = [getattr(m, n, None) for n in ("q_norm", "k_norm")]
    return all(isinstance(n, nn.Module) and _head_norm(n) is not None for n in norms)


@functools.cache
def _consumed(cls: type) -> tuple[str, ...]:
    """The parameters ``cls.forward`` takes past attention_mask (a cache, cache_position): not for the attention
    function."""
    params = inspect.signature(cls.forward).parameters.values()
    return tuple(p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))[4:]


def _qk_norm_rope_attention_forward(self: nn.Module, hidden_states: Tensor, position_embeddings: Any = None,
                                    attention_mask: Any = None, *args: Any, **kwargs: Any) -> Any:
    """Qwen3's (and Gemma 3's) attention forward with its per-head norms and rope as one
    :func:`hkernels.qk_norm_rope`; the rest (projections, the cache update, the attention function the config
    selects, o_proj) as transformers runs it:
    transformers 5's ``cache.update(k, v, layer, kwargs=...)`` or 4's ``past_key_values.update(k, v, layer,
    {sin, cos, cache_position})``. Where its forward takes anything else, or its norms have two epsilons, its own
    forward runs."""
    names = _consumed(type(self))
    given = {**dict(zip(names, args, strict=False)), **{k: v for k, v in kwargs.items() if k in names or k in _CACHES}}
    q_norm, k_norm = _head_norm(self.q_norm), _head_norm(self.k_norm)
    if (position_embeddings is None or q_norm is None or k_norm is None or q_norm[0] != k_norm[0]
            or not set(names) <= {"cache", "past_key_values", "cache_position"}
            or any(v is not None for k, v in given.items() if k not in names)):  # (a deprecated name: its own)
        return type(self).forward(self, hidden_states, position_embeddings, attention_mask, *args, **kwargs)
    rest = {k: v for k, v in kwargs.items() if k not in given}
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    q = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    k = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    v = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    cos, sin = position_embeddings
    eps = q_norm[0] if q_norm[0] is not None else torch.finfo(q.dtype).eps
    qw, kw = (n.weight if off == 0.0 else n.weight.float() + off
              for n, off in ((self.q_norm, q_norm[1]), (self.k_norm, k_norm[1])))
    q, k = _qk_norm_rope.qk_norm_rope(q, k, qw, kw, cos, sin, eps)
    if given.get("cache") is not None:
        k, v = given["cache"].update(k, v, self.layer_idx, kwargs=rest)
    elif given.get("past_key_values") is not None:
        k, v = given["past_key_values"].update(k, v, self.layer_idx, {
            "sin": sin, "cos": cos, "cache_position": given.get("cache_position")})
    module = sys.modules[type(self).__module__]
    functions, eager = module.ALL_ATTENTION_FUNCTIONS, module.eager_attention_forward
    implementation = self.config._attn_implementation
    get = getattr(functions, "get_interface", None)
    attention = get(implementation, eager) if get is not None else (
        eager if implementation == "eager" else functions[implementation])
    out, weights = attention(self, q, k, v, attention_mask, dropout=0.0 if not self.training else
                             self.attention_dropout, scaling=self.scaling,
                             sliding_window=getattr(self, "sliding_window", None), **rest)
    return self.o_proj(out.reshape(*input_shape, -1).contiguous()), weights


def apply_rotary_pos_emb(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, position_ids: Any = None,
                         unsqueeze_dim: int = 1) -> tuple[Tensor, Tensor]:
    """Hugging Face's ``apply_rotary_pos_emb`` on :func:`hkernels.rope`: q, k [B, H, S, D] (``unsqueeze_dim=1``)
    or [B, S, H, D] (``unsqueeze_dim=2``); cos, sin [B, S, D] or [S, D]. Returns rotated q and k in q's dtype
    and layout. (Signature of transformers 4.x; :func:`apply_rotary_pos_emb_v5` has 5.x's, without position_ids.)"""
    return _rotate(q, k, cos, sin, unsqueeze_dim)


def apply_rotary_pos_emb_v5(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor,
                            unsqueeze_dim: int = 1) -> tuple[Tensor, Tensor]:
    """:func:`apply_rotary_pos_emb` with transformers 5.x's signature (no position_ids)."""
    return _rotate(q, k, cos, sin, unsqueeze_dim)


def _rotate(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, unsqueeze_dim: int,
            mrope_section: list[int] | None = None) -> tuple[Tensor, Tensor]:
    if unsqueeze_dim == 2:
        qr, kr = _rope.rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin, mrope_section=mrope_section)
        return qr.transpose(1, 2), kr.transpose(1, 2)
    if unsqueeze_dim != 1:
        raise ValueError(f"hkernels.patch.apply_rotary_pos_emb: unsqueeze_dim must be 1 or 2, got {unsqueeze_dim}")
    return _rope.rope(q, k, cos, sin, mrope_section=mrope_section)


def apply_multimodal_rotary_pos_emb(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, mrope_section: list[int],
                                    unsqueeze_dim: int = 1) -> tuple[Tensor, Tensor]:
    """Qwen2-VL's and Qwen2.5-VL's ``apply_multimodal_rotary_pos_emb`` (transformers 4.x) on :func:`hkernels.rope`
    with ``mrope_section``: q, k [B, H, S, D] (``unsqueeze_dim=1``) or [B, S, H, D] (``unsqueeze_dim=2``); cos, sin
    [3, B, S, D], three position streams."""
    return _rotate(q, k, cos, sin, unsqueeze_dim, mrope_section)


apply_rotary_pos_emb.hkernels = apply_rotary_pos_emb_v5.hkernels = True  # type: ignore[attr-defined]
apply_multimodal_rotary_pos_emb.hkernels = True  # type: ignore[attr-defined]


def _parameters(fn: Any) -> list[str] | None:
    """The parameter names of ``fn``, seen through the ``kernels`` package's wrapper: transformers 5 with
    ``kernels`` installed turns a function marked ``use_kernel_forward_from_hub`` into a module instance whose
    forward (``self`` first) has the function's parameters; its own call signature reads ``(*args, **kwargs)``."""
    target = type(fn).forward if isinstance(fn, nn.Module) and hasattr(fn, "kernel_layer_name") else fn
    try:
        params = list(inspect.signature(target).parameters)
    except (TypeError, ValueError):
        return None
    return params[1:] if target is not fn else params


def _rope_for(fn: Any) -> Any:
    """Our replacement with the same parameters as ``fn`` (positional calls must bind the same way), or None when
    ``fn`` is not Hugging Face's shape of it."""
    params = _parameters(fn)
    if params is None or params[:4] != ["q", "k", "cos", "sin"]:
        return None
    if params[4:] == ["position_ids", "unsqueeze_dim"]:
        return apply_rotary_pos_emb
    if params[4:] in (["unsqueeze_dim"], []):
        return apply_rotary_pos_emb_v5
    return None


def _causal_lm_forward(self: nn.Module, input_ids: Tensor | None = None, labels: Tensor | None = None,
                       **kwargs: Any) -> Any:
    """A causal LM's forward with labels: the loss of its LM head by the fused linear cross-entropy, no logits."""
    if labels is None:
        return type(self).forward(self, input_ids, labels=labels, **kwargs)
    hidden, shifted, output = self.hkernels_loss_inputs(input_ids, labels, **kwargs)
    head = self.lm_head
    tokens = shifted.numel()
    loss = _linear_loss.fused_linear_cross_entropy(
        hidden.reshape(tokens, hidden.shape[-1]), head.weight, shifted.reshape(tokens), head.bias,
    )
    return output(loss=loss, logits=None)


def causal_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Causal self-attention (q [B, Hq, S, D], k/v [B, Hk, S, D]) on :func:`hkernels.attention`."""
    return _attention.attention(q, k, v, causal=True)


causal_attention.hkernels = True  # type: ignore[attr-defined]

_ATTENTION_HEAD_DIMS = _attention.HEAD_DIMS
# Hugging Face modeling modules whose eager_attention_forward is softmax(cap(scaling · q kᵀ) + mask) v over the
# key/value heads repeated per group (Gemma's with its optional softcap), returning [B, S, Hq, D] and the weights.
# Gemma 2 runs it by default: SDPA has no softcap.
HF_EAGER_ATTENTION_MODULES = tuple(f"transformers.models.{m}.modeling_{m}"
                                   for m in ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3"))
_MASK_SEEN = "_hkernels_mask_seen"  # on a mask tensor: what it was found to be, per (window, version)


def _hf_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Any,
                  dropout: Any, scaling: Any, causal_without_mask: bool, kwargs: dict[str, Any],
                  collector: Any) -> Tensor | None:
    """hkernels' result [B, S, Hq, D] of one Hugging Face attention call (q [B, Hq, S, D], k/v [B, Hk, S, D]) whose
    result it computes exactly, else None: self-attention without dropout, position bias or returned weights, with
    Gemma's softcap, and either no mask (``causal_without_mask``: SDPA then is causal) or a mask that is exactly
    causal, banded by the call's ``sliding_window`` W (a query sees W keys, itself included: window (W − 1, 0)),
    per document of rows packed by restarting ``position_ids``."""
    softcap = kwargs.get("softcap")
    window = kwargs.get("sliding_window")
    if not (isinstance(query, Tensor) and isinstance(key, Tensor) and isinstance(value, Tensor)
            and query.dim() == key.dim() == value.dim() == 4):
        return None
    B, Hq, S, D = query.shape
    if not (dropout == 0 and kwargs.get("position_bias") is None and key.shape == value.shape
            and key.shape[0] == B and key.shape[2] == S > 1 and key.shape[3] == D and D in _ATTENTION_HEAD_DIMS
            and Hq % key.shape[1] == 0 and query.dtype == key.dtype == value.dtype
            and query.device == key.device == value.device
            and (scaling is None or _positive(scaling)) and (softcap is None or _positive(softcap))
            and (window is None or (isinstance(window, int) and not isinstance(window, bool) and window >= 1))
            and not _weights_wanted(module, kwargs, collector)):
        return None
    if attention_mask is None:
        if not causal_without_mask:
            return None
        # No mask: SDPA runs plain causal attention, whatever sliding_window says (Hugging Face leaves the mask out
        # only where the window spans every key).
        left, packing = -1, None
    else:
        left = -1 if window is None else window - 1
        found = _mask_packing(attention_mask, query, left, kwargs)
        if found is None:
            return None
        packing = found or None
    bounds = None if left < 0 else (left, 0)
    if packing is None:
        out = _attention.attention(query, key, value, causal=True, scale=scaling, window=bounds, softcap=softcap)
        return out.transpose(1, 2).contiguous()
    cu, longest = packing
    rows = [t.transpose(1, 2).reshape(B * S, t.shape[1], D) for t in (query, key, value)]  # views when B = 1
    out = _attention_varlen.attention_varlen(*rows, cu, max_seqlen_q=longest, max_seqlen_k=longest, causal=True,
                                             scale=scaling, window=bounds, softcap=softcap)
    return out.reshape(B, S, Hq, D)


def _positive(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def _weights_wanted(module: nn.Module, kwargs: dict[str, Any], collector: Any) -> bool:
    """Whether the call's attention weights are read: asked for by the call or the config, or collected by
    transformers' output-capturing hooks (``collector``: what they collect; they record what the attention module
    returns)."""
    if kwargs.get("output_attentions") or getattr(getattr(module, "config", None), "output_attentions", False):
        return True
    collecting = collector.get() if collector is not None else None
    return bool(collecting) and "attentions" in collecting


def _output_collector() -> Any:
    """transformers' context variable of the outputs its hooks collect, or None in versions without it."""
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:
        return None
    return _active_collector


def _mask_packing(mask: Any, query: Tensor, left: int, kwargs: dict[str, Any]) -> tuple[Any, ...] | None:
    """Whether ``mask`` (bool: True keeps; or additive: 0 keeps, the dtype's min drops; [B or 1, 1, S, S]) is
    exactly causal self-attention with window ``left`` (−1: none) within each document: (cu_seqlens int32 on the
    device, longest document) for documents packed in rows, () for one document per row, None when the mask is
    anything else. The answer is kept on the mask (every layer of a kind gets the same one), which is read once."""
    B, _, S, _ = query.shape
    if not (isinstance(mask, Tensor) and mask.dim() == 4 and mask.shape[0] in (1, B) and mask.shape[1] == 1
            and tuple(mask.shape[2:]) == (S, S) and mask.device == query.device
            and (mask.dtype == torch.bool or mask.is_floating_point())):
        return None
    if torch.compiler.is_compiling():  # reading the mask's values would break the graph: SDPA takes it
        return None
    # An inference tensor has no version counter, so a change in place could not be seen: it is read every call.
    version = None if mask.is_inference() else mask._version
    seen = mask.__dict__.setdefault(_MASK_SEEN, {}) if version is not None else {}
    if (left, version) not in seen:
        seen[(left, version)] = _read_mask(mask, B, S, left, kwargs)
    return seen[(left, version)]


def _documents(B: int, S: int, kwargs: dict[str, Any]) -> Tensor | None:
    """The first token of each document of the flattened [B·S] tokens (CPU int64) where ``position_ids`` do not
    go up by one: how Hugging Face's masks find documents packed in a row (its masks are built from them alone, so
    ``cu_seq_lens_q`` adds nothing here); None without position ids of the rows' shape."""
    pos = kwargs.get("position_ids")
    if not (isinstance(pos, Tensor) and pos.dim() == 2 and pos.shape[0] in (1, B) and pos.shape[1] == S):
        return None
    p = pos.detach().expand(B, S).cpu()
    new = torch.ones(B, S, dtype=torch.bool)
    new[:, 1:] = p[:, 1:] - p[:, :-1] != 1
    return torch.nonzero(new.reshape(-1)).reshape(-1)


def _read_mask(mask: Tensor, B: int, S: int, left: int, kwargs: dict[str, Any]) -> tuple[Any, ...] | None:
    """:func:`_mask_packing`'s answer, comparing every element of ``mask`` with the mask the documents imply."""
    starts = _documents(B, S, kwargs)
    if starts is None:
        starts = torch.arange(0, B * S, S)
    lengths = torch.diff(starts, append=torch.tensor([B * S]))
    doc = torch.repeat_interleave(torch.arange(starts.numel()), lengths).view(B, S).to(mask.device)
    i = torch.arange(S, device=mask.device)
    keep = (i[None, :] <= i[:, None]) & (doc[:, :, None] == doc[:, None, :])
    if left >= 0:
        keep &= i[None, :] >= i[:, None] - left
    keep = keep[:, None]  # [B, 1, S, S]
    if mask.dtype != torch.bool:
        keep = torch.full(keep.shape, torch.finfo(mask.dtype).min, dtype=mask.dtype,
                          device=mask.device).masked_fill_(keep, 0)
    if not torch.equal(mask.expand(keep.shape), keep):
        return None
    if starts.numel() == B and bool((starts == torch.arange(0, B * S, S)).all()):
        return ()  # one document per row: the dense call
    cu = torch.cat([starts, torch.tensor([B * S])]).to(device=mask.device, dtype=torch.int32)
    return cu, int(lengths.max())


def _hf_sdpa(original: Any) -> Any:
    """Hugging Face's sdpa attention function, on :func:`hkernels.attention` / :func:`hkernels.attention_varlen`
    where :func:`_hf_attention` computes the call exactly; everything else to ``original``."""
    collector = _output_collector()

    def attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                  dropout: float = 0.0, scaling: float | None = None, is_causal: bool | None = None,
                  **kwargs: Any) -> tuple[Tensor, None]:
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        # A softcap is not SDPA's: transformers' sdpa function ignores it (4.x) or raises (5.x); the original does.
        out = None if kwargs.get("softcap") is not None else _hf_attention(
            module, query, key, value, attention_mask, dropout, scaling, bool(causal), kwargs, collector)
        if out is None:
            return original(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                            is_causal=is_causal, **kwargs)
        return out, None

    attention.hkernels = True  # type: ignore[attr-defined]
    return attention


def _hf_eager(original: Any) -> Any:
    """A Hugging Face module's ``eager_attention_forward`` (see :data:`HF_EAGER_ATTENTION_MODULES`), on hkernels
    where :func:`_hf_attention` computes the call exactly (no weights are returned then: nothing reads them);
    everything else to ``original``. Without a mask eager attention is not causal: ``original`` runs it."""
    collector = _output_collector()

    def eager_attention_forward(module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                                attention_mask: Tensor | None, *args: Any, **kwargs: Any) -> tuple[Tensor, Any]:
        out = None
        if not args and kwargs.get("scaling") is not None:
            rest = {k: v for k, v in kwargs.items() if k not in ("dropout", "scaling")}
            out = _hf_attention(module, query, key, value, attention_mask, kwargs.get("dropout", 0.0),
                                kwargs.get("scaling"), False, rest, collector)
        if out is None:
            return original(module, query, key, value, attention_mask, *args, **kwargs)
        return out, None

    eager_attention_forward.hkernels = True  # type: ignore[attr-defined]
    return eager_attention_forward


def _hf_experts_ok(m: nn.Module) -> bool:
    """A Hugging Face experts module that :func:`hkernels.moe` computes exactly: concatenated [gate; up] weights
    [E, 2·I, H], no biases, no post-expert norm, SiLU, all experts local."""
    act = getattr(m, "act_fn", None)
    gate_up, down = getattr(m, "gate_up_proj", None), getattr(m, "down_proj", None)
    return (isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor) and gate_up.dim() == down.dim() == 3
            and getattr(m, "has_gate", True) and not getattr(m, "has_bias", False)
            and not getattr(m, "is_transposed", False) and getattr(m, "is_concatenated", True)
            and not getattr(m, "has_post_expert_norm", False) and not getattr(m, "_is_expert_parallel", False)
            and (isinstance(act, nn.SiLU) or type(act).__name__ in ("SiLUActivation", "SiLU"))
            and gate_up.shape[1] == 2 * down.shape[2] and gate_up.shape[2] == down.shape[1])


def hf_experts_forward(self: nn.Module, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor
                       ) -> Tensor:
    """Hugging Face's experts forward (the ``"hkernels"`` experts implementation) on :func:`hkernels.moe`; a call
    it does not compute exactly (hidden states in another dtype than the weights) runs the implementation the
    model had before patching."""
    if hidden_states.dtype == self.gate_up_proj.dtype and _hf_experts_ok(self):
        return _moe.moe(hidden_states, self.gate_up_proj, self.down_proj, top_k_index, top_k_weights)
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    before = self.__dict__.get(_BEFORE, "eager")
    own = type(self).forward.__wrapped__
    return ALL_EXPERTS_FUNCTIONS.get_interface(before, own)(self, hidden_states, top_k_index, top_k_weights)


hf_experts_forward.hkernels = True  # type: ignore[attr-defined]
_EXPERTS = "hkernels"
_BEFORE = "_hkernels_experts_before"  # on a patched experts module: the implementation its config selected before


def _hf_experts_configs(model: nn.Module) -> list[tuple[str, Any, list[nn.Module]]]:
    """(path of the first, config, modules) for each distinct config that selects the experts implementation of
    ``model``'s experts modules built on transformers' experts interface."""
    found: dict[int, tuple[str, Any, list[nn.Module]]] = {}
    for path, m in model.named_modules():
        forward = getattr(type(m), "forward", None)
        config = getattr(m, "config", None)
        if (getattr(forward, "__wrapped__", None) is not None and hasattr(m, "gate_up_proj")
                and hasattr(config, "_experts_implementation_internal")):
            found.setdefault(id(config), (path, config, []))[2].append(m)
    return list(found.values())


# Hugging Face causal LMs whose loss is the shifted cross-entropy of ``lm_head(model(...))``, the logits capped to
# c·tanh(x / c) where ``config.final_logit_softcapping`` gives c (Gemma 2/3), patched by class name.
HF_CAUSAL_LMS = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "GemmaForCausalLM",
                 "Gemma2ForCausalLM", "Gemma3ForCausalLM")


def _hf_causal_lm_forward(self: nn.Module, input_ids: Tensor | None = None, *args: Any, labels: Tensor | None = None,
                          **kwargs: Any) -> Any:
    """A Hugging Face ``*ForCausalLM.forward`` that, given labels, computes its loss (token t predicts t + 1,
    ``num_items_in_batch`` and ``shift_labels`` honoured, the config's final logit softcap applied) by the fused
    linear cross-entropy: no logits."""
    if args or (labels is None and kwargs.get("shift_labels") is None):
        return type(self).forward(self, input_ids, *args, labels=labels, **kwargs)
    from transformers.modeling_outputs import CausalLMOutputWithPast

    num_items = kwargs.pop("num_items_in_batch", None)
    shift_labels = kwargs.pop("shift_labels", None)
    ignore_index = kwargs.pop("ignore_index", -100)
    kwargs.pop("logits_to_keep", None)
    return_dict = kwargs.pop("return_dict", None)
    if return_dict is None:
        return_dict = getattr(self.config, "return_dict", True)
    outputs = self.model(input_ids=input_ids, **kwargs)
    hidden = outputs[0] if isinstance(outputs, tuple) else outputs.last_hidden_state
    if shift_labels is None:
        shift_labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    head = self.lm_head
    loss = _linear_loss.fused_linear_cross_entropy(
        hidden.reshape(-1, hidden.shape[-1]), head.weight, shift_labels.reshape(-1).to(hidden.device), head.bias,
        ignore_index=ignore_index, reduction="mean" if num_items is None else "sum",
        softcap=getattr(self.config, "final_logit_softcapping", None) or None,
    )
    if num_items is not None:
        loss = loss / (num_items.to(loss.device) if torch.is_tensor(num_items) else num_items)
    fields = CausalLMOutputWithPast.__dataclass_fields__
    rest = {k: getattr(outputs, k, None) for k in ("cache", "past_key_values", "hidden_states", "attentions")
            if k in fields and not isinstance(outputs, tuple)}
    out = CausalLMOutputWithPast(loss=loss, logits=None, **rest)
    return out if return_dict else out.to_tuple()


def _loss_forward(m: nn.Module) -> Any:
    """The fused-loss forward for ``m`` (ours for modules that declare ``hkernels_loss_inputs``, or a known
    Hugging Face causal LM), else None."""
    if not isinstance(getattr(m, "lm_head", None), nn.Linear) or "forward" in m.__dict__:
        return None
    if hasattr(m, "hkernels_loss_inputs"):
        return _causal_lm_forward
    if type(m).__name__ in HF_CAUSAL_LMS and type(m).__module__.startswith("transformers.") and hasattr(m, "model"):
        return _hf_causal_lm_forward
    return None


def _bind(m: nn.Module, fn: Any) -> Any:
    """``fn`` bound to ``m`` as an instance ``forward`` with the signature of ``m``'s own (Hugging Face's Trainer
    reads it to decide which input columns to keep)."""
    def forward(*args: Any, **kwargs: Any) -> Any:
        return fn(m, *args, **kwargs)

    forward.__signature__ = inspect.signature(type(m).forward.__get__(m))  # type: ignore[attr-defined]
    forward.__qualname__ = fn.__qualname__
    forward.__module__ = fn.__module__
    return forward


def _kernelized(m: nn.Module) -> bool:
    """``m``'s forward was set by ``kernels.kernelize`` to one of :mod:`hkernels.hub`'s layers (its forward, bound
    to ``m``: how every kernels release replaces a forward)."""
    return getattr(getattr(m.__dict__.get("forward"), "__func__", None), "hkernels_layer", False)


def unkernelize(m: nn.Module) -> None:
    """Give ``m`` (a marked layer, or a marked function's module) its own forward back, as kernels itself does."""
    m.__dict__.pop("forward", None)
    m.__dict__.pop("_kernel_repo", None)


def _hooked(m: nn.Module) -> bool:
    """Hooks registered on ``m``, or a forward replaced on the instance (accelerate's offloading does that; the
    class's own forward bound there, as kernels 0.16 leaves a layer it reverts, replaces nothing)."""
    own = m.__dict__.get("forward")
    return bool(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks
                or getattr(m, "_backward_pre_hooks", None)
                or (own is not None and getattr(own, "__func__", None) is not type(m).forward))


def _parent(model: nn.Module, path: str) -> tuple[nn.Module, str]:
    parent_path, _, attr = path.rpartition(".")
    return (model.get_submodule(parent_path) if parent_path else model), attr


class _Tally:
    """What one :func:`patch` (or :func:`hkernels.hub.kernelize`) call found per op: replacements made, parts
    already on hkernels (an earlier call), and why a part was left as it is. ``passes``: the ops still to be
    patched here (kernelize's hooks may have done some already)."""

    def __init__(self, wanted: set[str]) -> None:
        self.wanted = wanted
        self.passes = set(wanted)
        self.done: list[Replacement] = []
        self.ours: dict[str, int] = dict.fromkeys(wanted, 0)
        self.why: dict[str, list[str]] = {op: [] for op in wanted}

    def add(self, r: Replacement) -> None:
        self.done.append(r)

    def note(self, op: str, reason: str) -> None:
        if op in self.why and reason not in self.why[op]:
            self.why[op].append(reason)

    def idle(self) -> list[str]:
        """The wanted ops that replaced nothing and found nothing already on hkernels, in OPS order."""
        replaced = {r.op for r in self.done}
        return [op for op in OPS if op in self.wanted and op not in replaced and not self.ours[op]]


# Why an op found nothing to replace, where nothing more specific was noted: what it looks for.
_LOOKS_FOR = {
    "rms_norm": "no torch.nn.RMSNorm, no Hugging Face RMSNorm marked use_kernel_forward_from_hub('RMSNorm') and "
                f"none of {', '.join(HF_RMS_NORMS + HF_OFFSET_RMS_NORMS)}",
    "layer_norm": "no torch.nn.LayerNorm",
    "swiglu": "no MLP with gate_proj, up_proj and down_proj Linears and a SiLU act_fn",
    "geglu": "no MLP with gate_proj, up_proj and down_proj Linears and a tanh-approximated GELU act_fn",
    "rope": "no module of the model's classes defines apply_rotary_pos_emb",
    "qk_norm_rope": f"no attention module with q_norm and k_norm hkernels knows ({', '.join(HF_QK_NORM_ATTENTIONS)})",
    "cross_entropy": "no torch.nn.CrossEntropyLoss module",
    "fused_linear_cross_entropy": "no causal LM with an lm_head Linear that hkernels knows "
                                  f"({', '.join(HF_CAUSAL_LMS)}, or a module with hkernels_loss_inputs)",
    "moe": "no experts module on transformers' experts interface or marked hkernels_experts = 'swiglu'",
    "attention": "no transformers attention module and no causal_attention marked hkernels_attention = 'causal'",
}


def _ops_arg(ops: str | list[str] | tuple[str, ...] | None) -> tuple[set[str], bool]:
    """(the ops wanted, whether the caller named them one by one) from patch's ``ops``."""
    if ops is None or ops == "all":
        return set(DEFAULT_OPS if ops is None else OPS), False
    if isinstance(ops, str):
        ops = [o.strip() for o in ops.split(",") if o.strip()]
    if not isinstance(ops, (list, tuple, set, frozenset)) or not all(isinstance(o, str) for o in ops):
        raise TypeError(f"hkernels.patch: ops must be None, 'all', a comma-separated string or a list of op names, "
                        f"got {ops!r}")
    wanted = set(ops)
    if "all" in wanted:
        raise ValueError("hkernels.patch: 'all' stands alone (ops='all'), not inside a list of ops")
    unknown = wanted - set(OPS)
    if unknown:
        raise ValueError(f"hkernels.patch: unknown op(s) {sorted(unknown)}; valid: {', '.join(OPS)}, or 'all'")
    if not wanted:
        raise ValueError("hkernels.patch: ops names no op; leave it None for the default set, or pass 'all'")
    return wanted, True


def patch(model: nn.Module, ops: str | list[str] | tuple[str, ...] | None = None, *,
          strict: bool = True) -> list[Replacement]:
    """Replace, in place, the parts of ``model`` that hkernels has ops for. ``ops``: names from :data:`OPS` (a list
    or a comma-separated string), ``"all"`` (every op, attention included), or None (:data:`DEFAULT_OPS`: all but
    attention). Returns what was replaced in this call; a part already on hkernels (patched before) is left as it is.

    Never silently does nothing: an op named in ``ops`` that replaces nothing and finds nothing already on hkernels
    raises ``ValueError`` naming the op and why, and the call replaces nothing (with ``strict=False``: a
    ``RuntimeWarning``, and the other ops are patched); with ``ops`` None or ``"all"``, so does a call in which no
    op applies at all."""
    wanted, named = _ops_arg(ops)
    tally = _Tally(wanted)
    run(model, tally, "hkernels.patch")
    verdict(model, tally, named, strict, "hkernels.patch")
    return tally.done


def run(model: nn.Module, tally: _Tally, who: str) -> None:
    """Patch ``model`` for the ops in ``tally.passes``, recording the replacements on the model."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"{who}: model must be a torch.nn.Module, got {type(model).__name__}")
    start = len(tally.done)
    _patch_modules(model, tally)
    _patch_forwards(model, tally)
    if "moe" in tally.passes:
        _patch_experts(model, tally)
    if "rope" in tally.passes:
        _patch_rope(model, tally)
    if "attention" in tally.passes:
        _patch_attention(model, tally)
    model.__dict__.setdefault(_RECORD, []).extend(tally.done[start:])


def verdict(model: nn.Module, tally: _Tally, named: bool, strict: bool, who: str) -> None:
    """Raise (``strict``; undoing the call's replacements) or warn where the call did nothing it was asked for:
    an op named one by one (``named``) that replaced nothing, or, asked for the default set, no op at all."""
    idle = tally.idle()
    if not idle or not (named or len(idle) == len(tally.wanted)):
        return
    lines = "; ".join(f"{op}: {'; '.join(tally.why[op]) or _LOOKS_FOR[op]}" for op in idle)
    what = f"{', '.join(idle)} replaced nothing" if named else "no op applies"
    message = f"{who}: {what} in {type(model).__name__} ({lines})"
    if strict:
        _rollback(model, tally.done)
        raise ValueError(message)
    warnings.warn(message, RuntimeWarning, stacklevel=3)


def _rollback(model: nn.Module, done: list[Replacement]) -> None:
    """Undo ``done`` (the replacements of one call, newest last) and drop them from the model's record: a call
    that raises leaves the model as it was."""
    record: list[Replacement] = model.__dict__.get(_RECORD, [])
    ids = {id(r) for r in done}
    model.__dict__[_RECORD] = [r for r in record if id(r) not in ids]
    _undo(model, list(reversed(done)))


def _patch_modules(model: nn.Module, tally: _Tally) -> None:
    """Norm, loss and experts modules -> hkernels' modules holding the same Parameters."""
    wanted = tally.passes
    builders = [(op, build) for op, build in (("rms_norm", _new_rms_norm), ("layer_norm", _new_layer_norm),
                                              ("cross_entropy", _new_loss), ("moe", _new_experts)) if op in wanted]
    ours = {"rms_norm": hnn.RMSNorm, "layer_norm": hnn.LayerNorm, "cross_entropy": hnn.CrossEntropyLoss,
            "moe": hnn.MoEExperts}
    hooked = []
    for path, m in list(model.named_modules()):
        for op, build in builders:
            if isinstance(m, ours[op]) or (op == "rms_norm" and _kernelized(m)):
                tally.ours[op] += 1
                break
            if not path:
                continue
            new = build(m)
            if new is not None:
                if _hooked(m):  # its hooks would not run on a new module: leave it, and say so
                    hooked.append(path)
                    tally.note(op, f"{path} has hooks or a replaced forward")
                    break
                parent, attr = _parent(model, path)
                setattr(parent, attr, new)
                tally.add(Replacement(path, op, "module", m, new))
                break
            if op == "rms_norm" and type(m).__name__.endswith("RMSNorm"):
                tally.note(op, f"{type(m).__name__} is not known to compute x / rms(x) * weight or x / rms(x) * "
                               "(1 + weight) in float32")
    if hooked:
        warnings.warn(f"hkernels.patch: left {len(hooked)} module(s) with hooks or a replaced forward as they are "
                      f"(e.g. {hooked[0]}): a new module would not run their hooks", RuntimeWarning, stacklevel=3)


def _patch_forwards(model: nn.Module, tally: _Tally) -> None:
    """Llama-style MLPs and causal LMs' losses: their forward replaced on the instance."""
    wanted = tally.passes
    for path, m in model.named_modules():
        own = m.__dict__.get("forward")
        gate = _mlp_gate(m)
        if gate is not None and gate in wanted:
            if own is None:
                multiplied = hasattr(m, "gate_multiplier") or hasattr(m, "down_multiplier")
                m.forward = _bind(m, _geglu_forward if gate == "geglu" else _swiglu_multiplied_forward if multiplied
                                  else _swiglu_forward)
                tally.add(Replacement(path or "<model>", gate, "forward", type(m).forward, m.forward))
            elif getattr(own, "__qualname__", None) in (_swiglu_forward.__qualname__, _geglu_forward.__qualname__,
                                                        _swiglu_multiplied_forward.__qualname__):
                tally.ours[gate] += 1
            else:
                tally.note(gate, f"{path or '<model>'} has its forward replaced on the instance")
        if "qk_norm_rope" in wanted and _qk_norm_attention(m):
            if own is None:
                m.forward = _bind(m, _qk_norm_rope_attention_forward)
                tally.add(Replacement(path or "<model>", "qk_norm_rope", "forward", type(m).forward, m.forward))
            elif getattr(own, "__qualname__", None) == _qk_norm_rope_attention_forward.__qualname__:
                tally.ours["qk_norm_rope"] += 1
            else:
                tally.note("qk_norm_rope", f"{path or '<model>'} has its forward replaced on the instance")
        if "fused_linear_cross_entropy" in wanted:
            if getattr(own, "__qualname__", None) in (_causal_lm_forward.__qualname__,
                                                      _hf_causal_lm_forward.__qualname__):
                tally.ours["fused_linear_cross_entropy"] += 1
                continue
            loss_forward = _loss_forward(m)
            if loss_forward is not None:
                m.forward = _bind(m, loss_forward)
                tally.add(Replacement(path or "<model>", "fused_linear_cross_entropy", "forward", type(m).forward,
                                      m.forward))


def _patch_experts(model: nn.Module, tally: _Tally) -> None:
    """Experts built on transformers' experts interface: their config selects the "hkernels" implementation."""
    configs = _hf_experts_configs(model)
    if not configs:
        return
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS.register(_EXPERTS, hf_experts_forward)
    for path, config, modules in configs:
        old = config._experts_implementation_internal
        if old == _EXPERTS:
            tally.ours["moe"] += 1
        # Only where hkernels.moe computes every experts module of the config exactly (not biases,
        # transposed weights, other activations...): the others keep the implementation they have.
        elif all(_hf_experts_ok(m) for m in modules):
            for m in modules:
                m.__dict__[_BEFORE] = old
            config._experts_implementation_internal = _EXPERTS
            tally.add(Replacement(path, "moe", "experts", old, _EXPERTS))
        else:
            tally.note("moe", f"the experts of {path} are not what hkernels.moe computes (biases, transposed or "
                              "interleaved weights, a post-expert norm, expert parallelism or another activation)")


def _patch_rope(model: nn.Module, tally: _Tally) -> None:
    """The module-level apply_rotary_pos_emb of the modules that define the model's classes."""
    for mod_name in sorted({type(m).__module__ for m in model.modules()}):
        mod = sys.modules.get(mod_name)
        multimodal = getattr(mod, "apply_multimodal_rotary_pos_emb", None)
        if multimodal is not None and mod_name in HF_MROPE_MODULES:
            where = f"{mod_name}.apply_multimodal_rotary_pos_emb"
            if getattr(multimodal, "hkernels", False):
                tally.ours["rope"] += 1
            elif _parameters(multimodal) == ["q", "k", "cos", "sin", "mrope_section", "unsqueeze_dim"]:
                mod.apply_multimodal_rotary_pos_emb = apply_multimodal_rotary_pos_emb
                tally.add(Replacement(where, "rope", "function", multimodal, apply_multimodal_rotary_pos_emb))
            else:
                tally.note("rope", f"{where} has a signature hkernels does not know: {_parameters(multimodal)}")
        fn = getattr(mod, "apply_rotary_pos_emb", None)
        if fn is None:
            continue
        where = f"{mod_name}.apply_rotary_pos_emb"
        if getattr(fn, "hkernels", False):
            tally.ours["rope"] += 1
            continue
        known = mod_name in HF_ROPE_MODULES or getattr(fn, "hkernels_rope", None) == "rotate_half"
        if not known:
            tally.note("rope", f"{where} is not known to be the full rotate_half rotation (hkernels knows "
                               "transformers' Llama, Mistral, Qwen2, Qwen3, Qwen2-VL and Qwen2.5-VL; mark others "
                               "hkernels_rope = 'rotate_half')")
            continue
        ours = _rope_for(fn) if callable(fn) else None
        if ours is None:
            tally.note("rope", f"{where} has a signature hkernels does not know: {_parameters(fn)}")
            continue
        mod.apply_rotary_pos_emb = ours
        tally.add(Replacement(where, "rope", "function", fn, ours))


def _patch_attention(model: nn.Module, tally: _Tally) -> None:
    """Marked causal_attention functions; transformers' sdpa function and its modules' eager attention."""
    for mod_name in sorted({type(m).__module__ for m in model.modules()}):
        mod = sys.modules.get(mod_name)
        fn = getattr(mod, "causal_attention", None)
        if callable(fn) and getattr(fn, "hkernels_attention", None) == "causal":
            mod.causal_attention = causal_attention
            tally.add(Replacement(f"{mod_name}.causal_attention", "attention", "function", fn, causal_attention))
        elif fn is causal_attention:
            tally.ours["attention"] += 1
    if not any(type(m).__module__.startswith("transformers.") for m in model.modules()):
        return
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    sdpa = ALL_ATTENTION_FUNCTIONS.get("sdpa")
    if sdpa is not None and getattr(sdpa, "hkernels", False):
        tally.ours["attention"] += 1
    elif sdpa is not None:
        ours = _hf_sdpa(sdpa)
        ALL_ATTENTION_FUNCTIONS["sdpa"] = ours
        tally.add(Replacement("transformers:ALL_ATTENTION_FUNCTIONS[sdpa]", "attention", "registry", sdpa, ours))
    for mod_name in sorted({type(m).__module__ for m in model.modules()} & set(HF_EAGER_ATTENTION_MODULES)):
        mod = sys.modules.get(mod_name)
        fn = getattr(mod, "eager_attention_forward", None)
        if callable(fn) and getattr(fn, "hkernels", False):
            tally.ours["attention"] += 1
        elif callable(fn):
            ours = _hf_eager(fn)
            mod.eager_attention_forward = ours
            tally.add(Replacement(f"{mod_name}.eager_attention_forward", "attention", "function", fn, ours))


def unpatch(model: nn.Module) -> list[Replacement]:
    """Undo every :func:`patch` (and :func:`hkernels.hub.kernelize`) of ``model``, newest first; returns what was
    restored. A function replaced in a module (rope) is restored for every model that uses that module."""
    done: list[Replacement] = model.__dict__.pop(_RECORD, [])
    _undo(model, list(reversed(done)))
    return list(reversed(done))


def _undo(model: nn.Module, newest_first: list[Replacement]) -> None:
    for r in newest_first:
        if r.kind == "module":
            parent, attr = _parent(model, r.where)
            setattr(parent, attr, r.old)
        elif r.kind == "forward":
            target = model if r.where == "<model>" else model.get_submodule(r.where)
            target.__dict__.pop("forward", None)
        elif r.kind == "kernelized":
            unkernelize(r.new)
        elif r.kind == "experts":
            config = model.get_submodule(r.where).config
            config._experts_implementation_internal = r.old
            for m in model.modules():
                if getattr(m, "config", None) is config:
                    m.__dict__.pop(_BEFORE, None)
        elif r.kind == "registry":
            from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

            ALL_ATTENTION_FUNCTIONS["sdpa"] = r.old
        else:
            mod_name, _, fn_name = r.where.rpartition(".")
            setattr(sys.modules[mod_name], fn_name, r.old)
