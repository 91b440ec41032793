"""python -m bench first-call: how long the first call of each op takes in a fresh process (compiling).

For each op x dtype x backend a new Python process, with empty private cache folders (Triton, TorchInductor,
Helion, hkernels' own, XDG, CUDA), imports hkernels, makes the op's inputs at one Llama-3 8B shape and times, on
the host clock with the GPU synchronized: importing the backend's modules for the op (Helion itself takes seconds
to import), the first forward call (tracing, code generation, compiling), the first backward call, then a second
(warm) forward and backward. That is what a user pays on a machine that has never run hkernels; with --warm each
case runs again in a second fresh process on the caches the first left (a restarted server). Rows whose first
forward or backward takes over --slow seconds are flagged. A process that fails or outlives --timeout gives a row
with its error. Writes results.json and table.txt in --out. On a CPU (HKERNELS_INTERPRET=1, --quick) it runs as a
check of the command: interpreted kernels compile nothing, so the times measure nothing.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from bench import cli

REPO = Path(__file__).resolve().parents[1]
MARK = "FIRST_CALL_JSON "  # the child's result line: kernels and compilers may print to stdout too
# Where each compiler keeps what it built; HELION_CACHE_DIR also holds Helion's own Triton cache.
CACHE_VARS = {
    "TRITON_CACHE_DIR": "triton",
    "TRITON_HOME": "triton-home",
    "TORCHINDUCTOR_CACHE_DIR": "inductor",
    "HELION_CACHE_DIR": "helion",
    "XDG_CACHE_HOME": "xdg",
    "CUDA_CACHE_PATH": "nv",
    "HKERNELS_CACHE_DIR": "hkernels",  # (hkernels' own: tuned tables, Helion's generated code)
}


@dataclass
class Result:
    op: str
    dtype: str
    backend: str
    shape: str
    import_s: float | None = None  # import hkernels (after torch)
    backend_import_s: float | None = None  # importing the backend's modules for the op (helion: Helion itself)
    fwd_s: float | None = None  # the first forward call, after those imports: tracing, code generation, compiling
    bwd_s: float | None = None  # the first backward call
    warm_fwd_ms: float | None = None  # the second forward call
    warm_bwd_ms: float | None = None
    process_s: float | None = None  # the whole subprocess, Python start-up included
    error: str = ""
    caches: str = "empty"  # "empty", or "warm": the compilers' caches as an earlier process of the case left them

    def slowest(self) -> float:
        return max(self.fwd_s or 0, self.bwd_s or 0)


def shape_for(op_name: str, quick: bool, device: torch.device) -> tuple[int, int, int]:
    """One Llama-3 8B shape: 4096 tokens at the op's model dimension; matmuls 4096³; attention 4 × 1024 tokens of
    32 heads. ``quick``: the smoke pass's first shape."""
    from bench.ops import MODELS, OPS, quick_shapes

    op = OPS[op_name]
    if quick:
        return quick_shapes(op, device)[0]
    if op_name.startswith("matmul"):
        return (4096, 4096, 4096)
    if op_name.startswith("attention"):
        return (1024, 4096, 4)
    return (4096, MODELS["llama3-8b"][op.dim], 0)


def _child(spec: dict[str, Any], out: dict[str, Any]) -> None:
    """The body of one fresh process: time the first calls of one op × dtype × backend into ``out``."""
    cuda = torch.cuda.is_available()

    def clock(fn: Callable[[], Any]) -> tuple[Any, float]:
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        value = fn()
        if cuda:
            torch.cuda.synchronize()
        return value, time.perf_counter() - t0

    hkernels, out["import_s"] = clock(lambda: importlib.import_module("hkernels"))  # CUDA is up before the clock
    from bench.ops import OPS
    from hkernels.tune.cases import make_inputs

    op = OPS[spec["op"]]
    device = torch.device("cuda" if cuda else "cpu")
    made = make_inputs(op, tuple(spec["shape"]), getattr(torch, spec["dtype"]), device)
    ins = [t.detach().requires_grad_() if i in op.diff else t for i, t in enumerate(made)]
    wrt = [ins[i] for i in op.diff]

    def forward() -> tuple[torch.Tensor, ...]:
        y = op.kernel(*ins)
        return y if isinstance(y, tuple) else (y,)

    # The backend's modules, imported on their own clock (they import lazily on the first call otherwise): Helion
    # alone takes seconds to import (its autotuner pulls in scikit-learn and TorchInductor), which is not compiling.
    from hkernels import registry

    backends = ("helion", "triton") if spec["backend"] == "auto" else (spec["backend"],)
    _, out["backend_import_s"] = clock(
        lambda: [registry.load(spec["op"], b) for b in backends if b in ("helion", "triton")])
    with hkernels.use_backend(spec["backend"]):
        ys, out["fwd_s"] = clock(forward)
        ups = [torch.ones_like(y) if y.dim() == 0 else torch.randn_like(y) for y in ys]  # a loss gets 1
        if wrt:
            _, out["bwd_s"] = clock(lambda: torch.autograd.grad(ys, wrt, ups))
        ys, warm = clock(forward)
        out["warm_fwd_ms"] = warm * 1e3
        if wrt:
            _, warm = clock(lambda: torch.autograd.grad(ys, wrt, ups))
            out["warm_bwd_ms"] = warm * 1e3


