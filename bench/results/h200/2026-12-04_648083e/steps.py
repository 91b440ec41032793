"""The 1B model's training step at 1 x 1024 under torch.compile, with and without hkernels patched in, in one
process: steps back to back, steps each ended by a sync, and forward+backward's host issue time (from an idle
GPU, until the last launch returns) against its whole time. python steps.py OUT.txt (a GPU only)."""

from __future__ import annotations

import sys
import time

import torch

import hkernels
from bench import model as bm


def main(path: str) -> None:
    dev = torch.device("cuda")
    with open(path, "w") as out:
        for variant in ("hkernels+compile", "torch_compile"):
            model = bm.build("1b", device=dev, dtype=torch.bfloat16, seed=0)
            if variant == "hkernels+compile":
                hkernels.patch(model)
            fwd = torch.compile(model)
            opt = torch.optim.AdamW(model.parameters(), lr=3e-4, foreach=True)
            ids = torch.randint(0, model.config.vocab_size, (1, 1024), device=dev)

            def fb(fwd: torch.nn.Module = fwd, ids: torch.Tensor = ids) -> None:
                fwd(ids, labels=ids).loss.backward()

            def step(opt: torch.optim.Optimizer = opt, fb=fb) -> None:
                fb()
                opt.step()
                opt.zero_grad(set_to_none=True)

            for _ in range(4):
                step()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(4):
                step()
            torch.cuda.synchronize()
            nosync = (time.perf_counter() - t0) / 4 * 1e3
            t0 = time.perf_counter()
            for _ in range(4):
                step()
                torch.cuda.synchronize()
            sync = (time.perf_counter() - t0) / 4 * 1e3
            host, whole = [], []
            for _ in range(4):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                fb()
                t1 = time.perf_counter()
                torch.cuda.synchronize()
                host.append((t1 - t0) * 1e3)
                whole.append((time.perf_counter() - t0) * 1e3)
                opt.step()
                opt.zero_grad(set_to_none=True)
            line = (f"{variant}: step back to back {nosync:.1f} ms, with a sync per step {sync:.1f} ms; fwd+bwd: "
                    f"host issue {sorted(host)[2]:.1f} ms, until done {sorted(whole)[2]:.1f} ms")
            print(line, flush=True)
            print(line, file=out, flush=True)
            del model, opt, fwd
            torch._dynamo.reset()
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1])
