"""Cross-entropy over a vocabulary in Helion (the twin of ``triton_fallback/cross_entropy.py``).

Math, per row of V logits x with target t and label smoothing ε (rows with t = ignore_index contribute 0):
    lse = log Σ_j exp(x_j),  loss = lse − (1−ε)·x_t − (ε/V)·Σ_j x_j
    ∂loss/∂x_j = softmax(x)_j − (1−ε)·[j = t] − ε/V
A target outside [0, V) that is not ignore_index gives a NaN loss and NaN gradient row: never a silent answer.

The forward, asked for the gradient, writes it in the same call (scaled per row, e.g. by 1/valid rows for a
mean), reading the logits once: a row is split into C chunks of BLOCK, one (row, chunk) work item per program
step. Each program publishes its chunk's (max, Σ exp, Σ x, x_target) in ``parts``, counts itself in for the row
with an atomic add, waits until all C have, combines the C partials into the row's log-sum-exp and writes its
chunk's gradient from the exponentials it still holds in registers (PHASE 0). Waiting is safe because the grid is
persistent and interleaved (``pid_type`` persistent_interleaved: program p takes items p, p + N, p + 2N, ... in
increasing order), its N = SMs × ``num_sm_multiplier`` programs all fit on the GPU at once (the config caps
registers with ``maxnreg``; the host checks the multiplier against that cap), N ≥ C, and items run row-major: the
lowest unpublished item's program can always reach it. Where that cannot hold (C > N, a config that is not persistent
interleaved) and in the interpreter, which runs programs one after another, the same kernel runs as two launches
(PHASE 1: partials; PHASE 2: combine and gradient, recomputing the exponentials), reading the logits twice.
BLOCK is chosen on the host (``parts`` must be sized there) and reaches the kernel as a specialised argument.
Without a gradient, one kernel reads each row once with an online (max, sum).

The backward scales the stored gradient in place and skips rows whose factor is exactly 1. Row counts are
dynamic; V is specialised.
"""

from __future__ import annotations

import helion
import helion.language as hl
import torch
import triton

from hkernels import _interpret
from hkernels.ops import _helion

Tensor = torch.Tensor


@helion.kernel(static_shapes=False)
def _cross_entropy_fwd(logits: Tensor, target: Tensor, ignore_index: int, smoothing: float) -> Tensor:
    # logits [T, V], target [T] int64 -> loss [T] float32; no gradient: each row read once, online (max, sum).
    t_rows, v = logits.size()
    v = hl.specialize(v)
    loss = torch.empty([t_rows], dtype=torch.float32, device=logits.device)
    for tile_t in hl.tile(t_rows):
        tgt = target[tile_t]
        valid = tgt != ignore_index
        in_range = (tgt >= 0) & (tgt < v)
        row_max = hl.full([tile_t], float("-inf"), dtype=torch.float32)
        row_sum = hl.zeros([tile_t], dtype=torch.float32)
        x_sum = hl.zeros([tile_t], dtype=torch.float32)
        x_t = hl.zeros([tile_t], dtype=torch.float32)
        for tile_v in hl.tile(v):
            inside = (tile_v.index < v)[None, :]
            x = torch.where(inside, logits[tile_t, tile_v].to(torch.float32), float("-inf"))
            new_max = torch.maximum(row_max, torch.amax(x, dim=-1))
            # While every value seen is -inf, shift by 0 so that no inf − inf = NaN enters the sum.
            shift = torch.where(new_max == float("-inf"), 0.0, new_max)
            row_sum = row_sum * torch.exp(row_max - shift) + torch.sum(torch.exp(x - shift[:, None]), dim=-1)
            row_max = new_max
            x_sum = x_sum + torch.sum(torch.where(inside, x, 0.0), dim=-1)
            # x_t picked out in passing (a compare per element) rather than by a gathered load
            x_t = x_t + torch.sum(torch.where(tile_v.index[None, :] == tgt[:, None], x, 0.0), dim=-1)
        lse = row_max + torch.log(row_sum)
        row_loss = lse - (1.0 - smoothing) * x_t - smoothing / v * x_sum
        loss[tile_t] = torch.where(valid, torch.where(in_range, row_loss, float("nan")), 0.0)
    return loss


