"""bench train's harness on the tiny model: it runs, writes its results, and its curve comparison can fail."""

from __future__ import annotations

import itertools
import json

from bench import train


def test_train_smoke_writes_results(tmp_path):
    rc = train.main(["--model", "tiny", "--seq", "8", "--batch", "2", "--steps", "1", "--warmup", "1",
                     "--variants", "eager,hkernels-triton", "--converge", "3", "--converge-variant", "hkernels-triton",
                     "--out", str(tmp_path)])
    data = json.loads((tmp_path / "results.json").read_text())
    assert [r["variant"] for r in data["rows"]] == ["eager", "hkernels-triton"]
    assert all(r.get("tokens_per_s") and len(r["losses"]) == 2 for r in data["rows"])
    assert len(data["converge"]["curves"]["eager"]) == 3
    assert rc == (0 if data["converge"]["match"] else 1)


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
