"""python -m bench latency: per-call latency at decode shapes, timed in interleaved rounds.

A shared host's speed drifts within a run, so latencies measured one backend after another (python -m bench
--latency) rank nothing finer than that drift. Here every backend of one op and shape is timed in each round, in
a fresh random order, as a loop of calls back to back between two syncs (what a caller waits for: host work or
GPU time, whichever is longer); ratios are taken within a round, then the median over rounds, so a slow stretch of
the host moves numerator and denominator together. Kernel backends run inside one use_backend scope per loop (as
under HKERNELS_BACKEND), not one per call.

Reported per op and shape: the median µs per call of each backend, and the paired ratios: each backend against
eager, torch.compile and Liger, and auto against the faster of helion and triton. ``auto_compile`` is hkernels' call
inside torch.compile: with eager PyTorch (torch), hkernels (auto) and torch.compile, the four columns. --mode
fwd_bwd times forward and backward calls back to back (torch.autograd.grad per call) instead of forward calls under
no_grad. latency.md beside latency.json is the table.

--dynamic: the compiled backends (torch_compile, auto_compile) are compiled with torch.compile's default
``dynamic=None`` and called once at another row count before they are timed, so the timed calls run the graph
torch.compile makes when a length changes (the row count symbolic), as a fine-tuning run with varying lengths does;
without it each shape gets its own static graph.

--gpu-time (a GPU only) times the kernels instead of the calls, for any shape: each backend's step (--mode fwd or
fwd_bwd) captured once as a CUDA graph, then in each round every graph replayed under do_bench (L2 flushed
between replays), in a fresh random order; the same paired ratios. Graph-timed rows measured one after another
drift apart as the host does; interleaved rounds settle whether auto is within 3% of the faster backend.

On a CPU (HKERNELS_INTERPRET=1, --quick) the command runs as a check of itself: interpreted times measure nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench import cli
from bench.ops import OPS, PRESETS, callable_for, preset_shapes, quick_shapes
from hkernels.runtime import interpret as _interpret
from hkernels.tune.cases import make_inputs
from hkernels.tune.timing import capture_graph, time_quantiles

BACKENDS = ("auto", "helion", "triton", "hk_torch", "torch", "torch_compile", "auto_compile", "liger")
_INTERPRETED = ("interpret mode on a CPU: the kernels run in Triton's interpreter, so these times measure nothing "
                "(a check that the command runs)")
KERNEL_BACKENDS = ("auto", "helion", "triton", "hk_torch")  # hk_torch: hkernels on its torch backend


def _loop(op: Any, backend: str, inputs: list[torch.Tensor], compiled: dict[str, Any],
          mode: str = "fwd", dynamic: bool = False) -> Callable[[int], None]:
    """A function running ``n`` calls of ``backend`` back to back: forwards (under no_grad), or forwards and
    backwards (``mode="fwd_bwd"``: one ``torch.autograd.grad`` per call)."""
    import hkernels

    fn = op.kernel if backend in KERNEL_BACKENDS else callable_for(op, backend, compiled, dynamic)
    call = fn
    if mode == "fwd_bwd":
        ins = [t.detach().clone().requires_grad_(i in op.diff) if i in op.diff else t for i, t in enumerate(inputs)]
        wrt = [ins[i] for i in op.diff]
        with torch.enable_grad():
            outs = fn(*ins)
        outs = outs if isinstance(outs, tuple) else (outs,)
        ups = [torch.ones_like(o) if o.dim() == 0 else torch.randn_like(o) for o in outs]

        def call(*_: Any) -> object:
            with torch.enable_grad():
                out = fn(*ins)
                return torch.autograd.grad(out if isinstance(out, tuple) else (out,), wrt, ups)

    if backend in KERNEL_BACKENDS:  # one scope per loop, not per call (as under HKERNELS_BACKEND)
        scope = "torch" if backend == "hk_torch" else backend

        def run(n: int) -> None:
            with hkernels.use_backend(scope):
                for _ in range(n):
                    call(*inputs)
        return run

    def run_fn(n: int) -> None:
        for _ in range(n):
            call(*inputs)
    return run_fn


def _step(op: Any, backend: str, inputs: list[torch.Tensor], mode: str,
          compiled: dict[str, Any], dynamic: bool = False) -> Callable[[], object]:
    """One forward (or forward and backward) of ``backend``, to capture as a CUDA graph: kernel backends with
    their scope entered inside, so that the capture records that backend's kernels."""
    fn = callable_for(op, backend, compiled, dynamic)
    if mode == "fwd":
        ins = [t.detach().clone() for t in inputs]  # a peer may write into its inputs
        return lambda: fn(*ins)
    ins = [t.detach().clone().requires_grad_(i in op.diff) if i in op.diff else t for i, t in enumerate(inputs)]
    wrt = [ins[i] for i in op.diff]
    outs = fn(*ins)
    outs = outs if isinstance(outs, tuple) else (outs,)
    ups = [torch.ones_like(o) if o.dim() == 0 else torch.randn_like(o) for o in outs]

    def fwd_bwd() -> object:
        out = fn(*ins)
        return torch.autograd.grad(out if isinstance(out, tuple) else (out,), wrt, ups)
    return fwd_bwd


