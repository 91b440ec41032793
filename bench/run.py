"""python -m bench [run]: which kernel to use on this GPU, how close it is to the hardware, and whether it is right.

For each op x shape x mode x backend: the median GPU time (the call replayed as a CUDA graph, L2 flushed between
replays), the per-call latency from Python in µs (calls back to back: host overhead or GPU time, whichever is
longer; --latency measures only that, the quick pass for decode shapes), the GB/s of the bytes the op must move
and their share of the device-to-device copy bandwidth measured in the same run, the speed relative to PyTorch
eager and torch.compile, the extra peak memory of a call, and the largest error against a float64 reference
(relative to the reference's largest value; a row of hkernels beyond the dtype's tolerance fails the run).
Modes: fwd, fwd_bwd, and bwd (fwd_bwd minus fwd, both measured in the run). Backends: helion, triton and auto
(hkernels), hk_torch (hkernels on its torch backend: PyTorch's fused kernel where it has one, what auto may choose),
torch (plain PyTorch eager), torch_compile (the same, compiled), auto_compile (hkernels' call inside
torch.compile), liger (Liger-Kernel, when importable), sdpa_flash and sdpa_cudnn (SDPA with that backend forced, for
attention), flex (torch.nn.attention.flex_attention compiled, for the attention variants SDPA lacks). Writes
results.csv, results.json (with the environment), table.txt, report.md and a PNG per memory-bound op.

Without a GPU, HKERNELS_INTERPRET=1 python -m bench --quick is a check, not a measurement: the kernels run in
Triton's interpreter on a CPU, so their times mean nothing and none are reported. It checks that every op x
backend x mode (fwd, fwd_bwd) runs, twice (the first call of its signature, then a second that reuses what the
first built), and matches the float64 reference within tolerance; report.md and table.txt list the checks,
results.json holds the rows without times.
"""

from __future__ import annotations

import importlib
import os
import shlex
import sys
import time
from pathlib import Path

# The float64 references of the largest shapes (8192 x 262144 logits: 16 GiB a tensor) need segments that grow in
# place: fixed-size segments leave too much reserved but unallocated. Timing is unaffected (the caching allocator
# serves the timed calls either way). Set before torch is imported, so that CUDA sees it.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch

from bench import cli

BACKENDS = ("helion", "triton", "auto", "hk_torch", "torch", "torch_compile", "auto_compile", "liger", "sdpa_flash",
            "sdpa_cudnn", "flex", "grouped_mm", "dense_mm", "unfused")
DEFAULT_BACKENDS = ("helion", "triton", "hk_torch", "torch", "torch_compile", "auto_compile", "liger", "sdpa_flash",
                    "sdpa_cudnn", "flex", "grouped_mm", "dense_mm", "unfused")
# other libraries, timed for the ops that have them: Liger; SDPA with a backend forced; flex_attention compiled;
# torch._grouped_mm and one dense matmul of the same flops (grouped_matmul); hkernels' own ops unfused (the calls a
# fused op replaces: qk_norm_rope's rms_norm then rope)
PEERS = ("liger", "sdpa_flash", "sdpa_cudnn", "flex", "grouped_mm", "dense_mm", "unfused")
OURS = ("helion", "triton", "auto", "auto_compile")


