"""``python -m hkernels.tune --ops rms_norm,softmax --shapes 4096x4096,16384x8192``: tune on this GPU.

For each op and shape (M×N, or M×N×K for matmul and attention, as in ``python -m bench``; inputs are the
benchmark's, at the given dtype) it
  1. runs the op forward and backward on Helion once and records which Helion kernels ran, with what arguments;
     each is autotuned with Helion's autotuner (``HELION_AUTOTUNE_EFFORT``, default here quick; precompilation
     off unless ``HELION_AUTOTUNE_PRECOMPILE`` says otherwise: with the default forked
     precompile a tuning run on the H200 outlived its benchmark subprocesses' 30 s timeout, without it a quick
     rms_norm search took 100 s and reached 98% of copy), its search seeded with the shipped config and cut off
     after ``--budget`` seconds per kernel; the tuned config is then timed against the shipped one and written
     for that row length only where it is at least 1% faster;
  2. searches the Triton launch settings where the op has a search space (the row-wise forwards: rms_norm,
     add_rms_norm, layer_norm, softmax; rope's tile size and warps; cross_entropy's block, warps, stages and
     programs per SM), timing each candidate, and writes the fastest;
  3. times the op on helion and on triton with what it just tuned (forward and forward+backward; per-call latency
     at ≤ 64 rows) and writes, per row length and rows, which backend ``auto`` should use (tried before the
     shipped buckets).
Everything goes to the user cache (``HKERNELS_CACHE_DIR``, else ``~/.cache/hkernels``; see ``hkernels.configs``),
which the library then prefers to the shipped tables: ``helion/<arch>/<op>.json``, ``triton/<arch>/<op>.json``,
``auto/<arch>.json``. Progress goes to stdout, one line per step. Without a GPU (interpret mode) it runs steps 2
and 3 on tiny shapes, as a check of the command itself; Helion's autotuner needs a GPU.
"""

from __future__ import annotations

import os

# Helion reads its settings when a kernel is defined: before any kernel module is imported.
os.environ.setdefault("HELION_AUTOTUNE_PRECOMPILE", "")
os.environ.setdefault("HELION_AUTOTUNE_EFFORT", "quick")

import argparse
import datetime
import itertools
import json
import math
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

import hkernels
from bench.auto_table import host_bound  # a host-bound call: compare per-call latency
from hkernels import _interpret, configs

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
ROW_OPS = ("rms_norm", "add_rms_norm", "layer_norm", "softmax")  # the row-wise Triton forwards (row settings)


def _say(text: str) -> None:
    print(text, flush=True)


def _time_ms(fn: Callable[[], object], device: torch.device) -> float:
    """GPU time of ``fn``: replayed as a CUDA graph (the benchmark's ms column), so that a call's host work does not
    hide the kernel's (rope at 4096 tokens: ~27 µs of GPU time under ~120 µs of host work per call, measured);
    do_bench where capture fails; a host clock on a CPU."""
    from bench.harness import time_graph, time_ms  # the benchmark's timers

    if device.type == "cuda":
        try:
            return time_graph(fn, device)[0]
        except Exception:
            pass
    return time_ms(fn, device)


def _parse_shape(text: str) -> tuple[int, int, int]:
    parts = [int(p) for p in text.lower().split("x")]
    if len(parts) not in (2, 3) or min(parts) < 1:
        raise ValueError(f"hkernels.tune: a shape is MxN or MxNxK with positive sizes, got {text!r}")
    return parts[0], parts[1], parts[2] if len(parts) == 3 else 0


class _Case:
    """One op at one shape: its inputs (from the benchmark's builders) and calls that run it."""

    def __init__(self, op: str, shape: tuple[int, int, int], dtype: torch.dtype, device: torch.device) -> None:
        from bench import ops as bench_ops  # the benchmark's input builders: one description of each op's inputs

        if op not in bench_ops.OPS:
            raise ValueError(f"hkernels.tune: unknown op {op!r}; ops are: {', '.join(sorted(bench_ops.OPS))}")
        self.op, self.shape, self.spec = op, shape, bench_ops.OPS[op]
        self.inputs = bench_ops.make_inputs(self.spec, shape, dtype, device)
        self.name = f"{op} {'x'.join(str(s) for s in shape if s)} {str(dtype).removeprefix('torch.')}"

    def forward(self) -> object:
        with torch.no_grad():
            return self.spec.kernel(*self.inputs)

    def forward_backward(self) -> object:
        leaves = [t.detach().requires_grad_(i in self.spec.diff) for i, t in enumerate(self.inputs)]
        out = self.spec.kernel(*leaves)
        outs = out if isinstance(out, tuple) else (out,)
        total = sum(o.float().sum() for o in outs if isinstance(o, torch.Tensor) and o.requires_grad)
        if isinstance(total, torch.Tensor):
            total.backward()
        return out

    def rows_n(self) -> tuple[int, int]:
        """(rows, n) of the first input: how the auto table buckets a call (see hkernels.dispatch)."""
        t = self.inputs[0]
        return t.numel() // t.shape[-1], t.shape[-1]


