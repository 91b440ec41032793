"""The ``auto`` backend's table: which backend to use per op and shape bucket, from measured points.

A call is judged by its per-call latency (host work: what a caller waits for) where it is host-bound
(:func:`host_bound`), else by GPU time. :func:`buckets` turns measured points into the table's buckets; the tune
command writes exact-in-n buckets to the user cache (:func:`write_auto`), and ``python -m bench auto-table`` builds
the shipped table out of results files with the same rules.
"""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any

import torch

import hkernels
from hkernels.tune import tables, timing
from hkernels.tune.cases import Case

LATENCY_ROWS = 64  # at or below this many rows a call is host-bound: compare per-call latency
# ... and at or below this many elements: rope at 64 tokens is 2048 rows of 128 elements per head, a few µs of GPU
# work, where the host path decides what a caller waits for
LATENCY_ELEMENTS = 64 * 4096
TIE = 0.99  # Triton must be at least 1% faster to displace Helion (the primary path) on a shape
# Ops whose GPU work is not in (rows, n): matmul's N, the linear loss's vocabulary, attention's keys
_WORK_BEYOND_ROWS = ("matmul", "fused_linear_cross_entropy", "attention", "attention_varlen")

Point = tuple[int, int, float, float, str, str]  # rows, n, helion time, triton time, where, unit (and modes)
# (a point may carry a seventh element: the torch backend's time, PyTorch's own call, where it was measured)
TORCH_TIE = 0.98  # the torch backend displaces the faster kernel where it is more than 2% faster than it


def host_bound(rows: int, n: int, op: str = "") -> bool:
    """Whether a call of ``op`` at ``rows`` × ``n`` (as the dispatcher buckets it) is judged by its per-call latency
    (host work) rather than GPU time."""
    return rows <= LATENCY_ROWS or (op not in _WORK_BEYOND_ROWS and rows * n <= LATENCY_ELEMENTS)


def buckets(points: list[Point], exact_n: bool) -> list[dict[str, Any]]:
    """An op's auto buckets from measured points, by ascending n, then rows; each point's bucket covers the rows
    above the previous point's (the last open-ended), and the faster backend wins it (Triton must win by TIE to
    displace Helion, the primary path; the torch backend, where measured, by TORCH_TIE over the faster kernel).
    The n bounds: up to each n, the last open-ended (``exact_n=False``, the shipped table: every row length gets a
    choice); or exactly each n (the tune command's: tried before the shipped buckets, which still decide the row
    lengths that were not tuned)."""
    ns = sorted({p[1] for p in points})
    out = []
    for j, n in enumerate(ns):
        here = sorted(p for p in points if p[1] == n)
        for i, (rows, _, helion, triton, where, unit, *torch_) in enumerate(here):
            bounds = {"min_n": n, "max_n": n} if exact_n else {"max_n": n if j + 1 < len(ns) else None}
            backend = "triton" if triton < TIE * helion else "helion"
            measured = f"{where}: helion {helion:.4g}, triton {triton:.4g}"
            if torch_ and torch_[0] is not None:
                measured += f", torch {torch_[0]:.4g}"
                if torch_[0] < TORCH_TIE * min(helion, triton):
                    backend = "torch"
            out.append({"max_rows": rows if i + 1 < len(here) else None, **bounds, "backend": backend,
                        "measured": f"{measured} {unit}"})
    return out


def measure_backends(case: Case, device: torch.device) -> dict[str, float]:
    """Forward + forward-and-backward time of each backend (helion, triton, and torch: PyTorch's own call) with the
    tables as they are now: GPU time (ms), or at decode-size rows the per-call latency (µs) of calls back to back,
    which is what a caller waits for. The torch backend is left out where it cannot run the case (its reference
    math out of memory at long sequences)."""
    rows, n = case.rows_n()
    if host_bound(rows, n, case.op):
        timer = lambda fn: timing.time_per_call(fn, device)[0] * 1e3
    else:
        timer = lambda fn: timing.gpu_time_ms(fn, device)
    times = {}
    for backend in ("helion", "triton", "torch"):
        with hkernels.use_backend(backend):
            try:
                times[backend] = timer(case.forward) + timer(case.forward_backward)
            except torch.OutOfMemoryError:
                if backend != "torch":
                    raise
                torch.cuda.empty_cache()
    return times


def write_auto(measured: dict[str, list[tuple[int, int, dict[str, float], str]]], arch: str, out: Path) -> None:
    """Per op, auto buckets from every shape measured so far (this run's and earlier runs', kept under "_points"),
    exact in n: other row lengths keep the shipped buckets, tried after these."""
    path = out / "auto" / f"{arch}.json"
    table = tables.read(path)
    kept = table.setdefault("_points", {})
    for op, new_points in measured.items():
        by_shape = {(p[0], p[1]): p for p in kept.get(op, [])}
        fresh: dict[tuple[int, int], list[Any]] = {}
        for rows, n, t, name in new_points:  # an op's variants at one shape (causal or not, ...): summed
            unit = "µs per call (fwd + fwd_bwd latency)" if host_bound(rows, n, op) else "ms (fwd + fwd_bwd)"
            point = fresh.get((rows, n))
            torch_time = t.get("torch")  # (absent where the torch backend was not timed)
            if point is None:
                fresh[(rows, n)] = [rows, n, t["helion"], t["triton"], name, unit, torch_time]
            else:
                point[2] += t["helion"]
                point[3] += t["triton"]
                point[4] += f" + {name}"
                point[6] = None if point[6] is None or torch_time is None else point[6] + torch_time
        for key, point in fresh.items():
            point[4] += f", hkernels.tune {datetime.date.today()}"
            by_shape[key] = point
        kept[op] = sorted(by_shape.values())
        # (a point without a unit: ms; without a torch time: the kernels alone)
        table[op] = buckets([(*p[:5], *(p[5:6] or ["ms"]), *(p[6:7] or [None])) for p in kept[op]], exact_n=True)
    tables.write(path, table)
