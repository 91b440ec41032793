"""What the benchmark runs: per op, the shapes, the bytes each mode must move, and one callable per backend."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import hkernels
from hkernels import reference

Tensor = torch.Tensor

LLAMA_HIDDEN = (4096, 8192)  # Llama-3 8B, 70B
LLAMA_VOCAB = 128256
ROWS = (1, 256, 4096, 16384)  # tokens: decode .. long prefill


@dataclass(frozen=True)
class OpBench:
    name: str
    params: tuple[str, ...]  # [N]-shaped parameter tensors
    eager: Callable[..., Tensor]  # plain PyTorch, as a user would write it (also what torch.compile compiles)
    kernel: Callable[..., Tensor]  # hkernels' public op
    ref: Callable[..., Tensor]  # float64 reference
    fwd_passes: int  # full [M, N] tensors the forward must move (read + write)
    bwd_passes: int  # and the backward
    shapes: tuple[tuple[int, int], ...]


def _liger() -> dict[str, Callable[..., Tensor]]:
    """Liger-Kernel's ops, when it is importable: a peer to measure against, never a dependency."""
    try:
        from liger_kernel.ops.layer_norm import LigerLayerNormFunction
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
        from liger_kernel.ops.softmax import LigerSoftmaxFunction
    except Exception:
        return {}
    return {
        "rms_norm": lambda x, w: LigerRMSNormFunction.apply(x, w, 1e-6),
        "layer_norm": lambda x, w, b: LigerLayerNormFunction.apply(x, w, b, 1e-5),
        "softmax": lambda x: LigerSoftmaxFunction.apply(x),
    }


LIGER = _liger()

_NORM_SHAPES = tuple((m, n) for n in LLAMA_HIDDEN for m in ROWS)

OPS: dict[str, OpBench] = {
    "rms_norm": OpBench(
        "rms_norm",
        ("weight",),
        eager=lambda x, w: F.rms_norm(x, (x.shape[-1],), w, 1e-6),
        kernel=lambda x, w: hkernels.rms_norm(x, w, 1e-6),
        ref=lambda x, w: reference.rms_norm(x, w, 1e-6),
        fwd_passes=2,  # read x, write y
        bwd_passes=3,  # read dy and x, write dx
        shapes=_NORM_SHAPES,
    ),
    "layer_norm": OpBench(
        "layer_norm",
        ("weight", "bias"),
        eager=lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b, 1e-5),
        kernel=lambda x, w, b: hkernels.layer_norm(x, w, b, 1e-5),
        ref=lambda x, w, b: reference.layer_norm(x, w, b, 1e-5),
        fwd_passes=2,
        bwd_passes=3,
        shapes=_NORM_SHAPES,
    ),
    "softmax": OpBench(
        "softmax",
        (),
        eager=lambda x: torch.softmax(x, -1),
        kernel=lambda x: hkernels.softmax(x, -1),
        ref=lambda x: reference.softmax(x, -1),
        fwd_passes=2,  # read x, write y
        bwd_passes=3,  # read dy and y, write dx
        shapes=(*_NORM_SHAPES, (1024, LLAMA_VOCAB), (4096, LLAMA_VOCAB)),
    ),
}

QUICK_SHAPES = ((4, 64), (3, 300))  # the smoke pass (CPU, interpret mode)


def bytes_moved(op: OpBench, mode: str, m: int, n: int, itemsize: int) -> int:
    """The fewest bytes ``mode`` must move: each [M, N] tensor once, plus the [N] parameters."""
    passes = op.fwd_passes + (op.bwd_passes if mode == "fwd_bwd" else 0)
    params = len(op.params) * n * itemsize * (2 if mode == "fwd_bwd" else 1)  # read; and write their grads
    return passes * m * n * itemsize + params


def make_inputs(op: OpBench, m: int, n: int, dtype: torch.dtype, device: torch.device, seed: int = 0):
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn((m, n), generator=g, device=device, dtype=dtype)
    params = [torch.randn(n, generator=g, device=device, dtype=dtype) * 0.5 + 1 for _ in op.params]
    dy = torch.randn((m, n), generator=g, device=device, dtype=dtype)
    return x, params, dy
