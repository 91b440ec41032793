"""Hand-written Triton kernels: the fallback behind hkernels' Helion kernels, and their yardstick.

``triton_fallback/<op>.py`` has the same file and function names as ``hkernels/ops/<op>.py``. This package
imports without Helion and without hkernels. With ``HKERNELS_INTERPRET=1`` its kernels run on CPU tensors in
Triton's interpreter; the variable must be set before this package (and triton) is imported: see ``_interpret.py``.
"""

from __future__ import annotations

from triton_fallback import _interpret  # noqa: F401  (fixes interpret mode for the process: before any kernel)
