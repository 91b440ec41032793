"""python -m bench latency: paired ratios within rounds, and the command end to end (interpret mode on a CPU)."""

from __future__ import annotations

import json

import torch

from bench import latency


def test_paired_ratio_cancels_a_drifting_host():
    # The host slows 3x half-way: per-round ratios stay 1.1, medians of the raw times would not show it.
    a = [11.0, 11.0, 33.0, 33.0, 33.0]
    b = [10.0, 10.0, 30.0, 30.0, 30.0]
    c = [12.0, 12.0, 36.0, 36.0, 36.0]
    times = {"auto": a, "helion": b, "triton": c}
    assert abs(latency.paired(times, "auto", "helion") - 1.1) < 1e-9
    assert abs(latency.paired(times, "auto", ("helion", "triton")) - 1.1) < 1e-9  # against the faster per round
    assert latency.paired(times, "auto", "torch_compile") is None


def test_measure_times_every_loop_every_round():
    calls: list[str] = []
    loops = {name: (lambda n, name=name: calls.extend([name] * n)) for name in ("x", "y", "z")}
    times = latency.measure(loops, torch.device("cpu"), rounds=4, calls=5)
    assert all(len(t) == 4 for t in times.values())
    assert calls.count("x") == calls.count("y") == calls.count("z") == 3 + 4 * 5  # warm-up, then the rounds


def test_latency_command_quick(tmp_path, capsys):
    assert latency.main(["--quick", "--ops", "rms_norm", "--backends", "triton,torch", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "latency.json").read_text())["rows"]
    assert rows and all(set(r["us_per_call"]) == {"triton", "torch"} for r in rows)
    assert rows[0]["vs_eager"]["triton"] > 0
    assert "rms_norm" in capsys.readouterr().out


def test_gpu_time_needs_a_gpu_on_a_cpu():
    if torch.cuda.is_available():
        return  # on a GPU the mode runs
    assert latency.main(["--quick", "--gpu-time", "--ops", "rms_norm"]) == 2


def test_steps_to_capture_run_forward_and_backward(device):
    from bench.ops import OPS, quick_shapes
    from hkernels.tune.cases import make_inputs

    op = OPS["rms_norm"]
    inputs = make_inputs(op, quick_shapes(op, device)[0], torch.float32, device)
    for backend in ("triton", "torch"):
        grads = latency._step(op, backend, inputs, "fwd_bwd", {})()
        assert len(grads) == len(op.diff)
        assert all(g.shape == inputs[i].shape for g, i in zip(grads, op.diff, strict=True))
        out = latency._step(op, backend, inputs, "fwd", {})()
        assert out.shape == inputs[0].shape


def test_latency_dynamic_times_the_graph_with_the_row_count_symbolic(tmp_path):
    """--dynamic: the compiled backend sees another row count first, so the timed calls run the graph whose row
    count is symbolic (one recompile, not one per shape), and the row says so."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    assert latency.main(["--quick", "--dynamic", "--ops", "rms_norm", "--backends", "torch,torch_compile",
                         "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "latency.json").read_text())["rows"]
    assert len(rows) == 2 and all(r["compiled"] == "row count symbolic" for r in rows)
    # the first shape's other length (a static graph, then the dynamic one); the second shape reuses the dynamic
    # graph unless its row count is 1, which torch.compile specializes
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 3
    assert "row count symbolic" in (tmp_path / "latency.md").read_text()