# ------------------------------------------------------------------------------------------------ Helion


def tune_helion(case: _Case, arch: str, out: Path, budget_s: int | None = None) -> list[str]:
    """Autotune every Helion kernel the op runs at this shape; write a kernel's config where it beats the shipped
    one. Returns summary lines.

    The search starts from the shipped config (a seed of Helion's autotuner) and stops after ``budget_s`` seconds
    per kernel (Helion's own budget; None: the effort's whole search). The tuned and the shipped config are then
    timed against each other (GPU time, same inputs) and the tuned one is written only when it is at least 1%
    faster: a short or noisy search never leaves the user with a slower table than the one shipped.
    """
    import helion

    from hkernels.ops import _helion

    with hkernels.use_backend("helion"), _helion.record() as launches:
        case.forward_backward()
    seen: dict[tuple[str, int], tuple[Any, tuple[Any, ...]]] = {}
    for kernel, args, n in launches:
        seen.setdefault((kernel.name, n), (kernel, args))
    lines = []
    for i, ((name, n), (kernel, args)) in enumerate(seen.items(), 1):
        dtype = next(a.dtype for a in args if isinstance(a, torch.Tensor))
        device = next(a.device for a in args if isinstance(a, torch.Tensor))
        budget = f", budget {budget_s} s" if budget_s else ""
        _say(f"  helion {i}/{len(seen)}: autotuning {name} at n={n} "
             f"({os.environ['HELION_AUTOTUNE_EFFORT']} effort{budget}, seeded with the shipped config)")
        bound = kernel.bind(args)
        shipped_bucket = _helion._bucket(arch, name, n, dtype)
        shipped = _helion._fit(helion.Config(**shipped_bucket["config"]), bound.config_spec.default_config())
        settings = kernel.settings
        saved = settings.autotune_seed_configs, settings.autotune_budget_seconds
        settings.autotune_seed_configs, settings.autotune_budget_seconds = [shipped], budget_s
        t0 = time.perf_counter()
        try:
            config = bound.autotune(args, force=True)
        except Exception as e:  # one kernel's failed search must not cost the others theirs; its table stays
            # (seen on the H200: Helion's search for the layer_norm backward found none of its seeds and random
            # configs working within a 25 s budget and raised NoConfigFound)
            why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            lines.append(f"helion {name} n={n}: search failed after {time.perf_counter() - t0:.0f} s ({why}); "
                         f"shipped config kept")
            _say(f"  helion {i}/{len(seen)}: {name}: search failed ({why}); the shipped config stays")
            continue
        finally:
            settings.autotune_seed_configs, settings.autotune_budget_seconds = saved
        elapsed = time.perf_counter() - t0
        times = {}
        for label, cfg in (("shipped", shipped), ("tuned", config)):
            fn = bound.compile_config(cfg, allow_print=False)
            times[label] = _time_ms(lambda fn=fn, args=args: fn(*args), device)
        gain = times["shipped"] / times["tuned"]
        verdict = (f"{elapsed:.0f} s; shipped {times['shipped'] * 1e3:.1f} µs, tuned {times['tuned'] * 1e3:.1f} µs "
                   f"({gain:.3f}x)")
        if gain >= 1.01:
            bucket = {"min_n": n, "max_n": n, "dtypes": [str(dtype).removeprefix("torch.")],
                      "config": dict(config.config),
                      "tuned": f"{case.name}, {datetime.date.today()}, {elapsed:.0f} s, {gain:.3f}x the shipped"}
            if "programs_per_sm" in shipped_bucket:
                bucket["programs_per_sm"] = shipped_bucket["programs_per_sm"]
            _merge_buckets(out / "helion" / arch / f"{case.op}.json", name, bucket)
            lines.append(f"helion {name} n={n}: written, {verdict}: {config}")
            _say(f"  helion {i}/{len(seen)}: {name}: {verdict}: written")
        else:
            lines.append(f"helion {name} n={n}: shipped config kept, {verdict}")
            _say(f"  helion {i}/{len(seen)}: {name}: {verdict}: not faster, the shipped config stays")
    _helion.forget()
    return lines


