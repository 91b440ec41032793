"""``python -m bench``: time every op on every backend at Llama-3 shapes, against the copy bandwidth of this GPU.

For each op × shape × mode (fwd, fwd_bwd) × backend it reports the median GPU time (the call replayed as a CUDA
graph; the per-call time from Python, host overhead included, is reported beside it), the GB/s of the bytes the op
must move, that as a share of the device-to-device copy bandwidth measured in the same run, the speed relative
to torch.compile, and the largest error against a float64 reference. Backends: helion and triton (hkernels),
torch (plain PyTorch eager: F.rms_norm, F.layer_norm, torch.softmax), torch_compile (the same, compiled), and
liger (Liger-Kernel, when importable). Writes results.csv, results.json (with the environment) and table.txt.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path

import torch

BACKENDS = ("helion", "triton", "torch", "torch_compile", "liger")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--ops", default="all", help="comma-separated ops (default: all)")
    p.add_argument("--backends", default=",".join(BACKENDS), help=f"comma-separated, from {', '.join(BACKENDS)}")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--modes", default="fwd,fwd_bwd", help="fwd, fwd_bwd or both")
    p.add_argument("--shapes", default=None, help="MxN,MxN,... instead of each op's Llama-3 shapes")
    p.add_argument("--quick", action="store_true", help="a smoke pass on tiny shapes (the only mode on CPU)")
    p.add_argument(
        "--no-graph", action="store_true", help="time per call from Python only (default: GPU time from CUDA graphs)"
    )
    p.add_argument("--out", type=Path, default=None, help="where to write results (default: bench/results/<gpu>)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    on_gpu = torch.cuda.is_available()
    interpret = os.environ.get("HKERNELS_INTERPRET", "") == "1"
    if not on_gpu and not (args.quick and interpret):
        print(
            "python -m bench measures GPU kernels and found no CUDA GPU. Without one, only a smoke pass of the "
            "harness runs: HKERNELS_INTERPRET=1 python -m bench --quick",
            file=sys.stderr,
        )
        return 2

    from bench import harness
    from bench.ops import LIGER, OPS, QUICK_SHAPES, bytes_moved, make_inputs
    from hkernels import use_backend  # before anything imports triton: interpret mode must be set up first

    dynamo_config = importlib.import_module("torch._dynamo.config")

    device = torch.device("cuda" if on_gpu else "cpu")
    # torch.compile recompiles per shape; the default limit (8 per function) would fall back to eager silently.
    for knob in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit", "accumulated_cache_size_limit"):
        if hasattr(dynamo_config, knob):
            setattr(dynamo_config, knob, 4096)
    dtype = getattr(torch, args.dtype)
    ops = list(OPS) if args.ops == "all" else args.ops.split(",")
    backends = args.backends.split(",")
    modes = args.modes.split(",")
    for name, known, what in ((ops, OPS, "op"), (backends, BACKENDS, "backend"), (modes, ("fwd", "fwd_bwd"), "mode")):
        bad = [x for x in name if x not in known]
        if bad:
            print(f"unknown {what}(s) {', '.join(bad)}; choose from {', '.join(known)}", file=sys.stderr)
            return 2
    if not on_gpu:
        backends = [b for b in backends if b in ("helion", "triton", "torch")]
    if args.shapes:
        shapes_for = lambda op: [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    elif args.quick:
        shapes_for = lambda op: QUICK_SHAPES
    else:
        shapes_for = lambda op: OPS[op].shapes

    copy = harness.copy_gbps(device)
    print(f"device-to-device copy: {copy:.0f} GB/s (bytes read + written)", file=sys.stderr)
    env = harness.environment(device)
    env["copy_gbps"] = round(copy, 1)

    out = args.out or harness.default_out(device)
    jobs = [(op, s, mode, b) for op in ops for s in shapes_for(op) for mode in modes for b in backends]
    rows: list[harness.Row] = []
    compiled: dict[str, object] = {}
    i = 0
    for op_name in ops:
        op = OPS[op_name]
        for m, n in shapes_for(op_name):
            x, params, dy = make_inputs(op, m, n, dtype, device)
            x64 = x.double().requires_grad_()
            p64 = [p.double().requires_grad_() for p in params]
            ref = op.ref(x64, *p64)
            ref_grads = torch.autograd.grad(ref, [x64, *p64], dy.double())
            ref = ref.detach()
            for mode in modes:
                group: list[harness.Row] = []
                for backend in backends:
                    i += 1
                    row = harness.Row(op_name, m, n, args.dtype, mode, backend)
                    group.append(row)
                    fn = _callable(op, backend, compiled, LIGER, use_backend)
                    if fn is None:
                        row.error = "not available here"
                        continue
                    try:
                        row.max_err, step = _check_and_step(fn, mode, x, params, dy, ref, ref_grads)
                        row.ms_eager = row.ms = harness.time_ms(step, device)
                        if on_gpu and not args.no_graph:
                            try:
                                row.ms, row.timing = harness.time_graph_ms(step, device), "graph"
                            except Exception as e:  # keep the per-call time, and say why
                                row.timing = f"per call (graph capture failed: {type(e).__name__})"
                        row.gbps = bytes_moved(op, mode, m, n, x.element_size()) / row.ms / 1e6
                        row.pct_copy = 100 * row.gbps / copy
                    except Exception as e:
                        row.error = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
                    harness.progress(i, len(jobs), _line(row))
                base = {r.backend: r.ms for r in group if r.ms}
                for r in group:
                    if r.ms and base.get("torch_compile"):
                        r.vs_compile = base["torch_compile"] / r.ms
                    if r.ms and base.get("torch"):
                        r.vs_eager = base["torch"] / r.ms
                rows.extend(group)
            del x, params, dy, x64, p64, ref, ref_grads
            if on_gpu:
                torch.cuda.empty_cache()
            harness.write(out, rows, env)  # after every shape: an interrupted run keeps what it measured

    harness.write(out, rows, env)
    print(f"\ncopy bandwidth {copy:.0f} GB/s; results in {out}/ (results.csv, results.json, table.txt)\n")
    print(harness.table(rows))
    failed = [r for r in rows if r.error and r.backend in ("helion", "triton")]
    for r in failed:
        print(f"hkernels failed: {r.op} {r.m}x{r.n} {r.mode} {r.backend}: {r.error}", file=sys.stderr)
    return 1 if failed else 0


def _callable(op, backend, compiled, liger, use_backend):
    if backend in ("helion", "triton"):

        def run(*a):
            with use_backend(backend):
                return op.kernel(*a)

        return run
    if backend == "torch":
        return op.eager
    if backend == "torch_compile":
        key = op.name
        if key not in compiled:
            compiled[key] = torch.compile(op.eager, dynamic=False)
        return compiled[key]
    if backend == "liger":
        return liger.get(op.name)
    raise ValueError(backend)


def _check_and_step(fn, mode, x, params, dy, ref, ref_grads):
    """Run once against the float64 reference (relative max error); return the error and the step to time."""

    def rel(got, want):
        return ((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()

    if mode == "fwd":
        with torch.no_grad():
            err = rel(fn(x, *params), ref)
        return err, lambda: fn(x, *params)
    xg = x.detach().clone().requires_grad_()
    pg = [p.detach().clone().requires_grad_() for p in params]
    inputs = [xg, *pg]
    y = fn(xg, *pg)
    grads = torch.autograd.grad(y, inputs, dy)
    err = max([rel(y.detach(), ref)] + [rel(g, r) for g, r in zip(grads, ref_grads, strict=True)])
    return err, lambda: torch.autograd.grad(fn(xg, *pg), inputs, dy)


def _line(row) -> str:
    what = f"{row.op} {row.m}x{row.n} {row.mode} {row.backend}"
    if row.error:
        return f"{what}: {row.error[:100]}"
    return f"{what}: {row.ms:.4f} ms, {row.gbps:.0f} GB/s ({row.pct_copy:.1f}% of copy), max err {row.max_err:.1e}"


if __name__ == "__main__":
    sys.exit(main())
