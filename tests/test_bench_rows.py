"""python -m bench: its command line, the derived backward rows (fwd_bwd - fwd: a difference lost in timing noise is
no failure), the tolerance check, and the report of a run with and without timings."""

from __future__ import annotations

import argparse
import importlib
import sys

import pytest

from bench import harness, report
from bench.__main__ import COMMANDS
from bench.__main__ import main as bench_main
from bench.harness import Row
from bench.ops import OPS
from bench.run import _backward_rows


def _row(mode: str, ms: float | None, error: str = "") -> Row:
    row = Row("rms_norm", 4, 64, "float32", mode, "triton", 0)
    row.ms, row.error = ms, error
    return row


def test_backward_row_within_noise_is_not_a_failure():
    op = OPS["rms_norm"]
    rows = _backward_rows({"fwd": [_row("fwd", 2.0)], "fwd_bwd": [_row("fwd_bwd", 1.5)]}, op, 1.0, 4)
    assert rows[0].ms is None and not rows[0].error and "not measurable" in rows[0].timing
    rows = _backward_rows({"fwd": [_row("fwd", 1.0)], "fwd_bwd": [_row("fwd_bwd", 3.0)]}, op, 1.0, 4)
    assert abs(rows[0].ms - 2.0) < 1e-12 and not rows[0].error
    rows = _backward_rows({"fwd": [_row("fwd", 1.0)], "fwd_bwd": [_row("fwd_bwd", None, "boom")]}, op, 1.0, 4)
    assert rows[0].error == "boom"  # a real failure still fails the run


def test_bench_help_lists_every_command(capsys):
    assert bench_main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(f"  {name} " in out for name in COMMANDS)
    assert bench_main(["no-such-command"]) == 2


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_option_of_every_command_states_its_default(command, capsys, monkeypatch):
    """Each command's parser: help text on every option, ending with its default (or saying it is required)."""
    parsers: list[argparse.ArgumentParser] = []
    real_parse = argparse.ArgumentParser.parse_args

    def capture(self, args=None, namespace=None):
        parsers.append(self)
        return real_parse(self, args, namespace)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    with pytest.raises(SystemExit):
        importlib.import_module(COMMANDS[command][0]).main(["--help"])
    assert f"python -m bench {command}" in capsys.readouterr().out
    (parser,) = parsers
    formatter = parser._get_formatter()
    for action in parser._actions:
        if action.help == argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
            continue
        assert action.help, f"{command} {action.dest}: no help"
        if action.option_strings:
            text = formatter._get_help_string(action)
            assert "default" in text or "(required)" in text, f"{command} {action.option_strings}: {text}"


def test_tolerance_check_fails_a_wrong_row():
    ok, wrong = Row("softmax", 4, 64, "bfloat16", "fwd", "triton"), Row("softmax", 4, 64, "bfloat16", "fwd", "helion")
    ok.max_err, wrong.max_err = 5e-3, 0.5
    assert harness.within_tolerance(ok) and not harness.within_tolerance(wrong)
    assert "1 of 2 rows" in harness.check_summary([ok, wrong])
    assert "2 of 2 rows" in harness.check_summary([ok, ok]) and "within tolerance" in harness.check_summary([ok, ok])


def test_report_without_timings_has_checks_and_no_claims(tmp_path):
    rows = [Row("rms_norm", 4, 64, "bfloat16", "fwd", b, max_err=2e-3) for b in ("helion", "torch")]
    env = {"device": "cpu (interpret mode)", "timed": False, "dtype": "bfloat16", "command": "python -m bench"}
    harness.write(tmp_path, rows, env)
    text = report.write(tmp_path, rows, env).read_text()
    assert harness.INTERPRETED in text and "2 of 2 rows" in text and "matched the float64 reference" in text
    assert "GB/s" not in text and "% of copy" not in text and "speedup" not in text.lower()
    assert "GB/s" not in (tmp_path / "table.txt").read_text()
    assert not list(tmp_path.glob("*.png"))


