"""attention_varlen: attention over packed sequences (no padding), FlashAttention's ``cu_seqlens`` convention.

The public function and its checks, its autograd (custom ops ``hkernels::attention_varlen_fwd`` / ``_bwd``), then
the reference math and the torch backend. Kernels: the attention kernels of ``hkernels/ops/attention.py`` (Helion)
and ``triton_fallback/attention.py``, launched over (sequence, query block) programs; the masks and the cap are
``hkernels/functional/attention.py``'s, per sequence.
"""

from __future__ import annotations

import warnings
from itertools import pairwise
from typing import Any

import torch

from hkernels import dispatch
from hkernels.functional._base import Autocast, Public, Tensor, autograd, call, check_range, torch_traces_when
from hkernels.functional.attention import HEAD_DIMS, check_qkv, softcap_value, window_bounds
from hkernels.functional.attention import math_bwd as _dense_bwd
from hkernels.functional.attention import math_fwd as _dense_fwd
from hkernels.runtime.routing import zero_rows_past

OP = "attention_varlen"
_INDEX = (torch.int32, torch.int64)


def attention_varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor | None = None,
                     max_seqlen_q: int | None = None, max_seqlen_k: int | None = None, causal: bool = False,
                     scale: float | None = None, window: tuple[int | None, int | None] | None = None,
                     softcap: float | None = None) -> Tensor:
    """Attention over packed sequences: sequence i is rows ``cu_seqlens[i] : cu_seqlens[i + 1]`` of q (and of k, v).

    q: [Tq, Hq, D]; k, v: [Tk, Hk, D] with Hq a multiple of Hk; D in 16, 32, 64, 128, 256 (256 not on Helion); one
    dtype; unit stride along D (views of a fused projection are read in place). cu_seqlens_q, cu_seqlens_k: [N + 1]
    int32 (or int64) on q's device, non-decreasing from 0 (cu_seqlens_k defaults to cu_seqlens_q: self-attention);
    sequences of length 0 and 1 are fine; rows past the last sequence get zeros. max_seqlen_q / max_seqlen_k: the
    longest sequence, which sizes the launch; given, the call never waits on the device; left out, it is read from
    cu_seqlens once per call (a host sync; under torch.compile the row count stands in for it). A larger value is
    fine (idle programs), a smaller one drops rows (``HKERNELS_CHECK=1`` raises on it, and on cu_seqlens that do
    not start at 0, decrease or end past the rows). causal, window and softcap as in :func:`hkernels.attention`,
    with the mask aligned at each sequence's end (query i of a sequence with Sq queries and Sk keys sits at key
    position i + Sk − Sq, FlashAttention's convention); a query that sees no key gets zeros. Returns [Tq, Hq, D] in
    q's dtype; differentiable in q, k, v.
    """
    return _CALLS(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, window, softcap)


def _check(q: Any, k: Any, v: Any, cu_q: Any, cu_k: Any, max_q: Any, max_k: Any, causal: Any, scale: Any,
           window: Any, softcap: Any) -> None:
    check_qkv(OP, q, k, v, ("q", "k", "v"), ("[Tq, Hq, D]", "[Tk, Hk, D]"), (2,), HEAD_DIMS)
    Tq = q.shape[0]
    for name, cu in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
        if cu is None and name == "cu_seqlens_k":
            continue
        if not isinstance(cu, Tensor):
            raise TypeError(f"hkernels.attention_varlen: {name} must be a tensor, got {type(cu).__name__}")
        if cu.dim() != 1 or cu.shape[0] < 1 or cu.dtype not in _INDEX:
            raise ValueError(f"hkernels.attention_varlen: {name} must be 1-D int32 (or int64) [N + 1], got "
                             f"{cu.dtype} {list(cu.shape)}")
        if cu.device != q.device:
            raise ValueError(f"hkernels.attention_varlen: {name} is on {cu.device} but q is on {q.device}")
    if cu_k is None and k.shape[0] != Tq:
        raise ValueError(f"hkernels.attention_varlen: without cu_seqlens_k, k must have as many rows as q "
                         f"(Tq = {Tq}, Tk = {k.shape[0]})")
    if cu_k is not None and cu_k.shape != cu_q.shape:
        raise ValueError(f"hkernels.attention_varlen: cu_seqlens_q and cu_seqlens_k must both be [N + 1], got "
                         f"{list(cu_q.shape)} and {list(cu_k.shape)}")
    for name, m in (("max_seqlen_q", max_q), ("max_seqlen_k", max_k)):
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 0):
            raise ValueError(f"hkernels.attention_varlen: {name} must be an int >= 0 or None, got {m!r}")
    if scale is not None and (not isinstance(scale, (int, float)) or isinstance(scale, bool)):
        raise TypeError(f"hkernels.attention_varlen: scale must be a float or None, got {type(scale).__name__}")
    window_bounds(OP, window, bool(causal))
    softcap_value(OP, softcap)


