"""python -m hkernels.tune --ops rms_norm,softmax --shapes 4096x4096,16384x8192: tune hkernels on this GPU.

For each op and shape (MxN, or MxNxK for matmul and attention, as in python -m bench; the inputs are the
benchmark's, from hkernels.tune.cases, at the given dtype) it
  1. runs the op forward and backward on Helion once and records which Helion kernels ran, with what arguments;
     each is autotuned with Helion's autotuner (HELION_AUTOTUNE_EFFORT, default here quick; precompilation off
     unless HELION_AUTOTUNE_PRECOMPILE says otherwise), its search seeded with the shipped config and cut off
     after --budget seconds per kernel; the tuned config is then timed against the shipped one and written for
     that row length only where it is at least 1% faster;
  2. searches the Triton launch settings where the op has a search space (the row-wise forwards: rms_norm,
     add_rms_norm, layer_norm, softmax; rope's tile size and warps; cross_entropy's block, warps, stages and
     programs per SM), timing each candidate, and writes the fastest;
  3. times the op on helion and on triton with what it just tuned, and on torch (PyTorch's own call: auto takes it
     where it is more than 2% faster than the faster kernel), forward and forward+backward (per-call latency at
     decode-size rows), and writes, per row length and rows, which backend auto should use (tried before the
     shipped buckets).
Everything goes to the user cache (HKERNELS_CACHE_DIR, else ~/.cache/hkernels; see hkernels.configs), which the
library then prefers to the shipped tables: helion/<arch>/<op>.json, triton/<arch>/<op>.json, auto/<arch>.json.
Progress goes to stdout, one line per step. Without a GPU (HKERNELS_INTERPRET=1 on a CPU) it runs steps 2 and 3
on the given shapes as a check of the command itself (interpreted timings choose nothing real); Helion's
autotuner needs a GPU.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch

from hkernels import configs
from hkernels.runtime import interpret as _interpret
from hkernels.tune import auto, helion_configs, say, triton_settings  # helion_configs sets Helion's defaults
from hkernels.tune.cases import OP_OF, Case

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
STEPS = ("helion", "triton", "auto")


def _parse_shape(text: str) -> tuple[int, int, int]:
    parts = [int(p) for p in text.lower().split("x")]
    if len(parts) not in (2, 3) or min(parts) < 1:
        raise ValueError(f"hkernels.tune: a shape is MxN or MxNxK with positive sizes, got {text!r}")
    return parts[0], parts[1], parts[2] if len(parts) == 3 else 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m hkernels.tune", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ops", required=True, help="comma-separated ops, as in python -m bench (required)")
    parser.add_argument("--shapes", required=True,
                        help="comma-separated MxN or MxNxK, as in python -m bench (required)")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(_DTYPES),
                        help="the inputs' dtype (default: %(default)s)")
    parser.add_argument("--steps", default=",".join(STEPS),
                        help="comma-separated, any of helion, triton, auto (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=None,
                        help="the cache directory to write (default: the user cache, HKERNELS_CACHE_DIR or "
                             "~/.cache/hkernels)")
    parser.add_argument("--budget", type=int, default=120,
                        help="seconds of Helion autotuning per kernel, 0 for no limit (the effort's whole "
                             "search); compiling the first configs counts, so a short budget can end before any "
                             "config is measured (default: %(default)s)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)

    out = args.out or configs.cache_dir()
    os.environ["HKERNELS_CACHE_DIR"] = str(out)  # this process reads back what it writes
    steps = {s.strip() for s in args.steps.split(",") if s.strip()}
    if not steps <= set(STEPS):
        parser.error(f"--steps takes {', '.join(STEPS)}; got {args.steps!r}")
    if torch.cuda.is_available():
        device = torch.device("cuda")
        arch = configs.cuda_arch(device)
    elif _interpret.enabled():
        device, arch = torch.device("cpu"), "interpret"
        if "helion" in steps:
            say("no GPU: skipping Helion autotuning (its autotuner benchmarks on a GPU); interpret mode runs the rest")
            steps.discard("helion")
    else:
        parser.error("needs a CUDA GPU (or HKERNELS_INTERPRET=1 to check the command itself on a CPU)")
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    try:
        shapes = [_parse_shape(s) for s in args.shapes.split(",") if s.strip()]
    except ValueError as e:
        parser.error(str(e))
    cases = [(op, shape) for op in ops for shape in shapes]
    triton_settings.new_run()
    say(f"hkernels.tune on {arch} ({torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU'}): "
        f"{len(cases)} case(s), steps {', '.join(sorted(steps))}; writing to {out}")
    summary: list[str] = []
    measured: dict[str, list[tuple[int, int, dict[str, float], str]]] = {}
    failed = 0
    for i, (op, shape) in enumerate(cases, 1):
        t0 = time.perf_counter()
        try:
            case = Case(op, shape, _DTYPES[args.dtype], device)
            say(f"[{i}/{len(cases)}] {case.name}")
            if "helion" in steps:
                summary += helion_configs.tune_helion(case, arch, out, args.budget or None)
            if "triton" in steps:
                summary += triton_settings.tune_triton(case, arch, out, device)
            configs.reload()
            if "auto" in steps:
                times = auto.measure_backends(case, device)
                rows, n = case.rows_n()
                measured.setdefault(OP_OF.get(op, op), []).append((rows, n, times, case.name))
                said = ", ".join(f"{b} {t:.4f}" for b, t in times.items())
                summary.append(f"auto {case.name}: {said} ms")
                say(f"  auto: {said} ms (fwd + fwd_bwd)")
        except Exception as e:  # one case failing must not lose the others' results
            failed += 1
            summary.append(f"FAILED {op} {shape}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            say(f"  failed: {type(e).__name__}: {e}")
        say(f"[{i}/{len(cases)}] done in {time.perf_counter() - t0:.0f} s")
    if measured:
        auto.write_auto(measured, arch, out)
    configs.reload()
    say("\n".join(["", "summary:", *summary]))
    return 1 if failed else 0
