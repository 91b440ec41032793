import json
import statistics
import time

import torch

import hkernels

d = torch.device("cuda")
x = torch.randn(1, 4096, device=d, dtype=torch.bfloat16)
w = torch.randn(4096, device=d, dtype=torch.bfloat16)
xl = torch.randn(16384, 4096, device=d, dtype=torch.bfloat16)
f = torch.compile(lambda x, w: hkernels.rms_norm(x, w))
out = {}
with torch.no_grad():
    for name, fn, a in (
        ("compiled rms_norm [1, 4096] per call us", f, x),
        ("eager rms_norm [1, 4096] per call us", hkernels.rms_norm, x),
    ):
        for _ in range(30):
            fn(a, w)
        torch.cuda.synchronize()
        r = []
        for _ in range(9):
            t = time.perf_counter()
            for _ in range(200):
                fn(a, w)
            torch.cuda.synchronize()
            r.append((time.perf_counter() - t) / 200 * 1e6)
        out[name] = statistics.median(r)
    g = torch.cuda.CUDAGraph()
    hkernels.rms_norm(xl, w)
    torch.cuda.synchronize()
    with torch.cuda.graph(g):
        hkernels.rms_norm(xl, w)
    import triton.testing as tt

    out["GPU time rms_norm [16384, 4096] graph replay us"] = tt.do_bench(g.replay, warmup=20, rep=200) * 1e3
print(json.dumps(out))