def _merge_buckets(path: Path, kernel: str, bucket: dict[str, Any]) -> None:
    table = _read(path)
    same = (bucket["min_n"], bucket["max_n"], bucket["dtypes"])
    kept = [b for b in table.get(kernel, []) if (b.get("min_n", 0), b["max_n"], b.get("dtypes")) != same]
    table[kernel] = [bucket, *kept]
    _write(path, table)


# ------------------------------------------------------------------------------------------------ Triton


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
            f"{'resident' if cand.resident else 'looped'}")


def tune_triton(case: _Case, arch: str, out: Path, device: torch.device) -> list[str]:
    """Search the Triton forward's launch settings where the op has a search space; write the fastest. Returns
    summary lines. Row-wise ops and rope time the forward (rope's backward is the same kernel); cross_entropy
    times forward+backward (its forward writes the gradient)."""
    import dataclasses

    from triton_fallback import _common

    spaces: dict[str, tuple[Callable[[int], Iterator[Any]], Callable[[], object]]] = {
        **{op: (_row_candidates, case.forward) for op in ROW_OPS},
        "rope": (_rope_candidates, case.forward),
        "cross_entropy": (_ce_candidates, case.forward_backward),
    }
    if case.op not in spaces:
        _say(f"  triton: no launch-setting search for {case.op} yet (its settings are the shipped heuristics)")
        return [f"triton {case.op}: not searched"]
    space, step = spaces[case.op]
    _, n = case.rows_n()
    timed = []
    candidates = list(space(n))
    with hkernels.use_backend("triton"):
        default_ms = _time_ms(step, device)
        for i, cand in enumerate(candidates, 1):
            _common.searching[(case.op, "fwd")] = cand
            try:
                ms = _time_ms(step, device)
            except Exception as e:  # a candidate that does not compile or run (shared memory, registers): skip it
                _say(f"  triton {i}/{len(candidates)}: {_describe(cand)} failed ({type(e).__name__})")
                continue
            finally:
                _common.searching.pop((case.op, "fwd"), None)
            timed.append((ms, cand))
            _say(f"  triton {i}/{len(candidates)}: {_describe(cand)}: {ms:.4f} ms")
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
    table = _read(path)
    kept = [b for b in table.get("fwd", []) if not (b["min_n"] <= n <= b["max_n"])]
    table["fwd"] = [{"min_n": n, "max_n": n, "settings": settings,
                     "tuned": f"{', '.join(sorted(shapes))}: {geomean:.3f}x the shipped settings' GPU time "
                              f"(geometric mean), {datetime.date.today()}"}, *kept]
    _write(path, table)
    configs.reload()
    return [f"triton {case.op} n={n}: {_describe(settings)}, {geomean:.3f}x shipped over {len(shapes)} shape(s) "
            f"(this shape: best alone {min(timed, key=lambda t: t[0])[0]:.4f} ms, shipped {default_ms:.4f} ms)"]


# (op, n) -> candidate (as JSON) -> shape name -> its time over the shipped settings', for this process's run
_triton_seen: dict[tuple[str, int], dict[str, dict[str, float]]] = {}


# ------------------------------------------------------------------------------------------------ auto




def measure_backends(case: _Case, device: torch.device) -> dict[str, float]:
    """Forward + forward-and-backward time of each kernel backend with the tables as they are now: GPU time (ms),
    or at decode-size rows the per-call latency (µs) of calls back to back, which is what a caller waits for."""
    from bench.harness import time_per_call

    rows, n = case.rows_n()
    if host_bound(rows, n, case.op):
        timer = lambda fn: time_per_call(fn, device)[0] * 1e3
    else:
        timer = lambda fn: _time_ms(fn, device)
    times = {}
    for backend in ("helion", "triton"):
        with hkernels.use_backend(backend):
            times[backend] = timer(case.forward) + timer(case.forward_backward)
    return times


def write_auto(measured: dict[str, list[tuple[int, int, dict[str, float], str]]], arch: str, out: Path) -> None:
    """Per op, auto buckets from every shape measured so far (this run's and earlier runs', kept under "_points"),
    exact in n (``bench.auto_table.buckets``): other row lengths keep the shipped buckets, tried after these."""
    from bench.auto_table import buckets  # the shipped table's bucket builder

    path = out / "auto" / f"{arch}.json"
    table = _read(path)
    kept = table.setdefault("_points", {})
    for op, new_points in measured.items():
        by_shape = {(p[0], p[1]): p for p in kept.get(op, [])}
        for rows, n, t, name in new_points:
            unit = "µs per call (fwd + fwd_bwd latency)" if host_bound(rows, n, op) else "ms (fwd + fwd_bwd)"
            by_shape[(rows, n)] = [rows, n, t["helion"], t["triton"], f"{name}, hkernels.tune {datetime.date.today()}",
                                   unit]
        kept[op] = sorted(by_shape.values())
        table[op] = buckets([(*p, 'ms')[:6] for p in kept[op]], exact_n=True)  # (older points had no unit)
    _write(path, table)


