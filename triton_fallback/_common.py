"""Launch settings shared by the row-wise kernels (norms, softmax): one helper decides block shapes and warps.

A row of N elements is *resident* when it fits in one block of registers (``BLOCK_N = next_pow2(N)`` up to
``max_resident``): it is read from memory once. Longer rows are *looped* in chunks of ``chunk`` elements and read
twice (the second read often hits L2).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch

from hkernels.runtime.device import cache_dir, cuda_arch, memo, next_pow2, num_sms
from hkernels.runtime.interpret import interpreting

# Elements per row up to which a row stays in registers.
MAX_RESIDENT_FWD = 32768
MAX_RESIDENT_BWD = 8192


@dataclass(frozen=True)
class RowSettings:
    resident: bool
    block_m: int  # rows per block (resident kernels)
    block_n: int  # next_pow2(N) when resident, else the chunk length
    num_warps: int
    num_stages: int = 3  # software pipelining of the row loop in persistent kernels (Triton's default)
    programs_per_sm: int = 2  # persistent kernels: programs per multiprocessor


# Settings the tune command is trying right now, by (op, "fwd"): they win over everything while it measures.
searching: dict[tuple[str, str], Any] = {}


@memo(16)
def _tuned_table(arch: str, op: str) -> dict[str, list[dict]]:
    # Written by python -m hkernels.tune: {"fwd": [{"min_n": n, "max_n": n, "settings": {RowSettings fields}}]}.
    path = cache_dir() / "triton" / arch / f"{op}.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def tuned_settings(op: str, n: int, device: torch.device) -> Any:
    """The tune command's launch settings for ``op``'s Triton forward at rows of ``n`` on ``device``'s arch: what it
    is trying right now while it searches, else the user table's entry (a dict of the op's own settings), else
    None."""
    s = searching.get((op, "fwd"))
    if s is not None:
        return s
    if device.type != "cuda":
        return None
    for bucket in _tuned_table(cuda_arch(device), op).get("fwd", []):
        if bucket["min_n"] <= n <= bucket["max_n"]:
            return bucket["settings"]
    return None


def tuned_row_settings(op: str, n: int, device: torch.device) -> RowSettings | None:
    """The tune command's row settings for ``op``'s forward at rows of ``n`` on ``device``'s arch, if any."""
    found = tuned_settings(op, n, device)
    if found is None or isinstance(found, RowSettings):
        return found
    found = RowSettings(**found)
    # A resident row must fit its block; anything else is a stale or foreign entry: ignored.
    return found if not found.resident or found.block_n == next_pow2(n) else None


def row_settings(
    n: int, m: int, backward: bool = False, op: str | None = None, device: torch.device | None = None
) -> RowSettings:
    """Block shape and warps for M rows of N elements; ``backward`` for kernels that hold two rows (dy and y/x).
    A forward that names its ``op`` and ``device`` takes tuned settings first (see :func:`tuned_row_settings`).
    Remembered per arguments (the host work of a decode-size call is what a caller waits for), except while the
    tune command is searching."""
    m = m if type(m) is int else 0  # (a symbolic row count: the settings never depend on it off the interpreter)
    if searching:
        return _row_settings(n, m, backward, op, device)
    return _row_settings_cached(n, m, backward, op, device)


@memo(4096)
def _row_settings_cached(
    n: int, m: int, backward: bool, op: str | None, device: torch.device | None
) -> RowSettings:
    return _row_settings(n, m, backward, op, device)


