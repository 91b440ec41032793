"""Matmul with a fused epilogue in Helion (the twin of ``triton_fallback/matmul.py``).

Math, with float32 accumulation whatever the input dtype (float32 inputs use IEEE products, no tf32):
  z = a @ b + bias,   y = act(z),   act in {none, relu, gelu (erf), gelu_tanh, silu}
  relu(z) = max(z, 0);  gelu(z) = z·Φ(z) = ½·z·(1 + erf(z/√2));  gelu_tanh(z) = ½·z·(1 + tanh(√(2/π)·(z + 0.044715·z³)))
  = z·σ(2u) with u = √(2/π)·(z + 0.044715·z³) (no tanh, no overflow);  silu(z) = z·σ(z).
  Φ is evaluated as ½·erfc(−z/√2) from a Chebyshev fit of erfc (relative error < 1.2e-7, see ``ERFC_P``).
The epilogue runs on the float32 accumulator; y (and z, when the backward needs it) is rounded once to a's dtype.
Backward of the activation (``matmul_act_bwd``), element-wise in float32:  dz = dy·act'(z) with
  relu' = [not z ≤ 0];  gelu' = Φ(z) + z·φ(z);  gelu_tanh' = s + z·s·(1 − s)·2√(2/π)·(1 + 3·0.044715·z²), s = σ(2u);
  silu' = s·(1 + z·(1 − s)), s = σ(z).
The matmul parts of the backward (dz @ bᵀ, aᵀ @ dz) are this same forward on transposed views.

Shapes: a [M, K] or [B, M, K]; b [K, N] or [B, K, N] (same B); bias [N] of any float dtype or None; y, z: [.., M, N]
contiguous in a's dtype. a and b may be any strided views; when one of the last two strides is 1 (row-major, or a
transposed view such as ``weight.t()``) they are read in place. Bytes for b-byte elements: reads M·K·b once per
column tile of y and K·N·b once per row tile (L2 serves most repeats: programs run in L2-swizzled groups), writes
M·N·b (twice with z). FLOPs: 2·B·M·N·K.

One kernel serves 2-D and batched inputs: 2-D ones are viewed as a batch of one, a size-1 dim that Helion
specialises away. Each program (or persistent loop step) owns a [BLOCK_M, BLOCK_N] tile of one batch and walks K in
steps of BLOCK_K. The outputs are allocated by the host and passed in, so that Helion knows their layout and can
store them through TMA descriptors (``indexing: tensor_descriptor``); a and b are read through descriptors too
where their strides allow (Helion checks 16-byte alignment and falls back to pointer loads per tensor otherwise).
A transposed view (``weight.t()``) is passed in its storage order with ``a_t`` / ``b_t`` set, and the kernel
transposes its 2-D tiles. Helion switches to 64-bit indices for tensors of more than 2^31
elements; a view spanning more memory than it holds (a slice of a wider tensor) takes the kernel's int64 twin.

Configs (``hkernels/configs/<arch>/matmul.json``): the buckets of ``_matmul_fwd`` are chosen by the key
``bucket_key`` = 10·path + tile_class. tile_class is 0 for decode rows (M ≤ 16), else the largest of 1: 64×64,
2: 64×128, 3: 128×128, 4: 128×256 tiles that still makes about one full wave over the GPU's multiprocessors (a
cue, not a rule: each bucket's config picks its own tiles). path 0 is the fast path (16-bit operands that TMA can
read and write, a light epilogue); path 1 caps the tile at 128×128, for the gelu epilogue that also writes z (at
128×256 it spills 64-184 bytes a thread on sm_90: 255 registers are not enough for the float32 tile, its
activation and two TMA stores) and for operands Helion cannot move through TMA (pointer loads of a 128×256 tile
spill too); path 2 is the int64 twin, whose Helion code loads through pointers (no descriptors with 64-bit
indices) and takes 128×128×32 tiles. The first bucket whose ``max_n`` covers the key wins, as for the other ops.
K does not choose the config. float32 inputs have their own buckets (IEEE float32 products run on FMA units, not
tensor cores: small tiles). The element-wise ``_matmul_act_bwd`` is bucketed by N, as the swiglu kernels.
"""

