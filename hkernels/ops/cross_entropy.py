"""Cross-entropy over a vocabulary in Helion (the twin of ``triton_fallback/cross_entropy.py``).

Math, per row of V logits x with target t and label smoothing ε (rows with t = ignore_index contribute 0):
    lse = log Σ_j exp(x_j),  loss = (1−ε)·(lse − x_t) + ε·(lse − (1/V)·Σ_j x_j)
    ∂loss/∂x_j = softmax(x)_j − (1−ε)·[j = t] − ε/V
With a logit cap c (Gemma 2/3) the x above are y_j = c·tanh(x_j / c), and ∂loss/∂x_j = ∂loss/∂y_j · (1 − tanh²);
with a z-loss λ (PaLM's) the loss gains λ·lse² and ∂loss/∂y_j gains 2λ·lse·softmax(y)_j. Both are fused into the
two passes below: no extra read of the logits.
A target outside [0, V) that is not ignore_index gives a NaN loss and NaN gradient row: never a silent answer.

The forward, asked for the gradient, writes it in the same call (scaled per row, e.g. by 1/valid rows for a
mean): pass 1 reads the row once with an online (max, sum); pass 2 reads it again and writes the gradient. At
vocabulary sizes pass 2 mostly reads from memory, not L2 (the rows in flight no longer fit there by then), so a
forward with the gradient moves about 1.5× one read and one write of [T, V]; the configs take a flat grid of
wide blocks (see bench/results/h200/README.md). The backward then only scales the stored gradient by the
upstream gradient, in place, and skips rows whose factor is exactly 1 (the usual ``loss.backward()``), so it
moves nothing in the common case. Row counts are dynamic; V is specialised.
"""

from __future__ import annotations

import helion
import helion.language as hl
import torch

from hkernels.ops import _helion
from hkernels.runtime.interpret import interpreting
from hkernels.runtime.launch import same_memory

Tensor = torch.Tensor
# traced at a symbolic row count (see hkernels/ops/rms_norm.py)
SYMBOLIC = frozenset({"cross_entropy_fwd", "cross_entropy_grad", "loss_grad_scale_"})
LOG2E = 1.4426950408889634
# rows of this many logits or more keep their logits in L2 between the forward's two passes (eviction hints; the
# measurement is in triton_fallback/cross_entropy.py's KEEP_IN_L2_FROM)
KEEP_IN_L2_FROM = 16384
# logit dtypes whose cap takes the GPU's tanh instruction (_tanh_approx): its error is under their rounding
FAST_TANH_DTYPES = (torch.bfloat16, torch.float16)


