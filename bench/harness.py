"""The rows, ceilings, checks and output of ``python -m bench``; the timers are the library's
(``hkernels.tune.timing``), shared with the tune command."""

from __future__ import annotations

import contextlib
import csv
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

import torch

from hkernels.runtime.device import num_sms
from hkernels.tune.timing import time_ms

# Said in stdout and at the top of report.md when the kernels run in Triton's interpreter on a CPU.
INTERPRETED = (
    "Interpret mode on a CPU: the kernels run in Triton's interpreter, so their times measure nothing and none are "
    "reported. This pass checks that every op x backend x mode runs and matches the float64 reference."
)
# The largest error (relative to the reference's largest value) a row may have, per dtype: a few units in the last
# place of the dtype at that value, and more for long reductions; a coarse check that catches wrong results (the
# test suite judges precision element by element).
TOLERANCE = {"float32": 1e-3, "float16": 1e-2, "bfloat16": 4e-2}


@dataclass
class Row:
    op: str
    m: int
    n: int
    dtype: str
    mode: str
    backend: str
    k: int = 0  # a third size (matmul's K, attention's batch; see bench/ops.py), 0 for the others
    ms: float | None = None  # GPU time: the call replayed as a CUDA graph (else ms_eager: see timing)
    spread: float | None = None  # (p80 - p20) / median of ms: the noise of this row in this run
    # Per call from Python, calls back to back (time_per_call): max(host overhead, GPU time), what a caller waits
    ms_eager: float | None = None
    us_call: float | None = None  # ms_eager in µs: the latency a caller sees at tiny shapes
    gbps: float | None = None
    pct_copy: float | None = None
    tflops: float | None = None  # compute-bound ops (matmul, attention, the linear loss): flops per second
    # Speedups, GPU time (ms): the peer's time / this time (> 1: this row is faster)
    vs_compile: float | None = None  # over torch.compile
    vs_eager: float | None = None  # over PyTorch eager
    vs_liger: float | None = None  # over Liger-Kernel (where it has the op)
    # The same from Python (ms_eager: calls back to back, no graph): what a caller without CUDA graphs gets
    vs_compile_py: float | None = None
    vs_eager_py: float | None = None
    vs_liger_py: float | None = None
    peak_mib: float | None = None  # memory the call allocates beyond its inputs, at its peak (MiB)
    max_err: float | None = None  # max |out - float64 ref| / max |ref|, over y and every gradient
    timing: str = "per call"  # what ms is: "graph" (GPU time) or "per call"
    first_s: float | None = None  # the row's first call (the correctness check): compile time, where it is new
    bench_s: float | None = None  # wall time the benchmark spent on the row, first call included
    error: str = ""
    # With --kernels: the GPU kernels one timed call launches, (name, ms per call, launches per call), longest first
    kernels: list[tuple[str, float, int]] | None = None