def _values(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor | None, max_q: int | None,
            max_k: int | None, causal: bool, scale: float | None, window: Any, softcap: Any) -> None:
    for name, cu, rows, given in (("cu_seqlens_q", cu_q, q.shape[0], max_q),
                                  ("cu_seqlens_k", cu_q if cu_k is None else cu_k, k.shape[0],
                                   max_q if cu_k is None and max_k is None else max_k)):
        first = int(cu[0])
        if first != 0:
            raise ValueError(f"hkernels.attention_varlen: {name} must start at 0, got {name}[0] = {first}")
        lengths = cu[1:] - cu[:-1]
        check_range(OP, f"{name}'s lengths ({name}[i + 1] - {name}[i])", lengths, 0, rows + 1,
                    why=": it must not decrease")
        last = int(cu[-1])
        if last > rows:
            raise ValueError(f"hkernels.attention_varlen: {name} ends at {last}, past the {rows} rows of "
                             f"{'q' if name.endswith('q') else 'k'}")
        longest = int(lengths.max()) if lengths.numel() else 0
        max_name = "max_seqlen_" + name[-1]
        if given is not None and given < longest:
            raise ValueError(f"hkernels.attention_varlen: {max_name} = {given} is below the longest sequence of "
                             f"{name} ({longest} rows): rows past it would be dropped")


def _longest(cu: Tensor) -> int:
    """The longest sequence of cu_seqlens (one host sync)."""
    return int((cu[1:] - cu[:-1]).max()) if cu.shape[0] > 1 else 0


def _body(request: str, q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor | None, max_q: int | None,
          max_k: int | None, causal: bool, scale: float | None, window: Any, softcap: Any) -> Tensor:
    if cu_k is None:
        cu_k, max_k = cu_q, max_q if max_k is None else max_k
    cu_q, cu_k = cu_q.to(torch.int32), cu_k.to(torch.int32)  # (no copy when they already are)
    if torch.compiler.is_compiling():  # no sync inside a graph: every row may be one sequence's
        max_q = q.shape[0] if max_q is None else max_q
        max_k = k.shape[0] if max_k is None else max_k
    max_q = _longest(cu_q) if max_q is None else max_q
    max_k = _longest(cu_k) if max_k is None else max_k
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    left, right = window_bounds(OP, window, bool(causal))
    o, _ = call(_fwd, q, k, v, cu_q, cu_k, max_q, max_k, bool(causal), scale, left, right,
                softcap_value(OP, softcap), request)
    return o


# ------------------------------------------------------------------------------------------------------ autograd


def _d_unit(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


@torch.library.custom_op("hkernels::attention_varlen_fwd", mutates_args=())
def _fwd(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int, causal: bool,
         scale: float, left: int, right: int, softcap: float, backend: str) -> tuple[Tensor, Tensor]:
    if q.numel() == 0 or k.numel() == 0 or cu_q.shape[0] < 2:
        backend = "torch"
    return dispatch.run(OP, "attention_varlen_fwd", backend, _d_unit(q), _d_unit(k), _d_unit(v), cu_q, cu_k,
                        max_q, max_k, causal, scale, left, right, softcap)


@_fwd.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int, causal: bool,
      scale: float, left: int, right: int, softcap: float, backend: str) -> tuple[Tensor, Tensor]:
    return q.new_empty(q.shape), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@torch.library.custom_op("hkernels::attention_varlen_bwd", mutates_args=())
def _bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, cu_q: Tensor, cu_k: Tensor,
         max_q: int, max_k: int, causal: bool, scale: float, left: int, right: int, softcap: float,
         backend: str) -> tuple[Tensor, Tensor, Tensor]:
    if q.numel() == 0 or k.numel() == 0 or cu_q.shape[0] < 2:
        backend = "torch"
    return dispatch.run(OP, "attention_varlen_bwd", backend, _d_unit(do), _d_unit(q), _d_unit(k), _d_unit(v), o,
                        lse, cu_q, cu_k, max_q, max_k, causal, scale, left, right, softcap)


