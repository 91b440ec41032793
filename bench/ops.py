"""What the benchmark runs: per op, how to make inputs, the bytes (or flops) each mode must move, one callable per
backend, and the shapes of each preset.

Every op is benchmarked at an (M, N) shape: M is tokens; N is the model dimension the op works over (hidden size,
MLP intermediate size or vocabulary; for rope, the hidden size, as heads of 128; for fused_linear_cross_entropy,
the hidden size, with Llama-3's vocabulary of 128256).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import hkernels
from hkernels import reference

Tensor = torch.Tensor

MODES = ("fwd", "bwd", "fwd_bwd")
HEAD_DIM, KV_HEADS = 128, 8  # Llama-3 attention: 128-wide heads, 8 key/value heads (GQA)
FLCE_VOCAB = 128256

Make = Callable[[int, int, torch.dtype, torch.device, torch.Generator], list[Tensor]]


@dataclass(frozen=True)
class OpBench:
    name: str
    make: Make  # inputs at shape (M, N); floating ones in the dtype under test
    diff: tuple[int, ...]  # which inputs get gradients
    eager: Callable[..., object]  # plain PyTorch, as a user would write it (also what torch.compile compiles)
    kernel: Callable[..., object]  # hkernels' public op
    ref: Callable[..., object]  # reference (run on float64 inputs)
    dim: str  # what N is: "hidden", "inter" or "vocab"
    passes: tuple[int, int] | None = None  # [M, N]-sized tensors the forward and the backward must move
    params: int = 0  # [N]-shaped parameters (read by the forward; their gradients written by the backward)
    bytes_fn: Callable[[str, int, int, int], int] | None = None  # instead of passes: (mode, M, N, itemsize) -> bytes
    flops_fn: Callable[[str, int, int], float] | None = None  # compute-bound ops: (mode, M, N) -> flops
    tokens: tuple[int, ...] = (1, 256, 4096, 16384)
    extra: tuple[tuple[int, int], ...] = ()  # more (M, N) in the model presets (e.g. softmax over a vocabulary)
    liger: Callable[..., object] | None = None


def _liger() -> dict[str, Callable[..., object]]:
    """Liger-Kernel's ops, when it is importable: a peer to measure against, never a dependency."""
    try:
        from liger_kernel.ops.cross_entropy import LigerCrossEntropyFunction
        from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction
        from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction
        from liger_kernel.ops.geglu import LigerGELUMulFunction
        from liger_kernel.ops.layer_norm import LigerLayerNormFunction
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
        from liger_kernel.ops.rope import LigerRopeFunction
        from liger_kernel.ops.softmax import LigerSoftmaxFunction
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction
    except Exception:
        return {}
    return {
        "rms_norm": lambda x, w: LigerRMSNormFunction.apply(x, w, 1e-6),
        "layer_norm": lambda x, w, b: LigerLayerNormFunction.apply(x, w, b, 1e-5),
        "softmax": lambda x: LigerSoftmaxFunction.apply(x),
        "swiglu": lambda g, u: LigerSiLUMulFunction.apply(g, u),
        "geglu": lambda g, u: LigerGELUMulFunction.apply(g, u),  # tanh form, as hkernels.geglu's default
        "rope": lambda q, k, c, s: LigerRopeFunction.apply(q, k, c, s),
        "add_rms_norm": lambda x, r, w: LigerFusedAddRMSNormFunction.apply(x, r, w, 1e-6),
        # Liger's cross-entropy writes the gradient over the logits (the caller's tensor): allowed for a peer.
        "cross_entropy": lambda x, t: LigerCrossEntropyFunction.apply(x, t, None, -100)[0],
        "fused_linear_cross_entropy": lambda h, w, t: LigerFusedLinearCrossEntropyFunction.apply(h, w, t)[0],
    }


LIGER = _liger()


def _rows(*params: int) -> Make:
    """x [M, N] and ``params`` more [N]-shaped parameters (weights ~1, biases ~0)."""

    def make(m: int, n: int, dtype: torch.dtype, device: torch.device, g: torch.Generator) -> list[Tensor]:
        x = torch.randn((m, n), generator=g, device=device, dtype=dtype)
        return [x] + [torch.randn(n, generator=g, device=device, dtype=dtype) * 0.5 + 1 - p for p in params]

    return make


def _gated(m: int, n: int, dtype: torch.dtype, device: torch.device, g: torch.Generator) -> list[Tensor]:
    return [torch.randn((m, n), generator=g, device=device, dtype=dtype) for _ in range(2)]


def _add_norm(m: int, n: int, dtype: torch.dtype, device: torch.device, g: torch.Generator) -> list[Tensor]:
    x, r = (torch.randn((m, n), generator=g, device=device, dtype=dtype) for _ in range(2))
    return [x, r, torch.randn(n, generator=g, device=device, dtype=dtype) * 0.5 + 1]


