"""The benchmark's report: a markdown summary (geomean speedups, best backend, failures) and a PNG per op; for a
run without timings (interpreted on a CPU), the checks only."""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from pathlib import Path

from bench.harness import INTERPRETED, Row, check_summary, shape_of, tolerance, within_tolerance

LARGE_BYTES = 64 * 2**20  # rows that move at least this much are judged against the copy bandwidth


def _geomean(values: list[float]) -> float | None:
    values = [v for v in values if v and v > 0]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else None


def _large(r: Row) -> bool:
    return bool(r.ms and r.gbps and r.gbps * r.ms * 1e6 >= LARGE_BYTES)


def _f(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def summary_rows(rows: list[Row]) -> list[dict[str, object]]:
    """Per op × mode × backend, both times: geomean speedups over eager, torch.compile and Liger in GPU time (graph
    replay) and from Python (calls back to back), over all shapes; and the median % of copy of the ≥ 64 MiB
    shapes."""
    groups: dict[tuple[str, str, str], list[Row]] = defaultdict(list)
    for r in rows:
        if r.ms and not r.error:
            groups[(r.op, r.mode, r.backend)].append(r)
    out = []
    for (op, mode, backend), rs in sorted(groups.items()):
        large = [r for r in rs if _large(r)]
        entry: dict[str, object] = {"op": op, "mode": mode, "backend": backend, "rows": len(rs),
                                    "pct_copy_large": statistics.median([r.pct_copy for r in large]) if large else None}
        for peer in ("eager", "compile", "liger"):
            entry[f"vs_{peer}"] = _geomean([getattr(r, f"vs_{peer}") for r in rs])
            entry[f"vs_{peer}_py"] = _geomean([getattr(r, f"vs_{peer}_py") for r in rs])
        out.append(entry)
    return out


def host_bound(rows: list[Row]) -> list[str]:
    """hkernels rows whose time from Python exceeds their GPU time by more than 15%: where the host, not the GPU,
    sets the pace (the µs a caller waits that a CUDA graph would remove)."""
    lines = []
    for r in rows:
        if (r.backend in OURS and not r.error and r.ms and r.ms_eager and "graph" in r.timing
                and r.ms_eager > 1.15 * r.ms):
            eager = next((e for e in rows if e.backend == "torch" and (e.op, e.m, e.n, e.k, e.mode)
                          == (r.op, r.m, r.n, r.k, r.mode) and e.ms_eager), None)
            lines.append(f"| {r.op} | {shape_of(r)} | {r.mode} | {r.backend} | {r.ms * 1e3:.1f} | "
                         f"{r.ms_eager * 1e3:.1f} | {r.ms_eager / r.ms:.2f} | "
                         f"{_f(eager.ms_eager * 1e3 if eager else None, '.1f')} |")
    return lines


def _best(rows: list[Row]) -> list[str]:
    """The fastest backend per op and mode over the ≥ 64 MiB shapes (geomean of time relative to the fastest)."""
    lines = []
    keyed: dict[tuple[str, str], dict[tuple[int, int, int], dict[str, float]]] = defaultdict(lambda: defaultdict(dict))
    for r in rows:
        if _large(r) and not r.error:
            keyed[(r.op, r.mode)][(r.m, r.n, r.k)][r.backend] = r.ms
    for (op, mode), shapes in sorted(keyed.items()):
        ratios: dict[str, list[float]] = defaultdict(list)
        for times in shapes.values():
            fastest = min(times.values())
            for backend, ms in times.items():
                ratios[backend].append(ms / fastest)
        ranked = sorted((g, b) for b, v in ratios.items() if (g := _geomean(v)) is not None)
        if ranked:
            text = ", ".join(f"{b} {g:.2f}×" for g, b in ranked)
            lines.append(f"| {op} | {mode} | {ranked[0][1]} | {text} |")
    return lines


OURS = ("helion", "triton", "auto", "auto_compile")


def compute_table(rows: list[Row]) -> list[str]:
    """Compute-bound ops (TFLOP/s, no bytes): one line per op × shape × mode, a column per backend, and the faster
    hkernels backend over the fastest other one (> 1: hkernels is faster)."""
    timed = [r for r in rows if r.tflops and not r.gbps and not r.error]
    backends = list(dict.fromkeys(r.backend for r in timed))
    if not timed:
        return []
    lines = [
        "| op | shape | mode | " + " | ".join(backends) + " | hkernels / best other |",
        "|---|---|---|" + "---|" * (len(backends) + 1),
    ]
    groups: dict[tuple, dict[str, Row]] = defaultdict(dict)
    for r in timed:
        groups[(r.op, shape_of(r), r.mode)][r.backend] = r
    for (op, shape, mode), by in groups.items():
        ours = max((by[b].tflops for b in OURS if b in by), default=None)
        theirs = max((by[b].tflops for b in by if b not in OURS), default=None)
        ratio = ours / theirs if ours and theirs else None
        cells = " | ".join(_f(by[b].tflops if b in by else None, ".0f") for b in backends)
        lines.append(f"| {op} | {shape} | {mode} | {cells} | {_f(ratio, '.2f')} |")
    return lines


def plot(out: Path, rows: list[Row], copy_gbps: float) -> list[str]:
    """One PNG per op: GB/s against rows, a panel per (mode, N), a line per backend, the copy bandwidth dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for op in dict.fromkeys(r.op for r in rows):
        mine = [r for r in rows if r.op == op and r.gbps]
        modes = list(dict.fromkeys(r.mode for r in mine))
        ns = sorted({r.n for r in mine})
        if not mine:
            continue
        fig, axes = plt.subplots(len(modes), len(ns), figsize=(4.2 * len(ns), 3.2 * len(modes)), squeeze=False)
        for i, mode in enumerate(modes):
            for j, n in enumerate(ns):
                ax = axes[i][j]
                for backend in dict.fromkeys(r.backend for r in mine):
                    pts = sorted((r.m, r.gbps) for r in mine if r.mode == mode and r.n == n and r.backend == backend)
                    if pts:
                        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=backend)
                ax.axhline(copy_gbps, color="black", linestyle="--", linewidth=1, label="copy")
                ax.set_xscale("log", base=2)
                ax.set_title(f"{op} {mode}, N={n}", fontsize=9)
                ax.set_xlabel("rows (tokens)", fontsize=8)
                ax.set_ylabel("GB/s", fontsize=8)
                ax.tick_params(labelsize=7)
                ax.grid(True, alpha=0.3)
        axes[0][0].legend(fontsize=7)
        fig.tight_layout()
        path = out / f"{op}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path.name)
    return written


def _write_checks(out: Path, rows: list[Row], env: dict[str, object]) -> Path:
    """report.md of a run without timings: what it checked, row by row; no times, rates, speedups or plots."""
    lines = [
        "# hkernels benchmark: a check of every op, no timings",
        "",
        f"**{INTERPRETED}**",
        "",
        f"**{check_summary(rows)}**",
        "",
        f"{env.get('device')} · torch {env.get('torch')} · triton {env.get('triton')} · helion {env.get('helion')} · "
        f"commit {env.get('commit') or '?'} · {env.get('date')}",
        "",
        f"`{env.get('command')}` · dtype {env.get('dtype')}",
        "",
        "Each row ran twice (the first call of its signature, then a second that reuses what the first built); its "
        "largest error over both, the outputs and (fwd_bwd) every gradient, is relative to the largest value of the "
        "float64 reference. bwd rows (fwd_bwd minus fwd, a difference of times) are left out: the backward is "
        "checked in fwd_bwd.",
        "",
        "| op | shape | mode | backend | max error | tolerance | result |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.error:
            result, err = f"failed: {r.error[:160]}", "-"
        else:
            result, err = ("ok" if within_tolerance(r) else "**beyond tolerance**"), _f(r.max_err, ".1e")
        lines.append(f"| {r.op} | {shape_of(r)} | {r.mode} | {r.backend} | {err} | {tolerance(r.dtype):.0e} | "
                     f"{result} |")
    lines += ["", "Every row: [table.txt](table.txt), [results.csv](results.csv), [results.json](results.json).", ""]
    path = out / "report.md"
    path.write_text("\n".join(lines))
    return path


def write(out: Path, rows: list[Row], env: dict[str, object], plots: bool = True) -> Path:
    """report.md (and the PNGs) in ``out``."""
    if not env.get("timed", True):
        return _write_checks(out, rows, env)
    copy = float(env.get("copy_gbps", 0) or 0)
    pngs: list[str] = []
    plot_note = ""
    if plots:
        try:
            pngs = plot(out, rows, copy)
        except ImportError:
            plot_note = "No plots: matplotlib is not installed (pip install -e '.[bench]')."
    lines = [
        "# hkernels benchmark report",
        "",
        f"{env.get('device')} · torch {env.get('torch')} · triton {env.get('triton')} · helion {env.get('helion')} · "
        f"liger-kernel {env.get('liger_kernel')} · commit {env.get('commit') or '?'} · {env.get('date')}",
        "",
        f"`{env.get('command')}` · dtype {env.get('dtype')} · device-to-device copy in this run: **{copy:.0f} GB/s**",
        "",
        "Every row has two times: the GPU time (each call captured as a CUDA graph and replayed, L2 flushed between",
        "replays) and the time from Python (calls back to back, then one sync: host overhead or GPU time, whichever",
        "is longer; median of 5 loops). GB/s and % of copy are of the GPU time, for the bytes each op must move.",
        "",
        f"Rows timed per call from Python instead (no GPU, --latency, or capture failed): "
        f"{sum(1 for r in rows if r.ms and 'graph' not in r.timing)} of {sum(1 for r in rows if r.ms)}.",
        "",
        "## Summary: speedup per op and backend, in both times",
        "",
        "GPU: the call replayed as a CUDA graph. From Python: calls back to back, no graph (what a caller without",
        "CUDA graphs waits). Each cell is the geomean over the shapes of the peer's time / this backend's time",
        "(> 1: faster than the peer).",
        "",
        "| op | mode | backend | GPU vs eager | GPU vs compile | GPU vs Liger | Python vs eager | Python vs compile "
        "| Python vs Liger | median % of copy (≥ 64 MiB) | rows |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summary_rows(rows):
        lines.append(
            f"| {s['op']} | {s['mode']} | {s['backend']} | {_f(s['vs_eager'], '.2f')} | {_f(s['vs_compile'], '.2f')} "
            f"| {_f(s['vs_liger'], '.2f')} | {_f(s['vs_eager_py'], '.2f')} | {_f(s['vs_compile_py'], '.2f')} | "
            f"{_f(s['vs_liger_py'], '.2f')} | {_f(s['pct_copy_large'], '.1f')} | {s['rows']} |"
        )
    bound = host_bound(rows)
    if bound:
        lines += ["", "## Where the host sets the pace (from Python > 1.15 × GPU time)", "",
                  "| op | shape | mode | backend | GPU µs | from Python µs | ratio | eager from Python µs |",
                  "|---|---|---|---|---|---|---|---|", *bound]
    compute = compute_table(rows)
    if compute:
        lines += ["", "## Compute-bound ops: TFLOP/s", "", *compute]
    best = _best(rows)
    if best:
        lines += [
            "",
            "## Which backend to use (shapes ≥ 64 MiB)",
            "",
            "| op | mode | fastest | geomean time relative to the fastest per shape |",
            "|---|---|---|---|",
            *best,
        ]
    failed = [r for r in rows if r.error]
    if failed:
        lines += ["", "## Rows that did not run", ""]
        lines += [f"- {r.op} {shape_of(r)} {r.mode} {r.backend}: {r.error[:160]}" for r in failed]
    beyond = [r for r in rows if not r.error and not within_tolerance(r)]
    if beyond:
        lines += ["", "## Rows beyond the error tolerance (max |error| / max |float64 reference|)", ""]
        lines += [f"- {r.op} {shape_of(r)} {r.mode} {r.backend}: {r.max_err:.1e} > {tolerance(r.dtype):.0e}"
                  for r in beyond]
    lines += ["", "## Plots", ""]
    lines += [f"![{p}]({p})" for p in pngs] or [plot_note or "(none)"]
    lines += ["", "Every row: [table.txt](table.txt), [results.csv](results.csv), [results.json](results.json).", ""]
    path = out / "report.md"
    path.write_text("\n".join(lines))
    return path
