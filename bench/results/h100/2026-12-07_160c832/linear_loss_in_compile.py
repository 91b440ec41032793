"""The linear loss alone inside torch.compile against torch.compile's own loss, 8192 × 2048 × 128256 bf16,
forward+backward, median GPU time from Python (triton.testing.do_bench) and the extra peak memory; counts in the
generated code tell how the head's gradient accumulates. ``python linear_loss_in_compile.py <MIN_CHUNK>`` (0: the
torch.compile loss), one process each, each with a TORCHINDUCTOR_CACHE_DIR of its own."""

import sys

import torch
import triton
from torch._inductor.utils import run_and_get_code

import hkernels
import hkernels.runtime.chunked as c

T, H, V = 8192, 2048, 128256
g = torch.Generator(device="cuda").manual_seed(0)
h = (torch.randn(T, H, device="cuda", generator=g) * 0.5).bfloat16().requires_grad_()
w = (torch.randn(V, H, device="cuda", generator=g) * 0.02).bfloat16().requires_grad_()
t = torch.randint(0, V, (T,), device="cuda", generator=g)


def ours(h, w, t):
    return hkernels.fused_linear_cross_entropy(h, w, t)


def plain(h, w, t):
    return torch.nn.functional.cross_entropy((h @ w.t()).float(), t)


def step(fn):
    fn(h, w, t).backward()
    h.grad = None
    w.grad = None


which = int(sys.argv[1])
name, fn = ("torch.compile", plain) if which == 0 else ("hkernels+compile", ours)
c.MIN_CHUNK = which or c.MIN_CHUNK
compiled = torch.compile(fn)
_, code = run_and_get_code(step, compiled)
src = "\n".join(code)
counts = {k: src.count(k) for k in ("addmm_into", "extern_kernels.addmm", "cross_entropy_fwd", "extern_kernels.mm")}
torch.cuda.synchronize()
torch.cuda.reset_peak_memory_stats()
base = torch.cuda.memory_allocated()
ms = triton.testing.do_bench(lambda: step(compiled), warmup=5, rep=60)
peak = (torch.cuda.max_memory_allocated() - base) / 2**20
print(f"{name:18s} MIN_CHUNK={which:5d} fwd+bwd {ms:7.2f} ms  extra peak {peak:7.0f} MiB  {counts}", flush=True)