@_bwd.register_fake
def _(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, cu_q: Tensor, cu_k: Tensor,
      max_q: int, max_k: int, causal: bool, scale: float, left: int, right: int, softcap: float,
      backend: str) -> tuple[Tensor, Tensor, Tensor]:
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
    q, k, v, cu_q, cu_k, *options, backend = inputs
    ctx.save_for_backward(q, k, v, cu_q, cu_k, *output)
    ctx.options, ctx.backend = options, backend
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)


def _backward(ctx: Any, do: Tensor | None, _dlse: Tensor | None) -> tuple[Tensor | None, ...]:
    if do is None:
        return (None,) * 13
    q, k, v, cu_q, cu_k, o, lse = ctx.saved_tensors
    dq, dk, dv = call(_bwd, do, q, k, v, o, lse, cu_q, cu_k, *ctx.options, ctx.backend)
    return (dq, dk, dv) + (None,) * 10


autograd(_fwd, _backward, _setup)


# ------------------------------------------------------------------------------- reference and the torch backend


def _spans(cu: Tensor, rows: int) -> list[tuple[int, int]]:
    """(start, end) of each sequence, clipped to the rows that exist."""
    bounds = [min(max(int(c), 0), rows) for c in cu.tolist()]
    return [(a, max(a, b)) for a, b in pairwise(bounds)]


def reference(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor | None = None,
              max_seqlen_q: int | None = None, max_seqlen_k: int | None = None, causal: bool = False,
              scale: float | None = None, window: tuple[int | None, int | None] | None = None,
              softcap: float | None = None) -> Tensor:
    """Each sequence by :func:`hkernels.references.attention`'s math, masks aligned at its end; zeros elsewhere."""
    cu_k = cu_seqlens_q if cu_seqlens_k is None else cu_seqlens_k
    left, right = window_bounds(OP, window, bool(causal))
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    o, _ = _loop_fwd(q, k, v, cu_seqlens_q, cu_k, bool(causal), scale, left, right, softcap_value(OP, softcap))
    return o


def _seq(t: Tensor, a: int, b: int) -> Tensor:
    """Rows a:b of a packed [T, H, D] as one [1, H, S, D] batch."""
    return t[a:b].transpose(0, 1).unsqueeze(0)


def attention_varlen_fwd(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int,
                         causal: bool, scale: float, left: int = -1, right: int = -1, softcap: float = 0.0
                         ) -> tuple[Tensor, Tensor]:
    """-> (o [Tq, Hq, D] in q's dtype, lse [Hq, Tq] float32; −inf and o = 0 for rows that see no key or belong to
    no sequence). PyTorch's FlashAttention varlen kernel where it takes the call (see _flash); else the sequences
    one by one, read on the host."""
    if _flash(q, cu_q, cu_k, max_q, max_k, softcap):
        try:
            # (max_q of at least 2: at 1, with more query heads than key/value heads and no window, the kernel
            # takes query i for sequence i, whatever cu_seqlens_q says; a larger bound only adds idle programs)
            o, lse, *_ = torch.ops.aten._flash_attention_forward(
                q, k, v, cu_q, cu_k, max(max_q, 2), max_k, 0.0, causal, False, scale=scale, window_size_left=left,
                window_size_right=right)
        except torch.OutOfMemoryError:
            raise
        except RuntimeError as e:
            _refused(q, e)
        else:
            # rows that see no key: lse +inf there, −inf here; rows past the last sequence are left unwritten
            past = torch.arange(q.shape[0], device=q.device, dtype=cu_q.dtype) >= cu_q[-1:]
            return zero_rows_past(o, cu_q[-1:]), lse.masked_fill(past | (lse == float("inf")), float("-inf"))
    return _loop_fwd(q, k, v, cu_q, cu_k, causal, scale, left, right, softcap)


def _loop_fwd(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, causal: bool, scale: float, left: int,
              right: int, softcap: float) -> tuple[Tensor, Tensor]:
    """attention_varlen_fwd one sequence at a time (the sequences read on the host)."""
    o = q.new_zeros(q.shape) + q[:0].sum()  # (an empty sum: zeros on autograd's graph even with no sequence)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float32, device=q.device)
    for (qa, qb), (ka, kb) in zip(_spans(cu_q, q.shape[0]), _spans(cu_k, k.shape[0]), strict=True):
        if qb == qa or kb == ka:  # no queries, or no keys: zeros, lse −inf
            continue
        oi, li = _dense_fwd(_seq(q, qa, qb), _seq(k, ka, kb), _seq(v, ka, kb), causal, scale, left, right,
                            softcap)
        o[qa:qb] = oi[0].transpose(0, 1)
        lse[:, qa:qb] = li[0]
    return o, lse


