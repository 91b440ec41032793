"""python -m bench.auto_table: the auto backend's shipped table, rebuilt from measured files."""

from __future__ import annotations

import json

from bench import auto_table


def test_auto_table_reads_latency_files_and_joins_one_folder(tmp_path):
    """bench.latency --gpu-time files (one per mode, one folder = one run) build buckets like bench results do, and
    replace an older run's numbers for the shape (session 6's hand-made buckets came from such files)."""
    old, run = tmp_path / "old", tmp_path / "run"
    old.mkdir()
    run.mkdir()
    (old / "results.json").write_text(json.dumps({"rows": [
        {"op": "cross_entropy", "m": 4096, "n": 8192, "mode": "fwd", "backend": b, "ms": ms}
        for b, ms in (("helion", 1.0), ("triton", 0.5))]}))
    for mode, helion, triton in (("fwd", 64.2, 72.4), ("fwd_bwd", 99.1, 109.9)):
        (run / f"{mode}.json").write_text(json.dumps({"rows": [{
            "op": "cross_entropy", "shape": "4096x8192", "timing": f"GPU µs per {mode} (graph replays)",
            "us_per_call": {"auto": 1.0, "helion": helion, "triton": triton}}]}))
    table = auto_table.build([old / "results.json", run / "fwd.json", run / "fwd_bwd.json"])
    (bucket,) = table["cross_entropy"]
    assert bucket["backend"] == "helion" and bucket["max_rows"] is None and bucket["max_n"] is None
    assert "helion 0.1633, triton 0.1823 ms (cross_entropy fwd + cross_entropy fwd_bwd)" in bucket["measured"]
    assert auto_table.build([run / "fwd.json", run / "fwd_bwd.json", old / "results.json"])["cross_entropy"][0][
        "backend"] == "triton"  # the older run given last wins: order is the caller's


def test_auto_table_reads_the_k_of_a_latency_shape(tmp_path):
    """bench.latency writes matmul shapes as MxNxK: the bucket is keyed by what the dispatcher sees, a [M, K]."""
    (tmp_path / "mm.json").write_text(json.dumps({"rows": [{
        "op": "matmul", "shape": "4096x4096x8192", "timing": "GPU µs per fwd (graph replays)",
        "us_per_call": {"helion": 30.0, "triton": 20.0}}]}))
    (bucket,) = auto_table.build([tmp_path / "mm.json"])["matmul"]
    assert bucket["backend"] == "triton" and bucket["measured"].startswith("rows=4096 n=8192")
