"""python -m bench train: whole training steps of a Llama-style decoder (bench.model), per variant:

- ``eager``: plain PyTorch (``torch.nn.RMSNorm``, SDPA, ``F.cross_entropy`` over the full logits);
- ``hkernels`` / ``hkernels-helion`` / ``hkernels-triton``: the same model after ``hkernels.patch`` (norms, SwiGLU,
  rope, the fused linear loss), on the ``auto`` backend or one backend;
- ``torch_compile``: the plain model under ``torch.compile``;
- ``hkernels+compile``: the patched model under ``torch.compile`` (hkernels' ops are traced into its graphs: their
  kernels launched by Inductor's generated code, fused around by Inductor);
- ``liger``: Liger-Kernel's kernels in the same places (its RMSNorm, SiLU-mul, rope and fused linear loss), when it
  is importable (a peer, never a dependency).

Each variant starts from the same weights (one seed) and trains on the same batches: tokens drawn from a fixed
random Markov chain (every token has 4 successors), so the loss falls from ln(V) towards ln(4) and curves can be
compared. Reported: tokens/s over the timed steps (after warm-up), peak memory allocated during them, the last
loss and the warm-up's wall time (where a compiled variant's compiles go), each variant's as it finishes;
results.json is rewritten after each variant, so a run stopped part-way keeps the variants it finished.
``--converge N`` also trains eager and hkernels (auto) for N steps each and compares their loss curves (10-step
moving averages; the tolerance is printed with the result), with a plot when matplotlib is there.

``--amp``: mixed precision as most people train: float32 parameters, each forward under ``torch.autocast`` to
``--dtype`` (the backward and the optimizer step outside it). ``--seq-lens 512,1024,2048,4096``: the row length
changes step to step through that list (the same sequence for every variant; torch.compile meets a new length and
makes it symbolic, as fine-tuning on real data does); tokens/s counts the tokens of each step. ``--compile-mode``:
torch.compile's mode for the compiled variants (``reduce-overhead``: CUDA graphs).

``--dist ddp`` / ``--dist fsdp2`` (under ``torchrun``; on H200s with ``NCCL_NVLS_ENABLE=0``): every variant wrapped
in DistributedDataParallel or FSDP2 (``fully_shard`` per decoder layer, after patching), ``--batch`` rows per
process out of one global batch; with ``--converge N`` the distributed curve is compared with one process training
on the same global batches.

On a CPU this runs only with ``HKERNELS_INTERPRET=1`` and the tiny model, which are then the defaults with a
small batch (a check of the harness: interpreted kernels make its tokens/s meaningless; ``--dist`` uses gloo
there).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import sys
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

# As under python -m bench run: segments that grow in place do not fragment. Before torch is imported.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch
from torch import nn

from bench import cli

VARIANTS = ("eager", "hkernels", "hkernels-helion", "hkernels-triton", "torch_compile", "hkernels+compile", "liger")
# Loss curves "match" when the 10-step moving averages differ by at most this fraction of eager's (plus a floor):
# bf16 training is not bitwise reproducible across kernels, so single steps wander; trends must not.
CURVE_RTOL, CURVE_ATOL, SMOOTH = 0.02, 0.02, 10


# The defaults that depend on the machine: (GPU, CPU). On a CPU the kernels run interpreted: a tiny model only.
_MACHINE_DEFAULTS = {"model": ("1b", "tiny"), "seq": (2048, 32), "batch": (4, 2)}


def _parse(argv: list[str]) -> argparse.Namespace:
    p = cli.parser("train", __doc__)
    p.add_argument("--model", default=None,
                   help="a bench.model config: 1b, moe (Qwen3-MoE's experts), tiny or tiny_moe (default: 1b on a GPU, "
                        "tiny on a CPU)")
    p.add_argument("--seq", type=int, default=None, help="tokens per row (default: 2048 on a GPU, 32 on a CPU)")
    p.add_argument("--batch", type=int, default=None,
                   help="rows per step, per process under --dist (default: 4 on a GPU, 2 on a CPU)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per variant")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation, caches)")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated variants")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                   help="the model's parameters and activations (with --amp: autocast's dtype)")
    p.add_argument("--amp", action="store_true",
                   help="float32 parameters, each forward under torch.autocast to --dtype (mixed precision)")
    p.add_argument("--seq-lens", default=None,
                   help="comma-separated row lengths taken in turn step by step (default: --seq every step)")
    p.add_argument("--compile-mode", default=None,
                   help="torch.compile's mode for torch_compile and hkernels+compile (default, reduce-overhead, "
                        "max-autotune-no-cudagraphs, ...)")
    p.add_argument("--lr", type=float, default=3e-4, help="AdamW's learning rate")
    p.add_argument("--converge", type=int, default=0,
                   help="also compare eager's and hkernels' loss curves over this many steps (0: no comparison)")
    p.add_argument("--converge-variant", default="hkernels", help="the hkernels variant whose curve is compared")
    p.add_argument("--patch-ops", default=None,
                   help="what hkernels.patch replaces in the hkernels variants: 'all' (adds attention) or a "
                        "comma-separated list (default: hkernels.patch's default set)")
    p.add_argument("--dist", default="none", choices=("none", "ddp", "fsdp2"),
                   help="under torchrun: DistributedDataParallel or FSDP2 (fully_shard per decoder layer) over the "
                        "processes; --batch is per process")
    p.add_argument("--out", type=Path, default=None,
                   help="where to write results.json (and loss_curves.png) (default: nowhere, the table goes to "
                        "stdout only)")
    args = p.parse_args(argv)
    on_gpu = torch.cuda.is_available()
    for name, (gpu, cpu) in _MACHINE_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, gpu if on_gpu else cpu)
    args.lengths = [int(s) for s in args.seq_lens.split(",")] if args.seq_lens else [args.seq]
    args.seq = max(args.lengths)
    return args


def markov_batches(vocab: int, batch: int, seq: int, seed: int, device: torch.device) -> Iterator[torch.Tensor]:
    """Endless [batch, seq] token batches from one fixed random Markov chain (4 successors per token)."""
    g = torch.Generator().manual_seed(seed)
    successors = torch.randint(0, vocab, (vocab, 4), generator=g)
    while True:
        ids = torch.empty(batch, seq, dtype=torch.int64)
        ids[:, 0] = torch.randint(0, vocab, (batch,), generator=g)
        picks = torch.randint(0, 4, (batch, seq), generator=g)
        for t in range(1, seq):
            ids[:, t] = successors[ids[:, t - 1], picks[:, t]]
        yield ids.to(device)


# ------------------------------------------------------------------------------------------------ Liger


def _liger_patch(model: nn.Module) -> Callable[[], None]:
    """Liger's kernels in the places hkernels.patch uses; returns the undo."""
    from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    from liger_kernel.ops.rope import LigerRopeFunction
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction

    from bench import model as bench_model

    class LigerRMSNorm(nn.Module):
        def __init__(self, old: nn.RMSNorm) -> None:
            super().__init__()
            self.weight, self.eps = old.weight, old.eps

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return LigerRMSNormFunction.apply(x, self.weight, self.eps)

    undo: list[Callable[[], None]] = []
    for path, m in list(model.named_modules()):
        parent_path, _, attr = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        if isinstance(m, nn.RMSNorm):
            setattr(parent, attr, LigerRMSNorm(m))
            undo.append(lambda p=parent, a=attr, o=m: setattr(p, a, o))
        if isinstance(m, bench_model.MLP):
            m.forward = types.MethodType(
                lambda self, x: self.down_proj(LigerSiLUMulFunction.apply(self.gate_proj(x), self.up_proj(x))), m)
            undo.append(lambda m=m: m.__dict__.pop("forward"))
        if isinstance(m, bench_model.Experts):
            from liger_kernel.ops.fused_moe import LigerFusedMoEFunction

            m.forward = types.MethodType(lambda self, x, index, weights: LigerFusedMoEFunction.apply(
                x, self.gate_up_proj, self.down_proj, index.to(torch.int32), weights), m)
            undo.append(lambda m=m: m.__dict__.pop("forward"))
    rope = bench_model.apply_rotary_pos_emb
    bench_model.apply_rotary_pos_emb = lambda q, k, cos, sin, *a, **kw: LigerRopeFunction.apply(q, k, cos, sin)
    undo.append(lambda: setattr(bench_model, "apply_rotary_pos_emb", rope))

    def forward(self: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> Any:
        if labels is None:
            return type(self).forward(self, input_ids)
        hidden, shifted, output = self.hkernels_loss_inputs(input_ids, labels)
        h = hidden.reshape(-1, hidden.shape[-1])
        return output(loss=LigerFusedLinearCrossEntropyFunction.apply(h, self.lm_head.weight, shifted.reshape(-1))[0])

    model.forward = types.MethodType(forward, model)
    undo.append(lambda: model.__dict__.pop("forward"))
    return lambda: [u() for u in reversed(undo)]


# ------------------------------------------------------------------------------------------------ runs


@contextlib.contextmanager
def _variant(name: str, model: nn.Module, wrap: Callable[[nn.Module], nn.Module],
             patch_ops: list[str] | None = None, compile_mode: str | None = None) -> Iterator[nn.Module]:
    """The module to train for variant ``name``: ``model`` patched (or compiled), then ``wrap``-ped (DDP, FSDP2:
    after patching, so that the wrapper sees the final modules); patches undone afterwards."""
    import hkernels

    if name == "eager":
        yield wrap(model)
    elif name == "hkernels+compile":  # (before the hkernels-<backend> names, which it also starts with)
        hkernels.patch(model, ops=patch_ops)
        try:
            yield torch.compile(wrap(model), mode=compile_mode)
        finally:
            hkernels.unpatch(model)
    elif name.startswith("hkernels"):
        backend = name.partition("-")[2] or "auto"
        hkernels.patch(model, ops=patch_ops)
        try:
            with hkernels.use_backend(backend):
                yield wrap(model)
        finally:
            hkernels.unpatch(model)
    elif name == "torch_compile":
        yield torch.compile(wrap(model), mode=compile_mode)
    elif name == "liger":
        undo = _liger_patch(model)
        try:
            yield wrap(model)
        finally:
            undo()
    else:
        raise ValueError(f"python -m bench train: unknown variant {name!r}; valid: {', '.join(VARIANTS)}")


def _wrapper(mode: str, device: torch.device) -> Callable[[nn.Module], nn.Module]:
    if mode == "none":
        return lambda m: m
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ids = [device.index] if device.type == "cuda" else None
        return lambda m: DistributedDataParallel(m, device_ids=ids)

    def fsdp2(m: nn.Module) -> nn.Module:
        from torch.distributed.fsdp import fully_shard

        for layer in m.model.layers:  # one all-gather per decoder layer; embeddings, final norm, head: the root
            fully_shard(layer)
        return fully_shard(m)

    return fsdp2


def _patch_ops(args: argparse.Namespace) -> str | None:
    """hkernels.patch's ops: None (its default set), "all", or the ops named (each must replace something)."""
    return args.patch_ops or None


def _rank_world() -> tuple[int, int]:
    return torch.distributed.get_rank(), torch.distributed.get_world_size()


def train(name: str, args: argparse.Namespace, device: torch.device, steps: int, warmup: int,
          say: Callable[[str], None], dist_mode: str = "none") -> dict[str, Any]:
    """``warmup`` + ``steps`` AdamW steps of variant ``name`` from the shared seed; its numbers and losses
    (``dist_mode`` "ddp" / "fsdp2": this process's share of a distributed run; tokens/s counts every process's)."""
    from bench import model as bench_model

    dtype = getattr(torch, args.dtype)
    model = bench_model.build(args.model, device=device, dtype=torch.float32 if args.amp else dtype, seed=0)
    region = (lambda: torch.autocast(device.type, dtype=dtype)) if args.amp else contextlib.nullcontext
    # Every process draws the same global batch (world x batch rows) and trains on its own rows: a distributed run
    # sees exactly the data of a one-process run with the global batch.
    rank, world = (dist_mode != "none" and _rank_world()) or (0, 1)
    rows = slice(rank * args.batch, (rank + 1) * args.batch) if dist_mode != "none" else slice(None)
    data = markov_batches(model.config.vocab_size, args.batch * (world if dist_mode != "none" else 1), args.seq,
                          seed=1, device=device)
    losses: list[float] = []
    on_gpu = device.type == "cuda"
    result: dict[str, Any] = {"variant": name}
    # Every batch made before the clock starts (the chain is walked token by token on the host: tens of ms a batch)
    lengths = args.lengths
    batches = [next(data)[rows][:, :lengths[i % len(lengths)]] for i in range(warmup + steps)]
    timed = tokens = 0
    with _variant(name, model, _wrapper(dist_mode, device), _patch_ops(args), args.compile_mode) as fwd:
        opt = torch.optim.AdamW(fwd.parameters(), lr=args.lr, foreach=True)  # after wrapping (FSDP2 reshards)
        t0 = start = time.perf_counter()
        step_times: list[float] = []  # when each timed step ended (each ends in a sync: its loss's .item())
        for i, ids in enumerate(batches):
            if i == warmup:
                if on_gpu:
                    torch.cuda.synchronize(device)
                    torch.cuda.reset_peak_memory_stats(device)
                t0 = time.perf_counter()
                result["warmup_s"] = t0 - start if on_gpu and warmup else None
            with region():
                loss = fwd(ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if dist_mode != "none":  # the global batch's loss: the mean of the ranks' (equal token counts)
                loss = loss.detach().clone()
                torch.distributed.all_reduce(loss)
                loss /= world
            losses.append(loss.item())  # a sync per step: the same for every variant
            timed += i >= warmup
            tokens += ids.numel() if i >= warmup else 0
            if i >= warmup:
                step_times.append(time.perf_counter())
            if (i + 1) % max(1, (warmup + steps) // 10) == 0 or i + 1 == warmup + steps:
                say(f"  {name}: step {i + 1}/{warmup + steps}, loss {losses[-1]:.4f}")
            if not math.isfinite(losses[-1]):
                result["error"] = f"loss is {losses[-1]} at step {i + 1}"
                break
        if on_gpu:
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - t0
    tokens *= world if dist_mode != "none" else 1
    on_time = on_gpu and timed and elapsed > 0  # interpreted kernels on a CPU: no time means anything
    result.update(
        tokens_per_s=tokens / elapsed if on_time else None,
        step_ms=elapsed / timed * 1e3 if on_time else None,
        # each timed step's own time: a one-off cost inside the timed steps (a late compile) stands out here
        steps_ms=[(b - a) * 1e3 for a, b in zip([t0, *step_times], step_times, strict=False)] if on_time else None,
        peak_mib=torch.cuda.max_memory_allocated(device) / 2**20 if on_gpu else None,
        last_loss=losses[-1] if losses else None,
        losses=losses,
    )
    if on_time:  # (each variant's numbers as it finishes: a run cut short keeps those in its log)
        warm = f", warm-up {result['warmup_s']:.1f} s" if result.get("warmup_s") is not None else ""
        say(f"  {name}: {result['tokens_per_s']:.0f} tokens/s, {result['step_ms']:.1f} ms a step{warm}")
    del model
    if on_gpu:
        torch.cuda.empty_cache()
    return result


def _smooth(xs: list[float], k: int = SMOOTH) -> list[float]:
    return [sum(xs[max(0, i - k + 1):i + 1]) / len(xs[max(0, i - k + 1):i + 1]) for i in range(len(xs))]


def compare_curves(eager: list[float], ours: list[float]) -> dict[str, Any]:
    """Worst deviation of ours from the reference (eager's, or one process's) loss curve (moving averages) against
    the tolerance."""
    n = min(len(eager), len(ours))  # a run that stopped early (a non-finite loss) is compared where both ran
    if n == 0:
        return {"match": False, "worst_step": 0, "reference_loss": float("nan"), "candidate_loss": float("nan"),
                "tolerance": "no steps to compare"}
    a, b = _smooth(eager[:n]), _smooth(ours[:n])
    worst = max(range(len(a)), key=lambda i: abs(a[i] - b[i]) / (CURVE_RTOL * abs(a[i]) + CURVE_ATOL))
    excess = abs(a[worst] - b[worst]) / (CURVE_RTOL * abs(a[worst]) + CURVE_ATOL)
    return {"match": excess <= 1.0 and len(eager) == len(ours), "worst_step": worst + 1,
            "reference_loss": a[worst], "candidate_loss": b[worst],
            "tolerance": f"|smoothed difference| <= {CURVE_RTOL} x reference + {CURVE_ATOL} ({SMOOTH}-step moving "
                         "average)"}


def _plot(curves: dict[str, list[float]], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, ys in curves.items():
        ax.plot(range(1, len(ys) + 1), ys, label=name, alpha=0.4, linewidth=0.8)
        ax.plot(range(1, len(ys) + 1), _smooth(ys), label=f"{name} ({SMOOTH}-step mean)")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _init_dist(mode: str, say: Callable[[str], None]) -> tuple[torch.device, int, int] | None:
    """Join the process group torchrun set up: (device, rank, world), or None (with the reason said)."""
    if "WORLD_SIZE" not in os.environ:
        say(f"python -m bench train: --dist {mode} runs under torchrun, e.g. NCCL_NVLS_ENABLE=0 torchrun "
            f"--nproc_per_node 2 -m bench train --dist {mode} ...")
        return None
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    # A long timeout: with --converge, the other processes wait while rank 0 trains the one-process reference.
    torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                         timeout=datetime.timedelta(hours=2))
    return device, torch.distributed.get_rank(), torch.distributed.get_world_size()


def main(argv: list[str] | None = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    from hkernels.runtime import interpret as _interpret

    say = lambda s: print(s, file=sys.stderr, flush=True)
    on_gpu = torch.cuda.is_available()
    if not on_gpu and not (_interpret.enabled() and args.model in ("tiny", "tiny_moe")):
        say("python -m bench train: needs a CUDA GPU (on a CPU: HKERNELS_INTERPRET=1 with the tiny model, a check of "
            "the harness)")
        return 2
    if not on_gpu:
        say("interpret mode on a CPU: a check of the harness; the kernels run in Triton's interpreter, so it "
            "reports each variant's losses and no times")
    device, rank, world = torch.device("cuda" if on_gpu else "cpu"), 0, 1
    if args.dist != "none":
        joined = _init_dist(args.dist, say)
        if joined is None:
            return 2
        device, rank, world = joined
        if rank:
            say = lambda s: None
    try:
        return _run(args, device, rank, world, say)
    finally:
        if args.dist != "none":
            # every rank leaves together: a rank torn down while another still works aborted gloo's threads
            # ("terminate called without an active exception") now and then
            with contextlib.suppress(Exception):
                torch.distributed.barrier()
            torch.distributed.destroy_process_group()


def _run(args: argparse.Namespace, device: torch.device, rank: int, world: int, say: Callable[[str], None]) -> int:
    on_gpu = device.type == "cuda"
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        say(f"python -m bench train: unknown variant(s) {sorted(unknown)}; valid: {', '.join(VARIANTS)}")
        return 2
    if args.converge and args.converge_variant not in VARIANTS[1:4]:
        say(f"python -m bench train: --converge-variant must be one of {', '.join(VARIANTS[1:4])}")
        return 2
    from bench.ops import LIGER

    if "liger" in variants and not LIGER:
        say("python -m bench train: liger-kernel is not importable here; skipping the liger variant")
        variants.remove("liger")
    where = f", {args.dist} over {world} processes" if args.dist != "none" else ""
    rows: list[dict[str, Any]] = []
    env = {"model": args.model, "batch": args.batch, "seq": args.seq, "seq_lens": args.lengths,
           "amp": args.amp, "compile_mode": args.compile_mode, "dtype": args.dtype, "steps": args.steps,
           "warmup": args.warmup, "dist": args.dist, "world": world,
           "device": torch.cuda.get_device_name(device) if on_gpu else "cpu", "torch": torch.__version__,
           "commit": os.environ.get("HKERNELS_COMMIT")}

    def write(converge: dict[str, Any] | None = None) -> None:
        if args.out is not None and rank == 0:
            args.out.mkdir(parents=True, exist_ok=True)
            text = json.dumps({"env": env, "rows": rows, "converge": converge}, indent=1)
            (args.out / "results.json").write_text(text)
    for i, name in enumerate(variants, 1):
        seq = args.seq if len(args.lengths) == 1 else "/".join(map(str, args.lengths))
        dtype = f"float32 under autocast to {args.dtype}" if args.amp else args.dtype
        say(f"[{i}/{len(variants)}] {name}: {args.model}, batch {args.batch} x seq {seq}, {dtype}{where}")
        try:
            rows.append(train(name, args, device, args.steps, args.warmup, say, args.dist))
        except Exception as e:  # one variant failing (memory, a compile error) must not lose the others
            say(f"  {name} failed: {type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}")
            rows.append({"variant": name, "error": f"{type(e).__name__}: {e}"[:500]})
            if on_gpu:
                torch.cuda.empty_cache()
        write()  # after each variant: a run stopped part-way keeps the variants it finished
    converge = None
    if args.converge:
        ours = args.converge_variant
        curves: dict[str, list[float]] = {}
        try:
            if args.dist == "none":  # hkernels against eager, one process
                say(f"convergence: eager and {ours}, {args.converge} steps each")
                names = ("eager", ours)
                curves = {n: train(n, args, device, args.converge, 0, say)["losses"] for n in names}
            else:  # the distributed run against one process training on the same global batches
                say(f"convergence: {ours} {args.dist} x{world} and one process with the global batch, "
                    f"{args.converge} steps each")
                names = (f"{ours} (one process, batch {args.batch * world})", f"{ours} ({args.dist} x{world})")
                curves = {names[1]: train(ours, args, device, args.converge, 0, say, args.dist)["losses"]}
                if rank == 0:
                    one = argparse.Namespace(**{**vars(args), "batch": args.batch * world})
                    curves = {names[0]: train(ours, one, device, args.converge, 0, say)["losses"], **curves}
        except Exception as e:  # keep the throughput rows: results.json is still written
            say(f"  convergence failed: {type(e).__name__}: {str(e).strip().splitlines()[0] if str(e) else ''}")
            converge = {"match": False, "error": f"{type(e).__name__}: {e}"[:500], "steps": args.converge,
                        "reference": "?", "candidate": ours, "worst_step": 0, "reference_loss": float("nan"),
                        "candidate_loss": float("nan"), "tolerance": "", "curves": curves}
        if args.dist != "none":
            torch.distributed.barrier()
        if rank == 0 and converge is None:
            converge = compare_curves(curves[names[0]], curves[names[1]])
            converge.update(reference=names[0], candidate=names[1], steps=args.converge, curves=curves)
    if rank:
        return 1 if any(r.get("error") for r in rows) else 0
    out = args.out
    if out is not None:
        write(converge)
        if converge is not None and _plot(converge["curves"], out / "loss_curves.png"):
            say(f"plot: {out / 'loss_curves.png'}")
    if not on_gpu:
        _print_losses(rows)
    else:
        _print_throughput(rows, args, world)
    if converge is not None:
        verdict = "match" if converge["match"] else "DO NOT match"
        print(f"\nloss curves over {converge['steps']} steps, {converge['reference']} vs {converge['candidate']}: "
              f"{verdict} (worst at step {converge['worst_step']}: {converge['reference_loss']:.4f} vs "
              f"{converge['candidate_loss']:.4f}; {converge['tolerance']})")
    if not on_gpu:
        print("\n(interpreted on a CPU: a check of the harness, which reports losses and no times)")
    failed = any(r.get("error") for r in rows) or (converge is not None and not converge["match"])
    return 1 if failed else 0


def _print_losses(rows: list[dict[str, Any]]) -> None:
    """Without a GPU: each variant's losses, and whether its curve matches eager's."""
    eager = next((r for r in rows if r["variant"] == "eager" and r.get("losses")), None)
    print(f"\n{'variant':16s} {'steps':>5s} {'first loss':>10s} {'last loss':>9s}  loss curve vs eager's")
    for r in rows:
        if not r.get("losses"):
            print(f"{r['variant']:16s} {'failed: ' + r['error'][:100] if r.get('error') else 'no steps'}")
            continue
        losses, verdict = r["losses"], "-"
        if eager is not None and r is not eager:
            c = compare_curves(eager["losses"], losses)
            verdict = (f"{'match' if c['match'] else 'DO NOT match'} (worst at step {c['worst_step']}: "
                       f"{c['reference_loss']:.4f} vs {c['candidate_loss']:.4f})")
        print(f"{r['variant']:16s} {len(losses):5d} {losses[0]:10.4f} {losses[-1]:9.4f}  {verdict}")


def _print_throughput(rows: list[dict[str, Any]], args: argparse.Namespace, world: int) -> None:
    eager = next((r for r in rows if r["variant"] == "eager" and r.get("tokens_per_s")), None)
    dist = f"   ({args.dist} over {world} processes; tokens/s of all, memory of one)" if args.dist != "none" else ""
    print(f"\n{'variant':16s} {'tokens/s':>10s} {'step ms':>9s} {'peak MiB':>9s} {'vs eager':>8s} {'mem/eager':>9s} "
          f"{'last loss':>9s} {'warm-up s':>9s}{dist}")
    for r in rows:
        if not r.get("tokens_per_s"):
            print(f"{r['variant']:16s} {'failed: ' + r['error'][:100] if r.get('error') else 'no timed steps'}")
            continue
        tps, peak = r["tokens_per_s"], r["peak_mib"]
        speed = f"{tps / eager['tokens_per_s']:.2f}" if eager else "-"
        mem = f"{peak / eager['peak_mib']:.2f}" if eager and peak and eager["peak_mib"] else "-"
        warm = f"{r['warmup_s']:9.1f}" if r.get("warmup_s") is not None else f"{'-':>9s}"
        print(f"{r['variant']:16s} {tps:10.0f} {r['step_ms']:9.1f} {peak or 0:9.0f} {speed:>8s} {mem:>9s} "
              f"{r['last_loss']:9.4f} {warm}")