def _parse(argv: list[str]):
    p = cli.parser("run", __doc__)
    p.add_argument("--ops", default="all", help="comma-separated ops, or all")
    p.add_argument("--backends", default=",".join(DEFAULT_BACKENDS),
                   help=f"comma-separated, from {', '.join(BACKENDS)}")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"], help="the inputs' dtype")
    p.add_argument("--modes", "--mode", default="fwd,fwd_bwd", help="comma-separated, from fwd, bwd, fwd_bwd")
    p.add_argument(
        "--shapes",
        default="llama3",
        help="comma-separated presets (llama3 = llama3-8b + llama3-70b, llama3-8b, llama3-70b, qwen, decode, "
        "prefill) and/or MxN or MxNxK sizes",
    )
    p.add_argument("--quick", action="store_true",
                   help="two small shapes per op instead of --shapes (on a CPU, with HKERNELS_INTERPRET=1, the only "
                        "mode: a check of every op, no timings)")
    p.add_argument(
        "--latency",
        "--no-graph",
        dest="latency",
        action="store_true",
        help="only the per-call latency from Python (calls back to back), no CUDA-graph GPU time: ms is then the "
        "latency; the fast pass for decode shapes",
    )
    p.add_argument("--kernels", action="store_true",
                   help="also profile each timed row's call (torch.profiler): its GPU kernels, the longest first, in "
                        "kernels.md and each row's 'kernels' (where a backend's time goes, kernel by kernel)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNGs (they need matplotlib)")
    p.add_argument("--out", type=Path, default=None,
                   help="where to write results (default: bench/results/<gpu>; on a CPU, $TMPDIR/hkernels-bench)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _parse(argv)
    from hkernels.runtime import interpret as _interpret

    on_gpu = torch.cuda.is_available()
    if not on_gpu and not (args.quick and _interpret.enabled()):
        print(
            "python -m bench measures GPU kernels and found no CUDA GPU. Without one, only a check of every op runs "
            "(no timings): HKERNELS_INTERPRET=1 python -m bench --quick",
            file=sys.stderr,
        )
        return 2

    from bench import harness, report
    from bench.ops import MODES, OPS, PRESETS, callable_for, preset_shapes, quick_shapes
    from hkernels.tune.cases import make_inputs
    from hkernels.tune.timing import time_graph, time_per_call

    dynamo_config = importlib.import_module("torch._dynamo.config")
    # torch.compile recompiles per shape; the default limit (8 per function) would fall back to eager silently.
    for knob in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit", "accumulated_cache_size_limit"):
        if hasattr(dynamo_config, knob):
            setattr(dynamo_config, knob, 4096)

    device = torch.device("cuda" if on_gpu else "cpu")
    dtype = getattr(torch, args.dtype)
    ops = list(OPS) if args.ops == "all" else args.ops.split(",")
    backends = args.backends.split(",")
    modes = args.modes.split(",")
    for names, known, what in ((ops, OPS, "op"), (backends, BACKENDS, "backend"), (modes, MODES, "mode")):
        bad = [x for x in names if x not in known]
        if bad:
            print(f"unknown {what}(s) {', '.join(bad)}; choose from {', '.join(known)}", file=sys.stderr)
            return 2
    if not on_gpu:  # the check on a CPU: interpreted kernels and eager PyTorch only
        backends = [b for b in backends if b in ("helion", "triton", "auto", "hk_torch", "torch")]
        print(harness.INTERPRETED, flush=True)

    def shapes_for(op_name: str) -> list[tuple[int, int, int]]:
        if args.quick:
            return quick_shapes(OPS[op_name], device)
        shapes: list[tuple[int, int, int]] = []
        for item in args.shapes.split(","):
            if item in PRESETS:
                shapes += preset_shapes(item, OPS[op_name])
            else:
                sizes = [int(x) for x in item.split("x")]
                if len(sizes) not in (2, 3):
                    raise ValueError(f"a shape is MxN or MxNxK, got {item!r}")
                shapes.append((sizes[0], sizes[1], sizes[2] if len(sizes) == 3 else 0))
        return list(dict.fromkeys(shapes))

    def backends_for(op_name: str) -> list[str]:
        op = OPS[op_name]
        return [b for b in backends if (b not in PEERS or b in op.peers) and (b != "torch_compile" or op.compile)]

    try:
        for op in ops:
            shapes_for(op)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2

    env = harness.environment(device, command=shlex.join(["python", "-m", "bench", *argv]))
    copy = None
    if on_gpu:
        copy = harness.copy_gbps(device)
        print(f"device-to-device copy: {copy:.0f} GB/s (bytes read + written)", file=sys.stderr)
        env["copy_gbps"] = round(copy, 1)
    else:
        env["timed"] = False  # interpreted: report.md, table.txt and compare show the checks only
    env["dtype"] = args.dtype
    out = args.out or harness.default_out(device)

    measured = [m for m in ("fwd", "fwd_bwd") if m in modes or "bwd" in modes]

    def modes_of(op_name: str) -> list[str]:  # a forward-only op (no input gets a gradient) has no fwd_bwd rows
        return measured if OPS[op_name].diff else [m for m in measured if m == "fwd"]

    total = sum(len(shapes_for(op)) * len(backends_for(op)) * len(modes_of(op)) for op in ops)
    rows: list[harness.Row] = []
    compiled: dict[str, object] = {}
    i = 0
    for op_name in ops:
        op = OPS[op_name]
        for m, n, k in shapes_for(op_name):
            inputs = make_inputs(op, (m, n, k), dtype, device)
            itemsize = inputs[0].element_size()
            try:
                ups, ref, ref_grads = _reference(op, inputs, modes_of(op_name))
            except torch.OutOfMemoryError:  # once more, with every cached block given back first
                torch.cuda.empty_cache()
                ups, ref, ref_grads = _reference(op, inputs, modes_of(op_name))
            by_mode: dict[str, list[harness.Row]] = {}
            for mode in modes_of(op_name):
                group = by_mode.setdefault(mode, [])
                for backend in backends_for(op_name):
                    i += 1
                    row = harness.Row(op_name, m, n, args.dtype, mode, backend, k)
                    group.append(row)
                    fn = callable_for(op, backend, compiled)
                    if fn is None:
                        row.error = "not available here"
                        continue
                    t0 = time.perf_counter()
                    try:
                        row.max_err, step = _check_and_step(fn, mode, inputs, op, ups, ref, ref_grads)
                        if on_gpu:
                            torch.cuda.synchronize(device)
                        row.first_s = time.perf_counter() - t0
                        if on_gpu:
                            med, p20, p80 = time_per_call(step, device)
                            row.ms = row.ms_eager = med
                            row.spread, row.us_call = (p80 - p20) / med, med * 1e3
                            row.timing = "per call (back to back)"
                            row.peak_mib = harness.peak_mib(step, device)
                            if not args.latency:
                                try:
                                    med, p20, p80 = time_graph(step, device)
                                    row.ms, row.spread, row.timing = med, (p80 - p20) / med, "graph"
                                except Exception as e:  # keep the per-call time, and say why
                                    row.timing = f"per call (graph capture failed: {type(e).__name__})"
                            _rates(row, op, copy, itemsize)
                            if args.kernels:  # (a profiler that fails leaves the row's times standing)
                                try:
                                    row.kernels = harness.kernel_times(step, device)
                                except Exception as e:
                                    print(f"{op_name} {mode} {backend}: kernels not profiled ({type(e).__name__}: "
                                          f"{e})", file=sys.stderr)
                        else:  # no timing: check a second call too, which reuses what the first built (its plan)
                            again, _ = _check_and_step(fn, mode, inputs, op, ups, ref, ref_grads)
                            row.max_err = max(row.max_err, again)
                            row.timing = "not timed (interpreted on a CPU)"
                    except Exception as e:
                        row.error = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
                    if on_gpu:
                        row.bench_s = time.perf_counter() - t0
                    else:  # interpreted: no time means anything, so none is kept
                        row.first_s = None
                    harness.progress(i, total, _line(row))
            if "bwd" in modes and on_gpu and "fwd_bwd" in by_mode:  # a difference of times: nothing to check on a CPU
                by_mode["bwd"] = _backward_rows(by_mode, op, copy, itemsize)
            for mode in modes:
                if mode in by_mode:
                    _relative(by_mode[mode])
                    rows.extend(by_mode[mode])
            del inputs, ups, ref, ref_grads
            if on_gpu:
                torch.cuda.empty_cache()
            harness.write(out, rows, env)  # after every shape: an interrupted run keeps what it measured
        report.write(out, rows, env, plots=not args.no_plots)  # and the report after every op

    harness.write(out, rows, env)
    report.write(out, rows, env, plots=not args.no_plots)
    failed = [r for r in rows if r.backend in OURS and (r.error or not harness.within_tolerance(r))]
    if on_gpu:
        print(f"\ncopy bandwidth {copy:.0f} GB/s; results in {out}/ (report.md, table.txt, results.csv/json, PNGs)\n")
        print(harness.table(rows))
        first = sum(r.first_s or 0 for r in rows)
        print(
            f"benchmark time on rows: {sum(r.bench_s or 0 for r in rows):.0f} s, of which first calls (compiling) "
            f"{first:.0f} s",
            file=sys.stderr,
        )
    else:  # each row was printed as it ran: the verdict, and where it was written
        print(f"\n{harness.check_summary(rows)}")
        if "bwd" in modes:
            print("bwd rows (fwd_bwd minus fwd, a difference of times) are left out: the backward is checked in "
                  "fwd_bwd.")
        print(f"Written to {out}/: report.md (the verdict and every row), table.txt (every row's error against "
              "float64, its tolerance and the result), results.csv and results.json (the rows and the environment).")
    for r in failed:
        why = r.error or f"max err {r.max_err:.1e} beyond the tolerance {harness.tolerance(r.dtype):.0e}"
        print(f"hkernels failed: {r.op} {harness.shape_of(r)} {r.mode} {r.backend}: {why}", file=sys.stderr)
    return 1 if failed else 0


def _outputs(out) -> tuple:
    return out if isinstance(out, tuple) else (out,)


def _reference(op, inputs, modes):
    """Upstream gradients (random; exactly 1 for a scalar loss, as ``loss.backward()`` gives), and the float64
    reference outputs and gradients (of ``op.ref_view`` of everything, where the op has one)."""
    view = op.ref_view or (lambda t: t)
    ins64 = [
        view(t).double().requires_grad_(i in op.diff) if t.is_floating_point() else t for i, t in enumerate(inputs)
    ]
    ref = _outputs(op.ref(*ins64))
    if op.ref_view is None:
        shapes = [r.shape for r in ref]
    else:  # the upstream gradients must have the full outputs' shapes
        with torch.no_grad():
            shapes = [o.shape for o in _outputs(op.eager(*inputs))]
    g = torch.Generator(device=inputs[0].device).manual_seed(1)
    dtype = inputs[0].dtype
    ups = [
        torch.ones(s, device=r.device, dtype=dtype) if len(s) == 0
        else torch.randn(s, generator=g, device=r.device, dtype=torch.float64).to(dtype)
        for s, r in zip(shapes, ref, strict=True)
    ]
    ref_grads = []
    if "fwd_bwd" in modes:
        ref_grads = torch.autograd.grad(ref, [ins64[i] for i in op.diff], [view(u).double() for u in ups])
    return ups, [r.detach() for r in ref], ref_grads


def _check_and_step(fn, mode, inputs, op, ups, ref, ref_grads):
    """Run once against the float64 reference (relative max error); return the error and the step to time."""
    view = op.ref_view or (lambda t: t)

    def rel(got, want):
        return ((view(got).double() - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()

    if mode == "fwd":
        # Fresh copies, in the same layout (clone keeps the strides): a peer may write into its inputs, and the timed
        # step calls it thousands of times on them. Liger's rope rotates q and k in place when q.transpose(1, 2) is
        # contiguous (HF's layout, bench/ops.py's _rope): shared inputs would differ from the reference's in every
        # later row.
        ins = [t.detach().clone() for t in inputs]
        # Grad mode as in the timed step (no input requires a gradient here, so no graph is recorded either way):
        # torch.compile guards on it, and a check under no_grad would compile every shape a second time for the step.
        outs = _outputs(fn(*ins))
        return max(rel(o.detach(), r) for o, r in zip(outs, ref, strict=True)), lambda: fn(*ins)
    # Fresh copies that get gradients (a peer may write into its inputs: Liger's cross-entropy and rope do).
    diff = op.diff
    ins = [t.detach().clone().requires_grad_(i in diff) if i in diff else t for i, t in enumerate(inputs)]
    wrt = [ins[i] for i in diff]
    outs = _outputs(fn(*ins))
    grads = torch.autograd.grad(outs, wrt, ups)
    err = max([rel(o.detach(), r) for o, r in zip(outs, ref, strict=True)]
              + [rel(g, r) for g, r in zip(grads, ref_grads, strict=True)])
    return err, lambda: torch.autograd.grad(_outputs(fn(*ins)), wrt, ups)


def _rates(row, op, copy, itemsize) -> None:
    from bench.ops import bytes_moved, flops

    moved = bytes_moved(op, row.mode, row.m, row.n, itemsize, row.k)
    if moved is not None:
        row.gbps = moved / row.ms / 1e6
        row.pct_copy = 100 * row.gbps / copy
    work = flops(op, row.mode, row.m, row.n, row.k)
    if work is not None:
        row.tflops = work / row.ms / 1e9


def _backward_rows(by_mode, op, copy, itemsize):
    """The backward alone: forward+backward minus forward, per backend, both measured in this run."""
    from bench.harness import Row

    out = []
    fwd = {r.backend: r for r in by_mode["fwd"]}
    for both in by_mode["fwd_bwd"]:
        row = Row(both.op, both.m, both.n, both.dtype, "bwd", both.backend, both.k,
                  timing=f"fwd_bwd - fwd ({both.timing})")
        f = fwd[both.backend]
        if both.ms and f.ms and both.ms > f.ms:
            row.ms = both.ms - f.ms
            row.spread = ((both.spread or 0) * both.ms + (f.spread or 0) * f.ms) / row.ms
            if both.ms_eager and f.ms_eager and both.ms_eager > f.ms_eager:
                row.ms_eager = both.ms_eager - f.ms_eager
                row.us_call = row.ms_eager * 1e3
            _rates(row, op, copy, itemsize)
            row.max_err, row.peak_mib = both.max_err, both.peak_mib
        elif both.error or f.error:
            row.error = both.error or f.error
        else:  # both measured, the difference lost in the noise (tiny calls): no number, no failure
            row.timing = f"fwd_bwd - fwd: not measurable, fwd_bwd {both.ms:.4g} ms <= fwd {f.ms:.4g} ms"
        out.append(row)
    return out


def _relative(group) -> None:
    """Each row's speedups over eager, torch.compile and Liger of the same op, shape and mode: in GPU time and in
    the time from Python."""
    for field, peer in (("eager", "torch"), ("compile", "torch_compile"), ("liger", "liger")):
        gpu = {r.backend: r.ms for r in group if r.ms}
        py = {r.backend: r.ms_eager for r in group if r.ms_eager}
        for r in group:
            if r.ms and gpu.get(peer):
                setattr(r, f"vs_{field}", gpu[peer] / r.ms)
            if r.ms_eager and py.get(peer):
                setattr(r, f"vs_{field}_py", py[peer] / r.ms_eager)


def _line(row) -> str:
    from bench.harness import shape_of, tolerance, within_tolerance

    what = f"{row.op} {shape_of(row)} {row.mode} {row.backend}"
    if row.error:
        return f"{what}: {row.error[:100]}"
    if row.ms is None:  # checked, not timed
        verdict = "within" if within_tolerance(row) else "BEYOND"
        return f"{what}: max err {row.max_err:.1e}, {verdict} the tolerance {tolerance(row.dtype):.0e}"
    rate = f"{row.gbps:.0f} GB/s ({row.pct_copy:.1f}% of copy)" if row.gbps else f"{row.tflops or 0:.0f} TFLOP/s"
    return (
        f"{what}: {'GPU ' if 'graph' in row.timing else ''}{row.ms:.4f} ms, from Python {row.us_call or 0:.1f} "
        f"µs/call, {rate}, "
        f"peak {row.peak_mib or 0:.0f} MiB, "
        f"max err {row.max_err:.1e} (first call {row.first_s or 0:.1f} s, row {row.bench_s or 0:.1f} s)"
    )


if __name__ == "__main__":
    sys.exit(main())