def _rope(m: int, n: int, dtype: torch.dtype, device: torch.device, g: torch.Generator) -> list[Tensor]:
    # one sequence of M tokens; q and k laid out as HF makes them: [B, S, H, D] projections viewed as [B, H, S, D]
    heads = n // HEAD_DIM
    q = torch.randn((1, m, heads, HEAD_DIM), generator=g, device=device, dtype=dtype).transpose(1, 2)
    k = torch.randn((1, m, KV_HEADS, HEAD_DIM), generator=g, device=device, dtype=dtype).transpose(1, 2)
    inv = 1.0 / 500000.0 ** (torch.arange(0, HEAD_DIM, 2, device=device, dtype=torch.float32) / HEAD_DIM)
    angles = torch.outer(torch.arange(m, device=device, dtype=torch.float32), inv)
    angles = torch.cat([angles, angles], dim=-1)[None]  # [1, S, D], HF's layout
    return [q, k, angles.cos().to(dtype), angles.sin().to(dtype)]


def _targets(m: int, v: int, device: torch.device, g: torch.Generator) -> Tensor:
    target = torch.randint(0, v, (m,), generator=g, device=device)
    return torch.where(torch.rand(m, generator=g, device=device) < 0.1, -100, target)  # some padding


def _logits(m: int, n: int, dtype: torch.dtype, device: torch.device, g: torch.Generator) -> list[Tensor]:
    return [torch.randn((m, n), generator=g, device=device, dtype=dtype) * 2, _targets(m, n, device, g)]


def _linear_ce(m: int, n: int, dtype: torch.dtype, device: torch.device, g: torch.Generator) -> list[Tensor]:
    vocab = FLCE_VOCAB if device.type == "cuda" else 512  # interpreted on CPU: the smoke pass only
    hidden = torch.randn((m, n), generator=g, device=device, dtype=dtype)
    weight = torch.randn((vocab, n), generator=g, device=device, dtype=dtype) * n**-0.5
    return [hidden, weight, _targets(m, vocab, device, g)]


def _rope_bytes(mode: str, m: int, n: int, itemsize: int) -> int:
    qk = m * (n + KV_HEADS * HEAD_DIM) * itemsize  # q and k, all heads
    tables = 2 * m * HEAD_DIM * itemsize
    return {"fwd": 2 * qk + tables, "bwd": 2 * qk + tables, "fwd_bwd": 4 * qk + 2 * tables}[mode]


def _ce_bytes(mode: str, m: int, n: int, itemsize: int) -> int:
    # forward alone (no gradient wanted): read the logits; with the gradient: read them, write their gradient
    return {"fwd": 1, "bwd": 1, "fwd_bwd": 2}[mode] * m * n * itemsize


def _flce_flops(mode: str, m: int, n: int) -> float:
    one = 2.0 * m * n * FLCE_VOCAB  # one [M, H] x [H, V] matmul
    return {"fwd": one, "bwd": 2 * one, "fwd_bwd": 3 * one}[mode]


def _eager_rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)

    def rot(x: Tensor) -> Tensor:
        half = x.shape[-1] // 2
        return torch.cat([-x[..., half:], x[..., :half]], dim=-1)

    return q * c + rot(q) * s, k * c + rot(k) * s


def _eager_add_norm(x: Tensor, r: Tensor, w: Tensor) -> tuple[Tensor, Tensor]:
    s = x + r
    return F.rms_norm(s, (s.shape[-1],), w, 1e-6), s


