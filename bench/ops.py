"""What the benchmark runs: per op, the bytes each mode must move and one callable per backend; shape presets."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import hkernels
from hkernels import reference

Tensor = torch.Tensor

MODES = ("fwd", "bwd", "fwd_bwd")


@dataclass(frozen=True)
class OpBench:
    name: str
    params: tuple[str, ...]  # [N]-shaped parameter tensors
    eager: Callable[..., Tensor]  # plain PyTorch, as a user would write it (also what torch.compile compiles)
    kernel: Callable[..., Tensor]  # hkernels' public op
    ref: Callable[..., Tensor]  # float64 reference
    fwd_passes: int  # full [M, N] tensors the forward must move (read + write)
    bwd_passes: int  # and the backward
    reduces_vocab: bool = False  # also benchmarked over a vocabulary (softmax over logits)


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

OPS: dict[str, OpBench] = {
    "rms_norm": OpBench(
        "rms_norm",
        ("weight",),
        eager=lambda x, w: F.rms_norm(x, (x.shape[-1],), w, 1e-6),
        kernel=lambda x, w: hkernels.rms_norm(x, w, 1e-6),
        ref=lambda x, w: reference.rms_norm(x, w, 1e-6),
        fwd_passes=2,  # read x, write y
        bwd_passes=3,  # read dy and x, write dx
    ),
    "layer_norm": OpBench(
        "layer_norm",
        ("weight", "bias"),
        eager=lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b, 1e-5),
        kernel=lambda x, w, b: hkernels.layer_norm(x, w, b, 1e-5),
        ref=lambda x, w, b: reference.layer_norm(x, w, b, 1e-5),
        fwd_passes=2,
        bwd_passes=3,
    ),
    "softmax": OpBench(
        "softmax",
        (),
        eager=lambda x: torch.softmax(x, -1),
        kernel=lambda x: hkernels.softmax(x, -1),
        ref=lambda x: reference.softmax(x, -1),
        fwd_passes=2,  # read x, write y
        bwd_passes=3,  # read dy and y, write dx
        reduces_vocab=True,
    ),
}

# Models: hidden size and vocabulary. Rows are tokens (batch × sequence).
MODELS = {"llama3-8b": (4096, 128256), "llama3-70b": (8192, 128256), "qwen": (3584, 152064)}  # Qwen2-7B
TOKENS = (1, 256, 4096, 16384)
PRESETS = ("llama3", *MODELS, "decode", "prefill")
QUICK_SHAPES = {"cpu": ((4, 64), (3, 300)), "cuda": ((256, 4096), (4096, 4096))}


def preset_shapes(preset: str, op: OpBench) -> list[tuple[int, int]]:
    """[M, N] shapes of ``preset`` for ``op``: llama3 (8B and 70B), one model, decode (few tokens), prefill (many)."""
    if preset == "llama3":
        return sorted(set(preset_shapes("llama3-8b", op) + preset_shapes("llama3-70b", op)), key=lambda s: (s[1], s[0]))
    if preset in MODELS:
        hidden, vocab = MODELS[preset]
        shapes = [(m, hidden) for m in TOKENS]
        return shapes + ([(1024, vocab), (4096, vocab)] if op.reduces_vocab else [])
    if preset == "decode":
        return [(m, n) for n in (4096, 8192) for m in (1, 8, 64)]
    if preset == "prefill":
        shapes = [(m, n) for n in (4096, 8192) for m in (4096, 16384)]
        return shapes + ([(4096, 128256)] if op.reduces_vocab else [])
    raise ValueError(f"unknown shape preset {preset!r}; presets: {', '.join(PRESETS)}, or sizes like 4096x8192")


def bytes_moved(op: OpBench, mode: str, m: int, n: int, itemsize: int) -> int:
    """The fewest bytes ``mode`` must move: each [M, N] tensor once, plus the [N] parameters (and their grads)."""
    passes = {"fwd": op.fwd_passes, "bwd": op.bwd_passes, "fwd_bwd": op.fwd_passes + op.bwd_passes}[mode]
    params = len(op.params) * n * itemsize * {"fwd": 1, "bwd": 2, "fwd_bwd": 2}[mode]  # read; grads written
    return passes * m * n * itemsize + params


def make_inputs(op: OpBench, m: int, n: int, dtype: torch.dtype, device: torch.device, seed: int = 0):
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn((m, n), generator=g, device=device, dtype=dtype)
    params = [torch.randn(n, generator=g, device=device, dtype=dtype) * 0.5 + 1 for _ in op.params]
    dy = torch.randn((m, n), generator=g, device=device, dtype=dtype)
    return x, params, dy
