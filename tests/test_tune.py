"""The tune command end to end on a small case: what it writes, and that the library then uses it."""

from __future__ import annotations

import json

import torch

import hkernels
from hkernels import configs, tune
from hkernels.tune import helion_configs, timing


def test_tune_writes_tables_the_library_then_uses(tmp_path, monkeypatch, device, capsys):
    monkeypatch.setenv("HKERNELS_CACHE_DIR", str(tmp_path))
    try:
        assert tune.main(["--ops", "rms_norm", "--shapes", "4x64", "--dtype", "float32", "--steps", "triton,auto",
                          "--out", str(tmp_path)]) == 0
        printed = capsys.readouterr().out
        assert "[1/1] rms_norm 4x64 float32" in printed and "triton 1/" in printed and "auto: helion" in printed
        arch = configs.cuda_arch(device) if device.type == "cuda" else "interpret"
        searched = json.loads((tmp_path / "triton" / arch / "rms_norm.json").read_text())["fwd"][0]
        assert searched["min_n"] == searched["max_n"] == 64 and searched["settings"]["block_n"] == 64
        table = json.loads((tmp_path / "auto" / f"{arch}.json").read_text())
        (bucket,) = table["rms_norm"]
        assert bucket["backend"] in ("helion", "triton", "torch") and bucket["max_rows"] is None
        assert bucket["min_n"] == bucket["max_n"] == 64  # exact in n: other row lengths keep the shipped buckets
        assert table["_points"]["rms_norm"][0][:2] == [4, 64]
        chosen = hkernels.selected_backend("rms_norm", torch.randn(4, 64, device=device), None)
        assert chosen == bucket["backend"] and "tuned table" in chosen.reason
    finally:
        configs.reload()


def test_tuned_auto_buckets_of_an_ops_variants_are_the_ops(tmp_path):
    """Cases that are variants of one op (attention causal or not, at head dim 64) are filed under the op the
    dispatcher routes, their times summed per shape; a later run replaces a shape's point."""
    from hkernels.tune import auto

    points = {"attention": [(524288, 64, {"helion": 2.0, "triton": 3.0}, "attention_d64 2048x2048x8"),
                            (524288, 64, {"helion": 1.5, "triton": 0.2}, "attention_d64_causal 2048x2048x8")]}
    auto.write_auto(points, "sm90", tmp_path)
    table = json.loads((tmp_path / "auto" / "sm90.json").read_text())
    (bucket,) = table["attention"]
    assert bucket["backend"] == "triton" and "helion 3.5, triton 3.2" in bucket["measured"]
    assert "attention_d64 2048x2048x8 + attention_d64_causal" in bucket["measured"]
    assert "attention_d64" not in table and "attention_d64_causal" not in table
    auto.write_auto({"attention": [(524288, 64, {"helion": 1.0, "triton": 2.0}, "attention_d64 2048x2048x8")]},
                    "sm90", tmp_path)
    (bucket,) = json.loads((tmp_path / "auto" / "sm90.json").read_text())["attention"]
    assert bucket["backend"] == "helion"


def test_tuned_auto_buckets_weigh_the_torch_backend(tmp_path):
    """A point measured on all three backends gives torch the bucket where it was more than 2% faster than the
    faster kernel; summed over an op's variants only where every variant measured it; points written without a
    torch time keep the kernels' choice."""
    from hkernels.tune import auto

    auto.write_auto({"attention": [(524288, 128, {"helion": 2.0, "triton": 3.0, "torch": 1.0}, "attention a"),
                                   (524288, 128, {"helion": 2.0, "triton": 3.0, "torch": 2.5}, "attention_causal a"),
                                   (524288, 64, {"helion": 2.0, "triton": 3.0, "torch": 0.1}, "attention_d64 a"),
                                   (524288, 64, {"helion": 2.0, "triton": 3.0}, "attention_d64_causal a")],
                     "rms_norm": [(4096, 4096, {"helion": 1.0, "triton": 1.1, "torch": 0.99}, "rms_norm a")],
                     "softmax": [(4096, 4096, {"helion": 1.0, "triton": 1.1}, "softmax a")]}, "sm90", tmp_path)
    table = json.loads((tmp_path / "auto" / "sm90.json").read_text())
    (d64, attention), (rms,), (soft,) = table["attention"], table["rms_norm"], table["softmax"]
    assert attention["backend"] == "torch" and "helion 4, triton 6, torch 3.5" in attention["measured"]
    assert d64["backend"] == "helion" and "torch" not in d64["measured"]  # one of its variants lacks torch
    assert rms["backend"] == "helion" and "torch 0.99" in rms["measured"]  # within 2% of Helion's
    assert soft["backend"] == "helion" and "torch" not in soft["measured"]
    auto.write_auto({"softmax": [(4096, 4096, {"helion": 1.0, "triton": 1.1, "torch": 0.5}, "softmax b")]},
                    "sm90", tmp_path)
    (soft,) = json.loads((tmp_path / "auto" / "sm90.json").read_text())["softmax"]
    assert soft["backend"] == "torch"


