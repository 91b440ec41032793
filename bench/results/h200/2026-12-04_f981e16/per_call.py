"""Per-call time from Python of a few public calls (calls back to back, one sync), for the tree on PYTHONPATH.
Prints one JSON line: {case: median µs over rounds}."""
import json
import statistics
import sys
import time

import torch

import hkernels

d = torch.device("cuda")
bf = torch.bfloat16
g = torch.Generator(device=d).manual_seed(0)


def r(*s, dtype=bf):
    return torch.randn(*s, device=d, dtype=dtype, generator=g)


x = r(1, 4096)
w = r(4096)
logits = r(8, 32000)
target = torch.randint(0, 32000, (8,), device=d)
q1, k1 = r(1, 32, 1, 128), r(1, 8, 1, 128)
table = r(4096, 128)
pos = torch.tensor([[17]], device=d)
qd = r(1, 32, 1, 128)
kc, vc = r(1, 8, 1024, 128), r(1, 8, 1024, 128)
lens = torch.tensor([1000], device=d, dtype=torch.int32)
qv, kv = r(64, 8, 64), r(64, 8, 64)
cu = torch.tensor([0, 20, 64], device=d, dtype=torch.int32)
xs = r(16, 256)
wg = r(4, 512, 256)
sizes = torch.tensor([4, 4, 4, 4], device=d)
CASES = {
    "rms_norm [1, 4096]": lambda: hkernels.rms_norm(x, w),
    "cross_entropy [8, 32000]": lambda: hkernels.cross_entropy(logits, target),
    "rope at positions [1, 32, 1, 128]": lambda: hkernels.rope(q1, k1, table, table, pos),
    "decode_attention 1 x 1024": lambda: hkernels.decode_attention(qd, kc, vc, lens),
    "attention_varlen 64 tokens": lambda: hkernels.attention_varlen(qv, kv, kv, cu, max_seqlen_q=44, max_seqlen_k=44),
    "grouped_matmul 16 x 256": lambda: hkernels.grouped_matmul(xs, wg, sizes),
}
out = {}
with torch.no_grad():
    for name, fn in CASES.items():
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        rounds = []
        for _ in range(15):
            t = time.perf_counter()
            for _ in range(200):
                fn()
            torch.cuda.synchronize()
            rounds.append((time.perf_counter() - t) / 200 * 1e6)
        out[name] = statistics.median(rounds)
print(json.dumps(out))
sys.stdout.flush()
