"""python -m bench sweep: time candidate launch settings of the norm and softmax kernels on this GPU; print and save
the best.

The tool that the shipped Helion configs (hkernels/configs/<arch>/<op>.json) and the Triton launch heuristic
(triton_fallback/_common.py) are chosen with. It times the backend functions themselves (no dispatcher), bf16, on
Llama-3 shapes, with one candidate forced at a time; it does not edit the tables. With HKERNELS_INTERPRET=1 on a
CPU it is a dry run of the command: interpreted times measure nothing.
"""

from __future__ import annotations

import itertools
import json
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from bench import cli, harness

Candidate = dict[str, Any]


def _triton_families(x, w, dy, r, mean) -> Iterator[tuple[str, Callable[[], object], list[Candidate]]]:
    import triton_fallback.layer_norm as tl_ln
    import triton_fallback.rms_norm as tl_rms
    import triton_fallback.softmax as tl_sm

    n = x.shape[1]
    resident = n <= 32768
    if resident:
        fwd = [{"block_m": bm, "warps": w_} for bm, w_ in itertools.product((1, 2, 4), (4, 8, 16))]
        yield "triton rms_norm_fwd", lambda: tl_rms.rms_norm_fwd(x, w, 1e-6), fwd
        yield "triton layer_norm_fwd", lambda: tl_ln.layer_norm_fwd(x, w, w, 1e-5), fwd
        yield "triton softmax_fwd", lambda: tl_sm.softmax_fwd(x), fwd
    else:  # long rows: softmax's split-row settings are searched by python -m bench sweep-llm
        return
    if n <= 8192:
        bwd = [
            {"block_m": bm, "warps": w_, "per_sm": p, "stages": st}
            for bm, w_, p, st in itertools.product((1, 2, 4), (8, 16), (1, 2), (1, 3))
        ]
        yield "triton rms_norm_bwd", lambda: tl_rms.rms_norm_bwd(dy, x, w, r), bwd
        yield "triton layer_norm_bwd", lambda: tl_ln.layer_norm_bwd(dy, x, w, w, mean, r), bwd
        yield "triton softmax_bwd", lambda: tl_sm.softmax_bwd(dy, x), fwd


def _apply_triton(candidate: Candidate) -> Callable[[], None]:
    """Force ``candidate`` on every Triton module; returns the undo."""
    import triton

    import triton_fallback._common as common
    import triton_fallback.layer_norm as tl_ln
    import triton_fallback.rms_norm as tl_rms
    import triton_fallback.softmax as tl_sm

    mods = (tl_rms, tl_ln, tl_sm)
    saved = [(m, m.row_settings, getattr(m, "persistent_programs", None)) for m in mods]

    def settings(n: int, m: int, backward: bool = False, **where: Any) -> common.RowSettings:  # (op, device)
        return common.RowSettings(
            True, candidate["block_m"], triton.next_power_of_2(n), candidate["warps"], candidate.get("stages", 3)
        )

    for m in mods:
        m.row_settings = settings
        if hasattr(m, "persistent_programs") and "per_sm" in candidate:
            m.persistent_programs = lambda dev, items, per_sm=2: common.persistent_programs(
                dev, items, candidate["per_sm"]
            )

    def undo() -> None:
        for m, rs, pp in saved:
            m.row_settings = rs
            if pp is not None:
                m.persistent_programs = pp

    return undo


def _helion_families(x, w, dy, r, mean) -> Iterator[tuple[str, Callable[[], object], list[Candidate]]]:
    import hkernels.ops.layer_norm as h_ln
    import hkernels.ops.rms_norm as h_rms
    import hkernels.ops.softmax as h_sm

    n = x.shape[1]
    if n <= 32768:
        fwd = [{"block_sizes": [bm], "num_warps": w_, "reduction_loops": [None]}
               for bm, w_ in itertools.product((1, 2, 4), (4, 8, 16))]
        yield "helion _rms_norm_fwd", lambda: h_rms.rms_norm_fwd(x, w, 1e-6), fwd
        yield "helion _layer_norm_fwd", lambda: h_ln.layer_norm_fwd(x, w, w, 1e-5), fwd
        yield "helion _softmax_fwd", lambda: h_sm.softmax_fwd(x), fwd
    else:  # long rows: softmax's split-row kernels (their chunk, lag and programs per SM live in the bucket)
        return
    if n <= 8192:
        bwd = [
            {"block_sizes": [bm], "num_warps": w_, "per_sm": p, "num_stages": st, "range_num_stages": [0, st]}
            for bm, w_, p, st in itertools.product((1, 2, 4), (8, 16), (1, 2), (1, 3))
        ]
        yield "helion _rms_norm_bwd", lambda: h_rms.rms_norm_bwd(dy, x, w, r), bwd
        yield "helion _layer_norm_bwd", lambda: h_ln.layer_norm_bwd(dy, x, w, w, mean, r), bwd
        yield "helion _softmax_bwd", lambda: h_sm.softmax_bwd(dy, x), fwd


