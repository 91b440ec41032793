"""python -m bench sweep-llm: time candidate launch settings of the LLM-op kernels on this GPU.

The tool that the shipped settings of cross_entropy (Helion table, Triton _settings), softmax's long rows (both
backends), the chunk length of fused_linear_cross_entropy, Helion's matmul tiles and the Triton attention
backward's settings are chosen with.
bf16, Llama-3 shapes; it times the backend functions themselves (no dispatcher) with one candidate forced at a
time, prints the best per family and saves every timing as JSON. Compute-bound families report TFLOP/s
("tflops") in place of the memory-bound families' % of copy ("pct_copy").
"""

from __future__ import annotations

import itertools
import json
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from bench import cli, harness
from hkernels.tune.timing import time_ms

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
        _helion._compiled.clear()  # compiled functions are kept by arguments, not by config

        def undo() -> None:
            _helion.config_for = saved
            _helion._compiled.clear()

        return undo

    return apply


_KEEP_FROM, _NEVER = 16384, 1 << 62  # the cross-entropy kernels' L2 hints from rows of this many logits, or never


def _triton_ce(cand: Candidate) -> Callable[[], None]:
    import triton_fallback.cross_entropy as ce

    saved, saved_keep = ce._settings, ce.KEEP_IN_L2_FROM
    ce._settings = lambda *_: (cand["block"], cand["warps"], cand["stages"], cand["per_sm"])
    if "keep_in_l2" in cand:
        ce.KEEP_IN_L2_FROM = _KEEP_FROM if cand["keep_in_l2"] else _NEVER

    def undo() -> None:
        ce._settings, ce.KEEP_IN_L2_FROM = saved, saved_keep

    return undo


def _helion_ce_keep(cand: Candidate) -> Callable[[], None]:
    """A Helion cross-entropy config, with the kernel's eviction hints on or off (``keep_in_l2``)."""
    import hkernels.ops.cross_entropy as ce

    saved = ce.KEEP_IN_L2_FROM
    ce.KEEP_IN_L2_FROM = _KEEP_FROM if cand["keep_in_l2"] else _NEVER
    undo_config = _helion_override("_cross_entropy_fwd")({k: v for k, v in cand.items() if k != "keep_in_l2"})

    def undo() -> None:
        ce.KEEP_IN_L2_FROM = saved
        undo_config()

    return undo


def _triton_ce_xt(cand: Candidate) -> Callable[[], None]:
    import triton_fallback.cross_entropy as ce

    saved = ce.GRAD_XT
    ce.GRAD_XT = cand["xt"]

    def undo() -> None:
        ce.GRAD_XT = saved

    return undo


def _triton_split_rows(cand: Candidate) -> Callable[[], None]:
    """Softmax's long-row (split) settings: chunk, warps, programs per SM and lag, forward and backward."""
    import triton_fallback.softmax as sm
    from triton_fallback._common import RowSettings

    saved = sm.SPLIT, sm.SPLIT_BWD, sm.SPLIT_LAG
    sm.SPLIT = sm.SPLIT_BWD = RowSettings(False, 1, cand["block"], cand["warps"], programs_per_sm=cand["per_sm"])
    sm.SPLIT_LAG = cand["lag"]

    def undo() -> None:
        sm.SPLIT, sm.SPLIT_BWD, sm.SPLIT_LAG = saved

    return undo


def _helion_split_rows(cand: Candidate) -> Callable[[], None]:
    """The same settings for Helion's split-row softmax kernels: their buckets' chunk, lag, programs per SM and
    warps, forward and backward."""
    from hkernels.ops import _helion

    saved = _helion._bucket
    bucket = {"max_n": None, "chunk": cand["block"], "lag": cand["lag"], "programs_per_sm": cand["per_sm"],
              "config": {"num_warps": cand["warps"], "pid_type": "flat"}}

    def patched(arch: str, kernel: str, n: int, dtype: torch.dtype) -> dict[str, Any]:
        return bucket if kernel in ("_softmax_fwd_split", "_softmax_bwd_split") else saved(arch, kernel, n, dtype)

    def reset() -> None:
        _helion._config.cache_clear()
        _helion._compiled.clear()  # compiled functions are kept by arguments, not by config

    _helion._bucket = patched
    reset()

    def undo() -> None:
        _helion._bucket = saved
        reset()

    return undo