@helion.kernel(static_shapes=False)
def _cross_entropy_fwd(
    logits: Tensor,
    flat: Tensor,
    target: Tensor,
    scale: Tensor,
    grad: Tensor | None,
    z: Tensor | None,
    pred: Tensor | None,
    ent: Tensor | None,
    class_weight: Tensor | None,
    row_stride: int,
    ignore_index: int,
    smoothing: float,
    softcap: float,
    inv_cap: float,
    z_scale: float,
    smooth: hl.constexpr,
    xt_load: hl.constexpr,
    capped: hl.constexpr,
    zloss: hl.constexpr,
    stats: hl.constexpr,
    weighted: hl.constexpr,
    keep: hl.constexpr,
    fast_tanh: hl.constexpr,
) -> Tensor:
    # logits [T, V], flat: the same storage as one run of (T − 1)·row_stride + V elements (for the load of
    # x[target]), target [T] int64, scale [T] float32 -> loss [T] float32; writes grad [T, V] when given. smooth:
    # smoothing ≠ 0 (Σx is only summed then). xt_load: x[target] by one load per row, for a gradient that does not
    # overwrite the logits; else picked out of pass 1 in passing (a compare per element): a load could be served
    # after another warp's pass-2 store over x[target] (Triton's twin orders them with a CTA barrier, which Helion
    # does not offer).
    # Per element, pass 1 costs a max, a subtract, a multiply, one exp2 and an add (plus Helion's selects of the
    # partial last block's lanes): exp is written as exp2 of x·log2 e, one MUFU op where libdevice's exp takes a
    # dozen instructions and makes the pass compute-bound. capped: each logit read as y = c·tanh(x / c), the
    # gradient through 1 − tanh² (x times inv_cap = 1 / c: a multiply per logit where a division takes several
    # instructions); zloss: λ·lse² joins each row's loss (written to z), 2λ·lse·softmax its gradient;
    # stats: pass 1 also keeps the first index of the running max and Σ exp(x − max)·x, for each row's predicted
    # class (pred, −1 where ignored) and its softmax's entropy lse − Σ p·x (ent, 0 where ignored); weighted (class
    # weights w [V] float32, F.cross_entropy's): the target's term scaled by w_t, the smoothing term by each w_j.
    # fast_tanh (16-bit logits on a GPU): the cap's tanh by the GPU's instruction (_tanh_approx).
    t_rows, v = logits.size()
    v = hl.specialize(v)
    loss = torch.empty([t_rows], dtype=torch.float32, device=logits.device)
    for tile_t in hl.tile(t_rows):
        tgt = target[tile_t]
        valid = tgt != ignore_index
        in_range = (tgt >= 0) & (tgt < v)
        row_max = hl.full([tile_t], float("-inf"), dtype=torch.float32)
        row_sum = hl.zeros([tile_t], dtype=torch.float32)  # Σ exp2((x − row_max)·log2 e)
        x_sum = hl.zeros([tile_t], dtype=torch.float32)
        x_t = hl.zeros([tile_t], dtype=torch.float32)
        arg = hl.zeros([tile_t], dtype=torch.int32)
        xe_sum = hl.zeros([tile_t], dtype=torch.float32)  # Σ exp2((x − row_max)·log2 e)·x
        w_sum = hl.zeros([tile_t], dtype=torch.float32)  # Σ w_j (weighted with smoothing)
        if xt_load:
            at = tile_t.index * row_stride + torch.where(valid & in_range, tgt, 0)
            x_t = hl.load(flat, [at]).to(torch.float32)
            if capped:
                x_t = softcap * _capped(x_t * inv_cap, fast_tanh)
        for tile_v in hl.tile(v):
            # Helion's reductions leave out the lanes past V (−inf for the max, 0 for the sums)
            # keep (with a gradient, long rows): pass 1's reads stay in L2 for pass 2's, which evicts them
            x = hl.load(logits, [tile_t, tile_v], eviction_policy="evict_last" if keep else None).to(torch.float32)
            if capped:
                th = _capped(x * inv_cap, fast_tanh)
                x = softcap * th  # (left out by the compiler where only p needs it)
                block_max = softcap * torch.amax(th, dim=-1)  # (c > 0: the largest tanh gives the largest y)
            else:
                block_max = torch.amax(x, dim=-1)
            new_max = torch.maximum(row_max, block_max)
            # While every value seen is -inf, shift by 0 so that no inf − inf = NaN enters the sum.
            shift = torch.where(new_max == float("-inf"), 0.0, new_max)
            if capped:  # exp(c·th − shift) with one fused multiply-add per logit (the capped loss is issue-bound)
                p = torch.exp2(th * (softcap * LOG2E) - (shift * LOG2E)[:, None])
            else:
                p = torch.exp2((x - shift[:, None]) * LOG2E)
            alpha = torch.exp2((row_max - shift) * LOG2E)
            row_sum = row_sum * alpha + torch.sum(p, dim=-1)
            if stats:  # the first index of a strictly larger max; −inf logits add nothing (0·−inf would be NaN)
                first = torch.amin(torch.where(x == block_max[:, None], tile_v.index[None, :], v), dim=-1)
                arg = torch.where(block_max > row_max, first, arg)
                xe_sum = xe_sum * alpha + torch.sum(torch.where(x > float("-inf"), p * x, 0.0), dim=-1)
            row_max = new_max
            if smooth:
                if weighted:
                    w = class_weight[tile_v]
                    x_sum = x_sum + torch.sum(x * w[None, :], dim=-1)
                    w_sum = w_sum + torch.sum(w[None, :] + 0.0 * x, dim=-1)
                else:
                    x_sum = x_sum + torch.sum(x, dim=-1)
            if not xt_load:
                x_t = x_t + torch.sum(torch.where(tile_v.index[None, :] == tgt[:, None], x, 0.0), dim=-1)
        lse = row_max + torch.log(row_sum)
        # Differences before scaling, as PyTorch's (1−ε)·(−log p_t) + ε·mean(−log p): lse − x_t cancels exactly where
        # it should (one logit: 0), where lse − (1−ε)·x_t − ε·mean(x) would leave an error of an ulp of |x| (large
        # logits, V = 1). Without smoothing the Σx term is left out, not multiplied by 0: a -inf logit would make it
        # 0·(-inf) = NaN where PyTorch's loss is finite or +inf.
        w_t = hl.full([tile_t], 1.0, dtype=torch.float32)
        if weighted:
            w_t = hl.load(class_weight, [torch.where(valid & in_range, tgt, 0)])
        row_loss = (1.0 - smoothing) * w_t * (lse - x_t)
        if smooth:
            if weighted:
                row_loss = row_loss + smoothing * (w_sum * lse - x_sum) / v
            else:
                row_loss = row_loss + smoothing * (lse - x_sum / v)
        if zloss:
            zr = torch.where(valid, torch.where(in_range, z_scale * lse * lse, float("nan")), 0.0)
            z[tile_t] = zr
            row_loss = row_loss + zr
        loss[tile_t] = torch.where(valid, torch.where(in_range, row_loss, float("nan")), 0.0)
        if stats:
            pred[tile_t] = torch.where(valid, arg, -1).to(torch.int64)
            ent[tile_t] = torch.where(valid, lse - xe_sum / row_sum, 0.0)
        if grad is not None:
            s = torch.where(valid, torch.where(in_range, scale[tile_t], float("nan")), 0.0)
            for tile_w in hl.tile(v):
                x = hl.load(logits, [tile_t, tile_w], eviction_policy="evict_first" if keep else None
                            ).to(torch.float32)
                hit = tile_w.index[None, :] == tgt[:, None]
                if capped:
                    th = _capped(x * inv_cap, fast_tanh)
                    p = torch.exp2(th * (softcap * LOG2E) - (lse * LOG2E)[:, None])
                else:
                    p = torch.exp2((x - lse[:, None]) * LOG2E)
                if weighted:  # p's factor (1−ε)·w_t + ε·Σw/V, and the z term's 2λ·lse (not weighted)
                    w = class_weight[tile_w]
                    p_factor = (1.0 - smoothing) * w_t
                    if smooth:
                        p_factor = p_factor + smoothing * w_sum / v
                    if zloss:
                        p_factor = p_factor + 2.0 * z_scale * lse
                    g = (p * p_factor[:, None] - smoothing * w[None, :] / v
                         - torch.where(hit, (1.0 - smoothing) * w_t[:, None], 0.0))
                else:
                    if zloss:
                        p = p * (1.0 + 2.0 * z_scale * lse[:, None])
                    g = p - smoothing / v - torch.where(hit, 1.0 - smoothing, 0.0)
                if capped:
                    g = g * (1.0 - th * th)
                grad[tile_t, tile_w] = (g * s[:, None]).to(grad.dtype)
    return loss


