"""Linear + cross-entropy without the [T, V] logits: the chunk loop every backend shares.

For each chunk of C tokens: logits = hidden_c @ weightᵀ (+ bias), a [C, V] buffer; the backend's cross-entropy
kernel reads it and, when gradients are wanted, overwrites it with ∂loss/∂logits (already scaled, e.g. by
1/valid tokens for a mean); then grad_hidden_c = dlogits @ weight, grad_weight += dlogitsᵀ @ hidden_c and
grad_bias += Σ dlogits. Only one chunk's logits exist at a time, so the extra memory is the gradients themselves
plus C·V elements, against T·V (and their float32 softmax) for the unfused ops. The matmuls are PyTorch's (cuBLAS);
the backend supplies the cross-entropy kernel: each backend's ``fused_linear_cross_entropy_fwd`` / ``_bwd`` are
:func:`backend_functions` of its cross-entropy module. Torch-only (no Triton), so the torch backend shares it too.

grad_weight accumulates in weight's dtype (a float32 accumulator would cost another 4·V·H bytes): every chunk's
addmm sums in float32 inside cuBLAS and rounds once, so a 16-bit weight gets ⌈T/C⌉ roundings instead of one. The
first chunk's product makes it (no zeroed [V, H] buffer first); later chunks add in place. Inside a compiled graph
the in-place add is the custom op ``hkernels::addmm_into``, which the compiler keeps in place: ``addmm_`` itself is
functionalised there into an out-of-place addmm, which cuBLAS's caller runs as a copy of the whole accumulator
followed by the product (a device-to-device copy of V·H elements per chunk: 0.35 ms each for a 128256 × 2048 bf16
head on an H100).
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F

from hkernels.runtime import plan as _plan

Tensor = torch.Tensor


@torch.library.custom_op("hkernels::addmm_into", mutates_args=("acc",))
def addmm_into(acc: Tensor, a: Tensor, b: Tensor) -> None:
    """acc += a @ b in place (cuBLAS, beta 1): the accumulation of a compiled graph (see above)."""
    acc.addmm_(a, b)


@addmm_into.register_fake
def _(acc: Tensor, a: Tensor, b: Tensor) -> None:
    return None

# Tokens per chunk: at least this many. Every chunk after the first reads and writes grad_weight (4·V·H bytes of a
# 16-bit head) next to its three matmuls' 6·V·H·C flops: at C tokens that costs about 155/C of the chunk's matmul
# time on an H100 (~230 flops a byte), 4% at 4096. Measured (H200, 8192 × 2048 × 128256 bf16 fwd+bwd inside
# torch.compile): 21.5 ms with 1024-token chunks, 20.7 with 2048, 19.9 with 4096 (torch.compile's own loss 20.4).
# The cost is memory: one chunk's logits, C·V elements (1 GB at 4096 × 128256 bf16); `chunk_size` trades it back.
MIN_CHUNK = 4096


def chunk_rows(t: int, h: int, v: int) -> int:
    """Tokens per chunk: T·H/V (a logits chunk the size of hidden) rounded down to a power of two, at least
    MIN_CHUNK, at most T."""
    per_chunk = max(MIN_CHUNK, 1 << max(0, (t * h // v).bit_length() - 1))
    return max(1, min(t, per_chunk))


# A call traced with T symbolic takes its chunk count from T's size class: T ≤ MIN_CHUNK times each of these,
# else the most.
TRACED_CLASSES = (1, 4, 16)
MAX_TRACED_CHUNKS = 16


def traced_chunks(t: torch.SymInt, h: int, v: int, rows: int | None = None) -> int:
    """How many equal parts a call traced with T symbolic (torch.compile after a second length) splits T into: as
    many as :func:`chunk_rows` makes at the top of T's size class (``T <= MIN_CHUNK·c``, c in TRACED_CLASSES: a
    guard, one graph per class, not per length), at most MAX_TRACED_CHUNKS. A loop over ⌈T/C⌉ chunks would
    specialise the graph to each T; one count for every T would re-read the weight that many times at every length
    (16 chunks at 512 tokens: 16 passes over a 128256 × 2048 weight where one does). A caller's ``rows`` (tokens
    per chunk) makes it as many as that needs at the top of the class, without the cap (beyond the last class:
    the cap, or the last class's count if more)."""
    for top in (MIN_CHUNK * c for c in TRACED_CLASSES):
        if t <= top:
            return -(-top // rows) if rows else min(MAX_TRACED_CHUNKS, -(-top // chunk_rows(top, h, v)))
    return max(MAX_TRACED_CHUNKS, -(-MIN_CHUNK * TRACED_CLASSES[-1] // rows) if rows else 0)


def chunk_bounds(t: Any, h: int, v: int, rows: int | None = None) -> list[tuple[Any, Any]]:
    """The [start, end) rows of each chunk: ``rows`` (default :func:`chunk_rows`) at a time for a concrete T; for
    a symbolic T, :func:`traced_chunks` equal parts, whose bounds are expressions of T (no guard on its value
    beyond its size class and parts of 0 or 1 rows, which only a T below twice the count meets)."""
    if isinstance(t, torch.SymInt):
        parts = traced_chunks(t, h, v, rows)
        return [(i * t // parts, (i + 1) * t // parts) for i in range(parts)]
    rows = rows or chunk_rows(t, h, v)
    return [(start, min(start + rows, t)) for start in range(0, t, rows)]


def linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Tensor | None,
    scale: Tensor,
    ignore_index: int,
    label_smoothing: float,
    with_grad: bool,
    cross_entropy_fwd: Callable[..., Tensor],
    rows: int | None = None,
    softcap: float = 0.0,
    z_scale: float = 0.0,
    z: Tensor | None = None,
    stats: tuple[Tensor, Tensor] | None = None,
    class_weight: Tensor | None = None,
) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor | None]:
    """hidden [T, H], weight [V, H], target [T], bias [V] or None (one dtype), scale [T] float32 (the gradients'
    factor per token) -> (loss [T] float32, grad_hidden [T, H], grad_weight [V, H], grad_bias [V]) — gradients None
    unless ``with_grad``; each in its input's dtype. ``cross_entropy_fwd`` is a backend's kernel (its contract),
    given the loss options: the logit ``softcap``, the z-loss ``z_scale`` (each token's z term written to ``z``
    [T] float32 when given), ``stats`` (each token's predicted class and entropy written there when given) and the
    classes' weights ``class_weight`` [V] float32."""
    T, H = hidden.shape[0], int(hidden.shape[1])  # (H and V specialised where a graph made them symbolic)
    V = int(weight.shape[0])
    loss = torch.empty(T, dtype=torch.float32, device=hidden.device)
    grad_hidden = torch.empty_like(hidden) if with_grad else None
    grad_weight: Tensor | None = None
    traced = bool(_plan.TRACING) or torch.compiler.is_compiling()  # (recorded into a graph: see addmm_into)
    grad_bias = torch.zeros(V, dtype=torch.float32, device=hidden.device) if with_grad and bias is not None else None
    for start, end in chunk_bounds(T, H, V, rows):
        h = hidden[start:end]
        logits = F.linear(h, weight, bias)  # [C, V]
        grad = logits if with_grad else None  # the gradient overwrites the logits in place
        rows_loss = cross_entropy_fwd(logits, target[start:end], scale[start:end], ignore_index, label_smoothing, grad,
                                      softcap, z_scale, z[start:end] if z is not None else None,
                                      tuple(t[start:end] for t in stats) if stats is not None else None,
                                      class_weight)
        loss[start:end] = rows_loss
        if grad is not None:
            assert grad_hidden is not None
            torch.mm(grad, weight, out=grad_hidden[start:end])
            if grad_weight is None:
                grad_weight = torch.mm(grad.t(), h)
            elif traced:
                addmm_into(grad_weight, grad.t(), h)
            else:
                grad_weight.addmm_(grad.t(), h)
            if grad_bias is not None:
                grad_bias += grad.sum(0, dtype=torch.float32)
        del logits, grad
    if grad_bias is not None:
        assert bias is not None
        grad_bias = grad_bias.to(bias.dtype)
    if with_grad and grad_weight is None:  # (no tokens: no chunk ran)
        grad_weight = torch.zeros_like(weight)
    return loss, grad_hidden, grad_weight, grad_bias


def backend_functions(cross_entropy: ModuleType) -> tuple[Callable[..., Any], Callable[..., Tensor]]:
    """``(fused_linear_cross_entropy_fwd, fused_linear_cross_entropy_bwd)`` of a backend whose cross-entropy kernels
    are ``cross_entropy.cross_entropy_fwd`` / ``cross_entropy_bwd`` (looked up per call, so a replaced module
    attribute takes effect)."""

    def fused_linear_cross_entropy_fwd(
        hidden: Tensor,
        weight: Tensor,
        target: Tensor,
        bias: Tensor | None,
        scale: Tensor,
        ignore_index: int,
        label_smoothing: float,
        with_grad: bool,
        softcap: float = 0.0,
        z_scale: float = 0.0,
        z: Tensor | None = None,
        stats: tuple[Tensor, Tensor] | None = None,
        class_weight: Tensor | None = None,
        rows: int | None = None,
    ) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor | None]:
        """hidden [T, H], weight [V, H], target [T], bias [V] or None, scale [T] float32 -> (loss [T] float32,
        grad_hidden, grad_weight, grad_bias: the gradients of Σ scale·loss, or None unless ``with_grad``); the
        logits capped with ``softcap`` > 0, the z-loss ``z_scale`` added (each token's term into ``z``), each
        token's predicted class and entropy into ``stats``, the classes' weights ``class_weight``; ``rows`` tokens
        per chunk (None: :func:`chunk_rows`)."""
        return linear_cross_entropy(hidden, weight, target, bias, scale, ignore_index, label_smoothing, with_grad,
                                    cross_entropy.cross_entropy_fwd, rows, softcap, z_scale, z, stats, class_weight)

    def fused_linear_cross_entropy_bwd(dloss: Tensor, grad: Tensor) -> Tensor:
        """grad [R, C] *= dloss [R] in place (rows with factor 1 untouched): scales the gradients the forward
        made."""
        return cross_entropy.cross_entropy_bwd(dloss, grad)

    return fused_linear_cross_entropy_fwd, fused_linear_cross_entropy_bwd
