"""decode_attention: attention of a few new tokens over a KV cache of per-sequence lengths, forward only.

The public function and its checks, its custom op ``hkernels::decode_attention_fwd`` (no autograd: inference),
then the reference math and the torch backend. Kernels: ``hkernels/ops/decode_attention.py`` (Helion),
``triton_fallback/decode_attention.py`` (split-K "flash decoding"; its docstring gives the work and traffic).
"""

from __future__ import annotations

from typing import Any

import torch

from hkernels import dispatch
from hkernels.functional._base import Autocast, Public, Tensor, bound, call, check_range, compute_dtype, wants_grad
from hkernels.functional.attention import check_qkv, softcap_value, window_bounds

OP = "decode_attention"
HEAD_DIMS = (16, 32, 64, 128, 256)
_INT = (torch.int32, torch.int64)


def decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Tensor, scale: float | None = None,
                     window: tuple[int | None, int | None] | None = None, softcap: float | None = None) -> Tensor:
    """Attention of Sq new tokens per sequence over a KV cache (decode, speculative verification), forward only.

    q: [B, Hq, Sq, D]; k_cache, v_cache: [B, Hk, S_max, D] with Hq a multiple of Hk (grouped-query attention); D in
    16, 32, 64, 128, 256; one dtype (bfloat16/float16/float32); any strides with unit stride along D (transposed
    views of [B, S_max, H, D] caches are read in place). cache_seqlens: [B] int32 (or int64) on q's device:
    sequence b holds L_b valid cache rows 0 .. L_b−1, the new tokens' keys and values already written as the last
    Sq of them, so query token t sits at position L_b − Sq + t and sees keys j ≤ L_b − Sq + t (causal among the new
    tokens). Rows ≥ L_b are never read. L_b is read on the device (no host sync); values outside [0, S_max] are
    clamped to it (``HKERNELS_CHECK=1`` raises instead). ``window=(left, right)``: key j is also seen only if
    j ≥ position − left (None or −1: unbounded; ``right`` is implied by the causal rule). ``softcap`` c > 0: scores
    become c·tanh(scale·q·k / c) before the softmax. ``scale`` defaults to D^-0.5. A query that sees no key
    (L_b − Sq + t < 0) gets zeros. Returns [B, Hq, Sq, D] in q's dtype; there is no backward (inputs that require
    grad, with grad mode on, raise).
    """
    return _CALLS(q, k_cache, v_cache, cache_seqlens, scale, window, softcap)


def _check(q: Any, k_cache: Any, v_cache: Any, cache_seqlens: Any, scale: Any, window: Any, softcap: Any) -> None:
    check_qkv(OP, q, k_cache, v_cache, ("q", "k_cache", "v_cache"), ("[B, Hq, Sq, D]", "[B, Hk, S_max, D]"),
              (0, 3), HEAD_DIMS)
    B = q.shape[0]
    if not isinstance(cache_seqlens, torch.Tensor) or cache_seqlens.dtype not in _INT:
        got = cache_seqlens.dtype if isinstance(cache_seqlens, torch.Tensor) else type(cache_seqlens).__name__
        raise TypeError(f"hkernels.decode_attention: cache_seqlens must be an int32 or int64 tensor, got {got}")
    if tuple(cache_seqlens.shape) != (B,):
        raise ValueError(f"hkernels.decode_attention: cache_seqlens must be [B] = [{B}] (one length per sequence), "
                         f"got {list(cache_seqlens.shape)}")
    if cache_seqlens.device != q.device:
        raise ValueError(f"hkernels.decode_attention: cache_seqlens is on {cache_seqlens.device} but q is on "
                         f"{q.device}")
    if scale is not None and (not isinstance(scale, (int, float)) or isinstance(scale, bool)):
        raise TypeError(f"hkernels.decode_attention: scale must be a float or None, got {type(scale).__name__}")
    window_bounds(OP, window, True)
    softcap_value(OP, softcap)
    if wants_grad(q, k_cache, v_cache):
        raise ValueError("hkernels.decode_attention: it is forward only (inference); q, k_cache and v_cache require "
                         "grad here: call it under torch.no_grad() or torch.inference_mode(), or on detached "
                         "tensors (hkernels.attention has a backward)")


def _values(q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Tensor, scale: float | None,
            window: Any, softcap: Any) -> None:
    check_range(OP, "cache_seqlens", cache_seqlens, 0, k_cache.shape[2] + 1, why=" (S_max, k_cache's third dim, "
                f"is {k_cache.shape[2]})")


def _body(request: str, q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Tensor, scale: float | None,
          window: tuple[int | None, int | None] | None, softcap: float | None) -> Tensor:
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    left, _ = window_bounds(OP, window, True)  # (causal among the new tokens: the right side is 0)
    cap = softcap_value(OP, softcap)
    with torch.no_grad():  # forward only: the result never joins a graph
        return call(_fwd, q, k_cache, v_cache, cache_seqlens, scale, left, cap, request)


