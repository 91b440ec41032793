"""Linear + cross-entropy, chunked over tokens, with the Helion cross-entropy kernel.

The twin of ``triton_fallback/fused_linear_cross_entropy.py``.

The chunk loop (PyTorch matmuls around the backend's cross-entropy kernel, which writes the logits' gradient over
the logits chunk) is shared by every backend: ``hkernels/_chunked.py``.
"""

from __future__ import annotations

import torch

from hkernels import _chunked
from hkernels.ops import cross_entropy

Tensor = torch.Tensor


def fused_linear_cross_entropy_fwd(
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Tensor | None,
    scale: Tensor,
    ignore_index: int,
    label_smoothing: float,
    with_grad: bool,
) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor | None]:
    """hidden [T, H], weight [V, H], target [T], bias [V] or None, scale [T] float32 -> (loss [T] float32,
    grad_hidden, grad_weight, grad_bias: the gradients of Σ scale·loss, or None unless ``with_grad``)."""
    return _chunked.linear_cross_entropy(
        hidden, weight, target, bias, scale, ignore_index, label_smoothing, with_grad, cross_entropy.cross_entropy_fwd
    )


def fused_linear_cross_entropy_bwd(dloss: Tensor, grad: Tensor) -> Tensor:
    """grad [R, C] *= dloss [R] in place (rows with factor 1 untouched): scales the gradients the forward made."""
    return cross_entropy.cross_entropy_bwd(dloss, grad)