def _apply_helion(candidate: Candidate) -> Callable[[], None]:
    import helion

    from hkernels.ops import _helion

    saved = (_helion.config_for, _helion.persistent)
    config = helion.Config(**{k: v for k, v in candidate.items() if k != "per_sm"})
    _helion.config_for = lambda kernel, n, device, dtype=None: config
    if "per_sm" in candidate:
        _helion.persistent = lambda m, device, per_sm=2: saved[1](m, device, candidate["per_sm"])
    _helion._compiled.clear()  # compiled functions are kept by arguments, not by config

    def undo() -> None:
        _helion.config_for, _helion.persistent = saved
        _helion._compiled.clear()

    return undo


def main(argv: list[str] | None = None) -> int:
    p = cli.parser("sweep", __doc__)
    p.add_argument("--shapes", default="16384x4096,16384x8192,4096x128256", help="comma-separated MxN")
    p.add_argument("--backends", default="helion,triton", help="comma-separated, from helion, triton")
    p.add_argument("--budget-s", type=float, default=420.0, help="stop starting new candidates after this many seconds")
    p.add_argument("--only", default="", help="time only families whose name contains this (e.g. _bwd; default: all)")
    p.add_argument("--out", type=Path, default=Path("sweep.json"), help="the JSON file of every timing")
    args = p.parse_args(argv)
    from hkernels.runtime import interpret as _interpret  # (interpret mode is set up on import)

    if not torch.cuda.is_available() and not _interpret.enabled():
        print("python -m bench sweep times kernels on a CUDA GPU and found none (HKERNELS_INTERPRET=1: a dry run on "
              "a CPU)", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("interpret mode on a CPU: a dry run of the command; these times measure nothing", file=sys.stderr)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    copy = harness.copy_gbps(device)
    start = time.time()
    results: dict[str, Any] = {"copy_gbps": copy, "families": {}}
    for shape in args.shapes.split(","):
        m, n = (int(v) for v in shape.split("x"))
        g = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(m, n, generator=g, device=device, dtype=torch.bfloat16)
        w = torch.randn(n, generator=g, device=device, dtype=torch.bfloat16)
        dy = torch.randn(m, n, generator=g, device=device, dtype=torch.bfloat16)
        r = torch.rand(m, generator=g, device=device) + 0.5
        mean = torch.randn(m, generator=g, device=device)
        sources = []
        if "triton" in args.backends:
            sources.append((_triton_families, _apply_triton))
        if "helion" in args.backends:
            sources.append((_helion_families, _apply_helion))
        for families, apply in sources:
            for family, fn, candidates in families(x, w, dy, r, mean):
                if args.only not in family:
                    continue
                passes = 3 if "bwd" in family else 2
                nbytes = passes * m * n * x.element_size()
                ok, failed = harness.time_candidates(
                    fn, candidates, apply, nbytes, copy, device, start + args.budget_s
                )
                tried = ok + failed
                results["families"][f"{family} {shape}"] = tried
                best = ok[0] if ok else None
                print(
                    f"{family:<28} {shape:>12}  best {best['pct_copy'] if best else 0:5.1f}% of copy "
                    f"{best['candidate'] if best else '-'}  (worst {ok[-1]['pct_copy'] if ok else 0:.1f}%, "
                    f"{len(tried)} tried)",
                    flush=True,
                )
        del x, w, dy
        if device.type == "cuda":
            torch.cuda.empty_cache()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1, default=str))
    print(f"copy {copy:.0f} GB/s; {time.time() - start:.0f} s; written {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
