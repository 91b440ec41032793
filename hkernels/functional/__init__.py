"""The ops, one file each: ``hkernels/functional/<op>.py`` holds the op's public function and argument checks, its
autograd (``torch.library`` custom ops with fake kernels), and its reference math, which is also the ``torch``
backend. ``_base.py`` is the call path they share (plans, custom-op calls, autograd wiring, checks).

``references.<op>`` is each op's reference function (the float64 truth of the tests and the benchmark, when given
float64 inputs): one reference per op, imported, never copied.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from hkernels import registry


class _References:
    """``references.rms_norm(x, w)``: the reference math of each op (its functional file's ``reference``)."""

    def __getattr__(self, op: str) -> Callable[..., Any]:
        if op not in registry.OPS:
            raise AttributeError(f"hkernels: no op named {op!r}")
        return importlib.import_module(registry.OPS[op].torch).reference

    def __dir__(self) -> list[str]:
        return sorted(registry.OPS)


references = _References()