# ------------------------------------------------------------------------------------------------- the custom op


def _d_unit(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


@torch.library.custom_op("hkernels::decode_attention_fwd", mutates_args=())
def _fwd(q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Tensor, scale: float, window_left: int,
         softcap: float, backend: str) -> Tensor:
    # window_left < 0: no window; softcap 0: none (the kernels' arguments are plain numbers)
    if q.numel() == 0 or k_cache.numel() == 0:
        backend = "torch"
    return dispatch.run(OP, "decode_attention_fwd", backend, _d_unit(q), _d_unit(k_cache), _d_unit(v_cache),
                        cache_seqlens.contiguous(), scale, window_left, softcap)


@_fwd.register_fake
def _(q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Tensor, scale: float, window_left: int,
      softcap: float, backend: str) -> Tensor:
    return q.new_empty(q.shape)


# ------------------------------------------------------------------------------- reference and the torch backend


def reference(q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Tensor, scale: float | None = None,
              window: tuple[int | None, int | None] | None = None, softcap: float | None = None) -> Tensor:
    """softmax(cap(scale · q kᵀ) masked to the keys each new token sees) v, per sequence b, query token t at
    position L_b − Sq + t (L_b clamped to [0, S_max]): keys j with pos − left ≤ j ≤ pos. No key: zeros."""
    D = q.shape[-1]
    scale = D**-0.5 if scale is None else scale
    left, _ = window_bounds(OP, window, True)
    return _attend(q, k_cache, v_cache, cache_seqlens, scale, None if left < 0 else left,
                   softcap_value(OP, softcap) or None)


def _attend(q: Tensor, k: Tensor, v: Tensor, seqlens: Tensor, scale: float, left: int | None,
            softcap: float | None) -> Tensor:
    ct = compute_dtype(q.dtype)
    B, Hq, Sq, D = q.shape
    Hk, S = k.shape[1], k.shape[2]
    G = Hq // Hk
    lengths = seqlens.to(q.device, torch.int64).clamp(0, S)
    pos = lengths[:, None] - Sq + torch.arange(Sq, device=q.device)  # [B, Sq]
    j = torch.arange(S, device=q.device)
    seen = j <= pos[..., None]  # [B, Sq, S]; pos < L_b, so every key seen is a valid cache row
    if left is not None:
        seen = seen & (j >= pos[..., None] - left)
    # rows past L_b may hold anything (NaN): zeroed, so that p = 0 times them stays 0
    valid = (j < lengths[:, None])[:, None, :, None]  # [B, 1, S, 1]
    kf = k.to(ct).masked_fill(~valid, 0.0)
    vf = v.to(ct).masked_fill(~valid, 0.0)
    # the G query heads of a key/value head as rows of one matmul: [B, Hk, G·Sq, D] · [B, Hk, D, S]
    qf = q.to(ct).reshape(B, Hk, G * Sq, D)
    scores = torch.matmul(qf, kf.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.unflatten(2, (G, Sq)).masked_fill(~seen[:, None, None], float("-inf"))
    p = torch.softmax(scores, dim=-1)
    p = torch.where(seen.any(-1)[:, None, None, :, None], p, 0.0)  # no key seen: zeros, not softmax's NaN
    o = torch.matmul(p.flatten(2, 3), vf)  # [B, Hk, G·Sq, D]
    return o.reshape(B, Hq, Sq, D).to(q.dtype)


def decode_attention_fwd(q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Tensor, scale: float,
                         window_left: int, softcap: float) -> Tensor:
    """q [B, Hq, Sq, D], k_cache/v_cache [B, Hk, S_max, D], cache_seqlens [B] integer; window_left < 0: no window;
    softcap 0: none -> o [B, Hq, Sq, D] in q's dtype."""
    return _attend(q, k_cache, v_cache, cache_seqlens, scale, None if window_left < 0 else window_left,
                   softcap or None)


def _fast(plan: Any, request: str, q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Tensor,
          scale: float | None, window: tuple[int | None, int | None] | None, softcap: float | None) -> Any:
    """Calls of this signature in one step: the kernel function the plan ran, with the options' kernel arguments
    found once (they are part of the signature)."""
    run = bound(plan, "decode_attention_fwd")
    if (run is None or wants_grad(q, k_cache, v_cache) or q.numel() == 0 or k_cache.numel() == 0
            or q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1):  # (the body copies those)
        return None
    s = q.shape[-1] ** -0.5 if scale is None else float(scale)
    left, _ = window_bounds(OP, window, True)
    cap = softcap_value(OP, softcap)
    return lambda q, k_cache, v_cache, cache_seqlens, *_: run(q, k_cache, v_cache, cache_seqlens, s, left, cap)


# Under autocast: as scaled_dot_product_attention, in autocast's dtype.
_CALLS = Public(OP, _check, _body, _fast, values=_values,
                autocast=Autocast("lower", ("aten::scaled_dot_product_attention",)))
