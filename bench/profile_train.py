"""python -m bench profile-train: where a training step spends its time, eager against hkernels.

For each variant (bench.model's Llama-style decoder: plain, after hkernels.patch, and either under torch.compile):
the step time (steps back to back, then one sync) and, from torch.profiler over two more steps, the GPU kernel time
per step and the ops that cost the most host time and the most GPU time. A step slower than its GPU kernel time
waits on the host. Compiled variants also report what the compiler did: graphs, graph breaks with their reasons,
recompiles, and the hkernels custom ops left opaque (called back into Python) with the reason. Writes
profile_<variant>.txt per variant ("+" written "_") to --out. A GPU only.
"""

from __future__ import annotations

import contextlib
import io
import logging
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch

from bench import cli


def main(argv: list[str] | None = None) -> int:
    p = cli.parser("profile-train", __doc__)
    p.add_argument("--model", default="1b", help="a bench.model config: 1b or tiny")
    p.add_argument("--batch", type=int, default=1, help="rows per step")
    p.add_argument("--seq", type=int, default=1024, help="tokens per row")
    p.add_argument("--variants", default="eager,hkernels",
                   help="comma-separated, from eager, hkernels, torch_compile, hkernels+compile")
    p.add_argument("--out", type=Path, default=Path("."), help="where the tables go")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    if not torch.cuda.is_available():
        print("python -m bench profile-train needs a CUDA GPU", file=sys.stderr)
        return 2
    import hkernels
    from bench import model as bench_model

    device = torch.device("cuda")
    args.out.mkdir(parents=True, exist_ok=True)
    ids = None
    for variant in args.variants.split(","):
        model = bench_model.build(args.model, device=device, dtype=torch.bfloat16, seed=0)
        if ids is None:
            ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq), device=device)
        if variant not in VARIANTS:
            print(f"python -m bench profile-train: unknown variant {variant!r}; valid: {', '.join(VARIANTS)}",
                  file=sys.stderr)
            return 2
        if variant.startswith("hkernels"):
            hkernels.patch(model)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4, foreach=True)
        fwd = torch.compile(model) if variant.endswith("compile") else model

        def step(fwd: torch.nn.Module = fwd, opt: torch.optim.Optimizer = opt, ids: torch.Tensor = ids) -> None:
            fwd(ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        compiled = ""
        with _compiler_log() as log, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", hkernels.HKernelsFallbackWarning)
            for _ in range(4):  # warm-up: compiling, plans, the allocator
                step()
        if variant.endswith("compile"):
            compiled = _compiler_summary(log.getvalue(), caught)
            print(compiled, flush=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(5):
            step()
        torch.cuda.synchronize()
        step_ms = (time.perf_counter() - t0) / 5 * 1e3
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(2):
                step()
            torch.cuda.synchronize()
        events = prof.key_averages()
        kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA and not e.is_user_annotation]
        gpu_ms = sum(e.self_device_time_total for e in kernels) / 2 / 1e3  # (kernel events only: ops hold them too)
        line = f"{variant}: step {step_ms:.1f} ms (steps back to back), GPU kernel time {gpu_ms:.1f} ms per step"
        print(line, flush=True)
        (args.out / f"profile_{variant.replace('+', '_')}.txt").write_text(
            f"{line}\n\n{compiled}\n\n{events.table(sort_by='self_cpu_time_total', row_limit=35)}\n\n"
            f"{events.table(sort_by='self_device_time_total', row_limit=60)}\n")
        del model, opt
        torch.cuda.empty_cache()
    return 0


VARIANTS = ("eager", "hkernels", "torch_compile", "hkernels+compile")


@contextlib.contextmanager
def _compiler_log() -> Iterator[io.StringIO]:
    """torch.compile's own records of graph breaks and recompiles, collected while the scope runs."""
    from torch._dynamo.utils import counters

    counters.clear()
    log = io.StringIO()
    handler = logging.StreamHandler(log)
    torch._logging.set_logs(graph_breaks=True, recompiles=True)
    loggers = [logging.getLogger(n) for n in ("torch._dynamo", "torch._logging")]
    for lg in loggers:
        lg.addHandler(handler)
    try:
        yield log
    finally:
        for lg in loggers:
            lg.removeHandler(handler)
        torch._logging.set_logs()


def _compiler_summary(log: str, caught: list[warnings.WarningMessage]) -> str:
    from torch._dynamo.utils import counters

    breaks = dict(counters["graph_break"])
    lines = [f"compiler: {counters['stats'].get('unique_graphs', 0)} graphs, "
             f"{sum(breaks.values())} graph breaks, {log.count('Recompiling function')} recompiles"]
    lines += [f"  graph break x{n}: {why.splitlines()[0][:240]}" for why, n in breaks.items()]
    lines += [f"  recompile: {ln.strip()[:240]}" for ln in log.splitlines() if "triggered by" in ln][:8]
    lines += [f"  opaque: {w.message}"[:400] for w in caught]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