def _row_settings(
    n: int, m: int, backward: bool = False, op: str | None = None, device: torch.device | None = None
) -> RowSettings:
    """The settings themselves (see row_settings): about 8192 elements per program for the forward kernels (2 rows
    of 4096 with 8 warps, 1 row of 8192 with 4); long rows go in 8192-element chunks with 16 warps (the norms'
    loops; softmax's split rows take their own, ``triton_fallback/softmax.py``'s SPLIT). The fastest of
    ``python -m bench sweep``'s candidates (see bench/results/h200/README.md). On a GPU they depend on N alone, so
    one compiled kernel serves every row count (a row count symbolic in a compiled graph included); a block of
    rows past M is masked off.
    """
    if op is not None and device is not None and not backward:
        tuned = tuned_row_settings(op, n, device)
        if tuned is not None:
            return tuned
    block_n = next_pow2(n)
    max_resident = MAX_RESIDENT_BWD if backward else MAX_RESIDENT_FWD
    if interpreting():
        # The interpreter runs programs one after another: few, large programs run fastest.
        if block_n <= max_resident:
            block_m = min(next_pow2(m), max(1, 65536 // block_n))
            return RowSettings(True, block_m, block_n, 4)
        return RowSettings(False, 1, 32768, 4)
    if block_n <= max_resident and backward:
        # Softmax backward rows hold dy and y: one row per program, more threads per row (16 warps from 4096).
        block_m = max(1, 2048 // block_n)
        return RowSettings(True, block_m, block_n, 16 if block_n >= 4096 else 8)
    if block_n <= max_resident:
        block_m = max(1, 8192 // block_n)
        warps = 8 if block_m > 1 else max(4, min(16, block_n // 2048))
        return RowSettings(True, block_m, block_n, warps)
    return RowSettings(False, 1, 8192, 16)


def persistent_bwd_settings(n: int, m: int) -> RowSettings:
    """Rows per loop step, warps, pipelining and programs per SM for the persistent norm backward kernels.

    The settings of Helion's twin kernels' sm90 configs, which pipeline the row loop: below N = 8192, 4096
    elements a step (one row at N = 4096), 8 warps, 3 stages, 2 programs per SM; from N = 8192 one row a step (two
    spill registers here on sm90), 16 warps, 3 stages, one program per SM. See bench/results/h200/README.md.
    """
    block_n = next_pow2(n)
    if interpreting():  # the rows a step takes as on the GPU: a step's column sums over many more rows would be one
        # long serial chain in the interpreter (NumPy adds row after row), several times less accurate
        return RowSettings(True, min(next_pow2(m), max(1, 4096 // block_n)), block_n, 4)
    if block_n >= 8192:
        return RowSettings(True, 1, block_n, 16, num_stages=3, programs_per_sm=1)
    return RowSettings(True, max(1, 4096 // block_n), block_n, 8, num_stages=3, programs_per_sm=2)


def persistent_programs(device: torch.device, work_items: int, per_sm: int = 2) -> int:
    """Programs for a persistent grid over ``work_items``: a couple per multiprocessor, never more than items (at
    least one). For a symbolic count of items (a compiled graph's varying length), the full count: a program past
    the work loops zero times (and writes a zero partial), so nothing depends on the length's value."""
    most = num_sms(device) * per_sm
    return max(1, min(work_items, most)) if type(work_items) is int else most


_MANY_ROWS = 1 << 16


def tile_class(m: int, n: int, batch: int, sms: int) -> int:
    """The matmul tile class, shared by both backends (Triton's configs, Helion's config keys): 0 for decode rows
    (M ≤ 16), else the largest of 1: 64×64, 2: 64×128, 3: 128×128, 4: 128×256 tiles that still gives about a full
    wave (≥ 0.9·sms tiles), 1 when none does. A symbolic M (a compiled graph whose length varies) takes the class of
    many rows, with no guard on it; N and the batch are static dims (constants of a graph with every size symbolic)."""
    n, batch = int(n), int(batch)
    if type(m) is not int:
        m = _MANY_ROWS
    if m <= 16:
        return 0
    for cls, (bm, bn) in ((4, (128, 256)), (3, (128, 128)), (2, (64, 128))):
        if batch * -(-m // bm) * -(-n // bn) >= 0.9 * sms:
            return cls
    return 1
