"""Timing, ceilings and output for ``python -m bench``."""

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


def time_quantiles(
    fn: Callable[[], object], device: torch.device, warmup_ms: float = 25, rep_ms: float = 100
) -> tuple[float, float, float]:
    """(median, p20, p80) milliseconds of ``fn``: CUDA events with L2 flushed between runs (do_bench), or a host
    clock on CPU."""
    if device.type == "cuda":
        import triton.testing

        med, p20, p80 = triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, quantiles=[0.5, 0.2, 0.8])
        return float(med), float(p20), float(p80)
    fn()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return times[2], times[1], times[3]


def time_ms(fn: Callable[[], object], device: torch.device) -> float:
    return time_quantiles(fn, device)[0]


def time_per_call(
    fn: Callable[[], object],
    device: torch.device,
    loop_ms: float = 50.0,
    min_calls: int = 20,
    max_calls: int = 2000,
    loops: int = 5,
) -> tuple[float, float, float]:
    """(median, p20, p80) milliseconds per call of ``fn`` called back to back, over ``loops`` loops of N calls.

    N makes a loop last about ``loop_ms`` (within [min_calls, max_calls]). Each loop is timed on the host clock
    between two synchronizations, so a call costs max(its host work, its GPU time): the steady-state latency a
    caller sees. Timing each call with CUDA events instead (do_bench) flushes L2 between calls, which hides the
    host work of the next call behind the flush, so it is neither the GPU time nor the latency. The same inputs
    every call: no fresh tensors, which would time the allocator too.
    """
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)

    def loop(n: int) -> float:
        sync()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        sync()
        return (time.perf_counter() - t0) * 1e3

    # Warm-up that also finds the cost of a call: batches growing 4x until one lasts a tenth of a loop.
    n = 1
    while (elapsed := loop(n)) < loop_ms / 10 and n < max_calls:
        n *= 4
    calls = max(min_calls, min(max_calls, round(loop_ms * n / max(elapsed, 1e-6))))
    times = sorted(loop(calls) / calls for _ in range(loops))
    return times[len(times) // 2], times[round(0.2 * (len(times) - 1))], times[round(0.8 * (len(times) - 1))]


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


def capture_graph(fn: Callable[[], object], device: torch.device) -> torch.cuda.CUDAGraph:
    """``fn`` captured as a CUDA graph, after a warm-up on a side stream (as graph capture of autograd requires)."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def time_graph(fn: Callable[[], object], device: torch.device) -> tuple[float, float, float]:
    """(median, p20, p80) milliseconds of ``fn`` captured once as a CUDA graph and replayed (L2 flushed between
    replays).

    This is the GPU time of the kernels alone. Launched from Python, a call whose host work (argument checks,
    dispatch, autograd bookkeeping) takes longer than its kernels leaves the GPU idle, and per-call timing then
    measures the host: on the H200 machines here, whose CPUs are slow, that is tens of µs per op call.
    """
    graph = capture_graph(fn, device)
    # do_bench spends its 25 + 100 ms whatever a replay costs, the bulk of a decode-shape row's measuring. A replay
    # under 0.2 ms gets 5 + 20 ms: still hundreds of samples (each also zeroes the 256 MB flush buffer, ~0.08 ms).
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(10):
        graph.replay()
    torch.cuda.synchronize(device)
    tiny = (time.perf_counter() - t0) * 1e3 / 10 < 0.2
    return time_quantiles(graph.replay, device, *((5, 20) if tiny else (25, 100)))


def copy_gbps(device: torch.device) -> float:
    """Device-to-device copy bandwidth, bytes read plus written, on 1 GiB (well past the 60 MB L2)."""
    n = (1 << 30) // 2 if device.type == "cuda" else 1 << 20
    src = torch.randn(n, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), device)
    return 2 * src.numel() * src.element_size() / ms / 1e6


def environment(device: torch.device) -> dict[str, object]:
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
        "command": " ".join(["python -m bench", *sys.argv[1:]]),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env["sms"] = props.multi_processor_count
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


def write(out: Path, rows: list[Row], env: dict[str, object]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(asdict(rows[0])))
        writer.writeheader()
        writer.writerows(asdict(r) for r in rows)
    (out / "results.json").write_text(json.dumps({"env": env, "rows": [asdict(r) for r in rows]}, indent=1))
    (out / "table.txt").write_text(table(rows) + "\n")


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