def _tanh(x: Tensor) -> Tensor:
    """tanh by exp2 (the Triton interpreter has no libdevice.tanh), exact limits at ±inf; its odd series to x⁷
    below |x| = 0.2, where 1 − 2 / (e^{2x} + 1) cancels: a relative error under 1e-6 everywhere."""
    x2 = x * x
    series = x * (1.0 + x2 * (-0.3333333333333333 + x2 * (0.13333333333333333 + x2 * -0.05396825396825397)))
    return torch.where(torch.abs(x) < 0.2, series, 1.0 - 2.0 / (torch.exp2(x * (2.0 * LOG2E)) + 1.0))


def _tanh_approx(x: Tensor) -> Tensor:
    """The GPU's tanh instruction: one special-function op where :func:`_tanh` takes two and a dozen float32 ops
    (which make the capped loss compute-bound); relative error 2^-11, under a 16-bit logit's own rounding."""
    return hl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=torch.float32, is_pure=True,
                                     pack=1)


def _capped(x: Tensor, fast: bool) -> Tensor:
    """tanh(x) for the cap: the GPU's instruction where ``fast`` (a constant of the kernel), else :func:`_tanh`."""
    return _tanh_approx(x) if fast else _tanh(x)


@helion.kernel(static_shapes=False)
def _cross_entropy_bwd(grad: Tensor, dloss: Tensor) -> None:
    # grad [R, V] *= dloss [R], in place; a row whose factor is exactly 1 is neither read nor written (masked).
    r, v = grad.size()
    for tile_r, tile_v in hl.tile([r, v]):
        g = dloss[tile_r].to(torch.float32)
        scaled = (g != 1.0)[:, None]
        x = hl.load(grad, [tile_r, tile_v], extra_mask=scaled).to(torch.float32)
        hl.store(grad, [tile_r, tile_v], (x * g[:, None]).to(grad.dtype), extra_mask=scaled)


