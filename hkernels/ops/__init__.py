"""Helion kernels, one module per op (``hkernels/ops/<op>.py``).

``hkernels.ops`` is also the public function that lists the ops: importing a submodule binds this package to
the name ``hkernels.ops``, so the package itself is made callable and answers ``hkernels.ops()`` the same way.
"""

from __future__ import annotations

import sys
import types


class _CallablePackage(types.ModuleType):
    def __call__(self) -> list[str]:
        from hkernels.requests import ops

        return ops()


sys.modules[__name__].__class__ = _CallablePackage
