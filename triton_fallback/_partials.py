"""The last step of a parameter gradient in hand-written Triton (the twin of ``hkernels/ops/_partials.py``).

The norms' backward kernels leave dw (and layer_norm's db) as a [P, N] float32 partial, one row per program or row
group; the parameter's gradient is the sum over P, in the parameter's dtype. ``partial.sum(0).to(dtype)`` does it
in two kernels for a 16-bit parameter (a float32 sum, then a cast); here it is one: each program sums a column
block over all P rows in float32, in a fixed order (so the result is bitwise the same run to run), and writes it
once in the parameter's dtype.

Bytes: reads P·N·4, writes N·b (b: the parameter's element size).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from hkernels.runtime.device import cdiv
from hkernels.runtime.launch import Bound

Tensor = torch.Tensor

BLOCK_P = 16  # partial rows summed per step: a [16, 64] float32 block in flight per program
BLOCK_N = 64  # columns per program: 4096 columns give 64 programs, each reading P rows of 256 bytes


@triton.jit
def _sum_partials_kernel(
    part_ptr,  # [P, N] float32, unit column stride
    out_ptr,  # [N], the parameter's dtype
    P, N, stride_part,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # Reads the program's column block of every partial row once (P·BLOCK_N·4 bytes), writes BLOCK_N elements.
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    acc = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
    for start in range(0, P, BLOCK_P):
        rows = start + tl.arange(0, BLOCK_P)
        mask = (rows < P)[:, None] & col_ok[None, :]
        acc += tl.load(part_ptr + rows.to(tl.int64)[:, None] * stride_part + cols[None, :], mask=mask, other=0.0)
    tl.store(out_ptr + cols, tl.sum(acc, axis=0).to(out_ptr.dtype.element_ty), mask=col_ok)


def sum_partials(part: Tensor, param: Tensor) -> Tensor:
    """part: [P, N] float32 (unit column stride), param: the parameter [N] -> the sum of part over P, [N] in
    param's dtype (summed in float32)."""
    return bind_sum_partials(part.shape[0], part.shape[1], param)(part, param)


def bind_sum_partials(P: int, N: int, param: Tensor) -> Callable[[Tensor, Tensor], Tensor]:
    """``sum_partials`` for a contiguous [P, N] float32 partial and a parameter of ``param``'s dtype and device, set
    up once (its callers bind it with their own plan)."""
    dtype, device = param.dtype, param.device
    k = Bound(_sum_partials_kernel, (cdiv(N, BLOCK_N),), BLOCK_P=BLOCK_P, BLOCK_N=BLOCK_N, num_warps=4)

    def run(part: Tensor, param: Tensor) -> Tensor:
        out = torch.empty(N, dtype=dtype, device=device)
        if N:
            k.go(part, out, P, N, part.stride(0))
        return out
    return run
