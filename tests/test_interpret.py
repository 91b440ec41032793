"""Interpret mode (HKERNELS_INTERPRET=1): asked for too late it fails with one clear error; asked for in time it
imports neither Helion nor Triton before a kernel needs them, and its correct calls print no NumPy warnings."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

import hkernels
from tests.conftest import ON_GPU

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _python(code: str, interpret: bool) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("HKERNELS_INTERPRET", "TRITON_INTERPRET")}
    if interpret:
        env["HKERNELS_INTERPRET"] = "1"
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


_LATE_CALL = """
    import os, torch
    {before}
    os.environ["HKERNELS_INTERPRET"] = "1"
    {after}
    try:
        hkernels.rms_norm(torch.randn(4, 64), torch.ones(64))
    except RuntimeError as e:
        print("ERROR:", e)
    else:
        print("NO ERROR")
"""


def test_interpret_asked_for_too_late_raises_one_clear_error():
    done = _python(_LATE_CALL.format(before="import hkernels", after=""), interpret=False)
    assert done.returncode == 0, done.stderr
    out = done.stdout.strip()
    assert out.startswith("ERROR: hkernels: "), out + done.stderr
    assert "HKERNELS_INTERPRET=1 was set after hkernels" in out, out
    assert "TRITON_INTERPRET=1" in out and "before starting Python" in out and "unset" in out, out
    assert "Warning" not in done.stderr, done.stderr  # no fallback warning: the error is the only message


@pytest.mark.skipif(ON_GPU, reason="interpret mode runs on a CPU-only machine")
@pytest.mark.parametrize("first", ["import transformers, triton", "import helion"],
                         ids=["transformers", "helion"])
def test_interpret_mode_after_a_library_that_imports_triton_first(first):
    """HKERNELS_INTERPRET=1 in the environment, and a script that imports a library importing triton before
    hkernels (transformers, trl, helion): Triton's functions decorated then are made interpreted, and every
    backend's kernels run and match the reference."""
    if "transformers" in first:
        pytest.importorskip("transformers")
    done = _python(f"""
        {first}
        import sys, torch
        assert "triton" in sys.modules
        import hkernels
        from hkernels import references
        x = torch.randn(5, 48, requires_grad=True)
        w = torch.randn(48, requires_grad=True)
        target = torch.randint(0, 48, (5,))
        want = references.rms_norm(x, w), references.softmax(x), references.cross_entropy(x, target)
        for backend in ("triton", "helion"):
            with hkernels.use_backend(backend):
                got = hkernels.rms_norm(x, w), hkernels.softmax(x), hkernels.cross_entropy(x, target)
                sum(g.sum() for g in got).backward()
            for a, b in zip(got, want):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        print("OK")
    """, interpret=True)
    assert done.returncode == 0 and done.stdout.strip() == "OK", done.stdout + done.stderr


def test_import_in_interpret_mode_loads_no_kernel_backend():
    done = _python("""
        import sys, hkernels
        print(sorted(m for m in ("helion", "triton", "torch._dynamo", "torch._inductor") if m in sys.modules))
    """, interpret=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout


@pytest.mark.skipif(ON_GPU, reason="interpret mode runs on a CPU-only machine")
@pytest.mark.parametrize("backend", ["helion", "triton"])
def test_interpreted_calls_print_no_numpy_warnings(backend, device):
    """The interpreter computes masked lanes too (log of 0, 0·inf, -inf − -inf past a row's end or a causal
    diagonal); their results are never stored, and their NumPy RuntimeWarnings must not reach the user."""
    g = torch.Generator().manual_seed(0)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=g).to(device).requires_grad_()

    target = torch.randint(0, 100, (5,), generator=g).to(device)
    target[0] = -100
    with warnings.catch_warnings(record=True) as seen, hkernels.use_backend(backend):
        warnings.simplefilter("always")
        hkernels.softmax(r(5, 100)).sum().backward()
        hkernels.cross_entropy(r(5, 100), target, label_smoothing=0.1).backward()
        hkernels.fused_linear_cross_entropy(r(5, 16), r(100, 16), target).backward()
        hkernels.attention(r(1, 2, 5, 16), r(1, 2, 5, 16), r(1, 2, 5, 16), causal=True).sum().backward()
        hkernels.matmul(r(5, 32), r(32, 8), activation="gelu").sum().backward()
    runtime = [f"{w.filename}:{w.lineno}: {w.message}" for w in seen if issubclass(w.category, RuntimeWarning)]
    assert not runtime, runtime