def _child_main(spec_text: str) -> int:
    spec = json.loads(spec_text)
    out: dict[str, Any] = {}
    try:
        _child(spec, out)
    except Exception as e:  # the timings reached so far say which call failed
        out["error"] = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:300]}"
    print(MARK + json.dumps(out), flush=True)
    return 1 if "error" in out else 0


def run_one(op: str, dtype: str, backend: str, shape: tuple[int, int, int], timeout: float,
            warm: bool = False) -> list[Result]:
    """One fresh subprocess with empty private caches; its result line, or its error, as a Result. ``warm``: then a
    second fresh process on the caches the first filled (what a server restarted on the same machine pays), as a
    second Result."""
    spec = json.dumps({"op": op, "dtype": dtype, "backend": backend, "shape": list(shape)})
    rows = []
    with tempfile.TemporaryDirectory(prefix="hkernels-first-call-") as root:
        env = dict(os.environ)
        for var, sub in CACHE_VARS.items():
            env[var] = str(Path(root) / sub)
            Path(env[var]).mkdir()
        env.pop("HELION_REMOTE_CACHE_BACKEND", None)  # a shared remote cache would make the first call warm
        for caches in ("empty", "warm") if warm else ("empty",):
            row = Result(op, dtype, backend, "x".join(str(s) for s in shape if s), caches=caches)
            rows.append(_spawn(spec, env, timeout, row))
            if row.error:
                break
    return rows


def _spawn(spec: str, env: dict[str, str], timeout: float, row: Result) -> Result:
    t0 = time.perf_counter()
    # Its own session: on a timeout the compile workers it started go with it.
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench", "first-call", "--child", spec],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        row.error, row.process_s = f"timed out after {timeout:.0f} s", timeout
        return row
    row.process_s = time.perf_counter() - t0
    lines = [line for line in stdout.splitlines() if line.startswith(MARK)]
    if not lines:
        tail = [line for line in stderr.strip().splitlines() if line.strip()][-1:] or [f"exit status {proc.returncode}"]
        row.error = f"no result: {tail[0][:300]}"
        return row
    for key, value in json.loads(lines[-1][len(MARK) :]).items():
        setattr(row, key, value)
    return row