def test_profiled_rows_list_their_kernels_longest_first(tmp_path):
    """--kernels: kernels.md holds each profiled row's kernels with their share of its kernel time, and
    results.json keeps them; a row not profiled is not listed."""
    import json

    profiled = Row("moe", 8192, 4096, "bfloat16", "fwd_bwd", "helion", 14336, ms=40.0)
    profiled.kernels = [("_helion__moe_down_bwd", 12.0, 1), ("_helion__moe_dweight", 6.0, 2),
                        ("_helion__moe_up", 2.0, 1)]
    plain = Row("moe", 8192, 4096, "bfloat16", "fwd_bwd", "triton", 14336, ms=30.0)
    harness.write(tmp_path, [profiled, plain], {"device": "a GPU", "dtype": "bfloat16"})
    text = (tmp_path / "kernels.md").read_text()
    assert "fwd_bwd helion: 20.000 ms in its 3 longest kernels" in text and "triton" not in text
    lines = [line for line in text.splitlines() if line.startswith("| ") and "kernel |" not in line]
    assert [line.split(" | ")[1] for line in lines] == ["60%", "30%", "10%"], lines
    assert "| 6.000 | 30% | 2 | `_helion__moe_dweight` |" in lines
    saved = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert saved[0]["kernels"][1] == ["_helion__moe_dweight", 6.0, 2] and saved[1]["kernels"] is None


def test_report_with_timings_plots_rates(tmp_path):
    pytest.importorskip("matplotlib")
    rows = []
    for m in (256, 4096):
        for backend, ms in (("triton", 0.01), ("torch", 0.02)):
            row = Row("rms_norm", m, 4096, "bfloat16", "fwd", backend, ms=ms, timing="graph", max_err=2e-3)
            row.gbps = 2 * m * 4096 * 2 / ms / 1e6
            row.pct_copy = 100 * row.gbps / 4000
            rows.append(row)
    env = {"device": "a GPU", "copy_gbps": 4000.0, "dtype": "bfloat16", "command": "python -m bench"}
    text = report.write(tmp_path, rows, env).read_text()
    assert "% of copy" in text and "![rms_norm.png](rms_norm.png)" in text
    assert (tmp_path / "rms_norm.png").stat().st_size > 0


@pytest.mark.parametrize("tool", ["sweep", "sweep_llm"])
def test_a_helion_candidate_of_the_sweeps_compiles_its_own_kernel(tool, device):
    """Compiled Helion functions are kept by their arguments, not their config: a sweep that forces a config must
    not time the previous candidate's kernel again."""
    import torch

    from bench import sweep, sweep_llm
    from hkernels.ops import _helion
    from hkernels.ops import rms_norm as h_rms

    apply = sweep._apply_helion if tool == "sweep" else sweep_llm._helion_override("_rms_norm_fwd")
    x, w = torch.randn(8, 256, device=device), torch.randn(256, device=device)
    kernels = []
    for warps in (4, 8):
        undo = apply({"block_sizes": [1], "num_warps": warps, "reduction_loops": [None]})
        try:
            h_rms.rms_norm_fwd(x, w, 1e-6)
            kernels.append(next(fn for key, fn in _helion._compiled.items() if key[0] is h_rms._rms_norm_fwd))
        finally:
            undo()
    assert kernels[0] is not kernels[1]


