"""Step 2 of the tune command: search the Triton launch settings of the ops that have a search space.

The row-wise forwards (rms_norm, add_rms_norm, layer_norm, softmax: rows per program, block, warps, resident rows
or chunks of long ones), rope (tile size, warps) and cross_entropy (block, warps, stages, programs per SM). Each
candidate is forced through ``triton_fallback._common.searching`` and timed; the fastest over every shape of the
run that shares its bucket is written.
"""

from __future__ import annotations

import dataclasses
import datetime
import itertools
import json
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

import hkernels
from hkernels import configs
from hkernels.tune import say, tables, timing
from hkernels.tune.cases import Case

ROW_OPS = ("rms_norm", "add_rms_norm", "layer_norm", "softmax")  # the row-wise Triton forwards (row settings)


def _row_candidates(n: int) -> Iterator[Any]:
    import triton

    from triton_fallback._common import MAX_RESIDENT_FWD, RowSettings

    block_n = triton.next_power_of_2(n)
    if block_n <= MAX_RESIDENT_FWD:
        for block_m, warps in itertools.product((1, 2, 4, 8), (4, 8, 16)):
            if block_m * block_n <= 32768:
                yield RowSettings(True, block_m, block_n, warps)
    for chunk, warps in itertools.product((4096, 8192, 16384), (8, 16)):
        if chunk < block_n:
            yield RowSettings(False, 1, chunk, warps)


def _rope_candidates(n: int) -> Iterator[dict[str, int]]:
    for elements, warps in itertools.product((1024, 2048, 4096, 8192, 16384), (2, 4, 8)):
        yield {"tile_elements": elements, "num_warps": warps}


def _ce_candidates(n: int) -> Iterator[dict[str, int]]:
    import triton

    widest = max(1024, triton.next_power_of_2(n))  # no block wider than the row needs
    for (block, warps), stages, per_sm in itertools.product(
        ((1024, 4), (2048, 4), (4096, 8), (8192, 16), (16384, 16), (16384, 32)), (1, 2), (1, 2, 4)
    ):
        if block <= widest:
            yield {"block": block, "num_warps": warps, "num_stages": stages, "per_sm": per_sm}


def _describe(cand: Any) -> str:
    if isinstance(cand, dict):
        return ", ".join(f"{k} {v}" for k, v in cand.items())
    return (f"block {cand.block_m}x{cand.block_n}, {cand.num_warps} warps, "
            f"{'resident' if cand.resident else 'chunks of long rows'}")


def tune_triton(case: Case, arch: str, out: Path, device: torch.device) -> list[str]:
    """Search the Triton forward's launch settings where the op has a search space; write the fastest. Returns
    summary lines. Row-wise ops and rope time the forward (rope's backward is the same kernel); cross_entropy
    times forward+backward (its forward writes the gradient)."""
    from triton_fallback import _common

    spaces: dict[str, tuple[Callable[[int], Iterator[Any]], Callable[[], object]]] = {
        **{op: (_row_candidates, case.forward) for op in ROW_OPS},
        "rope": (_rope_candidates, case.forward),
        "cross_entropy": (_ce_candidates, case.forward_backward),
    }
    if case.op not in spaces:
        say(f"  triton: no launch-setting search for {case.op} yet (its settings are the shipped heuristics)")
        return [f"triton {case.op}: not searched"]
    space, step = spaces[case.op]
    _, n = case.rows_n()
    timed = []
    candidates = list(space(n))
    with hkernels.use_backend("triton"):
        default_ms = timing.gpu_time_ms(step, device)
        for i, cand in enumerate(candidates, 1):
            _common.searching[(case.op, "fwd")] = cand
            try:
                ms = timing.gpu_time_ms(step, device)
            except Exception as e:  # a candidate that does not compile or run (shared memory, registers): skip it
                say(f"  triton {i}/{len(candidates)}: {_describe(cand)} failed ({type(e).__name__})")
                continue
            finally:
                _common.searching.pop((case.op, "fwd"), None)
            timed.append((ms, cand))
            say(f"  triton {i}/{len(candidates)}: {_describe(cand)}: {ms:.4f} ms")
    if not timed:
        return [f"triton {case.op}: {'every candidate failed' if candidates else 'no candidates for this shape'}"]
    # Several shapes of this run can share the bucket (one row length n; rope's n is the head dim): the winner is
    # the candidate with the best geometric mean of its time over the shipped settings' across all of them.
    seen = _triton_seen.setdefault((case.op, n), {})
    for ms, cand in timed:
        settings = cand if isinstance(cand, dict) else dataclasses.asdict(cand)
        seen.setdefault(json.dumps(settings, sort_keys=True), {})[case.name] = ms / default_ms
    shapes = set().union(*(set(r) for r in seen.values()))
    complete = {c: r for c, r in seen.items() if set(r) == shapes}
    if not complete:
        return [f"triton {case.op} n={n}: no candidate ran at every shape of its bucket; nothing written"]
    best_json, ratios = min(complete.items(), key=lambda kv: math.prod(kv[1].values()))
    geomean = math.prod(ratios.values()) ** (1 / len(ratios))
    settings = json.loads(best_json)
    path = out / "triton" / arch / f"{case.op}.json"
    table = tables.read(path)
    kept = [b for b in table.get("fwd", []) if not (b["min_n"] <= n <= b["max_n"])]
    table["fwd"] = [{"min_n": n, "max_n": n, "settings": settings,
                     "tuned": f"{', '.join(sorted(shapes))}: {geomean:.3f}x the shipped settings' GPU time "
                              f"(geometric mean), {datetime.date.today()}"}, *kept]
    tables.write(path, table)
    configs.reload()
    return [f"triton {case.op} n={n}: {_describe(settings)}, {geomean:.3f}x shipped over {len(shapes)} shape(s) "
            f"(this shape: best alone {min(timed, key=lambda t: t[0])[0]:.4f} ms, shipped {default_ms:.4f} ms)"]


# (op, n) -> candidate (as JSON) -> shape name -> its time over the shipped settings', for this run
_triton_seen: dict[tuple[str, int], dict[str, dict[str, float]]] = {}


def new_run() -> None:
    """Forget the shapes timed so far: a bucket is shared by the shapes of one run, not of earlier runs."""
    _triton_seen.clear()
