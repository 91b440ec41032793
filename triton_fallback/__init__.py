"""Hand-written Triton kernels: the fallback behind hkernels' Helion kernels, and their yardstick.

``triton_fallback/<op>.py`` has the same file and function names as ``hkernels/ops/<op>.py``. This package
imports without Helion. With ``HKERNELS_INTERPRET=1`` its kernels run on CPU tensors in Triton's interpreter;
the variable must be set before the kernel modules are imported (``triton.jit`` reads it when it decorates).
"""

from __future__ import annotations

import os

if os.environ.get("HKERNELS_INTERPRET", "").strip().lower() in {"1", "true", "yes", "on"}:
    os.environ["TRITON_INTERPRET"] = "1"
