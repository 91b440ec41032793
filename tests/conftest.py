"""One suite for every machine: CUDA tensors where a GPU is present, else CPU tensors in interpret mode.

Interpret mode must be chosen before hkernels (or any kernel module) is imported, so it is decided here, at
collection time, from whether torch sees a GPU.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

ON_GPU = torch.cuda.is_available()
# HKERNELS_TEST_FULL=1: the wider matrices some files keep opt-in on a CPU (every autocast case in float16 too).
FULL = ON_GPU or os.environ.get("HKERNELS_TEST_FULL", "").strip().lower() in {"1", "true", "yes", "on"}
if not ON_GPU:
    os.environ["HKERNELS_INTERPRET"] = "1"
os.environ.pop("HKERNELS_BACKEND", None)  # a developer's setting must not leak into the suite
# Nor the developer's tuned tables: the suite sees the shipped ones, plus what a test writes here.
os.environ["HKERNELS_CACHE_DIR"] = tempfile.mkdtemp(prefix="hkernels-tests-cache-")
# And a TorchInductor cache of its own: graphs compiled by an older tree, cached on disk under the same key, would
# call the custom ops with the argument lists they had then.
os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="hkernels-tests-inductor-")

import hkernels  # noqa: E402
from hkernels import dispatch  # noqa: E402

DEVICE = torch.device("cuda") if ON_GPU else torch.device("cpu")


@pytest.fixture
def device() -> torch.device:
    return DEVICE


@pytest.fixture(autouse=True)
def _fresh_dispatch_state(monkeypatch: pytest.MonkeyPatch):
    """Each test starts with no remembered Helion failures, no warnings already given, no routes or plans, no env
    override: what one test's patched table or dispatcher chose must not outlive it."""
    monkeypatch.delenv("HKERNELS_BACKEND", raising=False)
    dispatch.forget()
    yield
    dispatch.forget()


def pytest_configure(config: pytest.Config) -> None:
    # Under pytest-xdist (-n N) each worker computes on one thread: the workers already fill the cores, and torch's
    # and OpenBLAS's own threads beside them only contend for them. Set here, in the controller, before it starts
    # the workers: their libraries read these when they load.
    if getattr(config.option, "numprocesses", None) and not os.environ.get("PYTEST_XDIST_WORKER"):
        for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ.setdefault(var, "1")


def pytest_report_header(config: pytest.Config) -> list[str]:
    where = torch.cuda.get_device_name() if ON_GPU else "CPU, interpret mode (HKERNELS_INTERPRET=1)"
    return [f"hkernels: {where}; backends here: {', '.join(hkernels.backends('rms_norm'))}"]
