"""Split rows in Helion: the host side of the split-row kernels (softmax over long rows).

The walk (rows cut into chunks of ``block`` elements, each chunk visited twice by a persistent grid of P
co-resident programs, phase 2 ``lag`` steps behind phase 1) and its grid and lag rules are
``triton_fallback/_split.py``'s. The chunk length, the lag and the programs per multiprocessor are host-side
settings kept beside the config in each bucket: ``"chunk"``, ``"lag"``, ``"programs_per_sm"``.

In the kernels the chunks of a row meet through 64-bit slots, as in the twin: phase 1 publishes a chunk's two
float32 statistics in one store of their bits (``Tensor.view`` bitcasts), phase 2 reads the row's slots with
``hl.atomic_add(slots, [...], 0)`` (a read served where the stores land; ``hl.load`` has no volatile form) until
none holds the empty pattern, -1. The slots are allocated, empty, by each kernel's host code, per call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import helion
import torch

from hkernels.ops import _helion
from hkernels.runtime.device import next_pow2
from hkernels.runtime.launch import Bound
from triton_fallback._split import cooperative, split_grid

# What Helion's autotuner must keep (``autotune_config_overrides`` of each split kernel):
# - one program per pid: a persistent pid type runs several pids one after another in one program, which would
#   then wait for a chunk that it has yet to read itself; no register cap in the config (Helion 1.5.0 takes none
#   with a flat pid type: the launcher below caps registers);
# - no software pipelining of the step loop (the kernels issue their early loads themselves).
TUNE_OVERRIDES: dict[str, Any] = {
    "pid_type": "flat", "num_sm_multiplier": 1, "maxnreg": None, "num_stages": 1, "range_num_stages": [0, 0],
}

_CHUNK, _LAG, _PER_SM = 8192, 2, 2  # for a bucket that names none

# The names of the split-row kernels (each kernel module adds its own): what the tune command must not autotune.
KERNELS: set[str] = set()


@dataclass(frozen=True)
class Walk:
    """One launch's settings: chunks of ``block`` elements, ``programs`` programs (at most ``per_sm`` per
    multiprocessor), phase 2 ``lag`` steps behind phase 1."""

    block: int
    programs: int
    lag: int
    per_sm: int


def walk(kernel: helion.Kernel, rows: int, n: int, device: torch.device, dtype: torch.dtype) -> Walk:
    """The walk of ``rows`` rows of ``n`` elements of ``dtype`` by ``kernel``, from its bucket; the chunk is never
    longer than the row's next power of two."""
    bucket = _helion._bucket(_helion.arch_of(device), kernel.name, n, dtype)
    block = min(next_pow2(n), int(bucket.get("chunk", _CHUNK)))
    per_sm, lag = int(bucket.get("programs_per_sm", _PER_SM)), int(bucket.get("lag", _LAG))
    grid = split_grid(device, rows, n, block, per_sm, lag)
    return Walk(block, grid.programs, grid.lag, per_sm)


def bound_launcher(per_sm: int) -> Any:
    """Helion's ``_launcher`` for a split kernel of one bound call signature (a binder's), at most ``per_sm``
    programs per multiprocessor: each Triton kernel is launched as a :class:`~hkernels.runtime.launch.Bound`
    (straight to the compiled kernel after its first launch) with the split-row launch options on a GPU (a
    cooperative grid, so that a grid that cannot be co-resident fails to launch instead of hanging, and registers
    capped so that ``per_sm`` programs fit; Helion 1.5.0 configs can ask for neither with one program per pid)."""
    bounds: dict[tuple[int, tuple[int, ...]], Bound] = {}  # by id (a JITFunction hashes slowly) and grid

    def launch_bound(triton_kernel: Any, grid: tuple[int, ...], *args: Any, num_warps: int, num_stages: int,
                     **kwargs: Any) -> None:
        key = (id(triton_kernel), tuple(grid))
        found = bounds.get(key)
        if found is None:
            found = bounds[key] = Bound(triton_kernel, tuple(grid), num_warps=num_warps, num_stages=num_stages,
                                        **kwargs, **cooperative(num_warps, per_sm))
        found.go(*args)

    return launch_bound
