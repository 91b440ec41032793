"""Hand-written Triton kernels: the fallback behind hkernels' Helion kernels, and their yardstick.

``triton_fallback/<op>.py`` has the same file and function names as ``hkernels/ops/<op>.py``. This package
imports without Helion; of hkernels its modules name only the runtime below them (``hkernels/runtime``: launch
path, plans, interpret mode; importing it loads the hkernels package). With ``HKERNELS_INTERPRET=1`` its kernels
run on CPU tensors in Triton's interpreter; the variable must be set before this package (and triton) is imported:
see ``hkernels/runtime/interpret.py``.
"""

from __future__ import annotations

# (interpret mode is fixed for the process before any kernel is decorated: hkernels/runtime/interpret.py)
from hkernels.runtime import interpret  # noqa: F401