def test_the_grouped_and_moe_sweep_families_run_their_candidates(device):
    """sweep-llm's Helion grouped_matmul and moe families at a small shape: each candidate a CPU can run (no TMA
    descriptors there) runs under the family's override; a TMA candidate's indexing list covers every load and store
    of its kernel as the family's own call binds it (a longer list is cut to them, as for a shipped config), with a
    descriptor left after the cut."""
    if device.type == "cuda":
        pytest.skip("the sweep itself runs on a GPU (python -m bench sweep-llm)")
    from bench import sweep_llm
    from hkernels.ops import _helion

    kernel_of = {"helion moe fwd": "_moe_up", "helion moe down_bwd": "_moe_down_bwd",
                 "helion moe dweight": "_moe_dweight", "helion grouped_matmul fwd": "_grouped_matmul_fwd",
                 "helion grouped_matmul dx": "_grouped_matmul_fwd",
                 "helion grouped_matmul dweight": "_grouped_matmul_dweight"}
    families = [*sweep_llm._moe(64, 32, 64, 4, 2, device), *sweep_llm._grouped(64, 48, 32, 4, device)]
    assert sorted(name.rsplit(" ", 1)[0] for name, *_ in families) == sorted(kernel_of)
    for name, fn, _work, candidates, apply in families:
        with _helion.record() as launches:
            fn()
        (sites,) = {k.bind(args).config_spec.indexing.length
                    for k, args, _ in launches if k.name == kernel_of[name.rsplit(" ", 1)[0]]}
        ran = 0
        for cand in candidates:
            if "indexing" in cand:
                assert len(cand["indexing"]) >= sites and "tensor_descriptor" in cand["indexing"][:sites], (
                    name, cand, sites)
                continue  # (TMA: a GPU's)
            undo = apply({**cand, "block_sizes": [16] * len(cand["block_sizes"])})
            try:
                fn()
                ran += 1
            finally:
                undo()
        assert ran >= 1, name


def test_a_run_without_a_gpu_prints_each_row_once_and_no_time(tmp_path, capsys, device):
    """On a CPU (interpreted kernels): one line per row, no time anywhere (stdout, stderr, results.csv), and the
    closing lines name the output folder and what each file holds."""
    if device.type == "cuda":
        pytest.skip("a GPU run times its rows")
    import csv
    import re

    from bench.run import main as run_main

    assert run_main(["--quick", "--ops", "swiglu", "--shapes", "4x64", "--backends", "triton,torch", "--out",
                     str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    rows = [line.split("] ", 1)[1] for line in (out + err).splitlines() if re.match(r"\[\s*\d+/\d+\] ", line)]
    total = int(re.search(r"(\d+) of \1 rows", out).group(1))
    assert len(rows) == len(set(rows)) == total, rows
    assert [line for line in out.splitlines() if "4x64" in line and " rows " not in line] == []  # no table again
    assert not re.search(r"\d \s?(s|ms|µs)\b|tokens/s|GB/s", out + err), out + err
    assert f"Written to {tmp_path}/: report.md" in out and "table.txt" in out and "results.csv" in out
    with open(tmp_path / "results.csv") as f:
        assert all(not r["first_s"] and not r["bench_s"] and not r["ms"] for r in csv.DictReader(f))


def test_the_bench_keys_torch_compiles_caches_by_the_tree(tmp_path, monkeypatch):
    """python -m bench points torch.compile's on-disk caches at a directory named by the sources of hkernels and
    triton_fallback (a graph compiled with another tree's kernels is never found): the same tree the same
    directory, an edited one another; a directory the caller set is kept."""
    import importlib.util
    import shutil

    from bench import cli

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    here = cli.keyed_compile_cache()
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    assert cli.keyed_compile_cache() == here and "hkernels-" in here
    for package in ("hkernels", "triton_fallback"):  # a copy of the tree with one kernel file edited
        source = importlib.util.find_spec(package).submodule_search_locations[0]
        shutil.copytree(source, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "triton_fallback" / "rms_norm.py").write_text(
        (tmp_path / "triton_fallback" / "rms_norm.py").read_text() + "\n# an edit\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("hkernels", "triton_fallback"):  # (find_spec answers from sys.modules first)
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    edited = cli.keyed_compile_cache()
    assert edited != here
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert cli.keyed_compile_cache() == str(tmp_path / "mine")