OPS: dict[str, OpBench] = {
    "rms_norm": OpBench(
        "rms_norm", _rows(0), (0, 1),
        eager=lambda x, w: F.rms_norm(x, (x.shape[-1],), w, 1e-6),
        kernel=lambda x, w: hkernels.rms_norm(x, w, 1e-6),
        ref=lambda x, w: reference.rms_norm(x, w, 1e-6),
        dim="hidden", passes=(2, 3), params=1,  # read x, write y; read dy and x, write dx
    ),
    "layer_norm": OpBench(
        "layer_norm", _rows(0, 1), (0, 1, 2),
        eager=lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b, 1e-5),
        kernel=lambda x, w, b: hkernels.layer_norm(x, w, b, 1e-5),
        ref=lambda x, w, b: reference.layer_norm(x, w, b, 1e-5),
        dim="hidden", passes=(2, 3), params=2,
    ),
    "softmax": OpBench(
        "softmax", _rows(), (0,),
        eager=lambda x: torch.softmax(x, -1),
        kernel=lambda x: hkernels.softmax(x, -1),
        ref=lambda x: reference.softmax(x, -1),
        dim="hidden", passes=(2, 3),  # read x, write y; read dy and y, write dx
        extra=((1024, 128256), (4096, 128256)),
    ),
    "add_rms_norm": OpBench(
        "add_rms_norm", _add_norm, (0, 1, 2),
        eager=_eager_add_norm,
        kernel=lambda x, r, w: hkernels.add_rms_norm(x, r, w, 1e-6),
        ref=lambda x, r, w: reference.add_rms_norm(x, r, w, 1e-6),
        dim="hidden", passes=(4, 4), params=1,  # read x, r, write y, s; read dy, ds, s, write the one shared gradient
    ),
    "swiglu": OpBench(
        "swiglu", _gated, (0, 1),
        eager=lambda g, u: F.silu(g) * u,
        kernel=hkernels.swiglu,
        ref=reference.swiglu,
        dim="inter", passes=(3, 5),  # read gate, up, write y; read dy, gate, up, write dgate, dup
    ),
    "geglu": OpBench(
        "geglu", _gated, (0, 1),
        eager=lambda g, u: F.gelu(g, approximate="tanh") * u,
        kernel=lambda g, u: hkernels.geglu(g, u, "tanh"),
        ref=lambda g, u: reference.geglu(g, u, "tanh"),
        dim="inter", passes=(3, 5),
    ),
    "rope": OpBench(
        "rope", _rope, (0, 1),
        eager=_eager_rope,
        kernel=hkernels.rope,
        ref=reference.rope,
        dim="hidden", bytes_fn=_rope_bytes,
    ),
    "cross_entropy": OpBench(
        "cross_entropy", _logits, (0,),
        eager=lambda x, t: F.cross_entropy(x, t),
        kernel=lambda x, t: hkernels.cross_entropy(x, t),
        ref=lambda x, t: reference.cross_entropy(x, t),
        dim="vocab", bytes_fn=_ce_bytes,
        tokens=(256, 4096, 8192), extra=((4096, 262144), (8192, 262144)),
    ),
    "fused_linear_cross_entropy": OpBench(
        "fused_linear_cross_entropy", _linear_ce, (0, 1),
        eager=lambda h, w, t: F.cross_entropy(F.linear(h, w), t),
        kernel=lambda h, w, t: hkernels.fused_linear_cross_entropy(h, w, t),
        ref=lambda h, w, t: reference.fused_linear_cross_entropy(h, w, t),
        dim="hidden", flops_fn=_flce_flops, tokens=(1024, 4096, 8192),
    ),
}
for _name, _fn in LIGER.items():
    OPS[_name] = OpBench(**{**OPS[_name].__dict__, "liger": _fn})

MODELS = {
    "llama3-8b": {"hidden": 4096, "inter": 14336, "vocab": 128256},
    "llama3-70b": {"hidden": 8192, "inter": 28672, "vocab": 128256},
    "qwen": {"hidden": 3584, "inter": 18944, "vocab": 152064},  # Qwen2-7B
}
PRESETS = ("llama3", *MODELS, "decode", "prefill")
QUICK_SHAPES = {"cpu": ((4, 64), (3, 300)), "cuda": ((256, 4096), (4096, 4096))}


def preset_shapes(preset: str, op: OpBench) -> list[tuple[int, int]]:
    """(M, N) shapes of ``preset`` for ``op``: llama3 (8B and 70B), one model, decode (few tokens), prefill (many)."""
    if preset == "llama3":
        both = preset_shapes("llama3-8b", op) + preset_shapes("llama3-70b", op)
        return sorted(set(both), key=lambda s: (s[1], s[0]))
    if preset in MODELS:
        return [(m, MODELS[preset][op.dim]) for m in op.tokens] + list(op.extra)
    if preset in ("decode", "prefill"):
        tokens = (1, 8, 64) if preset == "decode" else (4096, 16384)
        return [(m, MODELS[model][op.dim]) for model in ("llama3-8b", "llama3-70b") for m in tokens]
    raise ValueError(f"unknown shape preset {preset!r}; presets: {', '.join(PRESETS)}, or sizes like 4096x8192")


def quick_shapes(op: OpBench, device: torch.device) -> list[tuple[int, int]]:
    """The smoke pass: two small shapes (rope's N must be a multiple of the head size)."""
    shapes = QUICK_SHAPES[device.type]
    if op.name in ("rope", "fused_linear_cross_entropy"):
        return [(m, max(HEAD_DIM, n // HEAD_DIM * HEAD_DIM)) for m, n in shapes][: 1 if device.type == "cpu" else 2]
    return list(shapes)


def bytes_moved(op: OpBench, mode: str, m: int, n: int, itemsize: int) -> int | None:
    """The fewest bytes ``mode`` must move (None for compute-bound ops): each [M, N] tensor once, plus the [N]
    parameters (read, and their gradients written)."""
    if op.bytes_fn is not None:
        return op.bytes_fn(mode, m, n, itemsize)
    if op.passes is None:
        return None
    fwd, bwd = op.passes
    passes = {"fwd": fwd, "bwd": bwd, "fwd_bwd": fwd + bwd}[mode]
    params = op.params * n * itemsize * {"fwd": 1, "bwd": 2, "fwd_bwd": 2}[mode]
    return passes * m * n * itemsize + params


def flops(op: OpBench, mode: str, m: int, n: int) -> float | None:
    return op.flops_fn(mode, m, n) if op.flops_fn is not None else None


def make_inputs(op: OpBench, m: int, n: int, dtype: torch.dtype, device: torch.device, seed: int = 0) -> list[Tensor]:
    return op.make(m, n, dtype, device, torch.Generator(device=device).manual_seed(seed))