def peak_mib(fn: Callable[[], object], device: torch.device) -> float | None:
    """MiB that one call of ``fn`` allocates beyond what was allocated before it, at its peak (CUDA only)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - before) / 2**20


def copy_gbps(device: torch.device) -> float:
    """Device-to-device copy bandwidth, bytes read plus written, on 1 GiB (well past the 60 MB L2)."""
    n = (1 << 30) // 2 if device.type == "cuda" else 1 << 20
    src = torch.randn(n, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), device)
    return 2 * src.numel() * src.element_size() / ms / 1e6


def tolerance(dtype: str) -> float:
    return TOLERANCE[dtype]


def within_tolerance(r: Row) -> bool:
    """Whether the row's error is within its dtype's tolerance (a row with no error measured claims nothing)."""
    return r.max_err is None or r.max_err <= TOLERANCE[r.dtype]


def environment(device: torch.device, command: str | None = None) -> dict[str, object]:
    """The run's environment; ``command`` is how it was started (default: python -m bench and this process's
    arguments)."""
    def version(name: str) -> str:
        from importlib import metadata

        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"

    # A copy of the tree sent to a lent GPU names its commit in HKERNELS_COMMIT (its .git, if any, may be stale)
    commit = os.environ.get("HKERNELS_COMMIT", "")
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout
        except OSError:
            commit = ""
    commit = commit.strip()
    env: dict[str, object] = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpret mode)",
        "torch": torch.__version__,
        "triton": version("triton"),
        "helion": version("helion"),
        "liger_kernel": version("liger-kernel"),
        "python": platform.python_version(),
        "commit": commit,
        "command": command or " ".join(["python -m bench", *sys.argv[1:]]),
    }
    if device.type == "cuda":
        env["sms"] = num_sms(device)
        env["cuda"] = torch.version.cuda
        with contextlib.suppress(OSError):
            env["driver"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True
            ).stdout.strip()
    return env


def _fmt(v: object, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def shape_of(r: Row) -> str:
    return f"{r.m}x{r.n}" + (f"x{r.k}" if r.k else "")


def _short(op: str) -> str:
    short = {"fused_linear_cross_entropy": "linear_ce", "cross_entropy": "cross_entr.", "attention": "attn"}
    return short.get(op, op.replace("attention_", "attn_"))


def table(rows: Iterable[Row]) -> str:
    """One line per row, both times: ``GPU ms`` (graph replay) with its rate and speedups, then ``py ms`` (calls back
    to back from Python) with its speedups; compute-bound rows show TFLOP/s in the GB/s column (e.g. ``512TF``)."""
    head = (
        f"{'op':<13} {'shape':>17} {'mode':<7} {'backend':<13} {'GPU ms':>9} {'GB/s':>7} {'%copy':>6} "
        f"{'xEager':>6} {'xCmp':>6} {'xLiger':>6} {'py ms':>9} {'xEager':>6} {'xCmp':>6} {'xLiger':>6} "
        f"{'err':>8} {'peak MiB':>9}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        shape = shape_of(r)
        if r.error:
            lines.append(f"{_short(r.op):<13} {shape:>17} {r.mode:<7} {r.backend:<13} failed: {r.error[:60]}")
            continue
        rate = _fmt(r.gbps, "7.0f") if r.gbps or r.tflops is None else _fmt(r.tflops, "5.0f") + "TF"
        gpu = r.ms if "graph" in r.timing else None
        lines.append(
            f"{_short(r.op):<13} {shape:>17} {r.mode:<7} {r.backend:<13} {_fmt(gpu, '9.4f')} {rate} "
            f"{_fmt(r.pct_copy, '6.1f')} {_fmt(r.vs_eager, '6.2f')} {_fmt(r.vs_compile, '6.2f')} "
            f"{_fmt(r.vs_liger, '6.2f')} {_fmt(r.ms_eager, '9.4f')} {_fmt(r.vs_eager_py, '6.2f')} "
            f"{_fmt(r.vs_compile_py, '6.2f')} {_fmt(r.vs_liger_py, '6.2f')} {_fmt(r.max_err, '8.1e')} "
            f"{_fmt(r.peak_mib, '9.1f')}"
        )
    return "\n".join(lines)


def check_table(rows: Iterable[Row]) -> str:
    """One line per row of a run without timings: its largest error against the float64 reference, the tolerance,
    and the verdict."""
    rows = list(rows)
    w = max([13, *(len(_short(r.op)) for r in rows)])
    head = f"{'op':<{w}} {'shape':>17} {'mode':<7} {'backend':<13} {'max err':>8} {'tolerance':>9}  result"
    lines = [head, "-" * len(head)]
    for r in rows:
        what = f"{_short(r.op):<{w}} {shape_of(r):>17} {r.mode:<7} {r.backend:<13}"
        if r.error:
            lines.append(f"{what} failed: {r.error[:60]}")
            continue
        verdict = "ok" if within_tolerance(r) else "BEYOND TOLERANCE"
        lines.append(f"{what} {_fmt(r.max_err, '8.1e')} {tolerance(r.dtype):9.0e}  {verdict}")
    return "\n".join(lines)


def check_summary(rows: list[Row]) -> str:
    """One sentence: how many rows ran and matched the reference within tolerance, and the largest error."""
    n_ops = len({r.op for r in rows})
    ops = f"{n_ops} op{'s' if n_ops != 1 else ''}"
    backends = ", ".join(dict.fromkeys(r.backend for r in rows))
    modes = ", ".join(dict.fromkeys(r.mode for r in rows))
    bad = [r for r in rows if r.error or not within_tolerance(r)]
    checked = [r for r in rows if r.max_err is not None and not r.error]
    worst = max(checked, key=lambda r: r.max_err / tolerance(r.dtype), default=None)
    largest = (f"; the largest error {worst.max_err:.1e} ({worst.op} {shape_of(worst)} {worst.mode} {worst.backend}), "
               f"tolerance {tolerance(worst.dtype):.0e} of max |reference| for {worst.dtype}") if worst else ""
    if not bad:
        return (f"{len(rows)} of {len(rows)} rows ({ops} x backends {backends} x modes {modes}) ran and matched "
                f"the float64 reference within tolerance{largest}.")
    return (f"{len(bad)} of {len(rows)} rows ({ops} x backends {backends} x modes {modes}) failed or missed the "
            f"float64 reference beyond tolerance{largest}.")


def write(out: Path, rows: list[Row], env: dict[str, object]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(asdict(rows[0])))
        writer.writeheader()
        writer.writerows(asdict(r) for r in rows)
    (out / "results.json").write_text(json.dumps({"env": env, "rows": [asdict(r) for r in rows]}, indent=1))
    (out / "table.txt").write_text((table(rows) if env.get("timed", True) else check_table(rows)) + "\n")
    if any(r.kernels for r in rows):
        (out / "kernels.md").write_text(kernels_md(rows))


def kernel_times(step: Callable[[], object], device: torch.device, calls: int = 3, top: int = 10
                 ) -> list[tuple[str, float, int]]:
    """The GPU kernels one call of ``step`` launches, from torch.profiler over ``calls`` calls after a warm one:
    (kernel name, ms per call, launches per call), the longest ``top`` first."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            step()
        torch.cuda.synchronize(device)
    found = []
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None)
        us = getattr(e, "cuda_time_total", 0.0) if us is None else us
        if us > 0:
            found.append((e.key, us / calls / 1e3, e.count // calls))
    found.sort(key=lambda k: -k[1])
    return [(name, round(ms, 4), n) for name, ms, n in found[:top]]


def kernels_md(rows: Iterable[Row]) -> str:
    """kernels.md: per profiled row, its kernels and each one's share of the row's kernel time."""
    out = ["# Kernels per call (torch.profiler, GPU time)", ""]
    for r in rows:
        if not r.kernels:
            continue
        total = sum(ms for _, ms, _ in r.kernels)
        out += [f"## {r.op} {shape_of(r)} {r.dtype} {r.mode} {r.backend}: {total:.3f} ms in its {len(r.kernels)} "
                "longest kernels", "", "| ms | share | launches | kernel |", "|---|---|---|---|"]
        out += [f"| {ms:.3f} | {ms / total:.0%} | {n} | `{name[:100]}` |" for name, ms, n in r.kernels]
        out.append("")
    return "\n".join(out)


def progress(i: int, total: int, text: str) -> None:
    """A progress bar on a terminal; one line per row in a log."""
    if sys.stderr.isatty():
        done = int(30 * i / max(total, 1))
        bar = "#" * done + "-" * (30 - done)
        print(f"\r[{bar}] {i}/{total} {text[:80]:<80}", end="" if i < total else "\n", file=sys.stderr, flush=True)
    else:
        print(f"[{i:>4}/{total}] {text}", file=sys.stderr, flush=True)


def default_out(device: torch.device) -> Path:
    if device.type != "cuda":
        return Path(os.environ.get("TMPDIR", "/tmp")) / "hkernels-bench"
    name = torch.cuda.get_device_name(device).lower()
    slug = "h200" if "h200" in name else "".join(c if c.isalnum() else "-" for c in name).strip("-")
    return Path(__file__).parent / "results" / slug


def time_candidates(
    fn: Callable[[], object],
    candidates: Iterable[dict[str, object]],
    apply: Callable[[dict[str, object]], Callable[[], None]],
    nbytes: int,
    copy: float,
    device: torch.device,
    deadline: float,
) -> tuple[list[dict[str, object]], list[dict[str, object]]]:
    """Time ``fn`` with each candidate forced by ``apply`` (which returns the undo) until ``deadline`` (time.time());
    returns (timed, fastest first, with % of copy for ``nbytes``; the failures with their errors)."""
    tried: list[dict[str, object]] = []
    for cand in candidates:
        if time.time() > deadline:
            break
        undo = apply(cand)
        try:
            ms = time_ms(fn, device)
            tried.append({"candidate": cand, "ms": ms, "pct_copy": 100 * nbytes / ms / 1e6 / copy})
        except Exception as e:
            tried.append({"candidate": cand, "error": f"{type(e).__name__}: {str(e)[:200]}"})
        finally:
            undo()
    ok = sorted((t for t in tried if "ms" in t), key=lambda t: float(t["ms"]))  # type: ignore[arg-type]
    return ok, [t for t in tried if "ms" not in t]
