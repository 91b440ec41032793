"""hkernels.warmup: pay the first call's cost at start, before the first request or training step.

A first call of an op in a fresh process imports its backend (Helion alone takes seconds), generates and compiles
its kernels and fills the dispatcher's routes; later calls of the same static dims (hidden size, head dim, vocab,
dtype) reuse all of it at any row count. Triton keeps what it compiled on disk (``TRITON_CACHE_DIR``), so a second
process skips the compiling, not the imports and code generation.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping, Sequence

import torch

log = logging.getLogger("hkernels")

ShapeLike = Sequence[int]


def warmup(ops: Iterable[str] | Mapping[str, Iterable[ShapeLike]], shapes: Iterable[ShapeLike] | None = None, *,
           dtype: torch.dtype = torch.bfloat16, device: torch.device | str | None = None,
           backward: bool = True) -> dict[str, float]:
    """Run each op once per shape, forward and (``backward=True``, for ops with gradients) forward+backward, on the
    backend each call would choose; returns seconds per case, ``{"rms_norm 2048x4096 bfloat16": 1.9, ...}``.

    ``ops``: op names (``hkernels.ops()``, and the variants ``python -m hkernels.tune`` knows, e.g.
    ``attention_causal``), each run at every shape of ``shapes``; or a mapping of op name to its own shapes.
    A shape is ``(M, N)`` or ``(M, N, K)`` as ``python -m hkernels.tune --shapes`` reads it: for the row ops M
    tokens and N the dim they work over (hidden size, MLP width, vocabulary); for attention M the sequence
    length, N the query width Hq·D and K the batch; for matmul ``[M, K] @ [K, N]``. One shape per static dims
    is enough for any row count; add a one-token shape (M = 1) where decode-sized calls take their own kernels.
    ``device``: CUDA when there is one. Progress goes to the ``hkernels`` logger (INFO).
    """
    from hkernels.tune.cases import OPS, Case  # (imports hkernels: not at module import)

    if isinstance(ops, Mapping):
        plan = [(op, tuple(s)) for op, op_shapes in ops.items() for s in op_shapes]
    else:
        if shapes is None:
            raise TypeError("hkernels.warmup: give shapes, or ops as a mapping of op name to its shapes")
        shapes = [tuple(s) for s in shapes]
        plan = [(op, s) for op in ops for s in shapes]
    for op, shape in plan:
        if op not in OPS:
            raise ValueError(f"hkernels.warmup: unknown op {op!r}; ops are: {', '.join(sorted(OPS))}")
        if not 2 <= len(shape) <= 3 or any(not isinstance(v, int) or v < 0 for v in shape):
            raise ValueError(f"hkernels.warmup: {op}: a shape is (M, N) or (M, N, K) of ints >= 0, got {shape!r}")
    dev = torch.device(device if device is not None else "cuda" if torch.cuda.is_available() else "cpu")
    times: dict[str, float] = {}
    for i, (op, shape) in enumerate(plan):
        start = time.perf_counter()
        case = Case(op, (*shape, 0)[:3], dtype, dev)
        if any(t.numel() == 0 for t in case.inputs):  # (a kernel is never launched on an empty input)
            raise ValueError(f"hkernels.warmup: {op} at {'x'.join(map(str, shape))} has empty inputs, which warm "
                             "nothing: give every size it takes (attention: (S, Hq·D, batch); matmul: (M, N, K))")
        try:
            case.forward()
            if backward and case.spec.diff:
                case.forward_backward()
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
        except Exception as e:
            raise RuntimeError(f"hkernels.warmup: {op} at {'x'.join(map(str, shape))} failed: {e}") from e
        times[case.name] = time.perf_counter() - start
        log.info("hkernels.warmup %d/%d: %s in %.2f s", i + 1, len(plan), case.name, times[case.name])
    return times
