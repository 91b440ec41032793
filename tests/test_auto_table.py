"""python -m bench auto-table: the auto backend's shipped table, rebuilt from measured files."""

from __future__ import annotations

import json

from bench import auto_table
from hkernels.tune.auto import host_bound


def test_auto_table_reads_latency_files_and_joins_one_folder(tmp_path):
    """python -m bench latency --gpu-time files (one per mode, one folder = one run) build buckets like bench results
    do, and replace an older run's numbers for the shape."""
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
    """python -m bench latency writes matmul shapes as MxNxK: the bucket is keyed by what the dispatcher sees, a
    [M, K]."""
    (tmp_path / "mm.json").write_text(json.dumps({"rows": [{
        "op": "matmul", "shape": "4096x4096x8192", "timing": "GPU µs per fwd (graph replays)",
        "us_per_call": {"helion": 30.0, "triton": 20.0}}]}))
    (bucket,) = auto_table.build([tmp_path / "mm.json"])["matmul"]
    assert bucket["backend"] == "triton" and bucket["measured"].startswith("rows=4096 n=8192")


def test_auto_table_judges_small_rope_calls_by_their_latency(tmp_path):
    """rope at 64 tokens is 2048 rows of one head each as the dispatcher buckets it, yet a few µs of GPU work: its
    per-call latency decides, whichever backend's GPU time is lower. 4096 tokens stay judged by GPU time."""
    rows = []
    for m, helion, triton in ((64, (0.004, 160.0), (0.005, 73.0)), (4096, (0.050, 90.0), (0.060, 80.0))):
        for backend, (ms, us) in (("helion", helion), ("triton", triton)):
            rows.append({"op": "rope", "m": m, "n": 4096, "mode": "fwd", "backend": backend, "ms": ms, "us_call": us})
    (tmp_path / "results.json").write_text(json.dumps({"rows": rows}))
    small, large = auto_table.build([tmp_path / "results.json"])["rope"]
    assert small["max_rows"] == 64 * 32 and small["backend"] == "triton" and "µs per call" in small["measured"]
    assert large["max_rows"] is None and large["backend"] == "helion" and " ms " in large["measured"]
    assert host_bound(64, 4096) and host_bound(2048, 128)
    assert not host_bound(256, 4096) and not host_bound(4096 * 32, 128)
    # matmul's rows are M of [M, K]: its N (here a vocabulary) is GPU work the element rule would not see
    assert host_bound(64, 4096, "matmul") and not host_bound(128, 2048, "matmul")


def test_auto_table_gives_attention_forward_buckets_of_its_own(tmp_path):
    """attention's forward is routed apart from its backward: its own buckets come from forward times alone,
    the op's from the sum of every mode (which routes the backward); a head dim of 64 buckets at n = 64
    (rows = B·H·S = 8·32·2048)."""
    rows = []
    for op, (fwd_h, fwd_t), (both_h, both_t) in (("attention_d64", (0.72, 0.68), (2.90, 3.22)),
                                                 ("attention", (2.33, 2.32), (9.57, 10.02))):
        m, n, k = (2048, 2048, 8) if op.endswith("d64") else (4096, 4096, 4)
        for mode, h, t in (("fwd", fwd_h, fwd_t), ("fwd_bwd", both_h, both_t)):
            rows += [{"op": op, "m": m, "n": n, "k": k, "mode": mode, "backend": b, "ms": ms}
                     for b, ms in (("helion", h), ("triton", t))]
    (tmp_path / "results.json").write_text(json.dumps({"rows": rows}))
    table = auto_table.build([tmp_path / "results.json"])
    assert [(b["max_n"], b["backend"]) for b in table["attention"]] == [(64, "helion"), (None, "helion")]
    # D = 128: Triton's forward is faster by less than the margin, so the primary backend keeps it
    fwd = table["attention:attention_fwd"]
    assert [(b["max_n"], b["backend"]) for b in fwd] == [(64, "triton"), (None, "helion")]
    assert fwd[0]["measured"].endswith("(attention_d64 fwd)") and "rows=524288 n=64" in fwd[0]["measured"]


