"""Modules over hkernels' ops: drop-ins for torch.nn's norms and the usual Llama-style blocks.

Each module has the constructor arguments, parameter names and ``state_dict`` of the module it replaces
(``torch.nn.RMSNorm``, ``torch.nn.LayerNorm``, a Hugging Face Llama MLP's ``gate_proj`` / ``up_proj`` /
``down_proj``, Llama's rotary embedding with a non-persistent ``inv_freq``), so checkpoints load both ways; its
forward calls the dispatcher like the functional ops (``HKERNELS_BACKEND``, :func:`hkernels.use_backend`).
:func:`hkernels.patch.patch` swaps them into an existing model.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from hkernels.functional.cross_entropy import cross_entropy
from hkernels.functional.fused_linear_cross_entropy import fused_linear_cross_entropy
from hkernels.functional.geglu import geglu
from hkernels.functional.layer_norm import layer_norm
from hkernels.functional.moe import moe
from hkernels.functional.rms_norm import rms_norm
from hkernels.functional.rope import rope
from hkernels.functional.swiglu import swiglu

Tensor = torch.Tensor

__all__ = [
    "CrossEntropyLoss",
    "GeGLUMLP",
    "LayerNorm",
    "LinearCrossEntropyLoss",
    "MoEExperts",
    "RMSNorm",
    "RotaryEmbedding",
    "SwiGLUMLP",
]


def _shape(normalized_shape: int | Sequence[int]) -> tuple[int, ...]:
    return (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)


def _over_last(x: Tensor, normalized_shape: tuple[int, ...], module: str) -> Tensor:
    """[..., *normalized_shape] -> [..., prod(normalized_shape)]: the ops normalise over one trailing dim."""
    dims = len(normalized_shape)
    if tuple(x.shape[-dims:]) != normalized_shape or x.dim() < dims:
        raise ValueError(f"hkernels.nn.{module}: input's trailing dims {list(x.shape[-dims:])} are not the "
                         f"normalized shape {list(normalized_shape)}")
    return x if dims == 1 else x.flatten(-dims)


class RMSNorm(nn.Module):
    """``torch.nn.RMSNorm`` on :func:`hkernels.rms_norm`: same arguments, parameter (``weight``) and state_dict.
    ``eps=None`` means ``torch.finfo(x.dtype).eps``, as in torch. ``offset``: the scale is ``offset + weight``
    (Gemma's RMSNorm is ``offset=1.0``), the weight initialised to ``1 - offset`` so that the scale starts at 1.
    ``casting``: as :func:`hkernels.rms_norm`'s (``"llama"``: Hugging Face's Llama-form modules' result dtype).
    ``in_place``: as :func:`hkernels.rms_norm`'s (the backward writes the input's gradient over the output's where
    nothing else holds it)."""

    def __init__(
        self,
        normalized_shape: int | Sequence[int],
        eps: float | None = None,
        elementwise_affine: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        offset: float = 0.0,
        casting: str = "float32",
        in_place: bool = False,
    ) -> None:
        super().__init__()
        self.normalized_shape = _shape(normalized_shape)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        self.offset = offset
        self.casting = casting
        self.in_place = in_place
        if elementwise_affine:
            self.weight = nn.Parameter(torch.full(self.normalized_shape, 1.0 - offset, device=device, dtype=dtype))
        else:
            self.register_parameter("weight", None)

    def forward(self, x: Tensor) -> Tensor:
        eps = torch.finfo(x.dtype).eps if self.eps is None else self.eps
        w = self.weight
        if len(self.normalized_shape) == 1 and x.dim() and x.shape[-1] == self.normalized_shape[0]:
            # the common case, without views (host time)
            return rms_norm(x, w, eps, self.offset, self.casting, self.in_place)
        rows = _over_last(x, self.normalized_shape, "RMSNorm")
        return rms_norm(rows, None if w is None else w.reshape(-1), eps, self.offset, self.casting,
                        self.in_place).view(x.shape)

    def extra_repr(self) -> str:
        offset = f", offset={self.offset}" if self.offset else ""
        casting = f", casting={self.casting!r}" if self.casting != "float32" else ""
        in_place = ", in_place=True" if self.in_place else ""
        return (f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}{offset}"
                f"{casting}{in_place}")


class LayerNorm(nn.Module):
    """``torch.nn.LayerNorm`` on :func:`hkernels.layer_norm`: same arguments, parameters (``weight``, ``bias``)
    and state_dict."""

    def __init__(
        self,
        normalized_shape: int | Sequence[int],
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.normalized_shape = _shape(normalized_shape)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        if elementwise_affine:
            self.weight = nn.Parameter(torch.ones(self.normalized_shape, device=device, dtype=dtype))
            if bias:
                self.bias = nn.Parameter(torch.zeros(self.normalized_shape, device=device, dtype=dtype))
            else:
                self.register_parameter("bias", None)
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)

    def forward(self, x: Tensor) -> Tensor:
        if len(self.normalized_shape) == 1 and x.dim() and x.shape[-1] == self.normalized_shape[0]:
            return layer_norm(x, self.weight, self.bias, self.eps)  # the common case, without views
        rows = _over_last(x, self.normalized_shape, "LayerNorm")
        w = None if self.weight is None else self.weight.reshape(-1)
        b = None if self.bias is None else self.bias.reshape(-1)
        return layer_norm(rows, w, b, self.eps).view(x.shape)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"


class SwiGLUMLP(nn.Module):
    """A Llama MLP, ``down_proj(silu(gate_proj(x)) * up_proj(x))``, with the gate on :func:`hkernels.swiglu`.
    Parameters as Hugging Face's LlamaMLP: ``gate_proj``, ``up_proj`` ([I, H]), ``down_proj`` ([H, I]). With
    Falcon-H1's multipliers: ``down_proj(silu(gate_proj(x) · gate_multiplier) * up_proj(x)) · down_multiplier``
    (both fused into the gate's kernel where down_proj has no bias)."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None, *,
                 gate_multiplier: float = 1.0, down_multiplier: float = 1.0) -> None:
        super().__init__()
        kw = {"bias": bias, "device": device, "dtype": dtype}
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.gate_multiplier, self.down_multiplier = gate_multiplier, down_multiplier
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, **kw)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, **kw)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, **kw)

    def forward(self, x: Tensor) -> Tensor:
        if self.down_proj.bias is None or self.down_multiplier == 1:
            return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x), self.gate_multiplier,
                                         self.down_multiplier))
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x), self.gate_multiplier)) * self.down_multiplier


