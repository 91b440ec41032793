"""``python -m bench.sweep_llm``: time candidate launch settings of the LLM-op kernels on this GPU.

What the shipped configs of cross_entropy (Helion table, Triton ``_settings``) and the chunk length of
fused_linear_cross_entropy were chosen from. bf16, Llama-3 shapes; times the backend functions themselves (no
dispatcher) with one candidate forced at a time; prints the best per family and saves every timing as JSON.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from bench import harness

Candidate = dict[str, Any]
Family = tuple[str, Callable[[], object], int, list[Candidate], Callable[[Candidate], Callable[[], None]]]


def _helion_override(kernel: str) -> Callable[[Candidate], Callable[[], None]]:
    def apply(cand: Candidate) -> Callable[[], None]:
        import helion

        from hkernels.ops import _helion

        saved = _helion.config_for

        def config_for(name: str, n: int, device: torch.device, dtype: torch.dtype = torch.bfloat16):
            return helion.Config(**cand) if name == kernel else saved(name, n, device, dtype)

        _helion.config_for = config_for

        def undo() -> None:
            _helion.config_for = saved

        return undo

    return apply


def _triton_ce(cand: Candidate) -> Callable[[], None]:
    import triton_fallback.cross_entropy as ce

    saved = ce._settings
    ce._settings = lambda *_: (cand["block"], cand["warps"], cand["stages"], cand["per_sm"])

    def undo() -> None:
        ce._settings = saved

    return undo


def _cross_entropy(t: int, v: int, device: torch.device) -> Iterator[Family]:
    import hkernels.ops.cross_entropy as h_ce
    import triton_fallback.cross_entropy as t_ce

    g = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(t, v, generator=g, device=device, dtype=torch.bfloat16) * 2
    target = torch.randint(0, v, (t,), generator=g, device=device)
    scale = torch.full((1,), 1.0 / t, device=device).expand(t)
    grad = torch.empty_like(logits)
    nbytes = 2 * logits.numel() * logits.element_size()  # read logits, write the gradient
    triton_cands = [
        {"block": b, "warps": w, "stages": s, "per_sm": p}
        for (b, w), s, p in itertools.product(((4096, 8), (8192, 16), (16384, 16), (16384, 32)), (1, 2, 3), (1, 2, 4))
    ]
    yield ("triton cross_entropy fwd+grad", lambda: t_ce.cross_entropy_fwd(logits, target, scale, -100, 0.0, grad),
           nbytes, triton_cands, _triton_ce)
    helion_cands = [
        {"block_sizes": [1, b, b], "num_warps": w, "range_num_stages": [0, s, s], "pid_type": pid,
         **({"num_sm_multiplier": p} if pid != "flat" else {})}
        for (b, w), s, (pid, p) in itertools.product(
            ((8192, 16), (16384, 16)), (1, 2),
            (("flat", 0), ("persistent_interleaved", 1), ("persistent_interleaved", 2)),
        )
    ]
    yield ("helion cross_entropy fwd+grad", lambda: h_ce.cross_entropy_fwd(logits, target, scale, -100, 0.0, grad),
           nbytes, helion_cands, _helion_override("_cross_entropy_fwd"))


def _linear_ce_chunks(t: int, h: int, v: int, device: torch.device) -> list[dict[str, Any]]:
    """fused_linear_cross_entropy forward+backward per chunk length: ms and extra peak MiB (with eager and Liger)."""
    import torch.nn.functional as F

    import hkernels
    from hkernels import _chunked

    g = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(t, h, generator=g, device=device, dtype=torch.bfloat16).requires_grad_()
    weight = (torch.randn(v, h, generator=g, device=device, dtype=torch.bfloat16) * h**-0.5).requires_grad_()
    target = torch.randint(0, v, (t,), generator=g, device=device)
    runs: list[tuple[str, Callable[[], object]]] = [
        ("eager", lambda: torch.autograd.grad(F.cross_entropy(F.linear(hidden, weight), target), [hidden, weight])),
    ]
    try:
        from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction as L

        runs.append(("liger", lambda: torch.autograd.grad(L.apply(hidden, weight, target)[0], [hidden, weight])))
    except Exception:
        pass
    out = []
    saved = _chunked.MIN_CHUNK
    for chunk in (256, 512, 1024, 2048, 4096):
        for backend in ("triton", "helion"):

            def step(backend: str = backend) -> object:
                with hkernels.use_backend(backend):
                    loss = hkernels.fused_linear_cross_entropy(hidden, weight, target)
                return torch.autograd.grad(loss, [hidden, weight])

            runs.append((f"{backend} chunk={chunk}", (chunk, step)))  # type: ignore[arg-type]
    for name, fn in runs:
        chunk = None
        if isinstance(fn, tuple):
            chunk, fn = fn
            _chunked.MIN_CHUNK = chunk
        try:
            ms = harness.time_ms(fn, device)
            peak = harness.peak_mib(fn, device)
            out.append({"run": name, "ms": ms, "peak_mib": peak})
            print(f"linear_ce {t}x{h}x{v} {name:<22} {ms:8.2f} ms  extra peak {peak:8.0f} MiB", flush=True)
        except Exception as e:
            out.append({"run": name, "error": f"{type(e).__name__}: {str(e)[:200]}"})
            print(f"linear_ce {name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
        finally:
            _chunked.MIN_CHUNK = saved
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.sweep_llm", description=__doc__.split("\n\n")[0])
    p.add_argument("--budget-s", type=float, default=300.0, help="stop starting new candidates after this long")
    p.add_argument("--only", default="", help="families whose name contains this (e.g. 'triton', 'linear')")
    p.add_argument("--out", type=Path, default=Path("sweep_llm.json"))
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("python -m bench.sweep_llm times kernels on a CUDA GPU and found none", file=sys.stderr)
        return 2
    import hkernels  # noqa: F401

    device = torch.device("cuda")
    copy = harness.copy_gbps(device)
    start = time.time()
    results: dict[str, Any] = {"copy_gbps": copy, "families": {}}
    for t, v in ((8192, 128256), (4096, 262144)):
        for family, fn, nbytes, candidates, apply in _cross_entropy(t, v, device):
            if args.only not in family:
                continue
            ok, failed = harness.time_candidates(fn, candidates, apply, nbytes, copy, device, start + args.budget_s)
            tried = ok + failed
            results["families"][f"{family} {t}x{v}"] = tried
            for rank, best in enumerate(ok[:3]):
                print(f"{family:<32} {t}x{v}  #{rank + 1} {best['pct_copy']:5.1f}% of copy {best['candidate']}")
            print(f"{family:<32} {t}x{v}  worst {ok[-1]['pct_copy'] if ok else 0:.1f}%, {len(tried)} tried, "
                  f"{sum('error' in x for x in tried)} failed", flush=True)
        torch.cuda.empty_cache()
    if "linear" in args.only or not args.only:
        results["linear_ce"] = _linear_ce_chunks(8192, 4096, 128256, device)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1, default=str))
    print(f"copy {copy:.0f} GB/s; {time.time() - start:.0f} s; written {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