# ------------------------------------------------------------------------------------------------ files


def _read(path: Path) -> dict[str, Any]:
    return configs._read(path)  # missing: empty; unreadable: a warning, then empty (rewritten whole)


def _write(path: Path, table: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(table, indent=1) + "\n")
    tmp.replace(path)  # readers never see half a file


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hkernels.tune", description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", required=True, help="comma-separated ops (as in python -m bench)")
    parser.add_argument("--shapes", required=True, help="comma-separated MxN or MxNxK (as in python -m bench)")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(_DTYPES))
    parser.add_argument("--steps", default="helion,triton,auto", help="any of helion, triton, auto")
    parser.add_argument("--out", type=Path, default=None, help="cache directory (default: the user cache)")
    parser.add_argument("--budget", type=int, default=120,
                        help="seconds of Helion autotuning per kernel (0: no limit, the effort's whole search); "
                             "compiling the first configs counts, so a short budget can end before any is measured "
                             "(on the H200, 25 s did for the layer_norm backward, 50 s did not)")
    args = parser.parse_args(argv)

    out = args.out or configs.cache_dir()
    os.environ["HKERNELS_CACHE_DIR"] = str(out)  # this process reads back what it writes
    steps = {s.strip() for s in args.steps.split(",") if s.strip()}
    if not steps <= {"helion", "triton", "auto"}:
        parser.error(f"--steps takes helion, triton, auto; got {args.steps!r}")
    if torch.cuda.is_available():
        device = torch.device("cuda")
        arch = configs.cuda_arch(device)
    elif _interpret.enabled():
        device, arch = torch.device("cpu"), "interpret"
        if "helion" in steps:
            _say("no GPU: skipping Helion autotuning (its autotuner benchmarks on a GPU); interpret mode runs the rest")
            steps.discard("helion")
    else:
        parser.error("needs a CUDA GPU (or HKERNELS_INTERPRET=1 to check the command itself on a CPU)")
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    try:
        shapes = [_parse_shape(s) for s in args.shapes.split(",") if s.strip()]
    except ValueError as e:
        parser.error(str(e))
    cases = [(op, shape) for op in ops for shape in shapes]
    _triton_seen.clear()  # buckets are shared by the shapes of this run, not of earlier runs in the process
    _say(f"hkernels.tune on {arch} ({torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU'}): "
         f"{len(cases)} case(s), steps {', '.join(sorted(steps))}; writing to {out}")
    summary: list[str] = []
    measured: dict[str, list[tuple[int, int, dict[str, float], str]]] = {}
    failed = 0
    for i, (op, shape) in enumerate(cases, 1):
        t0 = time.perf_counter()
        try:
            case = _Case(op, shape, _DTYPES[args.dtype], device)
            _say(f"[{i}/{len(cases)}] {case.name}")
            if "helion" in steps:
                summary += tune_helion(case, arch, out, args.budget or None)
            if "triton" in steps:
                summary += tune_triton(case, arch, out, device)
            configs.reload()
            if "auto" in steps:
                times = measure_backends(case, device)
                rows, n = case.rows_n()
                measured.setdefault(op, []).append((rows, n, times, case.name))
                summary.append(f"auto {case.name}: helion {times['helion']:.4f} ms, triton {times['triton']:.4f} ms")
                _say(f"  auto: helion {times['helion']:.4f} ms, triton {times['triton']:.4f} ms (fwd + fwd_bwd)")
        except Exception as e:  # one case failing must not lose the others' results
            failed += 1
            summary.append(f"FAILED {op} {shape}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            _say(f"  failed: {type(e).__name__}: {e}")
        _say(f"[{i}/{len(cases)}] done in {time.perf_counter() - t0:.0f} s")
    if measured:
        write_auto(measured, arch, out)
    configs.reload()
    _say("\n".join(["", "summary:", *summary]))
    return 1 if failed else 0


if __name__ == "__main__":  # Helion's autotuner may start worker processes: keep the work under this guard
    raise SystemExit(main())
