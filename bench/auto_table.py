"""python -m bench auto-table RESULTS.json ... --out FILE: the auto backend's table from measured benchmarks.

For each op and each measured shape it compares Helion's, Triton's and, where measured (the ``hk_torch`` rows),
the torch backend's times (the sum over the modes measured:
forward and forward+backward, or per-call latency for decode-sized rows, where the host's work is what a caller
waits for) and writes which backend to use for the shapes around it. The dispatcher reads the table
(hkernels/configs/auto/<arch>.json, or the tune command's copy in the user cache) to resolve auto.

Shapes are described as the dispatcher sees a call: rows = elements of the op's first tensor / its last dim,
n = its last dim. A bucket covers rows <= max_rows and n <= max_n (null: no bound); the first bucket that covers
a call wins, so buckets are written by ascending n, then ascending rows. A later result file replaces an earlier
one's numbers for the same shape entirely (give the newest last); consecutive files of one folder count as one run
(their numbers join, per backend: keep one run per folder). Files of python -m bench latency count too:
--gpu-time rows as GPU time of their mode, host-loop rows as per-call latency. Which calls are judged by latency,
and the buckets themselves, are the tune command's rules (hkernels.tune.auto). attention's forward also gets
buckets of its own from the forward's times alone (``"attention:attention_fwd"``): a call that needs no gradient
runs the faster forward, and a training step the faster forward and the faster backward. Variants routed apart
(``hkernels.tune.cases.ROUTE_OF``: attention with a window or a cap) get buckets of their own for each direction,
``"attention:attention_masked_fwd"`` and ``"attention:attention_masked_bwd"``.

Inside torch.compile: where the files hold ``auto_compile`` (hkernels' call inside a compiled function) and
``torch_compile`` (PyTorch's own call compiled) rows of one shape, the op gets ``"compiled:<op>"`` buckets: torch
where Inductor's own kernel was more than 3% faster there (the dispatcher then traces the torch backend's math for
Inductor to generate and fuse), ``kernel`` (the eager choice, its launches traced into the graph) elsewhere."""

from __future__ import annotations

import itertools
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from bench import cli
from hkernels.tune.auto import buckets, host_bound
from hkernels.tune.cases import HEAD_DIM, OP_OF, ROUTE_OF, SMALL_HEAD_DIM

# Ops whose forward gets buckets of its own (``"<op>:<op>_fwd"``, from the forward's times alone; the dispatcher
# routes the forward and the backward apart, and their saved tensors mean the same on both backends). The op's own
# buckets route its backward: they are built from the backward's time, forward+backward minus forward.
_FORWARD_APART = ("attention",)
# the benchmark's backends auto chooses among, by the name the table gives them: hk_torch is hkernels on its torch
# backend (PyTorch's own fused call where it has one), which auto takes where it was more than 2% faster
_CANDIDATES = {"helion": "helion", "triton": "triton", "hk_torch": "torch"}


