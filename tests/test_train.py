"""python -m bench train's harness on the tiny model: it runs, writes its results, its curve comparison can fail, and
its defaults fit the machine."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys

import pytest
import torch

from bench import train


def test_train_smoke_writes_results(tmp_path):
    rc = train.main(["--model", "tiny", "--seq", "8", "--batch", "2", "--steps", "1", "--warmup", "1",
                     "--variants", "eager,hkernels-triton", "--converge", "3", "--converge-variant", "hkernels-triton",
                     "--out", str(tmp_path)])
    data = json.loads((tmp_path / "results.json").read_text())
    assert [r["variant"] for r in data["rows"]] == ["eager", "hkernels-triton"]
    timed = torch.cuda.is_available()  # a CPU run (interpreted kernels) reports losses, no times
    assert all(bool(r.get("tokens_per_s")) == timed and len(r["losses"]) == 2 for r in data["rows"])
    assert len(data["converge"]["curves"]["eager"]) == 3 and data["converge"]["reference"] == "eager"
    assert rc == (0 if data["converge"]["match"] else 1)


def test_train_mixed_precision_with_varying_lengths(tmp_path):
    """--amp (float32 parameters, forwards under autocast) with --seq-lens (the row length changing step by step):
    each variant trains on the same lengths, hkernels' losses follow eager's, results.json says how it ran."""
    rc = train.main(["--model", "tiny", "--seq-lens", "8,16", "--batch", "2", "--steps", "2", "--warmup", "1",
                     "--amp", "--variants", "eager,hkernels-triton", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "results.json").read_text())
    assert rc == 0, data
    assert data["env"]["amp"] and data["env"]["seq_lens"] == [8, 16] and data["env"]["seq"] == 16
    eager, ours = (r["losses"] for r in data["rows"])
    assert len(eager) == len(ours) == 3
    assert train.compare_curves(eager, ours)["match"]


def test_train_moe_model_patches_its_experts(tmp_path):
    """The tiny MoE model (Qwen3-MoE's block, experts as transformers' grouped_mm): hkernels.patch puts its experts
    on hkernels.moe and the patched run's loss curve matches eager's."""
    rc = train.main(["--model", "tiny_moe", "--seq", "8", "--batch", "2", "--steps", "1", "--warmup", "1",
                     "--variants", "eager,hkernels-triton", "--converge", "3", "--converge-variant", "hkernels-triton",
                     "--out", str(tmp_path)])
    data = json.loads((tmp_path / "results.json").read_text())
    assert [r["variant"] for r in data["rows"]] == ["eager", "hkernels-triton"]
    assert data["converge"]["match"] and rc == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Inductor compiling the MoE model: GPU only (75 s on a CPU)")
def test_train_moe_model_with_compile_follows_eager(tmp_path):
    """The tiny MoE model patched (its experts on hkernels.moe) and compiled trains step for step as the plain
    model does, in float32."""
    rc = train.main(["--model", "tiny_moe", "--seq", "8", "--batch", "2", "--steps", "3", "--warmup", "0",
                     "--variants", "eager,hkernels+compile", "--dtype", "float32", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert rc == 0 and [r["variant"] for r in rows] == ["eager", "hkernels+compile"], rows
    eager, ours = (r["losses"] for r in rows)
    assert len(eager) == len(ours) == 3
    assert max(abs(a - b) for a, b in zip(eager, ours, strict=True)) < 1e-3


def test_each_variant_trains_what_its_name_says():
    """The compiled variants yield a compiled module (hkernels+compile also patched), the hkernels ones a patched
    module that is not compiled, eager the plain model; each is undone afterwards."""
    import hkernels
    from bench.model import build

    model = build("tiny", "cpu", torch.float32)
    compiled = torch._dynamo.eval_frame.OptimizedModule
    for name, want_compiled, want_patched in (("eager", False, False), ("hkernels", False, True),
                                              ("hkernels-triton", False, True), ("torch_compile", True, False),
                                              ("hkernels+compile", True, True)):
        with train._variant(name, model, lambda m: m) as fwd:
            assert isinstance(fwd, compiled) == want_compiled, name
            patched = any(isinstance(m, hkernels.nn.RMSNorm) for m in model.modules())
            assert patched == want_patched, name
        assert not any(isinstance(m, hkernels.nn.RMSNorm) for m in model.modules()), name


def test_a_run_stopped_part_way_keeps_the_variants_it_finished(tmp_path, monkeypatch):
    """results.json is written after each variant: a run cut off in its second variant (a time limit, ^C) still
    holds the first one's row, with its warm-up time (None where nothing is timed: a CPU)."""
    real = train.train

    def second_interrupted(name, *args, **kwargs):
        if name == "hkernels-triton":
            raise KeyboardInterrupt
        return real(name, *args, **kwargs)

    monkeypatch.setattr(train, "train", second_interrupted)
    with pytest.raises(KeyboardInterrupt):
        train.main(["--model", "tiny", "--seq", "8", "--batch", "2", "--steps", "1", "--warmup", "1",
                    "--variants", "eager,hkernels-triton", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert [r["variant"] for r in rows] == ["eager"] and len(rows[0]["losses"]) == 2
    assert "warmup_s" in rows[0] and (rows[0]["warmup_s"] is not None) == torch.cuda.is_available()


def test_curve_comparison_flags_a_drift():
    eager = [5.0 - 0.03 * i for i in range(40)]
    assert train.compare_curves(eager, [x + 0.01 for x in eager])["match"]
    drifted = [x + (0.5 if i >= 20 else 0.0) for i, x in enumerate(eager)]
    verdict = train.compare_curves(eager, drifted)
    assert not verdict["match"] and verdict["worst_step"] > 20


def test_markov_batches_are_reproducible_and_learnable():
    import torch

    a = next(train.markov_batches(50, 2, 30, seed=4, device=torch.device("cpu")))
    b = next(train.markov_batches(50, 2, 30, seed=4, device=torch.device("cpu")))
    assert torch.equal(a, b) and a.shape == (2, 30)
    # every token is followed by one of at most 4 successors
    pairs = {(int(x), int(y)) for row in a for x, y in itertools.pairwise(row.tolist())}
    by_first: dict[int, set[int]] = {}
    for x, y in pairs:
        by_first.setdefault(x, set()).add(y)
    assert max(len(v) for v in by_first.values()) <= 4


@pytest.mark.skipif(torch.cuda.is_available(), reason="two processes on CPU (gloo); a GPU machine runs this on GPUs")
@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_train_distributed_matches_one_process(mode, tmp_path):
    """torchrun with two CPU processes: the patched tiny model under DDP / FSDP2 trains, and its loss curve matches
    one process training on the same global batches."""
    env = {**os.environ, "HKERNELS_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "bench", "train",
           "--model", "tiny", "--dist", mode, "--seq", "8", "--batch", "2", "--steps", "1", "--warmup", "0",
           "--variants", "hkernels-triton", "--converge", "3", "--converge-variant", "hkernels-triton",
           "--dtype", "float32", "--out", str(tmp_path)]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["env"]["dist"] == mode and data["env"]["world"] == 2
    conv = data["converge"]
    assert conv["match"] and conv["candidate"] == f"hkernels-triton ({mode} x2)"
    ref, got = conv["curves"][conv["reference"]], conv["curves"][conv["candidate"]]
    assert max(abs(a - b) for a, b in zip(ref, got, strict=True)) < 1e-3  # float32: the same math, reordered


@pytest.mark.skipif(torch.cuda.is_available(), reason="two processes on CPU (gloo); a GPU machine runs this on GPUs")
def test_train_fsdp2_with_compile_follows_eager(tmp_path):
    """torchrun with two CPU processes, FSDP2: the patched tiny model under torch.compile (hkernels' ops inside the
    compiled graphs; interpreted kernels stay opaque there) trains step for step as the plain model does."""
    env = {**os.environ, "HKERNELS_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "bench", "train",
           "--model", "tiny", "--dist", "fsdp2", "--seq", "8", "--batch", "2", "--steps", "3", "--warmup", "0",
           "--variants", "eager,hkernels+compile", "--dtype", "float32", "--out", str(tmp_path)]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    eager, ours = (r["losses"] for r in rows)
    assert len(eager) == len(ours) == 3
    assert max(abs(a - b) for a, b in zip(eager, ours, strict=True)) < 1e-3  # float32: the same math, reordered


def test_defaults_fit_the_machine():
    """On a GPU the 1B model at batch 4 x 2048; on a CPU (interpreted kernels) the tiny model at a small batch, so
    that python -m bench train with no arguments finishes there."""
    args = train._parse([])
    if torch.cuda.is_available():
        assert (args.model, args.batch, args.seq) == ("1b", 4, 2048)
    else:
        assert args.model == "tiny" and args.batch * args.seq <= 256
    assert train._parse(["--model", "1b", "--seq", "16"]).model == "1b"