def _split_candidates() -> list[Candidate]:
    return [
        {"block": b, "warps": w, "lag": lag, "per_sm": p}
        for (b, w), lag, p in itertools.product(((4096, 4), (8192, 8), (8192, 16), (16384, 16)), (1, 2), (2, 4, 8))
        if w * p <= 32
    ]


def _softmax_long(m: int, n: int, device: torch.device) -> Iterator[Family]:
    import hkernels.ops.softmax as h_sm
    import triton_fallback.softmax as t_sm

    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(m, n, generator=g, device=device, dtype=torch.bfloat16) * 2
    y = torch.softmax(x.float(), -1).to(x.dtype)
    dy = torch.randn_like(x)
    nbytes = 2 * x.numel() * x.element_size()
    yield ("triton softmax fwd (split rows)", lambda: t_sm.softmax_fwd(x), nbytes, _split_candidates(),
           _triton_split_rows)
    yield ("triton softmax bwd (split rows)", lambda: t_sm.softmax_bwd(dy, y), nbytes * 3 // 2, _split_candidates(),
           _triton_split_rows)
    yield ("helion softmax fwd (split rows)", lambda: h_sm.softmax_fwd(x), nbytes, _split_candidates(),
           _helion_split_rows)
    yield ("helion softmax bwd (split rows)", lambda: h_sm.softmax_bwd(dy, y), nbytes * 3 // 2, _split_candidates(),
           _helion_split_rows)


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
    # the eviction hints that keep a row in L2 between the forward's two passes, with fewer rows in flight as well
    yield ("triton cross_entropy fwd+grad, rows kept in L2",
           lambda: t_ce.cross_entropy_fwd(logits, target, scale, -100, 0.0, grad), nbytes,
           [{"block": b, "warps": w, "stages": 1, "per_sm": p, "keep_in_l2": keep}
            for (b, w), p, keep in itertools.product(((8192, 16), (16384, 16)), (1, 2, 4), (False, True))],
           _triton_ce)
    # x[target] with the gradient written over the logits (as the linear loss does): the race-free reduction
    # (shipped) against one load and a barrier; the shipped launch settings.
    yield ("triton cross_entropy in-place x_t", lambda: t_ce.cross_entropy_fwd(logits, target, scale, -100, 0.0,
                                                                           logits),
           nbytes, [{"xt": "reduce"}, {"xt": "barrier"}], _triton_ce_xt)
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
    yield ("helion cross_entropy fwd+grad, rows kept in L2",
           lambda: h_ce.cross_entropy_fwd(logits, target, scale, -100, 0.0, grad), nbytes,
           [{"block_sizes": [1, b, b], "num_warps": 16, "range_num_stages": [0, 1, 1], "pid_type": pid,
             **({"num_sm_multiplier": p} if pid != "flat" else {}), "keep_in_l2": k}
            for b, (pid, p), k in itertools.product(
                (8192, 16384), (("flat", 0), ("persistent_interleaved", 1), ("persistent_interleaved", 2)),
                (False, True))],
           _helion_ce_keep)


def _matmul(m: int, n: int, k: int, device: torch.device) -> Iterator[Family]:
    """Helion's matmul forward tiles (the TMA fast path's buckets) at one shape; "nbytes" is the flops here."""
    import hkernels.ops.matmul as h_mm

    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(m, k, generator=g, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, k, generator=g, device=device, dtype=torch.bfloat16).t()
    cands: list[Candidate] = []
    for (bm, bn, bk), w, st, pid in itertools.product(
        ((128, 256, 64), (128, 128, 64), (256, 128, 64), (128, 256, 32)), (8,), (3, 4), ("flat", "persistent")
    ):
        c: Candidate = {"block_sizes": [bm, bn, bk], "num_warps": w, "num_stages": st, "l2_groupings": [8],
                        "indexing": "tensor_descriptor"}
        if pid == "persistent":
            c.update(pid_type="persistent_interleaved", range_flattens=[True, None])
        else:
            c.update(pid_type="flat")
        cands.append(c)
    yield (f"helion matmul fwd {m}x{n}x{k}", lambda: h_mm.matmul_fwd(a, b, None, None, False), -int(2 * m * n * k),
           cands, _helion_override("_matmul_fwd"))