from __future__ import annotations

from collections.abc import Callable

import helion
import helion.language as hl
import torch

from hkernels.functional.matmul import activate
from hkernels.ops import _helion
from hkernels.ops.swiglu import bind as bind_elementwise
from hkernels.ops.swiglu import int64_twin
from hkernels.runtime.device import num_sms
from hkernels.runtime.interpret import interpreting
from hkernels.runtime.launch import aligned, descriptors_ok
from triton_fallback._common import tile_class

Tensor = torch.Tensor
ACTIVATIONS = (None, "relu", "gelu", "gelu_tanh", "silu")
_INT32_MAX = 2**31 - 1
_TMA_DTYPES = (torch.bfloat16, torch.float16)
# traced at a symbolic length (see triton_fallback/rms_norm.py): configs by the tile class of many rows at a symbolic M
SYMBOLIC = frozenset({"matmul_fwd", "matmul_act_bwd"})
SQRT_HALF = 0.7071067811865475  # 1/√2
INV_SQRT_2PI = 0.3989422804014327  # 1/√(2π)
TWO_SQRT_2_OVER_PI = 1.5957691216057308  # 2·√(2/π): σ's argument is 2u
TWO_SQRT_2_OVER_PI_X3C = 0.21406444881780076  # 2·√(2/π)·3·0.044715, in d(2u)/dz
# Abramowitz & Stegun 7.1.26 (as in geglu.py, for the 16-bit backward): erfc(x) ≈ t·(A1 + t·(A2 + t·(A3 + t·(A4 +
# t·A5))))·e^(−x²), t = 1/(1 + P·x), x ≥ 0, |error| ≤ 1.5e-7.
P, A1, A2, A3, A4, A5 = 0.3275911, 0.254829592, -0.284496736, 1.421413741, -1.453152027, 1.061405429
# Coefficients of P in erfc(x) = t·exp(−x² + P(t)), t = 1/(1 + x/2), x ≥ 0: the Chebyshev fit of Numerical Recipes'
# erfcc, relative error < 1.2e-7 for every x ≥ 0. The gelu epilogue evaluates Φ(z) = ½·erfc(−z/√2) with it
# (1 − ½·erfc(z/√2) for z ≥ 0): straight-line FMAs and one exp, where libdevice's erf made the 128×256 epilogue
# spill registers on sm_90, and without ½·(1 + erf(z/√2))'s cancellation for z < −3.
ERFC_P = (
    -1.26551223, 1.00002368, 0.37409196, 0.09678418, -0.18628806,
    0.27886807, -1.13520398, 1.48851587, -0.82215223, 0.17087277,
)


def _activation(z: Tensor, activation: str | None) -> Tensor:
    # act(z) on a float32 tile; ``activation`` is a compile-time constant, so one branch is traced.
    if activation == "relu":
        return torch.relu(z)
    if activation == "gelu":
        # z·Φ(z) with Φ(z) = ½·erfc(−z/√2), erfc(x) = t·exp(−x² + P(t)), t = 1/(1 + x/2), x = |z|/√2 (see ERFC_P)
        x = torch.abs(z) * SQRT_HALF
        t = 1.0 / (1.0 + 0.5 * x)
        p = ERFC_P[8] + t * ERFC_P[9]
        p = ERFC_P[5] + t * (ERFC_P[6] + t * (ERFC_P[7] + t * p))
        p = ERFC_P[0] + t * (ERFC_P[1] + t * (ERFC_P[2] + t * (ERFC_P[3] + t * (ERFC_P[4] + t * p))))
        half_tail = 0.5 * t * torch.exp(p - x * x)
        return z * torch.where(z >= 0.0, 1.0 - half_tail, half_tail)
    if activation == "gelu_tanh":
        return z * torch.sigmoid(TWO_SQRT_2_OVER_PI * (z + 0.044715 * z * z * z))
    if activation == "silu":
        return z * torch.sigmoid(z)
    return z