def _f(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def table(rows: list[Result], slow: float) -> str:
    head = (
        f"{'op':<27} {'shape':<15} {'dtype':<9} {'backend':<8} {'caches':<6} {'import s':>8} {'backend s':>9} "
        f"{'first fwd s':>11} "
        f"{'first bwd s':>11} {'warm fwd ms':>11} {'warm bwd ms':>11}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        what = f"{r.op:<27} {r.shape:<15} {r.dtype:<9} {r.backend:<8} {r.caches:<6}"
        if r.error and r.fwd_s is None:
            lines.append(f"{what} failed: {r.error[:90]}")
            continue
        lines.append(
            f"{what} {_f(r.import_s, '8.1f')} {_f(r.backend_import_s, '9.2f')} {_f(r.fwd_s, '11.2f')} "
            f"{_f(r.bwd_s, '11.2f')} "
            f"{_f(r.warm_fwd_ms, '11.3f')} {_f(r.warm_bwd_ms, '11.3f')}"
            + (f"  over {slow:g} s" if r.slowest() > slow else "")
            + (f"  failed: {r.error[:60]}" if r.error else "")
        )
    return "\n".join(lines)


def _line(r: Result, slow: float) -> str:
    what = f"{r.op} {r.dtype} {r.backend}" + (" (warm caches)" if r.caches == "warm" else "")
    if r.error and r.fwd_s is None:
        return f"{what}: failed: {r.error[:120]}"
    text = f"{what}: fwd {r.fwd_s:.1f} s" + (f", bwd {r.bwd_s:.1f} s" if r.bwd_s is not None else "")
    text += f", warm {_f(r.warm_fwd_ms, '.2f')}/{_f(r.warm_bwd_ms, '.2f')} ms"
    text += f" (process {_f(r.process_s, '.0f')} s)"
    if r.slowest() > slow:
        text += f"  OVER {slow:g} s"
    return text + (f"; failed: {r.error[:100]}" if r.error else "")


def _parse(argv: list[str]) -> argparse.Namespace:
    p = cli.parser("first-call", __doc__)
    p.add_argument("--ops", default="all", help="comma-separated ops, or all")
    p.add_argument("--dtypes", default="bfloat16,float16,float32", help="comma-separated dtypes")
    p.add_argument("--backends", default="helion,triton", help="comma-separated, from helion, triton, auto")
    p.add_argument("--quick", action="store_true", help="tiny shapes (the only choice on a CPU, in interpret mode)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds one subprocess may take")
    p.add_argument("--slow", type=float, default=3.0, help="flag first calls slower than this many seconds")
    p.add_argument("--warm", action="store_true",
                   help="each case twice: with empty caches, then a second fresh process on the caches the first left")
    p.add_argument("--jobs", type=int, default=1, help="subprocesses at once (more contend for the CPU that compiles)")
    p.add_argument("--out", type=Path, default=None,
                   help="where to write (default: bench/results/<gpu>/first_call; on a CPU, "
                        "$TMPDIR/hkernels-bench/first_call)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _parse(argv)
    if args.child is not None:
        return _child_main(args.child)
    from hkernels.runtime import interpret as _interpret

    on_gpu = torch.cuda.is_available()
    if not on_gpu and not (args.quick and _interpret.enabled()):
        print(
            "python -m bench first-call times GPU compilation and found no CUDA GPU. Without one, only a check of the "
            "command runs: HKERNELS_INTERPRET=1 python -m bench first-call --quick",
            file=sys.stderr,
        )
        return 2
    if not on_gpu:
        print("interpret mode on a CPU: nothing compiles, so these times measure nothing (a check of the command)",
              file=sys.stderr)

    from bench import harness
    from bench.ops import OPS

    device = torch.device("cuda" if on_gpu else "cpu")
    ops = list(OPS) if args.ops == "all" else args.ops.split(",")
    dtypes, backends = args.dtypes.split(","), args.backends.split(",")
    known = (
        (ops, OPS, "op"),
        (dtypes, ("bfloat16", "float16", "float32"), "dtype"),
        (backends, ("helion", "triton", "auto"), "backend"),
    )
    for names, choices, what in known:
        bad = [x for x in names if x not in choices]
        if bad:
            print(f"unknown {what}(s) {', '.join(bad)}; choose from {', '.join(choices)}", file=sys.stderr)
            return 2
    out = args.out or harness.default_out(device) / "first_call"
    env = harness.environment(device, command=shlex.join(["python", "-m", "bench", "first-call", *argv]))
    env.update(
        timeout_s=args.timeout,
        jobs=args.jobs,
        caches=sorted(CACHE_VARS),
        warm=args.warm,
    )

    todo = [(op, dt, b, shape_for(op, args.quick, device)) for op in ops for dt in dtypes for b in backends]
    rows: list[list[Result] | None] = [None] * len(todo)
    done = 0
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        futures = {pool.submit(run_one, *job, args.timeout, args.warm): i for i, job in enumerate(todo)}
        for future in as_completed(futures):
            try:
                case = future.result()
            except Exception as e:  # this harness's own failure on one row: keep the others
                op, dt, b, shape = todo[futures[future]]
                case = [Result(op, dt, b, "x".join(str(s) for s in shape if s), error=f"{type(e).__name__}: {e}")]
            rows[futures[future]] = case
            done += 1
            for row in case:
                print(f"[{done}/{len(todo)}] {_line(row, args.slow)}", file=sys.stderr, flush=True)
            _write(out, [r for c in rows if c is not None for r in c], env, args.slow)  # an interrupted run keeps them

    finished = [r for c in rows if c is not None for r in c]
    print(f"\nresults in {out}/ (results.json, table.txt)\n")
    print(table(finished, args.slow))
    slow = [r for r in finished if r.slowest() > args.slow]
    if slow:
        print(f"\n{len(slow)} of {len(finished)} rows take over {args.slow:g} s on a first call:")
        for r in sorted(slow, key=Result.slowest, reverse=True):
            print(f"  {r.op} {r.dtype} {r.backend}: {r.slowest():.1f} s")
    return 1 if any(r.error for r in finished) else 0


def _write(out: Path, rows: list[Result], env: dict[str, object], slow: float) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"env": env, "rows": [asdict(r) for r in rows]}, indent=1))
    (out / "table.txt").write_text(table(rows, slow) + "\n")


if __name__ == "__main__":
    sys.exit(main())