def _moe(t: int, hidden: int, inter: int, experts: int, top_k: int, device: torch.device) -> Iterator[Family]:
    """Helion's moe forward at one shape (ids drawn uniformly): the up projection's column and K tiles, stages and
    TMA on the weight (its row tiles are the tile map's); "nbytes" is the flops here."""
    import hkernels.ops.moe as h_moe

    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(t, hidden, generator=g, device=device, dtype=torch.bfloat16)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=g, device=device, dtype=torch.bfloat16) / hidden**0.5
    down = torch.randn(experts, hidden, inter, generator=g, device=device, dtype=torch.bfloat16) / inter**0.5
    ids = torch.randint(0, experts, (t, top_k), generator=g, device=device)
    tw = torch.rand(t, top_k, generator=g, device=device, dtype=torch.bfloat16)
    # (the up kernel's loads and stores in order: the tile map's three, the tokens, x, the gate's and up's weight; h)
    tma = {"indexing": ["pointer"] * 5 + ["tensor_descriptor"] * 2 + ["pointer"] * 3, "host_tensor_descriptors": True}
    up: list[Candidate] = [
        {"block_sizes": [bn, bk], "num_warps": 8, "range_num_stages": [0, 0, 0, st], "l2_groupings": [8],
         **(tma if desc else {})}
        for bn, bk, st, desc in ((64, 64, 3, False), (128, 64, 3, True), (64, 64, 3, True), (128, 64, 4, False),
                                 (128, 32, 4, True), (256, 64, 3, True))
    ]
    yield (f"helion moe fwd {t}x{hidden}x{inter}", lambda: h_moe.moe_fwd(x, gate_up, down, ids, tw, False),
           -int(6 * t * top_k * hidden * inter), up, _helion_override("_moe_up"))
    # The backward's down-projection kernel alone (dout's rows gathered by token, SwiGLU's backward in its epilogue):
    # its column and K tiles, stages and TMA on the down weight (its loads and stores in order: the tile map's three,
    # the tokens, dout, the weight, the gate and up, the slots, the routing weights; dpre twice, hw).
    _, pre, src, order, pos, ends = h_moe.moe_fwd(x, gate_up, down, ids, tw, True)
    dout = torch.randn(t, hidden, generator=g, device=device, dtype=torch.bfloat16)
    w_tma = {"indexing": ["pointer"] * 5 + ["tensor_descriptor"] + ["pointer"] * 7, "host_tensor_descriptors": True}
    down_bwd: list[Candidate] = [
        {"block_sizes": [bn, bk], "num_warps": w, "range_num_stages": [0, 0, 0, st], "l2_groupings": [8],
         **(w_tma if desc else {})}
        for bn, bk, w, st, desc in ((64, 64, 8, 3, False), (128, 64, 8, 3, True), (64, 64, 8, 3, True),
                                    (128, 64, 8, 4, False), (128, 128, 8, 3, True), (64, 128, 8, 3, True),
                                    (128, 64, 4, 3, True), (256, 64, 8, 3, True))
    ]
    yield (f"helion moe down_bwd {t}x{hidden}x{inter}",
           lambda: h_moe.moe_bwd(dout, x, gate_up, down, ids, tw, pre, src, order, pos, ends, False, False),
           -int(2 * t * top_k * hidden * inter), down_bwd, _helion_override("_moe_down_bwd"))
    # The weight gradients (gate/up's with x gathered by token, down's with dout gathered), after the down-backward:
    # their tiles (the timed call includes the down-backward, whose time the candidates share)
    dweight: list[Candidate] = [
        {"block_sizes": [bn, bk, bm], "num_warps": 8, "range_num_stages": [0, st], "l2_groupings": [8]}
        for bn, bk, bm, st in ((128, 256, 64, 3), (128, 128, 64, 4), (256, 128, 64, 3), (128, 256, 32, 4),
                               (64, 256, 64, 3))
    ]
    yield (f"helion moe dweight {t}x{hidden}x{inter}",
           lambda: h_moe.moe_bwd(dout, x, gate_up, down, ids, tw, pre, src, order, pos, ends, False, True),
           -int(2 * t * top_k * hidden * inter * 4), dweight, _helion_override("_moe_dweight"))