@helion.kernel(static_shapes=False, dot_precision="ieee")
def _matmul_fwd(
    a: Tensor,
    b: Tensor,
    bias: Tensor | None,
    y: Tensor,
    z: Tensor | None,
    activation: hl.constexpr,
    upcast: hl.constexpr,
    a_t: hl.constexpr,
    b_t: hl.constexpr,
) -> None:
    # a: [B, M, K] (with a_t: its storage order [B, K, M]), b: [B, K, N] (with b_t: [B, N, K]), bias: [N] or None
    # -> y (and z when given): [B, M, N], written in place. Reads a [BLOCK_M, K] row panel of a and a [K, BLOCK_N]
    # column panel of b per tile, writes the tile of y once. A transposed operand is read in its storage order and
    # its 2-D tile transposed: wgmma reads that transpose from shared memory (a [1, K, N] load permuted as 3-D
    # goes through registers instead).
    # ``upcast`` (interpret mode only) multiplies float32 copies of the tiles: Triton's interpreter cannot multiply
    # bfloat16 tiles (it multiplies their raw bits); the products are the same, bf16 ones being exact in float32.
    if a_t:
        nb, k, m = a.size()
    else:
        nb, m, k = a.size()
    n = b.size(1) if b_t else b.size(2)
    for tile_m, tile_n, tile_b in hl.tile([m, n, nb], block_size=[None, None, 1]):
        acc = hl.zeros([tile_m, tile_n], dtype=torch.float32)
        for tile_k in hl.tile(k):
            lhs = a[tile_b.begin, tile_k, tile_m].T if a_t else a[tile_b.begin, tile_m, tile_k]
            rhs = b[tile_b.begin, tile_n, tile_k].T if b_t else b[tile_b.begin, tile_k, tile_n]
            lhs = lhs.to(torch.float32) if upcast else lhs
            rhs = rhs.to(torch.float32) if upcast else rhs
            acc = hl.dot(lhs, rhs, acc=acc)
        if bias is not None:
            acc = acc + bias[tile_n].to(torch.float32)[None, :]
        # y before z: fewer registers for the gelu epilogue (sm_90, 128×256 tiles: z first spills 1.6 KB a thread,
        # y first 64-184 bytes; that epilogue takes 128×128 tiles, which do not spill)
        y[tile_b.begin, tile_m, tile_n] = _activation(acc, activation).to(y.dtype)
        if z is not None:
            z[tile_b.begin, tile_m, tile_n] = acc.to(z.dtype)


# Backward of the epilogue, per element (the math of each derivative in the module docstring):
#   tanh form: 1 − s is taken as e·s with e = e^(−2u) (no cancellation where s ≈ 1); where e overflows, s = 0 and
#   1 − s = 1, so the product stays 0 instead of inf·0. erf form, 16-bit inputs: Φ from the cheap erfc form of
#   geglu.py (error ≤ 3e-7, far below a 16-bit ulp), which keeps this memory-bound kernel off the issue limit.
@helion.kernel(static_shapes=False)
def _matmul_act_bwd(dy: Tensor, z: Tensor, activation: hl.constexpr, fast_cdf: hl.constexpr) -> Tensor:
    # dy, z: [R, N] -> dz [R, N]; reads a tile of dy and z once, writes the tile of dz.
    r, n = z.size()
    n = hl.specialize(n)
    dz = torch.empty([r, n], dtype=dy.dtype, device=dy.device)
    for tile_r, tile_n in hl.tile([r, n]):
        d = dy[tile_r, tile_n].to(torch.float32)
        x = z[tile_r, tile_n].to(torch.float32)
        if activation == "relu":
            g = torch.where(x <= 0.0, 0.0, d)  # a NaN z passes the gradient, as torch.relu's backward does
        elif activation == "gelu":
            if fast_cdf:
                t = torch.abs(x) * SQRT_HALF
                q = 1.0 / (1.0 + P * t)
                e = torch.exp(-t * t)
                half_tail = 0.5 * q * (A1 + q * (A2 + q * (A3 + q * (A4 + q * A5)))) * e
                cdf = torch.where(x >= 0.0, 1.0 - half_tail, half_tail)
            else:
                cdf = 0.5 * (1.0 + torch.erf(x * SQRT_HALF))
                e = torch.exp(-0.5 * x * x)
            g = d * (cdf + x * INV_SQRT_2PI * e)
        elif activation == "gelu_tanh":
            x2 = x * x
            e = torch.exp(-TWO_SQRT_2_OVER_PI * (x + 0.044715 * x2 * x))
            s = 1.0 / (1.0 + e)
            one_minus_s = torch.where(s == 0.0, 1.0, e * s)
            g = d * (s + x * s * one_minus_s * (TWO_SQRT_2_OVER_PI + TWO_SQRT_2_OVER_PI_X3C * x2))
        else:  # silu
            s = torch.sigmoid(x)
            g = d * s * (1.0 + x * (1.0 - s))
        dz[tile_r, tile_n] = g.to(dz.dtype)
    return dz