def cross_entropy_fwd(
    logits: Tensor, target: Tensor, scale: Tensor, ignore_index: int, label_smoothing: float, grad: Tensor | None,
    softcap: float = 0.0, z_scale: float = 0.0, z: Tensor | None = None, stats: tuple[Tensor, Tensor] | None = None,
    weight: Tensor | None = None,
) -> Tensor:
    """logits [T, V] (unit column stride), target [T] int64, scale [T] float32 (any stride: the gradient's factor
    per row) -> loss [T] float32 per row. When ``grad`` [T, V] (unit column stride) is given, the gradient times
    scale is written there; it may be ``logits`` itself (each element is read before it is overwritten).
    ``softcap`` > 0: the logits capped to c·tanh(x / c) first; ``z_scale`` > 0: λ·lse² joins each row's loss (and
    is written to ``z`` [T] float32 when given); ``stats`` (pred [T] int64, entropy [T] float32): each row's
    predicted class (−1 where ignored) and entropy of the softmax (0 where ignored) written there; ``weight`` [V]
    float32: the classes' weights (F.cross_entropy's), unreduced."""
    T, V = logits.shape
    zloss = z_scale != 0.0
    if zloss and z is None:
        z = torch.empty(T, dtype=torch.float32, device=logits.device)
    # one run of elements from the first row's start to the last row's end: x[target] of row r is at r·stride + t
    flat = logits.as_strided(((T - 1) * logits.stride(0) + V,), (1,))
    # a gradient in the logits' memory (the linear loss writes it over them) takes the race-free x[target]
    xt_load = grad is None or not same_memory(grad, logits)
    pred, ent = stats if stats is not None else (None, None)
    args = (logits, flat, target, scale, grad, z if zloss else None, pred, ent, weight, logits.stride(0),
            int(ignore_index), float(label_smoothing), float(softcap), 1.0 / softcap if softcap > 0.0 else 0.0,
            float(z_scale), label_smoothing != 0.0, xt_load,
            softcap > 0.0, zloss, stats is not None, weight is not None,
            grad is not None and int(V) >= KEEP_IN_L2_FROM,  # (V: a constant of the kernel, symbolic or not)
            softcap > 0.0 and logits.dtype in FAST_TANH_DTYPES and not interpreting())
    return _helion.run(_cross_entropy_fwd, args, V, logits.device, rows=(0, 2, 3, 4, 5, 6, 7))


def cross_entropy_bwd(dloss: Tensor, grad: Tensor) -> Tensor:
    """grad [R, V] *= dloss [R] (any stride, stride 0 for one factor), in place; rows with factor 1 untouched."""
    _helion.run(_cross_entropy_bwd, (grad, dloss), grad.shape[1], grad.device)
    return grad
