"""attention: scaled dot-product attention, flash algorithm, ``softmax(cap(scale · q kᵀ) [mask]) v``.

The public function and its checks, its autograd (custom ops ``hkernels::attention_fwd`` / ``_bwd``), then the
reference math and the torch backend. Kernels: ``hkernels/ops/attention.py`` (Helion),
``triton_fallback/attention.py``. Packed sequences (``attention_varlen``) share those kernels and these masks:
``hkernels/functional/attention_varlen.py``.

The mask, for query i and key j of one sequence of Sq queries and Sk keys, aligned at the sequence's end
(``off = Sk − Sq``; 0 for self-attention): key j is kept when ``j ≤ i + off`` (causal), ``j ≥ i + off − left`` and
``j ≤ i + off + right`` (a window; unbounded sides are not checked). ``cap(s) = c·tanh(s / c)`` with softcap c.
A query that keeps no key gets o = 0 and lse = −inf.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from hkernels import dispatch
from hkernels.functional._base import Autocast, Public, Tensor, autograd, call, check_same, check_tensor, compute_dtype

OP = "attention"
HEAD_DIMS = (16, 32, 64, 128, 256)


def attention(q: Tensor, k: Tensor, v: Tensor, causal: bool = False, scale: float | None = None,
              window: tuple[int | None, int | None] | None = None, softcap: float | None = None) -> Tensor:
    """Scaled dot-product attention, flash algorithm: ``softmax(cap(scale · q kᵀ) [mask]) v``.

    q: [B, Hq, S, D]; k, v: [B, Hk, Skv, D] with Hq a multiple of Hk (grouped-query attention); D in 16, 32, 64,
    128, 256 (256 on the Triton and torch backends: Helion's kernels stop at 128); one dtype (bfloat16/float16;
    float32 too); any strides with unit stride along D (transposed views of [B, S, H, D] projections are read in
    place). ``scale`` defaults to D^-0.5. ``causal`` masks key j > query i.
    ``window=(left, right)``: query i sees keys i − left .. i + right (None or −1: unbounded on that side; with
    ``causal`` right is 0), Mistral's and Gemma's sliding window being ``(W − 1, 0)`` with causal. ``softcap`` c > 0
    replaces each score s by ``c·tanh(s / c)`` before the softmax (Gemma 2). causal and window need S == Skv (with
    different lengths the mask's alignment is ambiguous; :func:`attention_varlen` aligns it at the end). Returns
    [B, Hq, S, D] in q's dtype. Differentiable in q, k, v; the backward never materialises the S × Skv matrix.
    """
    return _CALLS(q, k, v, causal, scale, window, softcap)


def window_bounds(op: str, window: Any, causal: bool) -> tuple[int, int]:
    """``window`` -> (left, right) with −1 for an unbounded side (and right = 0 when causal); raises on bad ones."""
    if window is None:
        return -1, 0 if causal else -1
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise TypeError(f"hkernels.{op}: window must be (left, right) or None, got {window!r}")
    sides = []
    for name, w in zip(("left", "right"), window, strict=True):
        if w is None:
            w = -1
        if isinstance(w, bool) or not isinstance(w, int):
            raise TypeError(f"hkernels.{op}: window's {name} must be an int, None or -1 (unbounded), got {w!r}")
        if w < -1:
            raise ValueError(f"hkernels.{op}: window's {name} must be >= 0, or None / -1 (unbounded), got {w}")
        sides.append(w)
    left, right = sides
    return left, 0 if causal else right


def softcap_value(op: str, softcap: Any) -> float:
    """``softcap`` -> the cap c > 0, or 0.0 for none (None or 0); raises on bad ones."""
    if softcap is None:
        return 0.0
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise TypeError(f"hkernels.{op}: softcap must be a float or None, got {type(softcap).__name__}")
    if not (softcap >= 0 and softcap < float("inf")):  # (NaN fails both)
        raise ValueError(f"hkernels.{op}: softcap must be a finite float > 0 (0 or None: no cap), got {softcap}")
    return float(softcap)


def check_qkv(op: str, q: Any, k: Any, v: Any, names: tuple[str, str, str], layouts: tuple[str, str],
              agree: tuple[int, ...], head_dims: tuple[int, ...]) -> None:
    """The checks every attention op makes of its q, k, v (named ``names``, laid out as ``layouts``, heads on dim 1,
    D last): tensors of the layouts' rank on one device and dtype, k and v alike, q and k agreeing on the dims
    ``agree``, query heads a multiple of the key/value heads, D one of ``head_dims``."""
    rank = layouts[0].count(",") + 1
    for name, t in zip(names, (q, k, v), strict=True):
        check_tensor(op, name, t, (rank,))
    check_same(op, names, q, k, v, shape=False)
    qn, kn, vn = names
    if k.shape != v.shape:
        raise ValueError(f"hkernels.{op}: {kn} and {vn} must have the same shape, got {list(k.shape)} and "
                         f"{list(v.shape)}")
    if any(k.shape[i] != q.shape[i] for i in agree):
        what = " and ".join(layouts[0].strip("[]").split(", ")[i] for i in agree)
        raise ValueError(f"hkernels.{op}: {qn} {layouts[0]} = {list(q.shape)} and {kn} {layouts[1]} = "
                         f"{list(k.shape)} must agree on {what}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(f"hkernels.{op}: the query heads ({q.shape[1]}) must be a multiple of the key/value "
                         f"heads ({k.shape[1]})")
    if q.shape[-1] not in head_dims:
        raise ValueError(f"hkernels.{op}: head dim D must be one of {head_dims}, got {q.shape[-1]}")


def _check(q: Any, k: Any, v: Any, causal: Any, scale: Any, window: Any, softcap: Any) -> None:
    check_qkv(OP, q, k, v, ("q", "k", "v"), ("[B, Hq, S, D]", "[B, Hk, Skv, D]"), (0, 3), HEAD_DIMS)
    S = q.shape[2]
    left, right = window_bounds(OP, window, bool(causal))
    if (causal or left >= 0 or right >= 0) and k.shape[2] != S:
        raise ValueError(f"hkernels.attention: causal=True or a window needs as many queries as keys (S = {S}, "
                         f"Skv = {k.shape[2]}): with different lengths the mask's alignment is ambiguous "
                         "(hkernels.attention_varlen aligns it at the end)")
    if scale is not None and (not isinstance(scale, (int, float)) or isinstance(scale, bool)):
        raise TypeError(f"hkernels.attention: scale must be a float or None, got {type(scale).__name__}")
    softcap_value(OP, softcap)


def _body(request: str, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float | None, window: Any,
          softcap: Any) -> Tensor:
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    left, right = window_bounds(OP, window, bool(causal))
    o, _ = call(_fwd, q, k, v, bool(causal), scale, left, right, softcap_value(OP, softcap), request)
    return o


# ------------------------------------------------------------------------------------------------------ autograd


def _d_unit(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _masked(causal: bool, left: int, right: int, softcap: float) -> bool:
    # A window or a cap: the same functions, under names of their own, so that auto routes them by their own
    # measurements (the backends' masked kernels differ from the plain ones far more than between shapes).
    return left >= 0 or (right >= 0 and not causal) or softcap > 0


@torch.library.custom_op("hkernels::attention_fwd", mutates_args=())
def _fwd(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, left: int, right: int, softcap: float,
         backend: str) -> tuple[Tensor, Tensor]:
    if q.numel() == 0 or k.numel() == 0:
        backend = "torch"
    fn = "attention_masked_fwd" if _masked(causal, left, right, softcap) else "attention_fwd"
    return dispatch.run(OP, fn, backend, _d_unit(q), _d_unit(k), _d_unit(v), causal, scale, left, right, softcap)


@_fwd.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, left: int, right: int, softcap: float,
      backend: str) -> tuple[Tensor, Tensor]:
    return q.new_empty(q.shape), q.new_empty(q.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("hkernels::attention_bwd", mutates_args=())
def _bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, causal: bool, scale: float,
         left: int, right: int, softcap: float, backend: str) -> tuple[Tensor, Tensor, Tensor]:
    if q.numel() == 0 or k.numel() == 0:
        backend = "torch"
    fn = "attention_masked_bwd" if _masked(causal, left, right, softcap) else "attention_bwd"
    return dispatch.run(OP, fn, backend, _d_unit(do), _d_unit(q), _d_unit(k), _d_unit(v), o, lse, causal, scale,
                        left, right, softcap)


@_bwd.register_fake
def _(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, causal: bool, scale: float,
      left: int, right: int, softcap: float, backend: str) -> tuple[Tensor, Tensor, Tensor]:
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
    q, k, v, *options, backend = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.options, ctx.backend = options, backend
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)


def _backward(ctx: Any, do: Tensor | None, _dlse: Tensor | None) -> tuple[Tensor | None, ...]:
    if do is None:
        return (None,) * 9
    q, k, v, o, lse = ctx.saved_tensors
    dq, dk, dv = call(_bwd, do, q, k, v, o, lse, *ctx.options, ctx.backend)
    return dq, dk, dv, None, None, None, None, None, None


autograd(_fwd, _backward, _setup)


# ------------------------------------------------------------------------------- reference and the torch backend


def mask(sq: int, sk: int, causal: bool, left: int, right: int, device: torch.device) -> Tensor | None:
    """[sq, sk] bool, True where query i keeps key j (aligned at the end: off = sk − sq), or None for no mask."""
    right = 0 if causal else right
    if left < 0 and right < 0:
        return None
    i = torch.arange(sq, device=device)[:, None] + (sk - sq)
    j = torch.arange(sk, device=device)[None, :]
    keep = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if left >= 0:
        keep &= j >= i - left
    if right >= 0:
        keep &= j <= i + right
    return keep


def scores(q: Tensor, k: Tensor, scale: float, softcap: float, keep: Tensor | None) -> Tensor:
    """cap(scale · q kᵀ) with masked scores at −inf, in q's (compute) dtype; k has q's heads."""
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    return s if keep is None else s.masked_fill(~keep, float("-inf"))


def _finite(lse: Tensor) -> Tensor:
    """lse with 0 for a query that keeps no key (−inf): its scores are all −inf, so p = exp(s − 0) = 0 and o = 0,
    where exp(s − lse) would be NaN (and so would every gradient it reaches)."""
    return lse.masked_fill(lse == float("-inf"), 0.0)


def reference(q: Tensor, k: Tensor, v: Tensor, causal: bool = False, scale: float | None = None,
              window: tuple[int | None, int | None] | None = None, softcap: float | None = None) -> Tensor:
    """softmax(cap(scale · q kᵀ), mask) v, with GQA: q [B, Hq, S, D], k/v [B, Hk, Skv, D], Hq a multiple of Hk; a
    query that keeps no key gets 0."""
    left, right = window_bounds(OP, window, bool(causal))
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    o, _ = math_fwd(q, k, v, bool(causal), scale, left, right, softcap_value(OP, softcap))
    return o


def math_fwd(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, left: int = -1, right: int = -1,
             softcap: float = 0.0) -> tuple[Tensor, Tensor]:
    """-> (o [B, Hq, S, D] in q's dtype, lse [B, Hq, S] float32: logsumexp of the capped, scaled, masked scores;
    −inf and o = 0 for a query that keeps no key)."""
    ct = compute_dtype(q.dtype)
    group = q.shape[1] // k.shape[1]
    kf = k.to(ct).repeat_interleave(group, dim=1)
    vf = v.to(ct).repeat_interleave(group, dim=1)
    s = scores(q.to(ct), kf, scale, softcap, mask(q.shape[2], k.shape[2], causal, left, right, q.device))
    lse = torch.logsumexp(s, dim=-1)
    o = torch.matmul(torch.exp(s - _finite(lse)[..., None]), vf)
    return o.to(q.dtype), lse.float()


def math_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, causal: bool, scale: float,
             left: int = -1, right: int = -1, softcap: float = 0.0) -> tuple[Tensor, Tensor, Tensor]:
    """P = exp(S − lse);  dV = Pᵀ dO;  dP = dO Vᵀ;  dS = P ∘ (dP − rowsum(dO ∘ O));  with a cap S = c·tanh(Z / c),
    Z = scale · Q Kᵀ: dZ = dS ∘ (1 − (S / c)²), else dZ = dS;  dQ = scale·dZ K;  dK = scale·dZᵀ Q  (dK, dV summed
    over each group's query heads)."""
    ct = compute_dtype(q.dtype)
    B, Hq, S, _ = q.shape
    Hk = k.shape[1]
    group = Hq // Hk
    qf, kf, vf = q.to(ct), k.to(ct).repeat_interleave(group, 1), v.to(ct).repeat_interleave(group, 1)
    dof, of = do.to(ct), o.to(ct)
    s = scores(qf, kf, scale, softcap, mask(S, k.shape[2], causal, left, right, q.device))
    p = torch.exp(s - _finite(lse.to(ct))[..., None])
    dv = torch.matmul(p.transpose(-1, -2), dof)
    dp = torch.matmul(dof, vf.transpose(-1, -2))
    ds = p * (dp - (dof * of).sum(-1, keepdim=True))
    if softcap:
        ds = ds * (1 - (s.nan_to_num(neginf=0.0) / softcap) ** 2)
    dq = torch.matmul(ds, kf) * scale
    dk = torch.matmul(ds.transpose(-1, -2), qf) * scale
    dk = dk.reshape(B, Hk, group, *dk.shape[2:]).sum(2)
    dv = dv.reshape(B, Hk, group, *dv.shape[2:]).sum(2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def forward_fn(arguments: dict[str, Any]) -> str:
    """The forward function a call of :func:`attention` with these arguments runs (for ``selected_backend``)."""
    causal = bool(arguments["causal"])
    left, right = window_bounds(OP, arguments["window"], causal)
    masked = _masked(causal, left, right, softcap_value(OP, arguments["softcap"]))
    return "attention_masked_fwd" if masked else "attention_fwd"


# The torch backend. Without a window or a cap: PyTorch's own fused kernel where it takes the call (cuDNN's, else
# flash's: CUDA, 16-bit, D and layout as PyTorch accepts them), so auto can choose it where it is the fastest;
# elsewhere (CPU, float32/float64, a window or a cap) the math above. Their o and lse mean what the kernels' do
# (o [B, Hq, S, D] contiguous, lse [B, Hq, S] float32, natural log): a forward on one backend and a backward on
# another agree.


def attention_fwd(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, left: int = -1, right: int = -1,
                  softcap: float = 0.0) -> tuple[Tensor, Tensor]:
    key = _fused_key(q, k, v, causal) if not _masked(causal, left, right, softcap) else None
    for kind in _fused_kernels(key, q, k, v, causal) if key is not None else ():
        try:
            if kind == "cudnn":
                o, lse, *_ = torch.ops.aten._scaled_dot_product_cudnn_attention(
                    q, k, v, None, True, 0.0, causal, False, scale=scale)
                if o is None:  # (what it returns for inputs it has no plan for)
                    raise RuntimeError("cuDNN attention returned no output")
                return o.contiguous(), lse[..., 0]
            o, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
            return o.contiguous(), lse
        except torch.OutOfMemoryError:
            raise
        except RuntimeError as e:
            _refused(key, kind, e)
    return math_fwd(q, k, v, causal, scale, left, right, softcap)


def attention_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, causal: bool, scale: float,
                  left: int = -1, right: int = -1, softcap: float = 0.0) -> tuple[Tensor, Tensor, Tensor]:
    key = _fused_key(q, k, v, causal) if not _masked(causal, left, right, softcap) else None
    kinds = _fused_kernels(key, q, k, v, causal) if key is not None else ()
    if kinds:
        S, Skv = q.shape[2], k.shape[2]
        # the random-number state of dropout, which is off: never read
        seed, offset = (torch.empty((), dtype=torch.int64, device=q.device) for _ in range(2))
        dof = do if do.stride() == o.stride() else torch.empty_like(o).copy_(do)  # the fused kernels read both alike
    for kind in kinds:
        try:
            if kind == "cudnn":
                grads = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
                    dof, q, k, v, o, lse.unsqueeze(-1), seed, offset, None, None, None, S, Skv, 0.0, causal,
                    scale=scale)
            else:
                grads = torch.ops.aten._scaled_dot_product_flash_attention_backward(
                    dof, q, k, v, o, lse, None, None, S, Skv, 0.0, causal, seed, offset, scale=scale)
            return tuple(g.contiguous() for g in grads)
        except torch.OutOfMemoryError:
            raise
        except RuntimeError as e:
            _refused(key, kind, e)
    return math_bwd(do, q, k, v, o, lse, causal, scale, left, right, softcap)


# (a window or a cap: see _masked)
attention_masked_fwd = math_fwd
attention_masked_bwd = math_bwd

# the static signature of a call -> the fused kernels PyTorch takes it with, in the order tried ("cudnn", "flash")
_FUSED: dict[tuple[Any, ...], tuple[str, ...]] = {}


def _hint(v: Any) -> int:
    return v if type(v) is int else int(v.node.hint)  # a symbolic size: the value it was traced at


def _empty(t: Tensor) -> bool:
    return any(type(n) is int and n == 0 for n in t.shape)


def _fused_key(q: Tensor, k: Tensor, v: Tensor, causal: bool) -> tuple[Any, ...] | None:
    """What decides whether PyTorch's fused kernels take a call: device, dtype, heads, head dim, the lengths (any
    length where symbolic), the layout of q, k, v (their dims by stride), causal, PyTorch's switches; None off CUDA,
    off 16 bits or for an empty q or k."""
    if not q.is_cuda or q.dtype not in (torch.bfloat16, torch.float16) or _empty(q) or _empty(k):
        return None  # (an empty batch: cuDNN's checks take it, and its kernel returns None)
    orders = tuple(tuple(sorted(range(4), key=lambda d, t=t: -_hint(t.stride(d)))) for t in (q, k, v))
    lengths = tuple(n if type(n) is int else 256 for n in (q.shape[2], k.shape[2]))
    return (q.device, q.dtype, _hint(q.shape[1]), _hint(k.shape[1]), _hint(q.shape[-1]), lengths, causal, orders,
            torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.flash_sdp_enabled())


def _fused_kernels(key: tuple[Any, ...], q: Tensor, k: Tensor, v: Tensor, causal: bool) -> tuple[str, ...]:
    """The fused kernels PyTorch itself would take this call with, cuDNN's first (measured faster on sm90), then
    flash's: PyTorch's own checks, asked once per key on small tensors of the call's layout; none where neither
    takes it or PyTorch's fused kernels are switched off. A kernel that failed on the key before is left out."""
    found = _FUSED.get(key)
    if found is not None:
        return found
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    lengths, orders = key[5], key[7]
    with unset_fake_temporarily():  # real tensors, also while torch.compile traces the call
        probe = []
        for t, order, n in zip((q, k, v), orders, (*lengths, lengths[1]), strict=True):
            shape = (min(_hint(t.shape[0]), 2), _hint(t.shape[1]), n, _hint(t.shape[-1]))  # (2: the batch's stride)
            probe.append(torch.empty([shape[d] for d in order], dtype=t.dtype, device=t.device).permute(
                [order.index(d) for d in range(4)]))
        params = torch.backends.cuda.SDPAParams(*probe, None, 0.0, causal, key[2] != key[3])
        found = tuple(kind for kind, ok in (("cudnn", torch.backends.cuda.can_use_cudnn_attention),
                                            ("flash", torch.backends.cuda.can_use_flash_attention)) if ok(params))
    if len(_FUSED) >= 4096:
        _FUSED.clear()
    _FUSED[key] = found
    return found


def _fused(fn: str | None, tensors: tuple[Tensor, ...]) -> bool:
    """A call of ``fn`` on ``tensors`` that PyTorch's fused kernels take (auto's torch buckets are measured on
    them; elsewhere the torch backend is the math)."""
    if fn in ("attention_masked_fwd", "attention_masked_bwd"):
        return False
    q, k, v = tensors[1:4] if fn == "attention_bwd" else tensors[:3]
    key = _fused_key(q, k, v, False)
    return key is not None and bool(_fused_kernels(key, q, k, v, False))


dispatch.torch_fused_when(OP, _fused)


def _refused(key: tuple[Any, ...], kind: str, error: Exception) -> None:
    """A fused kernel PyTorch's checks accepted raised: calls of this key try the next one (or the math) from now
    on, with one warning."""
    _FUSED[key] = tuple(k for k in _FUSED.get(key, ()) if k != kind)
    warnings.warn(f"hkernels.attention: the torch backend's {kind} kernel failed on this input ({error}); such "
                  f"calls run {_FUSED[key][0] if _FUSED[key] else 'the reference math'} from now on",
                  dispatch.HKernelsFallbackWarning, stacklevel=3)


# Under autocast: as scaled_dot_product_attention, in autocast's dtype.
_CALLS = Public(OP, _check, _body, autocast=Autocast("lower", ("aten::scaled_dot_product_attention",)))