_FWD_WIDE = helion.kernel(_matmul_fwd.fn, static_shapes=False, dot_precision="ieee", index_dtype=torch.int64)
_BWD_WIDE = {_matmul_act_bwd.name: int64_twin(_matmul_act_bwd)}


def _tma_ready(t: Tensor) -> bool:
    # What Helion needs to read or write the [B, R, C] view through a TMA descriptor: a 16-bit dtype, a 16-byte
    # aligned base, a unit stride in one of the last two dims and 16-byte multiples for the other strides.
    if t.dtype not in _TMA_DTYPES or not aligned(t) or not descriptors_ok():
        return False
    e = t.element_size()
    unit = 2 if t.stride(2) == 1 or t.shape[2] == 1 else 1 if t.stride(1) == 1 or t.shape[1] == 1 else None
    if unit is None or t.shape[unit] * e < 16:
        return False
    return all(t.shape[d] == 1 or (t.stride(d) > 0 and t.stride(d) * e % 16 == 0) for d in range(3) if d != unit)


def bucket_key(m: int, n: int, batch: int, sms: int, path: int) -> int:
    """The config-bucket key: 10·path + ``tile_class`` (see the module docstring)."""
    return 10 * path + tile_class(m, n, batch, sms)


def _span(t: Tensor) -> int:
    # elements from the first to one past the last that a view can touch
    return 1 + sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride(), strict=True) if size > 0)


def _row_major(t: Tensor) -> bool:
    # a [B, R, C] view whose rows are contiguous (after _readable, the others have contiguous columns: a transpose)
    return t.stride(2) == 1 or t.shape[2] == 1


def _readable(t: Tensor) -> Tensor:
    # The kernel reads any strides, but only a view with a unit stride in one of its last two dims streams rows;
    # anything else (a stepped slice, a broadcast) is copied once.
    if t.stride(-1) == 1 or t.stride(-2) == 1:
        return t
    return t.contiguous()


def _batched(t: Tensor) -> Tensor:
    if t.dim() == 2:
        return t.unsqueeze(0)
    # a batch broadcast by a zero stride would make a TMA descriptor with a zero stride: copied instead
    return t.contiguous() if t.shape[0] > 1 and t.stride(0) == 0 else t


def _check(a: Tensor, b: Tensor, activation: str | None) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"matmul: activation must be one of {ACTIVATIONS}, got {activation!r}")
    if a.dim() != b.dim() or a.dim() not in (2, 3) or a.shape[-1] != b.shape[-2] or a.shape[:-2] != b.shape[:-2]:
        raise ValueError(f"matmul: cannot multiply {tuple(a.shape)} by {tuple(b.shape)}")
    if a.dtype != b.dtype:
        raise ValueError(f"matmul: a and b must share a dtype, got {a.dtype} and {b.dtype}")


