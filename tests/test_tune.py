"""The tune command end to end on a small case: what it writes, and that the library then uses it."""

from __future__ import annotations

import json

import torch

import hkernels
from hkernels import configs, tune


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
        assert bucket["backend"] in ("helion", "triton") and bucket["max_rows"] is None
        assert bucket["min_n"] == bucket["max_n"] == 64  # exact in n: other row lengths keep the shipped buckets
        assert table["_points"]["rms_norm"][0][:2] == [4, 64]
        chosen = hkernels.selected_backend("rms_norm", torch.randn(4, 64, device=device), None)
        assert chosen == bucket["backend"] and "tuned table" in chosen.reason
    finally:
        configs.reload()


def test_tune_rejects_bad_arguments(capsys):
    import pytest

    with pytest.raises(SystemExit):
        tune.main(["--ops", "rms_norm", "--shapes", "4x64", "--steps", "everything"])
    assert "--steps" in capsys.readouterr().err
