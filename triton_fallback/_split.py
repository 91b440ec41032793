"""Split rows: long rows (softmax over a vocabulary of 128k columns) read from memory once.

A row of N elements is cut into C chunks of ``BLOCK`` elements; the work items are the (row, chunk) pairs, and a
persistent grid of P co-resident programs walks them (program p takes items p, p + P, p + 2P, ...). Each item is
visited twice:

- **phase 1** reads its chunk from memory and publishes the chunk's partial statistics (a max and a sum of
  exponentials, a dot product) in 64-bit slots of a small scratch [rows, C, K], each slot two float32 values
  written by one store;
- **phase 2**, ``lag`` steps later, reads the row's C slots until none is empty (the scratch starts with every
  bit set, a pattern no published slot has), combines them, reads its chunk again and writes the output.

A slot is its own flag: a reader that sees it sees both its values, so no fence, barrier or counter orders the
phases, and a program waits only on the load of the slots. Between a chunk's two reads the whole grid reads and
writes about ``lag`` steps of P chunks (a few MB), so the second read comes from L2: each byte of the input crosses
the memory bus once and each byte of the output once, where a program that walks a whole row twice re-reads it
from memory (its rows in flight, P × a row, no longer fit in L2). Each step also starts the next step's phase-1
load before its own work, so a program has a chunk in flight while it works; phase 2's loads issued that early
too would hold a third chunk in registers, slower at the register cap that lets programs share a multiprocessor
(see bench/results/h200/README.md).

Every program of the grid must be resident at once (a waiting program holds its SM until the row's other chunks
are published): the kernel's registers are capped so that ``per_sm`` programs fit a multiprocessor, and the grid is
launched cooperatively, so a grid that still cannot be co-resident fails to launch instead of hanging. A program's
own later items never block it: ``lag`` is at least ⌈(C − 1) / P⌉. In Triton's interpreter programs run one after
another, so there the grid is one program with a lag of C.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from hkernels.runtime.device import cdiv, num_sms
from hkernels.runtime.interpret import interpreting

EMPTY = -1  # an unpublished slot: every bit set (its high half is a NaN that publish never writes)


@triton.jit
def publish(slot_ptr, a, b):
    """Writes the float32 pair (a, b) to one 64-bit slot in one store; a NaN ``a`` is written as the canonical NaN,
    so a published slot never reads as empty."""
    a = tl.where(a != a, float("nan"), a)
    bits = (a.to(tl.uint32, bitcast=True).to(tl.uint64) << 32) | b.to(tl.uint32, bitcast=True).to(tl.uint64)
    tl.store(slot_ptr, bits.to(tl.int64, bitcast=True))


@triton.jit
def place(item, C, BLOCK: tl.constexpr):
    """Work item -> (its row as int64, its chunk, the chunk's columns)."""
    row = item // C
    chunk = item - row * C
    return row.to(tl.int64), chunk, chunk * BLOCK + tl.arange(0, BLOCK)


@triton.jit
def collect(slot_ptr, C, K: tl.constexpr, BLOCK_C: tl.constexpr):
    """The pairs (a, b) of a row's C slots, ``K`` apart, read until none is empty."""
    k = tl.arange(0, BLOCK_C)
    bits = tl.load(slot_ptr + k * K, mask=k < C, other=0, volatile=True)
    while tl.sum((bits == -1).to(tl.int32), axis=0) > 0:  # -1: EMPTY
        bits = tl.load(slot_ptr + k * K, mask=k < C, other=0, volatile=True)
    bits = bits.to(tl.uint64, bitcast=True)
    a = (bits >> 32).to(tl.uint32).to(tl.float32, bitcast=True)
    b = (bits & 0xFFFFFFFF).to(tl.uint32).to(tl.float32, bitcast=True)
    return a, b


@dataclass(frozen=True)
class SplitGrid:
    """One launch's walk: ``programs`` co-resident programs, ``chunks`` per row, phase 2 ``lag`` steps behind."""

    programs: int
    chunks: int
    lag: int


def split_grid(device: torch.device, rows: int, n: int, block: int, per_sm: int, lag: int) -> SplitGrid:
    """The grid for ``rows`` rows of ``n`` elements in chunks of ``block``: at most ``per_sm`` programs per
    multiprocessor (the caller's kernel must fit that many per SM), never more programs than items."""
    chunks = max(1, cdiv(n, block))
    items = rows * chunks
    if interpreting() or device.type != "cuda":
        return SplitGrid(1, chunks, chunks)
    programs = max(1, min(items, num_sms(device) * per_sm))
    return SplitGrid(programs, chunks, max(lag, cdiv(chunks - 1, programs)))


def scratch(rows: int, grid: SplitGrid, k: int, device: torch.device) -> torch.Tensor:
    """The slots of one launch: [rows, C, k] int64, every one empty."""
    return torch.full((rows, grid.chunks, k), EMPTY, dtype=torch.int64, device=device)


def cooperative(num_warps: int, per_sm: int) -> dict[str, object]:
    """Launch options for a split-row kernel on a GPU: a cooperative launch (see the module docstring), and a
    register cap that lets ``per_sm`` programs of ``num_warps`` warps share a multiprocessor's 64K registers."""
    if interpreting():
        return {}
    regs = min(255, 65536 // (32 * num_warps * per_sm)) // 8 * 8
    return {"launch_cooperative_grid": True, "maxnreg": regs}