@helion.kernel(static_shapes=False)
def _cross_entropy_split(
    logits: Tensor,
    target: Tensor,
    scale: Tensor,
    loss: Tensor,
    grad: Tensor,
    parts: Tensor,
    count: Tensor,
    ignore_index: int,
    smoothing: float,
    block: int,
    phase: hl.constexpr,
) -> None:
    # logits [T, V], target [T] int64, scale [T] float32 -> loss [T] float32 and grad [T, V] (may be logits).
    # parts [T, C, 4] float32: per chunk (max, Σ exp(x − max), Σ x, x_target or 0); count [T] int32, zero (PHASE 0).
    # phase 0: one launch, the programs of a row wait for each other; 1: partials only; 2: combine and gradient.
    t_rows, v = logits.size()
    v = hl.specialize(v)
    block = hl.specialize(block)
    chunks = hl.specialize(parts.size(1))
    # Chunk before row: the flattened item index is row * C + chunk, so each row's items are consecutive.
    for tile_v, tile_t in hl.tile([v, t_rows], block_size=[block, 1]):
        row = tile_t.begin
        chunk = tile_v.id
        tgt = target[row]
        valid = tgt != ignore_index
        in_range = (tgt >= 0) & (tgt < v)
        inside = tile_v.index < v
        hit = tile_v.index == tgt
        x = torch.where(inside, logits[row, tile_v].to(torch.float32), float("-inf"))
        m = torch.amax(x, dim=0)
        shift = torch.where(m == float("-inf"), 0.0, m)  # an all -inf chunk: Σ exp = 0, no inf − inf
        p = torch.exp(x - shift)  # kept (in registers) for the gradient
        if phase != 2:
            parts[row, chunk, 0] = m
            parts[row, chunk, 1] = torch.sum(p, dim=0)
            parts[row, chunk, 2] = torch.sum(torch.where(inside, x, 0.0), dim=0)
            parts[row, chunk, 3] = torch.sum(torch.where(hit, x, 0.0), dim=0)
        if phase == 0:
            # Count in (release: the partials above are visible first), then wait for the row's other chunks.
            arrived = hl.atomic_add(count, [row], 1, sem="acq_rel") + 1
            while arrived < chunks:
                arrived = hl.atomic_add(count, [row], 0, sem="acquire")
        if phase != 1:
            ms = parts[row, :, 0]
            row_max = torch.amax(ms, dim=0)
            row_shift = torch.where(row_max == float("-inf"), 0.0, row_max)
            lse = row_shift + torch.log(torch.sum(parts[row, :, 1] * torch.exp(ms - row_shift), dim=0))
            s = torch.where(valid, torch.where(in_range, scale[row], float("nan")), 0.0)
            # exp(m − lse), not exp(shift − lse): for an all -inf chunk shift = 0 and exp(−lse) can overflow
            # (lse < −88) into 0 · inf = NaN; exp(−inf − lse) = 0.
            g = p * torch.exp(m - lse) - smoothing / v - torch.where(hit, 1.0 - smoothing, 0.0)
            grad[row, tile_v] = (g * s).to(grad.dtype)
            if chunk == 0:
                x_sum = torch.sum(parts[row, :, 2], dim=0)
                x_t = torch.sum(parts[row, :, 3], dim=0)
                row_loss = lse - (1.0 - smoothing) * x_t - smoothing / v * x_sum
                loss[row] = torch.where(valid, torch.where(in_range, row_loss, float("nan")), 0.0)


@helion.kernel(static_shapes=False)
def _cross_entropy_bwd(grad: Tensor, dloss: Tensor) -> None:
    # grad [R, V] *= dloss [R], in place; a row whose factor is exactly 1 is neither read nor written (masked).
    r, v = grad.size()
    for tile_r, tile_v in hl.tile([r, v]):
        g = dloss[tile_r].to(torch.float32)
        scaled = (g != 1.0)[:, None]
        x = hl.load(grad, [tile_r, tile_v], extra_mask=scaled).to(torch.float32)
        hl.store(grad, [tile_r, tile_v], (x * g[:, None]).to(grad.dtype), extra_mask=scaled)