def _padded(a3: Tensor, b3: Tensor, bias: Tensor | None, y: Tensor, z: Tensor | None
            ) -> tuple[Tensor, Tensor, Tensor | None, Tensor, Tensor | None]:
    """(a3, b3, bias, y_run, z_run): the operands and outputs the kernel runs on. Helion 1.5.0 specialises a size-1
    dim of an output to a broadcast and then stores every row (column) of a tile to the one address (M = 1 would
    give row 0 the value of a masked-off row). M or N of 1 is padded to 2 with zeros, a copy of K elements per
    batch; the extra row (column) of y is computed and dropped (``_unpad``)."""
    nb, m, k = a3.shape
    n = b3.shape[2]
    pad_m, pad_n = m == 1, n == 1
    if not (pad_m or pad_n):
        return a3, b3, bias, y, z
    if pad_m:
        a3 = torch.cat([a3, a3.new_zeros((nb, 1, k))], dim=1)
    if pad_n:
        b3 = torch.cat([b3, b3.new_zeros((nb, k, 1))], dim=2)
        if bias is not None:
            bias = torch.cat([bias.reshape(1), bias.new_zeros(1)])
    y_run = y.new_empty((nb, m + pad_m, n + pad_n))
    return a3, b3, bias, y_run, None if z is None else torch.empty_like(y_run)


def _unpad(y: Tensor, z: Tensor | None, y_run: Tensor, z_run: Tensor | None) -> None:
    if y_run is not y:
        m, n = y.shape[1:]
        y.copy_(y_run[:, :m, :n])
        if z is not None:
            z.copy_(z_run[:, :m, :n])  # type: ignore[index]


def _launch_args(a3: Tensor, b3: Tensor, bias: Tensor | None, y: Tensor, z: Tensor | None, activation: str | None,
                 m: int, n: int) -> tuple[helion.Kernel, tuple[object, ...], int]:
    """The kernel (32- or 64-bit indices), its arguments and its config key for [B, M, K] @ [B, K, N] into y (and
    z); m, n: the product's size before any padding (they choose the tile class)."""
    tensors = [t for t in (a3, b3, bias, y, z) if t is not None]
    wide = any(_span(t) > _INT32_MAX for t in tensors)
    if wide:
        path = 2
    elif (activation == "gelu" and z is not None) or not all(_tma_ready(t) for t in (a3, b3, y)):
        path = 1
    else:
        path = 0
    upcast = interpreting() and a3.dtype == torch.bfloat16
    key = bucket_key(m, n, a3.shape[0], num_sms(a3.device), path)  # the wave count of the GPU at hand
    a_t, b_t = not _row_major(a3), not _row_major(b3)
    args = (a3.transpose(1, 2) if a_t else a3, b3.transpose(1, 2) if b_t else b3, bias, y, z, activation, upcast,
            a_t, b_t)
    return (_FWD_WIDE if wide else _matmul_fwd), args, key


def matmul_fwd(
    a: Tensor, b: Tensor, bias: Tensor | None, activation: str | None, keep_pre: bool
) -> tuple[Tensor, Tensor | None]:
    """a: [M, K] or [B, M, K], b: [K, N] or [B, K, N], bias: [N] or None -> (y, z or None), [.., M, N] contiguous.

    y = act(a @ b + bias) in a's dtype; z = a @ b + bias in a's dtype when ``keep_pre`` and an activation is given.
    """
    _check(a, b, activation)
    a3, b3 = _batched(_readable(a)), _batched(_readable(b))
    nb, m, k = a3.shape
    n = b3.shape[2]
    y = torch.empty((nb, m, n), dtype=a.dtype, device=a.device)
    z = torch.empty_like(y) if keep_pre and activation is not None else None
    out_shape = (*a.shape[:-1], n)
    if y.numel() == 0:
        return y.view(out_shape), None if z is None else z.view(out_shape)
    if k == 0:  # an empty sum: the epilogue of zeros, on the host
        pre = torch.zeros((nb, m, n), dtype=torch.float32, device=a.device)
        if bias is not None:
            pre = pre + bias.to(torch.float32)
        y.copy_(activate(pre, activation))  # the same epilogue in PyTorch
        if z is not None:
            z.copy_(pre)
        return y.view(out_shape), None if z is None else z.view(out_shape)
    a3, b3, bias, y_run, z_run = _padded(a3, b3, bias, y, z)
    kernel, args, key = _launch_args(a3, b3, bias, y_run, z_run, activation, m, n)
    _helion.run(kernel, args, key, a.device)
    _unpad(y, z, y_run, z_run)
    return y.view(out_shape), None if z is None else z.view(out_shape)


