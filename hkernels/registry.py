"""The table of ops: for each, the module of each backend. The dispatcher reads this and nothing else to find code.

Every backend module of an op offers the same functions with the same signatures (``<op>_fwd``, ``<op>_bwd``, and
a few op-specific ones such as ``matmul_act_bwd``), on the kernel-level arguments the op's public function
prepares (2-D rows for the row ops). The ``torch`` backend is the op's functional module, where its reference
math lives. Modules are imported on the first call that needs them: ``import hkernels`` imports neither Helion nor
Triton, and a backend that fails to import costs only itself.

Adding an op: ``hkernels/functional/<op>.py``, ``hkernels/ops/<op>.py``, ``triton_fallback/<op>.py`` and a row here.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import sys
import threading
import types
from dataclasses import dataclass
from types import ModuleType
from typing import Any

BACKENDS: tuple[str, ...] = ("helion", "triton", "torch")


@dataclass(frozen=True)
class Op:
    name: str
    helion: str  # Helion kernels
    triton: str  # hand-written Triton twins, importable without Helion
    torch: str  # the public function, autograd and reference math (the torch backend)

    def module_name(self, backend: str) -> str:
        return getattr(self, backend)


OPS: dict[str, Op] = {op.name: op for op in (
    Op("rms_norm", "hkernels.ops.rms_norm", "triton_fallback.rms_norm", "hkernels.functional.rms_norm"),
    Op("layer_norm", "hkernels.ops.layer_norm", "triton_fallback.layer_norm", "hkernels.functional.layer_norm"),
    Op("softmax", "hkernels.ops.softmax", "triton_fallback.softmax", "hkernels.functional.softmax"),
    Op("add_rms_norm", "hkernels.ops.add_rms_norm", "triton_fallback.add_rms_norm",
       "hkernels.functional.add_rms_norm"),
    Op("swiglu", "hkernels.ops.swiglu", "triton_fallback.swiglu", "hkernels.functional.swiglu"),
    Op("geglu", "hkernels.ops.geglu", "triton_fallback.geglu", "hkernels.functional.geglu"),
    Op("rope", "hkernels.ops.rope", "triton_fallback.rope", "hkernels.functional.rope"),
    Op("qk_norm_rope", "hkernels.ops.qk_norm_rope", "triton_fallback.qk_norm_rope",
       "hkernels.functional.qk_norm_rope"),
    Op("cross_entropy", "hkernels.ops.cross_entropy", "triton_fallback.cross_entropy",
       "hkernels.functional.cross_entropy"),
    Op("fused_linear_cross_entropy", "hkernels.ops.fused_linear_cross_entropy",
       "triton_fallback.fused_linear_cross_entropy", "hkernels.functional.fused_linear_cross_entropy"),
    Op("matmul", "hkernels.ops.matmul", "triton_fallback.matmul", "hkernels.functional.matmul"),
    Op("grouped_matmul", "hkernels.ops.grouped_matmul", "triton_fallback.grouped_matmul",
       "hkernels.functional.grouped_matmul"),
    Op("moe", "hkernels.ops.moe", "triton_fallback.moe", "hkernels.functional.moe"),
    Op("decode_attention", "hkernels.ops.decode_attention", "triton_fallback.decode_attention",
       "hkernels.functional.decode_attention"),
    Op("attention", "hkernels.ops.attention", "triton_fallback.attention", "hkernels.functional.attention"),
    # packed sequences: the attention kernels, launched per (sequence, block)
    Op("attention_varlen", "hkernels.ops.attention", "triton_fallback.attention",
       "hkernels.functional.attention_varlen"),
)}

# One import at a time, and torch._dynamo before Helion: a call on the custom-op path (torch.compile, modes,
# subclasses) imports torch._dynamo, which imports torch._inductor; Helion's import pulls in torch._inductor, which
# imports torch._dynamo. Started from two threads at once, the two chains wait on each other's module locks and
# Python breaks the cycle by handing out half-initialised modules ("partially initialized module
# 'torch._dynamo'"), after which every op fails in that process. With torch._dynamo imported first, Helion's chain
# finds it whole. A plain eager call imports neither.
_import_lock = threading.RLock()
_loaded: dict[tuple[str, str], ModuleType | str] = {}
_prepared = False


def prepare() -> None:
    """Import torch._dynamo, once and under the import lock: before Helion is imported (see above)."""
    global _prepared
    if _prepared:
        return
    with _import_lock:
        if not _prepared:
            import torch._dynamo  # noqa: F401

            _prepared = True


def _import_helion() -> None:
    """Import Helion, without the scikit-learn its surrogate autotuners import at module level (about 1 s of
    Helion's import, which a first call waits for; the library never autotunes at call time). While Helion imports,
    ``sklearn.ensemble`` is a stand-in whose model classes construct the real ones when an autotuner first builds a
    model (``python -m hkernels.tune``, or the caller's own Helion autotuning), so autotuning finds scikit-learn;
    the stand-in leaves ``sys.modules`` once Helion is imported. Only in a process with one thread (``sys.modules``
    is every thread's: another one importing scikit-learn meanwhile would get the stand-in); otherwise, or where
    scikit-learn is not installed, or already imported, or Helion is, a plain import."""
    if ("helion" in sys.modules or "sklearn" in sys.modules or threading.active_count() > 1
            or importlib.util.find_spec("sklearn") is None):
        import helion
        return
    package, ensemble = types.ModuleType("sklearn"), types.ModuleType("sklearn.ensemble")
    for module in (package, ensemble):
        module.__spec__ = importlib.machinery.ModuleSpec(module.__name__, None)
    for name in ("RandomForestClassifier", "RandomForestRegressor"):
        setattr(ensemble, name, _on_first_use(name))
    package.ensemble = ensemble  # type: ignore[attr-defined]
    sys.modules["sklearn"], sys.modules["sklearn.ensemble"] = package, ensemble
    try:
        import helion  # noqa: F401
    finally:
        for module in (package, ensemble):
            if sys.modules.get(module.__name__) is module:
                del sys.modules[module.__name__]


def _on_first_use(name: str) -> type:
    """A stand-in for ``sklearn.ensemble.<name>``: constructing it constructs the real class."""
    def __new__(cls: type, *args: Any, **kwargs: Any) -> Any:
        real = importlib.import_module("sklearn.ensemble")
        return getattr(real, name)(*args, **kwargs)

    return type(name, (), {"__new__": __new__, "__module__": "sklearn.ensemble"})


def load(op: str, backend: str) -> ModuleType | str:
    """``op``'s module on ``backend``, or the reason it cannot be imported here."""
    key = (op, backend)
    found = _loaded.get(key)
    if found is None:
        with _import_lock:
            if backend == "helion":
                prepare()
                _import_helion()
            found = _loaded.get(key)
            if found is None:
                try:
                    found = importlib.import_module(OPS[op].module_name(backend))
                except Exception as e:  # an import error of any kind means: this backend is not available here
                    found = f"{backend} cannot be imported here ({type(e).__name__}: {e})"
                _loaded[key] = found
    return found
