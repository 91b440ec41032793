"""Cross-entropy over a vocabulary in hand-written Triton (the twin of ``hkernels/ops/cross_entropy.py``).

Math, per row of V logits x with target t and label smoothing ε (rows with t = ignore_index contribute 0):
    lse = log Σ_j exp(x_j),  loss = lse − (1−ε)·x_t − (ε/V)·Σ_j x_j
    ∂loss/∂x_j = softmax(x)_j − (1−ε)·[j = t] − ε/V
A target outside [0, V) that is not ignore_index gives a NaN loss and NaN gradient row: never a silent answer.

The forward, asked for the gradient, writes it in the same call (scaled per row, e.g. by 1/valid rows for a
mean), reading the logits once: a row (256 KB at V = 128256 in bf16) does not fit one multiprocessor, so it is
split into C chunks held in the registers of C programs running at the same time. Each program publishes its
chunk's (max, Σ exp, Σ x, x_target), counts itself in for the row with an atomic add, waits until all C have,
combines the C partials into the row's log-sum-exp and writes its chunk's gradient from registers. Waiting is
safe because the grid is persistent and no larger than the programs that fit on the GPU at once (computed from the
compiled kernel's registers and warps), and every program takes its (row, chunk) items in increasing order: the
lowest unfinished row always has all its programs on the way to it. When that many programs cannot be resident
at once (vocabularies past ~2M), and in the interpreter, which runs programs one after another, the same kernel
runs as two launches instead (partials; then combine and gradient), reading the logits twice. Without a gradient,
one program per row reads it once with an online (max, sum).

The backward then only scales the stored gradient by the upstream gradient, in place, and skips rows whose
factor is exactly 1 (the usual ``loss.backward()``), so it moves nothing in the common case.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from triton_fallback._common import interpreting, persistent_programs

Tensor = torch.Tensor


@triton.jit
def _cross_entropy_fwd_kernel(
    logits_ptr,  # [T, V], unit column stride
    target_ptr,  # [T] int64
    scale_ptr,  # [T] float32, any stride (0: one factor for all rows): the gradient's factor per row
    loss_ptr,  # [T] float32 out
    grad_ptr,  # [T, V] out (logits' dtype), when HAS_GRAD
    T, V, stride_logits, stride_scale, stride_grad, ignore_index, smoothing,
    HAS_GRAD: tl.constexpr, BLOCK_V: tl.constexpr, NUM_STAGES: tl.constexpr,
):
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
        for start in tl.range(0, V, BLOCK_V, num_stages=NUM_STAGES):
            cols = start + tl.arange(0, BLOCK_V)
            x = tl.load(x_row + cols, mask=cols < V, other=-float("inf")).to(tl.float32)
            new_max = tl.maximum(row_max, tl.max(x, axis=0))
            # While every value seen is -inf, shift by 0 so that no inf − inf = NaN enters the sum.
            shift = tl.where(new_max == -float("inf"), 0.0, new_max)
            row_sum = row_sum * tl.exp(row_max - shift) + tl.sum(tl.exp(x - shift), axis=0)
            row_max = new_max
            x_sum += tl.sum(tl.where(cols < V, x, 0.0), axis=0)
        lse = row_max + tl.log(row_sum)
        x_t = tl.load(x_row + t, mask=valid & in_range, other=0.0).to(tl.float32)
        loss = lse - (1.0 - smoothing) * x_t - smoothing / V * x_sum
        loss = tl.where(valid, tl.where(in_range, loss, float("nan")), 0.0)
        tl.store(loss_ptr + row64, loss)
        if HAS_GRAD:
            # Pass 2: the row again (from L2 when few rows are in flight), the gradient out.
            s = tl.load(scale_ptr + row64 * stride_scale).to(tl.float32)
            s = tl.where(valid, tl.where(in_range, s, float("nan")), 0.0)
            g_row = grad_ptr + row64 * stride_grad
            for start in tl.range(0, V, BLOCK_V, num_stages=NUM_STAGES):
                cols = start + tl.arange(0, BLOCK_V)
                x = tl.load(x_row + cols, mask=cols < V, other=0.0).to(tl.float32)
                g = tl.exp(x - lse) - smoothing / V - tl.where(cols == t, 1.0 - smoothing, 0.0)
                tl.store(g_row + cols, (g * s).to(grad_ptr.dtype.element_ty), mask=cols < V)


@triton.jit
def _cross_entropy_split_kernel(
    logits_ptr,  # [T, V], unit column stride
    target_ptr,  # [T] int64
    scale_ptr,  # [T] float32, any stride: the gradient's factor per row
    loss_ptr,  # [T] float32 out
    grad_ptr,  # [T, V] out (may be logits_ptr: each program reads its chunk before writing it)
    part_ptr,  # [T, C, 4] float32: per chunk (max, Σ exp(x − max), Σ x, x_target or 0)
    count_ptr,  # [T] int32, zero: programs of the row that have published their partials (PHASE 0)
    T, V, C, stride_logits, stride_scale, stride_grad, ignore_index, smoothing,
    BLOCK_V: tl.constexpr, C_POW2: tl.constexpr,
    PHASE: tl.constexpr,  # 0: one launch, programs of a row wait for each other; 1: partials only; 2: the rest
):
    for item in tl.range(tl.program_id(0), T * C, tl.num_programs(0)):
        row = item // C
        chunk = item - row * C
        row64 = tl.cast(row, tl.int64)
        t = tl.load(target_ptr + row64)
        valid = t != ignore_index
        in_range = (t >= 0) & (t < V)
        cols = chunk * BLOCK_V + tl.arange(0, BLOCK_V)
        mask = cols < V
        x = tl.load(logits_ptr + row64 * stride_logits + cols, mask=mask, other=-float("inf")).to(tl.float32)
        m = tl.max(x, axis=0)
        shift = tl.where(m == -float("inf"), 0.0, m)  # an all -inf chunk: Σ exp = 0, no inf − inf
        p = tl.exp(x - shift)  # kept (in registers) for the gradient
        part = part_ptr + (row64 * C + chunk) * 4
        if PHASE != 2:
            tl.store(part, m)
            tl.store(part + 1, tl.sum(p, axis=0))
            tl.store(part + 2, tl.sum(tl.where(mask, x, 0.0), axis=0))
            tl.store(part + 3, tl.sum(tl.where(cols == t, x, 0.0), axis=0))
        if PHASE == 0:
            # Count in (release: the partials above are visible first), then wait for the row's other chunks.
            arrived = tl.atomic_add(count_ptr + row64, 1, sem="acq_rel") + 1
            while arrived < C:
                arrived = tl.atomic_add(count_ptr + row64, 0, sem="acquire")
        if PHASE != 1:
            k = tl.arange(0, C_POW2)
            parts = part_ptr + (row64 * C + k) * 4
            ms = tl.load(parts, mask=k < C, other=-float("inf"), volatile=True)
            ss = tl.load(parts + 1, mask=k < C, other=0.0, volatile=True)
            row_max = tl.max(ms, axis=0)
            row_shift = tl.where(row_max == -float("inf"), 0.0, row_max)
            lse = row_shift + tl.log(tl.sum(ss * tl.exp(ms - row_shift), axis=0))
            sc = tl.load(scale_ptr + row64 * stride_scale).to(tl.float32)
            sc = tl.where(valid, tl.where(in_range, sc, float("nan")), 0.0)
            # exp(m − lse), not exp(shift − lse): an all −inf chunk gives 0, not 0·inf, when lse < −88
            g = p * tl.exp(m - lse) - smoothing / V - tl.where(cols == t, 1.0 - smoothing, 0.0)
            tl.store(grad_ptr + row64 * stride_grad + cols, (g * sc).to(grad_ptr.dtype.element_ty), mask=mask)
            if chunk == 0:
                x_sum = tl.sum(tl.load(parts + 2, mask=k < C, other=0.0, volatile=True), axis=0)
                x_t = tl.sum(tl.load(parts + 3, mask=k < C, other=0.0, volatile=True), axis=0)
                loss = lse - (1.0 - smoothing) * x_t - smoothing / V * x_sum
                tl.store(loss_ptr + row64, tl.where(valid, tl.where(in_range, loss, float("nan")), 0.0))


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


def _row_settings(v: int) -> tuple[int, int]:
    """(BLOCK_V, warps) of the forward without a gradient: one program per row, an online (max, sum) in one read."""
    if interpreting():
        return min(triton.next_power_of_2(v), 32768), 4
    block = min(triton.next_power_of_2(v), 8192)
    return block, max(4, min(8, block // 1024))


def _split_settings(v: int) -> tuple[int, int, int]:
    """(BLOCK_V, warps, register cap) of the split-row kernel: each program holds BLOCK_V logits in registers.

    8192 × 8 warps: 32 float32 values a thread; ptxas gives it 124-128 registers on sm_90, none spilled, so the
    cap of 128 costs nothing and makes two programs per multiprocessor fit for certain (one loads while the
    other waits for the rest of its row). To be confirmed by python -m bench.sweep_llm.
    """
    if interpreting():  # the interpreter's tests cover one chunk per row and many (V > 4096)
        return min(triton.next_power_of_2(v), 4096), 4, 128
    block = min(triton.next_power_of_2(v), 8192)
    return block, max(4, min(8, block // 1024)), 128


def _resident_programs(warps: int, max_regs: int, device: torch.device) -> int:
    """Programs of ``warps`` warps and at most ``max_regs`` registers a thread that fit on the GPU at once (each
    program of the split kernel waits for others of its row: they must all be running). The register cap is a
    launch option (``maxnreg``), so this holds whatever registers the compiler ends up using; the kernel's shared
    memory (a few KB of reduction scratch) never limits these counts."""
    props = torch.cuda.get_device_properties(device)
    regs_per_warp = -(-max_regs * 32 // 256) * 256  # allocated per warp in units of 256
    by_regs = getattr(props, "regs_per_multiprocessor", 65536) // (regs_per_warp * warps)
    by_threads = getattr(props, "max_threads_per_multi_processor", 2048) // (32 * warps)
    return max(0, min(by_regs, by_threads, 32)) * props.multi_processor_count


def cross_entropy_fwd(
    logits: Tensor, target: Tensor, scale: Tensor, ignore_index: int, label_smoothing: float, grad: Tensor | None
) -> Tensor:
    """logits [T, V] (unit column stride), target [T] int64, scale [T] float32 (any stride: the gradient's factor
    per row) -> loss [T] float32 per row. When ``grad`` [T, V] (unit column stride) is given, the gradient times
    scale is written there; it may be ``logits`` itself (each element is read before it is overwritten)."""
    T, V = logits.shape
    loss = torch.empty(T, dtype=torch.float32, device=logits.device)
    if grad is None:
        block, warps = _row_settings(V)
        _cross_entropy_fwd_kernel[(persistent_programs(logits.device, T, 2),)](
            logits, target, scale, loss, loss,
            T, V, logits.stride(0), scale.stride(0), 0, ignore_index, label_smoothing,
            HAS_GRAD=False, BLOCK_V=block, NUM_STAGES=1, num_warps=warps,
        )
        return loss
    if T == 0:
        return loss
    block, warps, max_regs = _split_settings(V)
    chunks = triton.cdiv(V, block)
    c_pow2 = triton.next_power_of_2(chunks)
    parts = torch.empty(T, chunks, 4, dtype=torch.float32, device=logits.device)
    args = (logits, target, scale, loss, grad, parts)
    sizes = (T, V, chunks, logits.stride(0), scale.stride(0), grad.stride(0), ignore_index, label_smoothing)
    meta = dict(BLOCK_V=block, C_POW2=c_pow2, num_warps=warps)
    if not interpreting():
        meta["maxnreg"] = max_regs
        resident = _resident_programs(warps, max_regs, logits.device)
        if chunks <= resident:
            count = torch.zeros(T, dtype=torch.int32, device=logits.device)
            grid = (min(T * chunks, resident),)
            _cross_entropy_split_kernel[grid](*args, count, *sizes, PHASE=0, **meta)
            return loss
    # Two launches, no waiting: the interpreter (programs run one after another), or too many chunks per row.
    grid = (min(T * chunks, 65536),)
    for phase in (1, 2):
        _cross_entropy_split_kernel[grid](*args, loss, *sizes, PHASE=phase, **meta)
    return loss


def cross_entropy_bwd(dloss: Tensor, grad: Tensor) -> Tensor:
    """grad [R, V] *= dloss [R] (any stride, stride 0 for one factor), in place; rows with factor 1 untouched."""
    R, V = grad.shape
    block = min(triton.next_power_of_2(V), 32768 if interpreting() else 4096)
    _cross_entropy_bwd_kernel[(R,)](
        grad, dloss, V, grad.stride(0), dloss.stride(0), BLOCK_V=block, num_warps=4 if block <= 2048 else 8
    )
    return grad