def test_auto_table_routes_attention_backward_by_the_backward_alone(tmp_path):
    """With the forward routed by its own buckets, the op's buckets decide the backward: by forward+backward minus
    forward. Here Triton's forward is faster (2.0 against 3.0 ms) and Helion's backward (6.0 against 6.3): the sum
    would pick Triton for both, the training step then taking 8.3 ms where Triton's forward and Helion's backward
    take 8.0."""
    rows = [{"op": "attention", "m": 4096, "n": 4096, "k": 4, "mode": mode, "backend": b, "ms": ms}
            for mode, h, t in (("fwd", 3.0, 2.0), ("fwd_bwd", 9.0, 8.3)) for b, ms in (("helion", h), ("triton", t))]
    (tmp_path / "results.json").write_text(json.dumps({"rows": rows}))
    table = auto_table.build([tmp_path / "results.json"])
    (bwd,) = table["attention"]
    (fwd,) = table["attention:attention_fwd"]
    assert (fwd["backend"], bwd["backend"]) == ("triton", "helion")
    assert "helion 6, triton 6.3 ms (attention fwd_bwd − fwd)" in bwd["measured"]


def test_auto_table_takes_the_torch_backend_where_it_was_more_than_two_percent_faster(tmp_path):
    """hk_torch rows (hkernels on its torch backend: PyTorch's fused kernel) are the third candidate. D = 128:
    the backward goes to torch (5.0 ms against the kernels' 6.0), the forward stays on Triton (torch's 1.99 ms is
    within 2% of 2.0). D = 64: the forward goes to torch (0.5 against 1.0); hk_torch has no forward+backward row
    there, so the kernels decide the backward."""
    rows = [{"op": "attention", "m": 4096, "n": 4096, "k": 4, "mode": mode, "backend": b, "ms": ms}
            for mode, times in (("fwd", (3.0, 2.0, 1.99)), ("fwd_bwd", (9.0, 8.3, 6.99)))
            for b, ms in zip(("helion", "triton", "hk_torch"), times, strict=True)]
    rows += [{"op": "attention_d64", "m": 2048, "n": 2048, "k": 8, "mode": mode, "backend": b, "ms": ms}
             for mode, times in (("fwd", (1.0, 1.1, 0.5)), ("fwd_bwd", (3.0, 3.3)))
             for b, ms in zip(("helion", "triton", "hk_torch"), times, strict=False)]
    (tmp_path / "results.json").write_text(json.dumps({"rows": rows}))
    table = auto_table.build([tmp_path / "results.json"])
    assert [b["backend"] for b in table["attention"]] == ["helion", "torch"]
    assert "helion 6, triton 6.3, torch 5 ms (attention fwd_bwd − fwd)" in table["attention"][1]["measured"]
    assert [b["backend"] for b in table["attention:attention_fwd"]] == ["torch", "triton"]


def test_auto_table_routes_windowed_and_capped_attention_apart(tmp_path):
    """Rows of attention with a window or a cap build buckets of their own for each direction, and leave the plain
    op's buckets to plain attention: Helion's plain backward wins here while its masked one loses."""
    rows = []
    for op, (fh, ft), (bh, bt) in (("attention_causal", (1.29, 1.26), (5.14, 5.53)),
                                   ("attention_window", (0.85, 0.71), (5.01, 2.91))):
        rows += [{"op": op, "m": 4096, "n": 4096, "k": 4, "mode": mode, "backend": b, "ms": ms}
                 for mode, h, t in (("fwd", fh, ft), ("fwd_bwd", bh, bt)) for b, ms in (("helion", h), ("triton", t))]
    (tmp_path / "results.json").write_text(json.dumps({"rows": rows}))
    table = auto_table.build([tmp_path / "results.json"])
    assert [b["backend"] for b in table["attention"]] == ["helion"]
    assert [b["backend"] for b in table["attention:attention_masked_fwd"]] == ["triton"]
    (bwd,) = table["attention:attention_masked_bwd"]
    assert bwd["backend"] == "triton" and "(attention_window fwd_bwd − fwd)" in bwd["measured"]
    assert "attention_window" not in table["attention"][0]["measured"]


def test_auto_table_builds_compiled_buckets(tmp_path):
    """bench auto-table: auto_compile and torch_compile rows of one shape give the op's compiled buckets."""
    rows = [{"op": "rms_norm", "m": m, "n": 4096, "mode": mode, "backend": b, "ms": ms, "us_call": ms * 1e3}
            for m, kernel, inductor in ((16384, 0.18, 0.22), (65536, 1.0, 0.5))
            for mode in ("fwd", "fwd_bwd") for b, ms in (("auto_compile", kernel), ("torch_compile", inductor))]
    (tmp_path / "results.json").write_text(json.dumps({"rows": rows}))
    small, large = auto_table.build([tmp_path / "results.json"])["compiled:rms_norm"]
    assert small["backend"] == "kernel" and small["max_rows"] == 16384 and "hkernels 0.36, Inductor 0.44" in (
        small["measured"])
    assert large["backend"] == "torch" and large["max_rows"] is None