def measure_graphs(steps: dict[str, Callable[[], object]], device: torch.device, rounds: int,
                   seed: int = 0) -> dict[str, list[float]]:
    """GPU µs of each step per round: each captured once as a CUDA graph, replayed under do_bench per round in a
    random order."""
    graphs = {b: capture_graph(fn, device) for b, fn in steps.items()}
    rng = random.Random(seed)
    times: dict[str, list[float]] = {b: [] for b in graphs}
    for _ in range(rounds):
        order = list(graphs)
        rng.shuffle(order)
        for b in order:
            times[b].append(time_quantiles(graphs[b].replay, device, 5, 20)[0] * 1e3)
    return times


def measure(loops: dict[str, Callable[[int], None]], device: torch.device, rounds: int, calls: int,
            seed: int = 0) -> dict[str, list[float]]:
    """µs per call of each loop, one entry per round; every round times every loop once, in a random order."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *a: None)
    rng = random.Random(seed)
    times: dict[str, list[float]] = {b: [] for b in loops}
    for run in loops.values():  # warm-up: compilation, caches, allocator
        run(max(3, calls // 10))
    sync(device)
    for _ in range(rounds):
        order = list(loops)
        rng.shuffle(order)
        for b in order:
            sync(device)
            t0 = time.perf_counter()
            loops[b](calls)
            sync(device)
            times[b].append((time.perf_counter() - t0) / calls * 1e6)
    return times


def paired(times: dict[str, list[float]], a: str, b: str | tuple[str, ...]) -> float | None:
    """Median over rounds of a's time over b's in the same round (b: several names = their per-round minimum)."""
    names = (b,) if isinstance(b, str) else b
    if a not in times or not all(n in times for n in names):
        return None
    ratios = [times[a][i] / min(times[n][i] for n in names) for i in range(len(times[a]))]
    return statistics.median(ratios)


def markdown(results: list[dict[str, Any]], env: dict[str, Any]) -> str:
    """The table: µs per call of each backend, and hkernels' best over eager, torch.compile and Liger (paired,
    within rounds; > 1 means hkernels waits less)."""
    backends = list(dict.fromkeys(b for r in results for b in r["us_per_call"]))
    lines = [f"# Per-call latency from Python ({env.get('mode', 'fwd')}, {env.get('dtype')})", "",
             f"{env.get('device')} · torch {env.get('torch')} · commit {env.get('commit') or '?'} · "
             f"{env.get('rounds')} interleaved rounds of {env.get('calls')} calls back to back · {env.get('timing')}",
             *(["", f"**{_INTERPRETED[0].upper()}{_INTERPRETED[1:]}.**"] if env.get("device") == "cpu" else []),
             *(["", "Compiled backends with the row count symbolic (--dynamic: called at another row count first)."]
               if any(r.get("compiled") == "row count symbolic" for r in results) else []),
             "", "| op | shape | " + " | ".join(f"{b} µs" for b in backends)
             + " | auto / eager | auto / compile | auto / Liger | auto_compile / compile |",
             "|---|---|" + "---|" * (len(backends) + 4)]
    for r in results:
        us = r["us_per_call"]
        ratio = [r.get(f"vs_{peer}", {}).get("auto") for peer in ("eager", "torch_compile", "liger")]
        ratio.append(r.get("vs_torch_compile", {}).get("auto_compile"))
        lines.append(f"| {r['op']} | {r['shape']} | " + " | ".join(f"{us[b]:.1f}" if b in us else "-" for b in backends)
                     + " | " + " | ".join(f"{1 / v:.2f}" if v else "-" for v in ratio) + " |")
    lines += ["", "auto / peer: the peer's time over auto's (> 1: auto is faster). auto_compile: hkernels' call "
              "inside torch.compile (default mode), against torch.compile of PyTorch's own call.", ""]
    return "\n".join(lines)


def _write(out: Path | None, results: list[dict[str, Any]], device: torch.device, args: argparse.Namespace) -> None:
    if out is None:
        return
    out.mkdir(parents=True, exist_ok=True)
    on_gpu = device.type == "cuda"
    env = {"device": torch.cuda.get_device_name(device) if on_gpu else "cpu", "torch": torch.__version__,
           "rounds": args.rounds if on_gpu else 2, "calls": args.calls if on_gpu else 2,
           "commit": os.environ.get("HKERNELS_COMMIT"),
           "mode": args.mode, "dtype": args.dtype,
           "timing": "GPU time of graph replays" if args.gpu_time else "host loop, then one sync"}
    tmp = out / "latency.json.tmp"  # then renamed: a run killed mid-write keeps the last whole file
    tmp.write_text(json.dumps({"env": env, "rows": results}, indent=1))
    os.replace(tmp, out / "latency.json")
    (out / "latency.md").write_text(markdown(results, env))


def _see_another_length(op: Any, shape: tuple[int, ...], backends: list[str], dtype: torch.dtype,
                        device: torch.device, compiled: dict[str, Any], mode: str) -> None:
    """--dynamic: each compiled backend called (and differentiated, for fwd_bwd) at another row count first, so that
    torch.compile recompiles with the row count symbolic before the timed calls."""
    other = (shape[0] + 1 if shape[0] > 1 else 2, *shape[1:])
    inputs = make_inputs(op, other, dtype, device)
    for b in backends:
        if b in ("torch_compile", "auto_compile"):
            if mode == "fwd":
                with torch.no_grad():
                    callable_for(op, b, compiled, True)(*inputs)
            else:
                _step(op, b, inputs, mode, compiled, True)()


def _parse(argv: list[str]) -> argparse.Namespace:
    p = cli.parser("latency", __doc__)
    p.add_argument("--ops", default=",".join(OPS), help="comma-separated ops")
    p.add_argument("--shapes", default="decode", help="comma-separated presets (decode, ...) and/or MxN sizes")
    p.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated backends")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"), help="the inputs' dtype")
    p.add_argument("--rounds", type=int, default=15, help="interleaved rounds (2 on a CPU)")
    p.add_argument("--calls", type=int, default=200, help="calls per loop (2 on a CPU)")
    p.add_argument("--quick", action="store_true", help="two small shapes per op (the only mode on a CPU)")
    p.add_argument("--gpu-time", action="store_true",
                   help="GPU time of CUDA-graph replays instead of per-call latency (any shape; a GPU only)")
    p.add_argument("--dynamic", action="store_true",
                   help="compiled backends with the row count symbolic (called at another row count first)")
    p.add_argument("--mode", default="fwd", choices=("fwd", "fwd_bwd"),
                   help="what a call runs: a forward (under no_grad), or a forward and its backward")
    p.add_argument("--out", type=Path, default=None, help="where to write latency.json and latency.md (default: "
                                                          "nowhere, the table goes to stdout only)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    on_gpu = torch.cuda.is_available()
    if not on_gpu and not (args.quick and _interpret.enabled()):
        print("python -m bench latency: needs a CUDA GPU (on a CPU: HKERNELS_INTERPRET=1 with --quick, a check of "
              "the command)", file=sys.stderr)
        return 2
    if args.gpu_time and not on_gpu:
        print("python -m bench latency: --gpu-time needs a CUDA GPU (it replays CUDA graphs)", file=sys.stderr)
        return 2
    if not on_gpu:
        print(_INTERPRETED, file=sys.stderr)
    device = torch.device("cuda" if on_gpu else "cpu")
    dtype = getattr(torch, args.dtype)
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    unknown = [o for o in ops if o not in OPS]
    if unknown:
        print(f"python -m bench latency: unknown op(s) {unknown}; valid: {', '.join(OPS)}", file=sys.stderr)
        return 2
    wanted = [b.strip() for b in args.backends.split(",") if b.strip()]
    results: list[dict[str, Any]] = []
    compiled: dict[str, Any] = {}
    for op_name in ops:
        op = OPS[op_name]
        if args.quick:
            shapes = quick_shapes(op, device)
        else:
            shapes = []
            for item in args.shapes.split(","):
                if item in PRESETS:
                    shapes += preset_shapes(item, op)
                elif item:
                    m, n = (int(v) for v in item.lower().split("x")[:2])
                    shapes.append((m, n, 0))
        for shape in shapes:
            inputs = make_inputs(op, shape, dtype, device)
            backends = [b for b in wanted if b in ("auto", "helion", "triton", "hk_torch", "torch", "auto_compile")
                        or (b == "torch_compile" and op.compile) or b in op.peers]
            if args.dynamic:
                _see_another_length(op, shape, backends, dtype, device, compiled, args.mode)
            if args.gpu_time:
                steps = {b: _step(op, b, inputs, args.mode, compiled, args.dynamic) for b in backends}
                times = measure_graphs(steps, device, args.rounds)
            else:
                with torch.no_grad():
                    loops = {b: _loop(op, b, inputs, compiled, args.mode, args.dynamic) for b in backends}
                    times = measure(loops, device, args.rounds if on_gpu else 2, args.calls if on_gpu else 2)
            row = {
                "op": op_name, "shape": "x".join(str(s) for s in shape if s), "dtype": args.dtype,
                "compiled": "row count symbolic" if args.dynamic else "static",
                "timing": f"GPU µs per {args.mode} (graph replays)" if args.gpu_time else "µs per call (host loop)",
                "us_per_call": {b: statistics.median(t) for b, t in times.items()},
                "vs_torch_compile": {b: paired(times, b, "torch_compile") for b in times if b != "torch_compile"},
                "vs_eager": {b: paired(times, b, "torch") for b in times if b != "torch"},
                "vs_liger": {b: paired(times, b, "liger") for b in times if b != "liger"},
                "auto_vs_best_kernel": paired(times, "auto", ("helion", "triton")),
                "rounds": {b: [round(x, 2) for x in t] for b, t in times.items()},
            }
            results.append(row)
            us = row["us_per_call"]
            print(f"{op_name:14s} {row['shape']:>9s} " + " ".join(f"{b} {us[b]:.1f}" for b in backends)
                  + (f" | auto/best {row['auto_vs_best_kernel']:.3f}" if row["auto_vs_best_kernel"] else ""),
                  file=sys.stderr, flush=True)
            _write(args.out, results, device, args)  # after every row: a time limit keeps what was measured
    _write(args.out, results, device, args)
    header = f"{'op':14s} {'shape':>9s} " + " ".join(f"{b:>13s}" for b in wanted) + "   best hk / compile  auto/best"
    print(header)
    for row in results:
        us = row["us_per_call"]
        cells = " ".join(f"{us[b]:13.1f}" if b in us else f"{'-':>13s}" for b in wanted)
        vs = [row["vs_torch_compile"].get(b) for b in ("helion", "triton")]
        best = min((v for v in vs if v is not None), default=None)
        auto = row["auto_vs_best_kernel"]
        print(f"{row['op']:14s} {row['shape']:>9s} {cells}   {f'{best:.2f}' if best else '-':>17s}  "
              f"{f'{auto:.3f}' if auto else '-':>9s}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