def test_tune_rejects_bad_arguments(capsys):
    import pytest

    with pytest.raises(SystemExit):
        tune.main(["--ops", "rms_norm", "--shapes", "4x64", "--steps", "everything"])
    assert "--steps" in capsys.readouterr().err


def test_tuned_triton_settings_are_read_for_their_arch_and_row_length(tmp_path, monkeypatch):
    """The lookup the Triton launchers make (no GPU needed: the arch is stubbed): an entry applies to its row
    length only, on its arch only, and a row-settings entry whose block does not fit the row is ignored."""
    from hkernels.runtime import device as runtime_device
    from triton_fallback import _common

    monkeypatch.setenv("HKERNELS_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(runtime_device, "_cuda_arch", lambda index: "sm90")
    folder = tmp_path / "triton" / "sm90"
    folder.mkdir(parents=True)
    (folder / "rope.json").write_text(json.dumps(
        {"fwd": [{"min_n": 128, "max_n": 128, "settings": {"tile_elements": 8192, "num_warps": 8}}]}))
    row = {"resident": True, "block_m": 2, "block_n": 4096, "num_warps": 8, "num_stages": 3, "programs_per_sm": 2}
    (folder / "softmax.json").write_text(json.dumps(
        {"fwd": [{"min_n": 4096, "max_n": 4096, "settings": row}, {"min_n": 300, "max_n": 300, "settings": row}]}))
    configs.reload()
    try:
        gpu = torch.device("cuda", 0)  # a device object; nothing runs on it
        assert _common.tuned_settings("rope", 128, gpu) == {"tile_elements": 8192, "num_warps": 8}
        assert _common.tuned_settings("rope", 64, gpu) is None
        assert _common.tuned_settings("rope", 128, torch.device("cpu")) is None
        assert _common.tuned_row_settings("softmax", 4096, gpu) == _common.RowSettings(**row)
        assert _common.tuned_row_settings("softmax", 300, gpu) is None  # a 4096-wide block for 300: stale
        monkeypatch.setattr(runtime_device, "_cuda_arch", lambda index: "sm100")
        configs.reload()
        assert _common.tuned_settings("rope", 128, gpu) is None  # tuned on another arch
    finally:
        configs.reload()


def test_tune_searches_rope_and_cross_entropy_settings(tmp_path, monkeypatch, device, capsys):
    monkeypatch.setenv("HKERNELS_CACHE_DIR", str(tmp_path))
    try:
        # Two shapes per op that share a bucket (rope's head dim 128; the same vocabulary): one winner for both.
        assert tune.main(["--ops", "rope,cross_entropy", "--shapes", "4x256,2x256", "--dtype", "float32", "--steps",
                          "triton", "--out", str(tmp_path)]) == 0
        arch = configs.cuda_arch(device) if device.type == "cuda" else "interpret"
        rope = json.loads((tmp_path / "triton" / arch / "rope.json").read_text())["fwd"]
        assert len(rope) == 1 and set(rope[0]["settings"]) == {"tile_elements", "num_warps"}
        assert rope[0]["min_n"] == 128 and "4x256" in rope[0]["tuned"] and "2x256" in rope[0]["tuned"]
        ce = json.loads((tmp_path / "triton" / arch / "cross_entropy.json").read_text())["fwd"]
        assert len(ce) == 1 and set(ce[0]["settings"]) == {"block", "num_warps", "num_stages", "per_sm"}
        assert ce[0]["min_n"] == 256 and "4x256" in ce[0]["tuned"] and "2x256" in ce[0]["tuned"]
        assert "no launch-setting search" not in capsys.readouterr().out
    finally:
        configs.reload()


class _FakeSettings:
    autotune_seed_configs = None
    autotune_budget_seconds = None


class _FakeKernel:
    """Stands in for a Helion kernel: Helion's autotuner needs a GPU, the tune command's handling of its result
    does not. ``tuned_ms`` is what the tuned config times at (the shipped one times 1.0 ms)."""

    name = "_fake_fwd"

    def __init__(self, tuned_ms: float) -> None:
        import helion

        self.settings = _FakeSettings()
        self.tuned = helion.Config(num_warps=8)
        self.tuned_ms = tuned_ms
        self.seen: dict[str, object] = {}
        outer = self

        class Bound:
            class config_spec:  # mirrors Helion's attribute name
                @staticmethod
                def default_config():
                    return helion.Config(num_warps=4)

            @staticmethod
            def autotune(args, force):
                outer.seen["seed"] = outer.settings.autotune_seed_configs
                outer.seen["budget"] = outer.settings.autotune_budget_seconds
                if outer.tuned_ms is None:
                    raise RuntimeError("No working config found from autotuning")
                return outer.tuned

            @staticmethod
            def compile_config(config, allow_print):
                ms = outer.tuned_ms if config == outer.tuned else 1.0
                return lambda *args: ms

        self.bound = Bound

    def bind(self, args):
        return self.bound


def _run_fake_tune(tmp_path, monkeypatch, tuned_ms: float | None, renamed: bool = False):
    import contextlib

    import helion

    from hkernels.ops import _helion
    from hkernels.ops.add_rms_norm import _Renamed

    kernel = _FakeKernel(tuned_ms)
    x = torch.randn(4, 64)
    # add_rms_norm runs rms_norm's kernels under its own names: the tune command must reach their settings too
    launched = _Renamed(kernel, "_fake_fwd") if renamed else kernel

    @contextlib.contextmanager
    def record():
        yield [(launched, (x,), 64)]

    class Case:
        name, op = "fake 4x64 bfloat16", "fake"

        def forward_backward(self):
            return None

    monkeypatch.setattr(_helion, "record", record)
    monkeypatch.setattr(_helion, "forget", lambda: None)
    monkeypatch.setattr(_helion, "_bucket", lambda *a: {"config": {"num_warps": 4}})
    monkeypatch.setattr(timing, "gpu_time_ms", lambda fn, device: fn())
    lines = helion_configs.tune_helion(Case(), "sm90", tmp_path, budget_s=30)
    assert kernel.seen["seed"] == [helion.Config(num_warps=4)] and kernel.seen["budget"] == 30  # seeded, bounded
    assert kernel.settings.autotune_seed_configs is None and kernel.settings.autotune_budget_seconds is None
    return lines


def test_tune_helion_writes_a_tuned_config_only_where_it_beats_the_shipped_one(tmp_path, monkeypatch):
    path = tmp_path / "helion" / "sm90" / "fake.json"
    (line,) = _run_fake_tune(tmp_path, monkeypatch, tuned_ms=1.0)  # a search that found nothing better
    assert "shipped config kept" in line and not path.exists()
    (line,) = _run_fake_tune(tmp_path, monkeypatch, tuned_ms=0.8)
    assert "written" in line and "1.250x" in line
    (bucket,) = json.loads(path.read_text())["_fake_fwd"]
    assert bucket["config"] == {"num_warps": 8} and bucket["min_n"] == bucket["max_n"] == 64
    (line,) = _run_fake_tune(tmp_path, monkeypatch, tuned_ms=None)  # a failed search: reported, table untouched
    assert "search failed" in line and "No working config" in line and "shipped config kept" in line
    assert json.loads(path.read_text())["_fake_fwd"][0]["config"] == {"num_warps": 8}


def test_tune_helion_skips_split_row_kernels(tmp_path, monkeypatch):
    """A split-row kernel's programs wait for each other: Helion's autotuner, which launches them neither
    cooperatively nor with capped registers, must never run it."""
    import contextlib

    from hkernels.ops import _helion, softmax

    class _SplitKernel:
        name = softmax._softmax_fwd_split.name  # a split-row kernel (softmax names its own in _split.KERNELS)

        def bind(self, args):
            raise AssertionError("a split-row kernel was bound for autotuning")

    @contextlib.contextmanager
    def record():
        yield [(_SplitKernel(), (torch.randn(4, 64),), 64)]

    class Case:
        name, op = "fake 4x64 bfloat16", "fake"

        def forward_backward(self):
            return None

    monkeypatch.setattr(_helion, "record", record)
    (line,) = helion_configs.tune_helion(Case(), "sm90", tmp_path, budget_s=30)
    assert "not autotuned" in line and "shipped config kept" in line and not (tmp_path / "helion").exists()


def test_tune_helion_reaches_a_renamed_kernel(tmp_path, monkeypatch):
    """add_rms_norm's kernels are rms_norm's under other names (``_Renamed``): the tune command reaches their
    ``settings`` through the wrapper."""
    (line,) = _run_fake_tune(tmp_path, monkeypatch, tuned_ms=0.8, renamed=True)
    assert "written" in line
