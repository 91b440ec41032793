"""Cross-entropy over a vocabulary in hand-written Triton: the twin of ``hkernels/ops/cross_entropy.py``, whose
docstring gives the math, the two passes and the bytes moved.

Here the forward is a persistent grid over rows (``_settings``). Split rows that read the logits from memory once
(``triton_fallback/_split.py``, softmax's long rows) are no faster here: with the gradient they reach the same
share of copy, and for the loss alone less, since each chunk's work waits on a dependent load of x[target] and on
the row's other chunks (see bench/results/h200/README.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hkernels.runtime.device import next_pow2
from hkernels.runtime.interpret import interpreting
from hkernels.runtime.launch import launch
from triton_fallback._common import persistent_programs, tuned_settings

Tensor = torch.Tensor
# exp(x) as exp2(x·log2 e): the flush-to-zero ex2, fewer instructions than tl.exp's
LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)

# The custom ops whose launches these host functions record at a symbolic length (see triton_fallback/rms_norm.py):
# a persistent grid of a fixed size there, looping to the row count.
SYMBOLIC = frozenset({"cross_entropy_fwd", "cross_entropy_grad", "loss_grad_scale_"})


@triton.jit
def _tanh(x):
    # 1 − 2 / (e^{2x} + 1): exact limits at ±inf, one exp2, tl math only (the interpreter has no libdevice); below
    # |x| = 0.2, where that form cancels (an absolute error of float32's epsilon, which a large cap c multiplies),
    # its odd series to x⁷: a relative error under 1e-6 everywhere.
    x2 = x * x
    series = x * (1.0 + x2 * (-0.3333333333333333 + x2 * (0.13333333333333333 + x2 * -0.05396825396825397)))
    return tl.where(tl.abs(x) < 0.2, series, 1.0 - 2.0 / (tl.math.exp2(x * 2.8853900817779268) + 1.0))


@triton.jit
def _tanh_approx(x):
    # The GPU's tanh instruction: one special-function op where the form above takes two and a dozen float32 ops
    # (which make the capped loss compute-bound); relative error 2^-11, under a 16-bit logit's own rounding.
    return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True,
                                     pack=1)


@triton.jit
def _capped(x, FAST: tl.constexpr):
    if FAST:
        return _tanh_approx(x)
    else:
        return _tanh(x)


@triton.jit
def _cross_entropy_fwd_kernel(
    logits_ptr,  # [T, V], unit column stride
    target_ptr,  # [T] int64
    scale_ptr,  # [T] float32, any stride (0: one factor for all rows): the gradient's factor per row
    loss_ptr,  # [T] float32 out
    grad_ptr,  # [T, V] out (logits' dtype), when HAS_GRAD
    z_ptr,  # [T] float32 out: each row's z term λ·lse², when Z_LOSS
    pred_ptr,  # [T] int64 out: each row's predicted class (its first largest logit; −1 where ignored), when STATS
    ent_ptr,  # [T] float32 out: each row's entropy of softmax (0 where ignored), when STATS
    w_ptr,  # [V] float32: the classes' weights, when WEIGHTED
    T, V, stride_logits, stride_scale, stride_grad, ignore_index, smoothing, softcap, z_scale,
    HAS_GRAD: tl.constexpr, BLOCK_V: tl.constexpr, NUM_STAGES: tl.constexpr, XT_BARRIER: tl.constexpr,
    SOFTCAP: tl.constexpr, Z_LOSS: tl.constexpr, STATS: tl.constexpr, WEIGHTED: tl.constexpr,
    SMOOTH: tl.constexpr, KEEP_IN_L2: tl.constexpr, FAST_TANH: tl.constexpr,
):
    # With SOFTCAP each logit x is read as y = c·tanh(x / c) and the gradient leaves through dy/dx = 1 − tanh²;
    # with Z_LOSS the row's loss gains λ·lse² and its gradient λ·2·lse·softmax; with STATS pass 1 also keeps the
    # first index of the running max and Σ exp(x − max)·x, for the predicted class and the entropy lse − Σ p·x: all
    # fused into the same two passes. WEIGHTED (class weights w, as F.cross_entropy's): the target's term scaled by
    # w_t, the smoothing term by each class's w_j (Σ w_j x_j and Σ w_j summed in pass 1, w_j read again in pass 2).
    smoothing = tl.cast(smoothing, tl.float32)  # float32 scalars (a compiled graph's launch types floats as float64)
    softcap = tl.cast(softcap, tl.float32)
    inv_cap = 1.0 / softcap  # (x · 1/c: a multiply per logit where a division takes several instructions)
    cap_log2e = softcap * LOG2E
    z_scale = tl.cast(z_scale, tl.float32)
    for row in tl.range(tl.program_id(0), T, tl.num_programs(0)):
        row64 = tl.cast(row, tl.int64)
        x_row = logits_ptr + row64 * stride_logits
        t = tl.load(target_ptr + row64)
        valid = t != ignore_index
        in_range = (t >= 0) & (t < V)
        # Pass 1: online max and Σ exp (rescaled when the max grows), and Σ x for label smoothing.
        row_max = tl.full([], -float("inf"), dtype=tl.float32)
        row_sum = tl.full([], 0.0, dtype=tl.float32)
        x_sum = tl.full([], 0.0, dtype=tl.float32)
        x_t = tl.full([], 0.0, dtype=tl.float32)
        arg = tl.full([], 0, dtype=tl.int32)
        w_sum = tl.full([], 0.0, dtype=tl.float32)  # Σ w_j (WEIGHTED with smoothing; else V)
        xe_sum = tl.full([], 0.0, dtype=tl.float32)  # Σ exp(x − shift)·x, rescaled as row_sum is
        for start in tl.range(0, V, BLOCK_V, num_stages=NUM_STAGES):
            cols = start + tl.arange(0, BLOCK_V)
            # KEEP_IN_L2 (with a gradient): pass 1's reads stay in L2 for pass 2's, which evicts them as it reads,
            # and the gradient streams past (a row of 128256 bf16 logits is 256 KB: some 130 rows in flight fill
            # two thirds of an H100's L2)
            x = tl.load(x_row + cols, mask=cols < V, other=-float("inf"),
                        eviction_policy="evict_last" if KEEP_IN_L2 else "").to(tl.float32)
            if SOFTCAP:
                th = tl.where(cols < V, _capped(x * inv_cap, FAST_TANH), -float("inf"))
                x = softcap * th  # (left out by the compiler where only p needs it)
                block_max = softcap * tl.max(th, axis=0)  # (c > 0: the largest tanh gives the largest y)
            else:
                block_max = tl.max(x, axis=0)
            new_max = tl.maximum(row_max, block_max)
            # While every value seen is -inf, shift by 0 so that no inf − inf = NaN enters the sum.
            shift = tl.where(new_max == -float("inf"), 0.0, new_max)
            alpha = tl.math.exp2((row_max - shift) * LOG2E)
            # (capped: exp(c·th − shift) with one fused multiply-add per logit, the loss being issue-bound there)
            p = tl.math.exp2(th * cap_log2e - shift * LOG2E if SOFTCAP else (x - shift) * LOG2E)
            row_sum = row_sum * alpha + tl.sum(p, axis=0)
            if STATS:  # the first index of a strictly larger max; −inf logits add nothing (0·−inf would be NaN)
                first = tl.min(tl.where(x == block_max, cols, V), axis=0)
                arg = tl.where(block_max > row_max, first, arg)
                xe_sum = xe_sum * alpha + tl.sum(tl.where(x > -float("inf"), p * x, 0.0), axis=0)
            row_max = new_max
            if SMOOTH:  # Σx only for label smoothing: a reduction per block the plain loss does not need
                if WEIGHTED:
                    w = tl.load(w_ptr + cols, mask=cols < V, other=0.0)
                    x_sum += tl.sum(tl.where(cols < V, x * w, 0.0), axis=0)
                    w_sum += tl.sum(w, axis=0)
                else:
                    x_sum += tl.sum(tl.where(cols < V, x, 0.0), axis=0)
            if HAS_GRAD and not XT_BARRIER:
                # x_t picked out in passing, inside the block's reductions. A separate load of x[t] after pass 1
                # races with pass 2 when the gradient overwrites the logits: another warp may store the gradient
                # over x[t] before this warp's load is served (nothing orders them), and the loss varies from run
                # to run. The extra reduction costs time, hence "barrier", the default (see GRAD_XT).
                x_t += tl.sum(tl.where(cols == t, x, 0.0), axis=0)
        lse = row_max + tl.log(row_sum)
        if HAS_GRAD and not XT_BARRIER:
            x_t = tl.where(valid & in_range, x_t, 0.0)
        else:  # one load; with a gradient, a barrier below orders it before any warp's pass-2 store
            x_t = tl.load(x_row + t, mask=valid & in_range, other=0.0).to(tl.float32)
            if SOFTCAP:
                x_t = softcap * _capped(x_t * inv_cap, FAST_TANH)
        # Without smoothing the Σx term is left out, not multiplied by 0 (0·(-inf) = NaN for a -inf logit)
        # Differences before scaling, as PyTorch's: lse − x_t cancels exactly where it should (one logit: 0)
        if WEIGHTED:
            w_t = tl.load(w_ptr + t, mask=valid & in_range, other=0.0)
            loss = (1.0 - smoothing) * w_t * (lse - x_t) + tl.where(
                smoothing != 0.0, smoothing * (w_sum * lse - x_sum) / V, 0.0)
            p_factor = (1.0 - smoothing) * w_t + smoothing * w_sum / V  # of softmax in the gradient
            if Z_LOSS:
                p_factor += 2.0 * z_scale * lse  # (the z term is not weighted)
        else:
            loss = (1.0 - smoothing) * (lse - x_t) + tl.where(smoothing != 0.0, smoothing * (lse - x_sum / V), 0.0)
        if Z_LOSS:
            z = tl.where(valid, tl.where(in_range, z_scale * lse * lse, float("nan")), 0.0)
            tl.store(z_ptr + row64, z)
            loss += z
        loss = tl.where(valid, tl.where(in_range, loss, float("nan")), 0.0)
        tl.store(loss_ptr + row64, loss)
        if STATS:
            tl.store(pred_ptr + row64, tl.where(valid, arg.to(tl.int64), -1))
            tl.store(ent_ptr + row64, tl.where(valid, lse - xe_sum / row_sum, 0.0))
        if HAS_GRAD:
            if XT_BARRIER:
                # Every warp's x[t] load is performed before the barrier completes (bar.sync orders the CTA's
                # memory accesses), so no pass-2 store can overwrite x[t] under it.
                tl.debug_barrier()
            # Pass 2: the row again (from L2 when few rows are in flight), the gradient out.
            s = tl.load(scale_ptr + row64 * stride_scale).to(tl.float32)
            s = tl.where(valid, tl.where(in_range, s, float("nan")), 0.0)
            g_row = grad_ptr + row64 * stride_grad
            for start in tl.range(0, V, BLOCK_V, num_stages=NUM_STAGES):
                cols = start + tl.arange(0, BLOCK_V)
                x = tl.load(x_row + cols, mask=cols < V, other=0.0,
                            eviction_policy="evict_first" if KEEP_IN_L2 else "").to(tl.float32)
                if SOFTCAP:
                    th = _capped(x * inv_cap, FAST_TANH)
                p = tl.math.exp2(th * cap_log2e - lse * LOG2E if SOFTCAP else (x - lse) * LOG2E)
                if WEIGHTED:
                    w = tl.load(w_ptr + cols, mask=cols < V, other=0.0)
                    g = p * p_factor - smoothing * w / V - tl.where(cols == t, (1.0 - smoothing) * w_t, 0.0)
                else:
                    if Z_LOSS:
                        p = p * (1.0 + 2.0 * z_scale * lse)
                    g = p - smoothing / V - tl.where(cols == t, 1.0 - smoothing, 0.0)
                if SOFTCAP:
                    g = g * (1.0 - th * th)
                tl.store(g_row + cols, (g * s).to(grad_ptr.dtype.element_ty), mask=cols < V,
                         eviction_policy="evict_first" if KEEP_IN_L2 else "")


@triton.jit
def _cross_entropy_bwd_kernel(
    grad_ptr,  # [R, V], scaled in place
    dloss_ptr,  # [R], any stride (0: one factor for all rows)
    V, stride_grad, stride_dloss,
    BLOCK_V: tl.constexpr,
):
    # Reads and writes a row only when its factor is not exactly 1.
    row = tl.program_id(0).to(tl.int64)
    g = tl.load(dloss_ptr + row * stride_dloss).to(tl.float32)
    if g != 1.0:
        g_row = grad_ptr + row * stride_grad
        for start in range(0, V, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            x = tl.load(g_row + cols, mask=cols < V, other=0.0).to(tl.float32)
            tl.store(g_row + cols, (x * g).to(grad_ptr.dtype.element_ty), mask=cols < V)


def _settings(v: int) -> tuple[int, int, int, int]:
    """(BLOCK_V, warps, pipeline stages, programs per SM) for rows of ``v`` logits.

    From 16384 logits a row: 16384-wide blocks, 16 warps, no pipelining of the row loops and 4 programs per SM (of
    which one is resident: ~106 registers × 512 threads), the fastest of ``python -m bench sweep-llm``'s candidates
    (see bench/results/h200/README.md). Below: blocks of up to 8192 (16384 with 2 pipeline stages would ask too
    much shared memory for float32 rows), up to 8 warps, 2 programs per SM.
    """
    if interpreting():  # one big block, few programs
        return min(next_pow2(v), 32768), 4, 1, 1
    if v >= 16384:
        return 16384, 16, 1, 4
    block = min(next_pow2(v), 8192)
    return block, max(4, min(8, block // 1024)), 2, 2


# Logit dtypes whose cap takes the GPU's tanh instruction (_tanh_approx): its error is under their rounding.
FAST_TANH_DTYPES = (torch.bfloat16, torch.float16)

# How the forward with a gradient reads x[target] safely when the gradient overwrites the logits: "barrier" (one
# load, then a CTA barrier before pass 2) or "reduce" (picked out inside pass 1's reductions, a fourth reduction per
# block). Both pass the in-place race test; "barrier" is the faster (see bench/results/h200/README.md).
GRAD_XT = "barrier"

# Eviction hints on the forward with a gradient that keep a row's logits in L2 between its two passes (see the
# kernel), for rows of KEEP_IN_L2_FROM logits or more: measured by ``python -m bench sweep-llm``'s "rows kept in L2"
# candidates (bench/results/h100/README.md), 1.12x at [8192, 128256] and 1.03x at [4096, 262144] on an H100.
KEEP_IN_L2_FROM = 16384


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
    T, V = logits.shape[0], int(logits.shape[1])  # (V specialised where a graph made it symbolic)
    loss = torch.empty(T, dtype=torch.float32, device=logits.device)
    tuned = tuned_settings("cross_entropy", V, logits.device)  # from python -m hkernels.tune, if it ran here
    if tuned:
        block, warps, stages, per_sm = tuned["block"], tuned["num_warps"], tuned["num_stages"], tuned["per_sm"]
    else:
        block, warps, stages, per_sm = _settings(V)
    grid = (persistent_programs(logits.device, T, per_sm),)
    zloss = z_scale != 0.0
    if zloss and z is None:
        z = torch.empty(T, dtype=torch.float32, device=logits.device)
    launch(_cross_entropy_fwd_kernel, grid,
        logits, target, scale, loss, grad if grad is not None else loss, z if z is not None else loss,
        *(stats if stats is not None else (loss, loss)), weight if weight is not None else loss,
        T, V, logits.stride(0), scale.stride(0), grad.stride(0) if grad is not None else 0,
        ignore_index, label_smoothing, softcap, z_scale,
        HAS_GRAD=grad is not None, BLOCK_V=block, NUM_STAGES=stages, XT_BARRIER=GRAD_XT == "barrier",
        SOFTCAP=softcap > 0.0, Z_LOSS=zloss, STATS=stats is not None, WEIGHTED=weight is not None,
        SMOOTH=label_smoothing != 0.0, KEEP_IN_L2=grad is not None and V >= KEEP_IN_L2_FROM,
        FAST_TANH=softcap > 0.0 and logits.dtype in FAST_TANH_DTYPES and not interpreting(),
        num_warps=warps,
    )
    return loss


def cross_entropy_bwd(dloss: Tensor, grad: Tensor) -> Tensor:
    """grad [R, V] *= dloss [R] (any stride, stride 0 for one factor), in place; rows with factor 1 untouched."""
    R, V = grad.shape[0], int(grad.shape[1])
    block = min(next_pow2(V), 32768 if interpreting() else 4096)
    launch(_cross_entropy_bwd_kernel, (R,),
        grad, dloss, V, grad.stride(0), dloss.stride(0), BLOCK_V=block, num_warps=4 if block <= 2048 else 8
    )
    return grad