def _grouped(t: int, n: int, k: int, experts: int, device: torch.device) -> Iterator[Family]:
    """Helion's grouped GEMM (the moe layers' projections) at one shape, tokens spread evenly over the experts:
    the forward's column and K tiles (its row tiles are the tile map's, a bucket setting), TMA on the weight (with
    host descriptors, without which Helion drops the K loop's pipelining) and the weight gradient's tile order;
    "nbytes" is the flops here."""
    import hkernels.ops.grouped_matmul as h_gm

    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(t, k, generator=g, device=device, dtype=torch.bfloat16)
    w = torch.randn(experts, n, k, generator=g, device=device, dtype=torch.bfloat16) / k**0.5
    sizes = torch.full((experts,), t // experts, device=device, dtype=torch.int32)
    dy = torch.randn(t, n, generator=g, device=device, dtype=torch.bfloat16)
    # (the forward's loads and store in order: the tile map's three, x, the weight; y)
    tma = {"indexing": ["pointer"] * 4 + ["tensor_descriptor", "pointer"], "host_tensor_descriptors": True}
    fwd: list[Candidate] = [
        {"block_sizes": [bn, bk], "num_warps": 8, "range_num_stages": [0, 0, 0, st], "l2_groupings": [8],
         **(tma if desc else {})}
        for bn, bk, st, desc in ((64, 64, 3, False), (64, 64, 3, True), (128, 64, 3, True), (128, 64, 4, False),
                                 (128, 128, 3, True), (256, 64, 3, True), (64, 64, 4, True), (128, 32, 4, False))
    ]
    yield (f"helion grouped_matmul fwd {t}x{n}x{k}", lambda: h_gm.grouped_matmul_fwd(x, w, sizes),
           -int(2 * t * n * k), fwd, _helion_override("_grouped_matmul_fwd"))
    # dx: the forward's kernel on the transposed weight (Helion's descriptor permuted), the moe backward's dx too
    ends = h_gm.group_ends(sizes, t)
    w_t = w.transpose(1, 2)
    yield (f"helion grouped_matmul dx {t}x{k}x{n}", lambda: h_gm._forward(dy, w_t, ends), -int(2 * t * n * k), fwd,
           _helion_override("_grouped_matmul_fwd"))
    dweight: list[Candidate] = [
        {"block_sizes": [bn, bk, bm], "num_warps": 8, "range_num_stages": [0, st], "l2_groupings": [8],
         **({"loop_orders": [order]} if order else {})}
        for (bn, bk, bm, st), order in (((128, 256, 64, 3), None), ((128, 256, 64, 3), [1, 2, 0]),
                                        ((128, 256, 64, 3), [2, 1, 0]), ((128, 128, 64, 4), None),
                                        ((256, 128, 64, 3), None), ((128, 256, 32, 4), None), ((64, 256, 64, 3), None))
    ]
    yield (f"helion grouped_matmul dweight {t}x{n}x{k}",
           lambda: h_gm.grouped_matmul_bwd(dy, x, w, sizes, False, True), -int(2 * t * n * k), dweight,
           _helion_override("_grouped_matmul_dweight"))


def _triton_matmul_gelu(m: int, n: int, k: int, device: torch.device) -> Iterator[Family]:
    """The Triton TMA kernel with the bias + tanh-gelu epilogue: epilogue slices, flattening, warp specialization."""
    import dataclasses

    import triton_fallback.matmul as t_mm

    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(m, k, generator=g, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, k, generator=g, device=device, dtype=torch.bfloat16).t()
    bias = torch.randn(n, generator=g, device=device, dtype=torch.bfloat16)
    base = t_mm.MatmulConfig(128, 256, 64, 8, 8, 4, subtile=4, flatten=True)
    cands: list[Candidate] = [
        {"subtile": st, "flatten": fl, "warp_specialize": ws, "num_stages": ns, "act": act}
        for act in ("gelu_tanh", None)
        for st, fl, ws, ns in ((4, True, False, 4), (2, True, False, 4), (4, False, False, 4), (4, False, True, 4),
                               (4, True, False, 3), (2, False, True, 3), (4, False, True, 3))
    ]
    state: dict[str, Any] = {"act": None}

    def apply(cand: Candidate) -> Callable[[], None]:
        saved = t_mm.matmul_config
        cfg = dataclasses.replace(base, **{k_: v for k_, v in cand.items() if k_ != "act"})
        t_mm.matmul_config = lambda *_a, **_k: cfg
        state["act"] = cand["act"]

        def undo() -> None:
            t_mm.matmul_config = saved

        return undo

    yield (f"triton matmul(+gelu) fwd {m}x{n}x{k}", lambda: t_mm.matmul_fwd(a, b, bias, state["act"], False),
           -int(2 * m * n * k), cands, apply)


def _attention_bwd(device: torch.device) -> Iterator[Family]:
    """The Triton attention backward (dq by atomics, or the separate dq kernel) at B=4, H=32, S=4096, D=128."""
    import triton_fallback.attention as t_at

    g = torch.Generator(device=device).manual_seed(0)
    q, k, v, do = (torch.randn(4, 32, 4096, 128, generator=g, device=device, dtype=torch.bfloat16) for _ in range(4))
    scale = 128**-0.5
    cands: list[Candidate] = []
    for causal in (False, True):
        for bm, bn, w, st in ((64, 64, 8, 2), (64, 64, 4, 2), (64, 128, 8, 2), (128, 64, 8, 2), (64, 64, 8, 3)):
            cands.append({"causal": causal, "dq_atomic": True, "dkdv": (bm, bn, w, st), "dq": None})
        for dkdv in ((64, 128, 8, 2), (128, 128, 8, 2), (64, 128, 8, 3)):
            for dq in ((128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3)):
                cands.append({"causal": causal, "dq_atomic": False, "dkdv": dkdv, "dq": dq})
    fwd = {c: t_at.attention_fwd(q, k, v, c, scale) for c in (False, True)}
    state: dict[str, Any] = {"causal": False}

    def apply(cand: Candidate) -> Callable[[], None]:
        saved = t_at.attention_settings
        state["causal"] = cand["causal"]

        def settings(head_dim: int, dtype: torch.dtype, causal: bool, kernel: str, tma: bool = True) -> Any:
            if kernel == "fwd":
                return saved(head_dim, dtype, causal, kernel, tma)
            bm, bn, w, st = cand[kernel] if cand[kernel] else cand["dkdv"]
            return t_at.AttentionSettings(bm, bn, w, st, dq_atomic=cand["dq_atomic"])

        t_at.attention_settings = settings

        def undo() -> None:
            t_at.attention_settings = saved

        return undo

    def step() -> object:
        o, lse = fwd[state["causal"]]
        return t_at.attention_bwd(do, q, k, v, o, lse, state["causal"], scale)

    flops = int(2.5 * 4 * 4 * 32 * 4096 * 4096 * 128)  # the backward's 5 matmuls (causal: half of it)
    for causal in (False, True):
        mine = [c for c in cands if c["causal"] == causal]
        yield (f"triton attention bwd 4x32x4096x128{' causal' if causal else ''}", step, -flops, mine, apply)


def _linear_ce_chunks(t: int, h: int, v: int, device: torch.device) -> list[dict[str, Any]]:
    """fused_linear_cross_entropy forward+backward per chunk length: ms and extra peak MiB (with eager and Liger)."""
    import torch.nn.functional as F

    import hkernels
    from hkernels.runtime import chunked as _chunked

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
            ms = time_ms(fn, device)
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
    p = cli.parser("sweep-llm", __doc__)
    p.add_argument("--budget-s", type=float, default=600.0, help="stop starting new candidates after this many seconds")
    p.add_argument("--family-s", type=float, default=60.0, help="and after this many seconds within one family")
    p.add_argument("--only", default="",
                   help="time only families whose name contains this (e.g. 'triton', 'linear'; default: all)")
    p.add_argument("--out", type=Path, default=Path("sweep_llm.json"), help="the JSON file of every timing")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("python -m bench sweep-llm times kernels on a CUDA GPU and found none", file=sys.stderr)
        return 2
    import hkernels  # noqa: F401

    device = torch.device("cuda")
    copy = harness.copy_gbps(device)
    start = time.time()
    results: dict[str, Any] = {"copy_gbps": copy, "families": {}}

    def save() -> None:  # after every family: a run cut short keeps what it measured
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1, default=str))

    memory_bound = [((t, v), _cross_entropy(t, v, device)) for t, v in ((8192, 128256), (4096, 262144))]
    memory_bound.append(((4096, 128256), _softmax_long(4096, 128256, device)))
    for (t, v), families in memory_bound:
        for family, fn, nbytes, candidates, apply in families:
            if args.only not in family:
                continue
            deadline = min(start + args.budget_s, time.time() + args.family_s)
            ok, failed = harness.time_candidates(fn, candidates, apply, nbytes, copy, device, deadline)
            tried = ok + failed
            results["families"][f"{family} {t}x{v}"] = tried
            for rank, best in enumerate(ok[:3]):
                print(f"{family:<32} {t}x{v}  #{rank + 1} {best['pct_copy']:5.1f}% of copy {best['candidate']}")
            print(f"{family:<32} {t}x{v}  worst {ok[-1]['pct_copy'] if ok else 0:.1f}%, {len(tried)} tried, "
                  f"{sum('error' in x for x in tried)} failed", flush=True)
            save()
        torch.cuda.empty_cache()
    extra: list[Family] = [*_attention_bwd(device), *_matmul(8192, 8192, 8192, device),
                            *_matmul(4096, 28672, 4096, device), *_triton_matmul_gelu(8192, 8192, 8192, device),
                            *_grouped(16384, 28672, 4096, 8, device), *_grouped(16384, 4096, 14336, 8, device),
                            *_moe(8192, 4096, 14336, 8, 2, device)]
    for family, fn, work, candidates, apply in extra:
        if args.only not in family:
            continue
        deadline = min(start + args.budget_s, time.time() + args.family_s)
        ok, failed = harness.time_candidates(fn, candidates, apply, 1, copy, device, deadline)
        for t_ in ok:  # compute-bound: TFLOP/s instead of % of copy
            flops = -work * (0.5 if t_["candidate"].get("causal") else 1.0)
            t_["tflops"] = flops / float(t_["ms"]) / 1e9
            del t_["pct_copy"]
        ok.sort(key=lambda t_: -float(t_["tflops"]))
        results["families"][family] = ok + failed
        for rank, best in enumerate(ok[:4]):
            print(f"{family:<40} #{rank + 1} {best['tflops']:6.0f} TFLOP/s {best['candidate']}", flush=True)
        print(f"{family:<40} {len(ok)} timed, {len(failed)} failed: {[f['error'][:80] for f in failed][:3]}")
        torch.cuda.empty_cache()
        save()
    if "linear" in args.only or not args.only:
        results["linear_ce"] = _linear_ce_chunks(8192, 4096, 128256, device)
    save()
    print(f"copy {copy:.0f} GB/s; {time.time() - start:.0f} s; written {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
