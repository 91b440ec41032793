"""python -m bench autocast: each op under torch.autocast against the same op on 16-bit inputs, both times.

Per op and shape, forward+backward (forward only with --mode fwd), four variants timed in interleaved rounds:

- ``16-bit``: hkernels (auto) on 16-bit inputs, no autocast: the yardstick;
- ``16-bit, autocast``: the same inputs inside an autocast region: what the autocast path itself costs (nothing to
  cast; a flag, the policy and autocast switched off around the body);
- ``AMP``: the inputs mixed-precision training hands the op (float32 parameters; float32 activations where the
  model's residual stream is float32, 16-bit ones where a matmul under autocast made them), under autocast: the
  casts the op's PyTorch counterpart makes, and, for the norms and softmax on CUDA, float32 math and I/O;
- ``PyTorch AMP``: PyTorch's own call (F.rms_norm, SDPA, linear + cross_entropy, ...) on the AMP inputs under the
  same autocast.

Reported: the GPU time (each variant's step captured once as a CUDA graph, replayed under do_bench, L2 flushed)
and the time from Python (calls back to back between two syncs), as medians over rounds, and the ratios to
``16-bit`` within each round. Writes autocast.json and autocast.md under --out.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import hkernels
from bench import cli
from bench.latency import measure, measure_graphs

Tensor = torch.Tensor
F32, B16 = torch.float32, torch.bfloat16


def _t(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, scale: float = 1.0,
       grad: bool = True) -> Tensor:
    return (torch.randn(shape, device=device, dtype=torch.float32) * scale).to(dtype).requires_grad_(grad)


# case -> (make(act dtype, param dtype, device) -> (args, kwargs), hkernels' call, PyTorch's call, AMP activations)
CASES: dict[str, tuple[Callable[..., tuple[tuple[Any, ...], dict[str, Any]]], Callable[..., Any],
                       Callable[..., Any], torch.dtype]] = {
    "rms_norm 16384x4096": (
        lambda a, p, d: ((_t((16384, 4096), a, d), _t((4096,), p, d)), {}),
        lambda x, w: hkernels.rms_norm(x, w), lambda x, w: F.rms_norm(x, (x.shape[-1],), w, 1e-6), F32),
    "rms_norm 1x4096": (
        lambda a, p, d: ((_t((1, 4096), a, d), _t((4096,), p, d)), {}),
        lambda x, w: hkernels.rms_norm(x, w), lambda x, w: F.rms_norm(x, (x.shape[-1],), w, 1e-6), F32),
    "layer_norm 16384x4096": (
        lambda a, p, d: ((_t((16384, 4096), a, d), _t((4096,), p, d), _t((4096,), p, d)), {}),
        lambda x, w, b: hkernels.layer_norm(x, w, b), lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b), F32),
    "softmax 16384x4096": (
        lambda a, p, d: ((_t((16384, 4096), a, d, 3.0),), {}),
        lambda x: hkernels.softmax(x), lambda x: torch.softmax(x, -1), F32),
    "swiglu 16384x14336": (
        lambda a, p, d: ((_t((16384, 14336), a, d), _t((16384, 14336), a, d)), {}),
        lambda g, u: hkernels.swiglu(g, u), lambda g, u: F.silu(g) * u, B16),
    "cross_entropy 8192x128256": (
        lambda a, p, d: ((_t((8192, 128256), a, d, 3.0), torch.randint(0, 128256, (8192,), device=d)), {}),
        lambda x, t: hkernels.cross_entropy(x, t), lambda x, t: F.cross_entropy(x, t), B16),
    "fused_linear_cross_entropy 8192x4096x128256": (
        lambda a, p, d: ((_t((8192, 4096), a, d), _t((128256, 4096), p, d, 4096 ** -0.5),
                          torch.randint(0, 128256, (8192,), device=d)), {}),
        lambda h, w, t: hkernels.fused_linear_cross_entropy(h, w, t),
        lambda h, w, t: F.cross_entropy(F.linear(h, w).float(), t), F32),
    "matmul 8192x4096x14336": (
        lambda a, p, d: ((_t((8192, 4096), a, d), _t((4096, 14336), p, d, 4096 ** -0.5)), {}),
        lambda x, w: hkernels.matmul(x, w), lambda x, w: torch.matmul(x, w), F32),
    "attention causal B4 H32 S4096 D128": (
        lambda a, p, d: (tuple(_t((4, 32, 4096, 128), a, d) for _ in range(3)), {"causal": True}),
        lambda q, k, v, causal: hkernels.attention(q, k, v, causal=causal),
        lambda q, k, v, causal: F.scaled_dot_product_attention(q, k, v, is_causal=causal), F32),
}

VARIANTS = ("16-bit", "16-bit, autocast", "AMP", "PyTorch AMP")


def _step(case: str, variant: str, device: torch.device, mode: str) -> Callable[[], object]:
    make, ours, theirs, amp_act = CASES[case]
    amp = variant.endswith("AMP")
    args, kwargs = make(amp_act if amp else B16, F32 if amp else B16, device)
    fn = theirs if variant == "PyTorch AMP" else ours
    region = (lambda: torch.autocast(device.type, dtype=B16)) if variant != "16-bit" else contextlib.nullcontext
    wrt = [a for a in args if isinstance(a, Tensor) and a.requires_grad]

    def step() -> object:
        with region():
            out = fn(*args, **kwargs)
        if mode == "fwd":
            return out
        outs = out if isinstance(out, tuple) else (out,)
        return torch.autograd.grad(outs, wrt, [torch.ones_like(o) for o in outs])

    if mode == "fwd":
        def forward() -> object:
            with torch.no_grad():
                return step()
        return forward
    return step


def _parse(argv: list[str]) -> argparse.Namespace:
    p = cli.parser("autocast", __doc__)
    p.add_argument("--cases", default="all", help=f"comma-separated, from {', '.join(CASES)}; or all")
    p.add_argument("--mode", default="fwd_bwd", choices=["fwd", "fwd_bwd"],
                   help="what a step runs: a forward (under no_grad), or a forward and its backward")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds per case")
    p.add_argument("--out", type=Path, default=None,
                   help="where to write autocast.json and autocast.md (default: nowhere, the table goes to stdout)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv if argv is not None else sys.argv[1:])
    if not torch.cuda.is_available():
        print("python -m bench autocast: times the GPU; no GPU here", file=sys.stderr)
        return 1
    device = torch.device("cuda")
    cases = list(CASES) if args.cases == "all" else args.cases.split(",")
    results = []
    for i, case in enumerate(cases, 1):
        print(f"[{i}/{len(cases)}] {case}", file=sys.stderr, flush=True)
        steps = {v: _step(case, v, device, args.mode) for v in VARIANTS}
        gpu = measure_graphs(steps, device, args.rounds)
        calls = 20 if "16384" in case or "8192" in case or "S4096" in case else 200
        host = measure({v: (lambda n, s=s: [s() for _ in range(n)]) for v, s in steps.items()}, device, args.rounds,
                       calls)
        row: dict[str, Any] = {"case": case, "mode": args.mode}
        for v in VARIANTS:
            row[v] = {"gpu_us": statistics.median(gpu[v]), "python_us": statistics.median(host[v]),
                      "gpu_x": statistics.median(a / b for a, b in zip(gpu[v], gpu["16-bit"], strict=True)),
                      "python_x": statistics.median(a / b for a, b in zip(host[v], host["16-bit"], strict=True))}
        results.append(row)
        del steps
        torch.cuda.empty_cache()
    lines = [f"# hkernels under torch.autocast ({torch.cuda.get_device_name()}, bfloat16, {args.mode})", "",
             "µs: GPU time (CUDA graph) / from Python (calls back to back); × the 16-bit call in the same rounds.",
             "", "| case | " + " | ".join(VARIANTS) + " |", "|---|" + "---|" * len(VARIANTS)]
    for row in results:
        cells = [f"{row[v]['gpu_us']:.1f} / {row[v]['python_us']:.1f} ({row[v]['gpu_x']:.2f}× / "
                 f"{row[v]['python_x']:.2f}×)" for v in VARIANTS]
        lines.append(f"| {row['case']} | " + " | ".join(cells) + " |")
    text = "\n".join(lines)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "autocast.json").write_text(json.dumps({"torch": torch.__version__, "rows": results}, indent=1))
        (args.out / "autocast.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
