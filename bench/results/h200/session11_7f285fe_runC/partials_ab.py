"""Session 11: the norms' backward with the one-kernel dw/db sum (sum_partials) against the old
partial.sum(0).to(dtype), both backends, GPU time of CUDA-graph replays, interleaved rounds, bf16."""
from __future__ import annotations

import json
import statistics
import sys

import torch

from bench.latency import measure_graphs, paired
from hkernels.ops import layer_norm as h_ln
from hkernels.ops import rms_norm as h_rms
from triton_fallback import layer_norm as t_ln
from triton_fallback import rms_norm as t_rms


def old_sum(part, param):
    return part.sum(0).to(param.dtype)


def main() -> None:
    dev = torch.device("cuda")
    shapes = [(1024, 4096), (4096, 4096), (4096, 8192), (16384, 4096), (16384, 8192), (4096, 16384)]
    rows = []
    for (m, n) in shapes:
        g = torch.Generator(device=dev).manual_seed(0)
        x, dy = (torch.randn(m, n, device=dev, generator=g).bfloat16() for _ in range(2))
        w, b = (torch.randn(n, device=dev, generator=g).bfloat16() for _ in range(2))
        for name, mod in (("triton", t_rms), ("helion", h_rms)):
            _, rstd = mod.rms_norm_fwd(x, w, 1e-6)
            steps = {}
            for variant in ("new", "old"):
                def step(mod=mod, variant=variant, rstd=rstd, dy=dy, x=x, w=w):
                    saved = mod.sum_partials
                    if variant == "old":
                        mod.sum_partials = old_sum
                    try:
                        return mod.rms_norm_bwd(dy, x, w, rstd)
                    finally:
                        mod.sum_partials = saved
                steps[variant] = step
            want = steps["old"]()[1].float()
            got = steps["new"]()[1].float()
            err = ((got - want).abs().max() / want.abs().max()).item()
            t = measure_graphs(steps, dev, 11)
            rows.append(dict(op="rms_norm", backend=name, m=m, n=n, new_us=statistics.median(t["new"]),
                             old_us=statistics.median(t["old"]), new_over_old=paired(t, "new", "old"), dw_rel_diff=err))
            print(rows[-1], flush=True)
        for name, mod in (("triton", t_ln), ("helion", h_ln)):
            _, mean, rstd = mod.layer_norm_fwd(x, w, b, 1e-5)
            steps = {}
            for variant in ("new", "old"):
                def step(mod=mod, variant=variant, mean=mean, rstd=rstd, dy=dy, x=x, w=w, b=b):
                    saved = mod.sum_partials
                    if variant == "old":
                        mod.sum_partials = old_sum
                    try:
                        return mod.layer_norm_bwd(dy, x, w, b, mean, rstd)
                    finally:
                        mod.sum_partials = saved
                steps[variant] = step
            t = measure_graphs(steps, dev, 11)
            rows.append(dict(op="layer_norm", backend=name, m=m, n=n, new_us=statistics.median(t["new"]),
                             old_us=statistics.median(t["old"]), new_over_old=paired(t, "new", "old")))
            print(rows[-1], flush=True)
    with open(sys.argv[1], "w") as f:
        json.dump(rows, f, indent=1)
    print("op         backend  shape        new µs   old µs   new/old")
    for r in rows:
        print(f"{r['op']:<10} {r['backend']:<8} {r['m']}x{r['n']:<7} {r['new_us']:8.1f} {r['old_us']:8.1f}  "
              f"{r['new_over_old']:.3f}")


if __name__ == "__main__":
    main()