def dispatch_shape(bench_op: str, m: int, n: int, k: int) -> tuple[int, int]:
    """(rows, n) of the op's first tensor for a benchmark row of ``bench_op`` at (M, N, K); see bench/ops.py for
    what M, N, K are."""
    op = OP_OF.get(bench_op, bench_op)
    if op in ("rope", "attention", "attention_varlen"):
        head_dim = SMALL_HEAD_DIM if bench_op.startswith("attention_d64") else HEAD_DIM
        # rope: q [1, H, S, D]; attention: q [B, H, S, D]; attention_varlen: q [T, H, D], T = M·K
        return m * (n // head_dim) * max(k, 1), head_dim
    if op in ("matmul", "grouped_matmul"):
        return m, k  # a [M, K]; x [M, K]
    if op == "decode_attention":
        return max(k, 1) * (n // HEAD_DIM), HEAD_DIM  # q [B, Hq, 1, D]
    return m, n


def _score(row: dict[str, Any], latency: bool) -> float | None:
    if latency:
        return row.get("us_call")
    return row.get("ms")


def _rows_of(data: dict[str, Any]) -> list[dict[str, Any]]:
    """A results file's benchmark rows; a ``python -m bench latency`` file's rows put in the same form: GPU time
    (``--gpu-time``, CUDA-graph replays) as ``ms`` of its mode, host-loop latency as ``us_call`` of the forward."""
    rows = []
    for row in data["rows"]:
        if "us_per_call" not in row:
            rows.append(row)
            continue
        m, n, k = ([int(v) for v in row["shape"].lower().split("x")] + [0, 0])[:3]  # MxN or MxNxK
        gpu = row.get("timing", "").startswith("GPU")
        mode = row["timing"].split(" per ")[1].split()[0] if gpu else "fwd"
        for backend, us in row["us_per_call"].items():
            if us is not None:
                rows.append({"op": row["op"], "m": m, "n": n, "k": k, "mode": mode, "backend": backend,
                             **({"ms": us / 1000.0} if gpu else {"us_call": us})})
    return rows


def build(paths: list[Path]) -> dict[str, Any]:
    # (op, rows, n) -> {(bench op, mode): {backend: score}}; later runs win per key. Files in one folder are one run
    # (a latency --gpu-time pass per mode writes one file each): their numbers join before they replace.
    cells: dict[tuple[str, int, int], dict[tuple[str, str], dict[str, float]]] = defaultdict(dict)
    compiled: dict[tuple[str, int, int], dict[tuple[str, str], dict[str, float]]] = {}
    for _, run in itertools.groupby(paths, key=lambda p: p.resolve().parent):  # consecutive files of one folder
        data = {"rows": [row for path in run for row in _rows_of(json.loads(path.read_text()))]}
        fresh: dict[tuple[Any, ...], dict[str, float]] = defaultdict(dict)
        for row in data["rows"]:
            if row["backend"] not in _CANDIDATES or row.get("error") or row["mode"] == "bwd":
                continue
            op = OP_OF.get(row["op"], row["op"])
            rows, n = dispatch_shape(row["op"], row["m"], row["n"], row.get("k", 0))
            score = _score(row, host_bound(rows, n, op))
            route = ROUTE_OF.get(row["op"])
            if score:
                fresh[(f"{op}:{route}" if route else op, rows, n, row["op"], row["mode"])][
                    _CANDIDATES[row["backend"]]] = score
        # A later file replaces a shape's whole cell: one run's numbers, one timing method (never fwd from one
        # run summed with fwd_bwd from another).
        per_cell: dict[tuple[str, int, int], dict[tuple[str, str], dict[str, float]]] = defaultdict(dict)
        for (op, rows, n, variant, mode), by_backend in fresh.items():
            if "helion" in by_backend and "triton" in by_backend:
                per_cell[(op, rows, n)][(variant, mode)] = by_backend
        cells.update(per_cell)
        compiled.update(_compiled_cells(data["rows"]))
    table: dict[str, Any] = {}
    for op in sorted({key[0] for key in cells}):
        if ":" in op:  # a variant routed apart: each direction by its own times
            table[f"{op}_fwd"] = buckets(_points(cells, op, "fwd"), exact_n=False)
            table[f"{op}_bwd"] = buckets(_points(cells, op, backward=True), exact_n=False)
            continue
        apart = op in _FORWARD_APART
        table[op] = buckets(_points(cells, op, backward=apart), exact_n=False)
        fwd = _points(cells, op, "fwd") if apart else []
        if fwd:
            table[f"{op}:{op}_fwd"] = buckets(fwd, exact_n=False)
    for op in sorted({key[0] for key in compiled}):
        table[f"compiled:{op}"] = _compiled_buckets(
            [(rows, n, measured) for (o, rows, n), measured in compiled.items() if o == op], op)
    return {"_about": "auto's backend per op and shape bucket, from python -m bench auto-table "
                      f"{' '.join(str(p) for p in paths)}", **table}


# Inside a graph Inductor's own kernel must be this much faster to displace hkernels' kernel.
COMPILED_TIE = 0.97
_COMPILED = {"auto_compile": "kernel", "torch_compile": "torch"}


def _compiled_cells(rows: list[dict[str, Any]]) -> dict[tuple[str, int, int], dict[tuple[str, str], dict[str, float]]]:
    """One run's ``auto_compile`` and ``torch_compile`` rows: (op, rows, n) -> {(bench op, mode): {"kernel" | "torch":
    score}}, only where both were measured (a shape's whole cell: a later run replaces it)."""
    fresh: dict[tuple[Any, ...], dict[str, float]] = defaultdict(dict)
    for row in rows:
        if row["backend"] not in _COMPILED or row.get("error") or row["mode"] == "bwd" or row["op"] in ROUTE_OF:
            continue
        op = OP_OF.get(row["op"], row["op"])
        rows_, n = dispatch_shape(row["op"], row["m"], row["n"], row.get("k", 0))
        score = _score(row, host_bound(rows_, n, op))
        if score:
            fresh[(op, rows_, n, row["op"], row["mode"])][_COMPILED[row["backend"]]] = score
    out: dict[tuple[str, int, int], dict[tuple[str, str], dict[str, float]]] = defaultdict(dict)
    for (op, rows_, n, variant, mode), by in fresh.items():
        if len(by) == 2:
            out[(op, rows_, n)][(variant, mode)] = by
    return out


def _compiled_buckets(points: list[tuple[int, int, dict[tuple[str, str], dict[str, float]]]], op: str
                      ) -> list[dict[str, Any]]:
    """An op's compiled buckets, by ascending n, then rows (as :func:`hkernels.tune.auto.buckets` lays them out):
    each measured shape's bucket goes to the faster of hkernels' kernel and Inductor's own, inside a graph."""
    out = []
    ns = sorted({n for _, n, _ in points})
    for j, n in enumerate(ns):
        here = sorted((p for p in points if p[1] == n), key=lambda p: p[0])
        for i, (rows, _, measured) in enumerate(here):
            kernel = sum(v["kernel"] for v in measured.values())
            torch_ = sum(v["torch"] for v in measured.values())
            unit = "µs per call" if host_bound(rows, n, op) else "ms"
            modes = " + ".join(f"{variant} {mode}" for variant, mode in sorted(measured))
            out.append({
                "max_rows": rows if i + 1 < len(here) else None,
                "max_n": n if j + 1 < len(ns) else None,
                "backend": "torch" if torch_ < COMPILED_TIE * kernel else "kernel",
                "measured": f"rows={rows} n={n}: hkernels {kernel:.4g}, Inductor {torch_:.4g} {unit} inside "
                            f"torch.compile ({modes})",
            })
    return out


def _points(cells: dict[tuple[str, int, int], dict[tuple[str, str], dict[str, float]]], op: str,
            mode: str | None = None, backward: bool = False) -> list[tuple[Any, ...]]:
    """The measured points of ``op`` for tune's ``buckets``: per shape, each backend's time summed over the modes
    measured (only ``mode``'s, if given). ``backward``: the backward's time instead, forward+backward minus forward
    where a variant has both (its other modes as measured)."""
    points = []
    for (o, rows, n), measured in cells.items():
        chosen = {key: v for key, v in measured.items() if mode is None or key[1] == mode}
        if o != op or not chosen:
            continue
        # the torch backend counts only where it was measured in every mode the kernels were
        with_torch = all("torch" in v for v in chosen.values())
        times = {b: 0.0 for b in ("helion", "triton", "torch")}
        modes = []
        for (variant, m), v in sorted(chosen.items()):
            fwd = measured.get((variant, "fwd")) if backward and m == "fwd_bwd" else None
            if backward and m == "fwd" and (variant, "fwd_bwd") in measured:
                continue
            for b in times if with_torch else ("helion", "triton"):
                times[b] += v[b] - (fwd[b] if fwd else 0.0)
            modes.append(f"{variant} {m}{' − fwd' if fwd else ''}")
        unit = "µs per call" if host_bound(rows, n, op.split(":")[0]) else "ms"
        points.append((rows, n, times["helion"], times["triton"], f"rows={rows} n={n}",
                       f"{unit} ({' + '.join(modes)})", times["torch"] if with_torch else None))
    return points


def main(argv: list[str] | None = None) -> int:
    parser = cli.parser("auto-table", __doc__)
    parser.add_argument("results", nargs="+", type=Path,
                        help="results.json files of python -m bench and latency.json files of python -m bench "
                             "latency, oldest first (one folder = one run)")
    parser.add_argument("--out", type=Path, required=True, help="where to write the table (JSON)")
    args = parser.parse_args(argv)
    table = build(args.results)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(table, indent=1, ensure_ascii=False) + "\n")
    for op, op_buckets in table.items():
        if op.startswith("_"):
            continue
        picks = ", ".join(f"{b['backend']}≤({b['max_rows']},{b['max_n']})" for b in op_buckets)
        print(f"{op}: {picks}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
