"""python -m bench profile-train: where a training step spends its time, eager against hkernels.

For each variant (bench.model's Llama-style decoder, plain and after hkernels.patch): the step time (steps back to
back, then one sync) and, from torch.profiler over two more steps, the GPU kernel time per step and the ops that
cost the most host time and the most GPU time. A step slower than its GPU kernel time waits on the host. Writes
profile_<variant>.txt per variant to --out. A GPU only.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from bench import cli


def main(argv: list[str] | None = None) -> int:
    p = cli.parser("profile-train", __doc__)
    p.add_argument("--model", default="1b", help="a bench.model config: 1b or tiny")
    p.add_argument("--batch", type=int, default=1, help="rows per step")
    p.add_argument("--seq", type=int, default=1024, help="tokens per row")
    p.add_argument("--variants", default="eager,hkernels", help="comma-separated, from eager, hkernels")
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
        if variant == "hkernels":
            hkernels.patch(model)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4, foreach=True)

        def step(model: torch.nn.Module = model, opt: torch.optim.Optimizer = opt, ids: torch.Tensor = ids) -> None:
            model(ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        for _ in range(4):  # warm-up: compiling, plans, the allocator
            step()
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
        (args.out / f"profile_{variant}.txt").write_text(
            f"{line}\n\n{events.table(sort_by='self_cpu_time_total', row_limit=35)}\n\n"
            f"{events.table(sort_by='self_device_time_total', row_limit=25)}\n")
        del model, opt
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