class GeGLUMLP(SwiGLUMLP):
    """A GeGLU MLP (Gemma's layout), ``down_proj(gelu(gate_proj(x), approximate) * up_proj(x))``, on
    :func:`hkernels.geglu`."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False, approximate: str = "tanh",
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__(hidden_size, intermediate_size, bias, device, dtype)
        self.approximate = approximate

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(geglu(self.gate_proj(x), self.up_proj(x), self.approximate))


class RotaryEmbedding(nn.Module):
    """Llama's rotary tables: ``forward(x, position_ids)`` -> ``(cos, sin)``, each [B, S, D] in x's dtype, with
    ``inv_freq = base^(-2i/D)`` a non-persistent buffer (so the state_dict is empty, as Hugging Face's);
    :meth:`rotate` rotates q [B, Hq, S, D] and k [B, Hk, S, D] with :func:`hkernels.rope`."""

    def __init__(self, dim: int, base: float = 10000.0, device: torch.device | str | None = None) -> None:
        super().__init__()
        if dim % 2:
            raise ValueError(f"hkernels.nn.RotaryEmbedding: the head dim must be even, got {dim}")
        self.dim, self.base = dim, base
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @torch.no_grad()
    def forward(self, x: Tensor, position_ids: Tensor) -> tuple[Tensor, Tensor]:
        # [B, S, D/2] angles in float32 (positions up to 2^24 are exact), then both halves (rotate_half layout)
        freqs = position_ids[:, :, None].float() * self.inv_freq[None, None, :].to(x.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)

    @staticmethod
    def rotate(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        return rope(q, k, cos, sin)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, base={self.base}"


class CrossEntropyLoss(nn.Module):
    """``torch.nn.CrossEntropyLoss`` for [N, C] logits and [N] class targets on :func:`hkernels.cross_entropy`,
    class ``weight`` [C] included (a buffer, as torch's: the same state_dict); other input layouts go to
    ``F.cross_entropy``."""

    def __init__(self, ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0,
                 weight: Tensor | None = None) -> None:
        super().__init__()
        self.ignore_index, self.reduction, self.label_smoothing = ignore_index, reduction, label_smoothing
        self.register_buffer("weight", weight)
        self.weight: Tensor | None

    def forward(self, input: Tensor, target: Tensor) -> Tensor:
        if input.dim() == 2 and target.dim() == 1 and not target.is_floating_point():
            return cross_entropy(input, target, self.ignore_index, self.reduction, self.label_smoothing,
                                 weight=self.weight)
        return F.cross_entropy(input, target, weight=self.weight, ignore_index=self.ignore_index,
                               reduction=self.reduction, label_smoothing=self.label_smoothing)


class LinearCrossEntropyLoss(nn.Module):
    """The loss of an LM head without its logits: ``forward(hidden [..., H], weight [V, H], target [...],
    bias=None)`` is ``cross_entropy(hidden @ weight.T + bias, target)`` by
    :func:`hkernels.fused_linear_cross_entropy` (leading dims flattened); ``chunk_size`` its tokens per chunk."""

    def __init__(self, ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0,
                 chunk_size: int | None = None) -> None:
        super().__init__()
        self.ignore_index, self.reduction, self.label_smoothing = ignore_index, reduction, label_smoothing
        self.chunk_size = chunk_size

    def forward(self, hidden: Tensor, weight: Tensor, target: Tensor, bias: Tensor | None = None) -> Tensor:
        if hidden.shape[:-1] != target.shape:
            raise ValueError(f"hkernels.nn.LinearCrossEntropyLoss: hidden {list(hidden.shape)} and target "
                             f"{list(target.shape)} must agree on the leading dims")
        tokens = math.prod(target.shape)
        loss = fused_linear_cross_entropy(
            hidden.reshape(tokens, hidden.shape[-1]), weight, target.reshape(tokens), bias, self.ignore_index,
            self.reduction, self.label_smoothing, chunk_size=self.chunk_size,
        )
        return loss.view(target.shape) if self.reduction == "none" else loss


class MoEExperts(nn.Module):
    """The experts of a SwiGLU mixture-of-experts layer on :func:`hkernels.moe`: a drop-in for Hugging Face's
    experts modules (Mixtral, Qwen2-MoE, Qwen3-MoE): the same parameters, ``gate_up_proj`` [E, 2·I, H] (gate rows,
    then up rows) and ``down_proj`` [E, H, I], so the same state_dict, and the same call, ``forward(hidden_states
    [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]``."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.num_experts, self.hidden_dim, self.intermediate_dim = num_experts, hidden_size, intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size, device=device,
                                                     dtype=dtype))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size, device=device,
                                                  dtype=dtype))
        for p in (self.gate_up_proj, self.down_proj):
            nn.init.normal_(p, std=p.shape[-1] ** -0.5)

    @classmethod
    def sharing(cls, experts: nn.Module) -> MoEExperts:
        """A MoEExperts holding ``experts``' own ``gate_up_proj`` and ``down_proj`` Parameters (not copies)."""
        gate_up, down = experts.gate_up_proj, experts.down_proj
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.num_experts, new.hidden_dim, new.intermediate_dim = down.shape[0], down.shape[1], down.shape[2]
        new.gate_up_proj, new.down_proj = gate_up, down
        return new

    def forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        return moe(hidden_states, self.gate_up_proj, self.down_proj, top_k_index, top_k_weights)

    def extra_repr(self) -> str:
        return f"{self.num_experts}, {self.hidden_dim}, {self.intermediate_dim}"