def _bind_fwd(a: Tensor, b: Tensor, bias: Tensor | None, activation: str | None, keep_pre: bool
              ) -> Callable[..., tuple[Tensor, Tensor | None]]:
    """The forward for arguments of this signature (a plan's binding): the kernel, its config and its compiled
    function found once; ``run(a, b, bias, activation, keep_pre)``. Empty products and K = 0 launch no kernel and
    keep the general path."""
    _check(a, b, activation)
    a3, b3 = _batched(_readable(a)), _batched(_readable(b))
    nb, m, k = a3.shape
    n = b3.shape[2]
    if nb * m * n == 0 or k == 0:  # no kernel: nothing to bind
        return matmul_fwd
    keep = keep_pre and activation is not None
    dtype, device, out_shape = a.dtype, a.device, (*a.shape[:-1], n)
    y = torch.empty((nb, m, n), dtype=dtype, device=device)
    a3, b3, bias, y_run, z_run = _padded(a3, b3, bias, y, torch.empty_like(y) if keep else None)
    kernel, args, key = _launch_args(a3, b3, bias, y_run, z_run, activation, m, n)
    fn, launcher = _helion.bind(kernel, args, key, device)
    upcast, a_t, b_t = args[6:]

    def run(a: Tensor, b: Tensor, bias: Tensor | None, activation: str | None, keep_pre: bool
            ) -> tuple[Tensor, Tensor | None]:
        y = torch.empty((nb, m, n), dtype=dtype, device=device)
        z = torch.empty_like(y) if keep else None
        a3, b3, bias, y_run, z_run = _padded(_batched(_readable(a)), _batched(_readable(b)), bias, y, z)
        fn(a3.transpose(1, 2) if a_t else a3, b3.transpose(1, 2) if b_t else b3, bias, y_run, z_run, activation,
           upcast, a_t, b_t, _launcher=launcher)
        _unpad(y, z, y_run, z_run)
        return y.view(out_shape), None if z is None else z.view(out_shape)
    return run


# Binder (see hkernels/runtime/plan.py): the same function for every call of one signature, set up once.
matmul_fwd.bind = _bind_fwd  # type: ignore[attr-defined]


def matmul_act_bwd(dy: Tensor, z: Tensor, activation: str) -> Tensor:
    """dy, z: [.., M, N] -> dz = dy·act'(z) in dy's dtype, [.., M, N] contiguous."""
    if activation not in ACTIVATIONS[1:]:
        raise ValueError(f"matmul_act_bwd: activation must be one of {ACTIVATIONS[1:]}, got {activation!r}")
    n = z.shape[-1]
    dy2 = dy.reshape(-1, n)
    z2 = z.reshape(-1, n)
    if dy2.stride(-1) != 1:
        dy2 = dy2.contiguous()
    if z2.stride(-1) != 1:
        z2 = z2.contiguous()
    if dy2.numel() == 0:
        return torch.empty(z.shape, dtype=dy.dtype, device=dy.device)
    args = (dy2, z2, activation, dy.dtype != torch.float32)
    dz = bind_elementwise(_matmul_act_bwd, _BWD_WIDE, args)(*args)
    return dz.view(z.shape)