def attention_varlen_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, cu_q: Tensor,
                         cu_k: Tensor, max_q: int, max_k: int, causal: bool, scale: float, left: int = -1,
                         right: int = -1, softcap: float = 0.0) -> tuple[Tensor, Tensor, Tensor]:
    """Each sequence's gradients by the attention backward's formula (PyTorch's FlashAttention varlen backward
    where it takes the call); zeros for rows outside every sequence."""
    if _flash(q, cu_q, cu_k, max_q, max_k, softcap):
        rng = torch.empty(2, dtype=torch.int64, device=q.device)  # dropout's random-number state: off, never read
        try:
            dq, dk, dv = torch.ops.aten._flash_attention_backward(
                do, q, k, v, o, lse.masked_fill(lse == float("-inf"), float("inf")), cu_q, cu_k, max(max_q, 2),
                max_k, 0.0, causal, rng, rng, scale=scale, window_size_left=left, window_size_right=right)
        except torch.OutOfMemoryError:
            raise
        except RuntimeError as e:
            _refused(q, e)
        else:
            return zero_rows_past(dq, cu_q[-1:]), zero_rows_past(dk, cu_k[-1:]), zero_rows_past(dv, cu_k[-1:])
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for (qa, qb), (ka, kb) in zip(_spans(cu_q, q.shape[0]), _spans(cu_k, k.shape[0]), strict=True):
        if qb == qa or kb == ka:
            continue
        g = _dense_bwd(_seq(do, qa, qb), _seq(q, qa, qb), _seq(k, ka, kb), _seq(v, ka, kb), _seq(o, qa, qb),
                       lse[:, qa:qb].unsqueeze(0), causal, scale, left, right, softcap)
        for full, part, a, b in ((dq, g[0], qa, qb), (dk, g[1], ka, kb), (dv, g[2], ka, kb)):
            full[a:b] += part[0].transpose(0, 1)
    return dq, dk, dv


# PyTorch's FlashAttention varlen kernel (the one ``torch.nn.attention.varlen`` calls): CUDA, 16-bit, int32
# cu_seqlens, the longest sequences known, no cap. A device where it raised keeps the loop (one warning).
_FLASH_REFUSED: set[torch.device] = set()


def _flash(q: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int, softcap: float) -> bool:
    return (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and not softcap and max_q > 0 and max_k > 0
            and cu_q.dtype == cu_k.dtype == torch.int32 and q.shape[-1] % 8 == 0 and q.device not in _FLASH_REFUSED)


def _refused(q: Tensor, error: Exception) -> None:
    _FLASH_REFUSED.add(q.device)
    warnings.warn(f"hkernels.attention_varlen: the torch backend's FlashAttention kernel failed on {q.device} "
                  f"({error}); calls there run one sequence at a time from now on",
                  dispatch.HKernelsFallbackWarning, stacklevel=3)


def _torch_takes(name: str, args: tuple[Any, ...]) -> bool:
    """The torch backend's call runs PyTorch's FlashAttention varlen kernel, reading nothing on the host (traceable
    into a graph): the forward's (q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, left, right, softcap, ...), the
    backward's (do, q, k, v, o, lse, cu_q, cu_k, max_q, max_k, causal, scale, left, right, softcap, ...); only on a
    GPU its kernel runs on (sm80 and later: inside a graph there is no falling back to the loop)."""
    if name.endswith("_fwd"):
        q, _k, _v, cu_q, cu_k, max_q, max_k, *_rest, softcap, _backend = args
    else:
        _do, q, _k, _v, _o, _lse, cu_q, cu_k, max_q, max_k, *_rest, softcap, _backend = args
    return _flash(q, cu_q, cu_k, max_q, max_k, softcap) and torch.cuda.get_device_capability(q.device)[0] >= 8


torch_traces_when(OP, _torch_takes)


# Under autocast: as scaled_dot_product_attention, in autocast's dtype.
_CALLS = Public(OP, _check, _body, values=_values, autocast=Autocast("lower", ("aten::scaled_dot_product_attention",)))