def _split_block(v: int) -> int:
    """Logits per chunk of the split kernel (held in registers as float32 by one program).

    8192 on a GPU, as the Triton twin (the shipped configs give it 8 warps: 32 values per thread). The interpreter
    caps chunks at 4096 so that its tests cover both one chunk per row and many (V = 262144: 64 chunks).
    """
    return min(triton.next_power_of_2(v), 4096 if _interpret.enabled() else 8192)


def _waiting_programs(config: helion.Config, device: torch.device) -> int:
    """Programs of a one-launch (PHASE 0) grid, or 0 where the config does not make waiting safe.

    Only persistent_interleaved walks each row's items in order across distinct programs (persistent_blocked
    gives a program runs of consecutive items: it could wait for an item it holds itself), and only with items
    row-major (no loop reorder, no L2 grouping). All programs must be resident at once: the config caps
    registers (``maxnreg``), so its ``num_sm_multiplier`` programs per multiprocessor are checked here against
    the register file and thread slots, whatever registers the compiler ends up using.
    """
    c = config.config
    if device.type != "cuda" or torch.version.hip is not None or c.get("pid_type") != "persistent_interleaved":
        return 0
    if c.get("loop_orders", [[0, 1]]) != [[0, 1]] or any(g != 1 for g in c.get("l2_groupings", [1])):
        return 0
    per_sm, warps, regs = int(c.get("num_sm_multiplier", 1)), int(c.get("num_warps", 4)), c.get("maxnreg")
    if regs is None:
        return 0
    props = torch.cuda.get_device_properties(device)
    regs_per_warp = -(-int(regs) * 32 // 256) * 256  # allocated per warp in units of 256
    if per_sm * warps * regs_per_warp > getattr(props, "regs_per_multiprocessor", 65536):
        return 0
    if per_sm * warps * 32 > getattr(props, "max_threads_per_multi_processor", 2048) or per_sm > 32:
        return 0
    return helion.runtime.get_num_sm(device) * per_sm


def cross_entropy_fwd(
    logits: Tensor, target: Tensor, scale: Tensor, ignore_index: int, label_smoothing: float, grad: Tensor | None
) -> Tensor:
    """logits [T, V] (unit column stride), target [T] int64, scale [T] float32 (any stride: the gradient's factor
    per row) -> loss [T] float32 per row. When ``grad`` [T, V] (unit column stride) is given, the gradient times
    scale is written there; it may be ``logits`` itself (each element is read before it is overwritten)."""
    T, V = logits.shape
    if grad is None:
        if T == 1:  # the Helion 1.5.0 size-1 bug (see _helion.pad_single_row): add a second row, ignored
            (logits2,) = _helion.pad_single_row(logits)
            target2 = torch.cat([target, target.new_full((1,), ignore_index)])
            return cross_entropy_fwd(logits2, target2, scale, ignore_index, label_smoothing, None)[:1]
        args = (logits, target, int(ignore_index), float(label_smoothing))
        return _helion.run(_cross_entropy_fwd, args, V, logits.device)
    loss = torch.empty(T, dtype=torch.float32, device=logits.device)
    if T == 0:
        return loss
    block = _split_block(V)
    chunks = triton.cdiv(V, block)
    parts = torch.empty(T, chunks, 4, dtype=torch.float32, device=logits.device)
    head, tail = (logits, target, scale, loss, grad, parts), (int(ignore_index), float(label_smoothing), block)
    config = _helion.config_for(_cross_entropy_split.name, V, logits.device, logits.dtype)
    if chunks <= _waiting_programs(config, logits.device):
        count = torch.zeros(T, dtype=torch.int32, device=logits.device)
        _helion.run(_cross_entropy_split, (*head, count, *tail, 0), V, logits.device)
        return loss
    # Two launches, no waiting: the interpreter (programs run one after another), or too many chunks per row.
    count = torch.empty(1, dtype=torch.int32, device=logits.device)  # not used by these phases
    for phase in (1, 2):
        _helion.run(_cross_entropy_split, (*head, count, *tail, phase), V, logits.device)
    return loss


def cross_entropy_bwd(dloss: Tensor, grad: Tensor) -> Tensor:
    """grad [R, V] *= dloss [R] (any stride, stride 0 for one factor), in place; rows with factor 1 untouched."""
    _helion.run(_cross_entropy_bwd, (grad, dloss), grad.shape[1], grad.device)
    return grad
