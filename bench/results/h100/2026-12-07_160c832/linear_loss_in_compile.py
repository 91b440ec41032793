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
    loss = fn(h, w, t)
    loss.backward()
    h.grad = None
    w.grad = None


which = int(sys.argv[1])
for name, fn, mins in (("torch.compile", plain, (0,)), ("hkernels+compile", ours, (which,))):
    if (which == 0) != (name == "torch.compile"):
        continue
    for m in mins:
        c.MIN_CHUNK = m or c.MIN_CHUNK
        torch._dynamo.reset()
        compiled = torch.compile(fn)
        _, code = run_and_get_code(lambda: step(compiled))
        src = "\n".join(code)
        counts = {k: src.count(k) for k in ("addmm_into", "extern_kernels.addmm", "cross_entropy_fwd", "extern_kernels.mm")}
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        ms = triton.testing.do_bench(lambda: step(compiled), warmup=5, rep=60)
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
        print(f"{name:18s} MIN_CHUNK={m:5d} fwd+bwd {ms:7.2f} ms  extra peak {peak:7.0f} MiB  {counts}", flush=True)
