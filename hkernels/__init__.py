"""hkernels: fast GPU operators for LLM training and inference.

Every op has a Helion kernel, a hand-written Triton twin and a PyTorch reference; a dispatcher picks one per
call (``HKERNELS_BACKEND``, :func:`use_backend`). ``HKERNELS_INTERPRET=1``, set before this import, runs the
kernels on CPU tensors in Triton's interpreter.
"""

from __future__ import annotations

# First: importing _interpret fixes interpret mode for the process (hkernels/runtime/interpret.py) before any kernel
# module or triton is imported, since triton.jit decides interpreted-or-not when it decorates.
from hkernels.runtime import interpret as _interpret

_interpret.setup()

# ops: the Helion kernels' package, callable (hkernels.ops() lists the ops); nn: modules over the ops
from hkernels import nn, ops  # noqa: E402
from hkernels.fallback import BackendUnavailableError, HKernelsFallbackWarning  # noqa: E402
from hkernels.functional import references  # noqa: E402
from hkernels.functional._base import trace_all  # noqa: E402
from hkernels.functional.add_rms_norm import add_rms_norm  # noqa: E402
from hkernels.functional.attention import attention  # noqa: E402
from hkernels.functional.attention_varlen import attention_varlen  # noqa: E402
from hkernels.functional.cross_entropy import CrossEntropyOutput, cross_entropy  # noqa: E402
from hkernels.functional.decode_attention import decode_attention  # noqa: E402
from hkernels.functional.fused_linear_cross_entropy import fused_linear_cross_entropy  # noqa: E402
from hkernels.functional.geglu import geglu  # noqa: E402
from hkernels.functional.grouped_matmul import grouped_matmul  # noqa: E402
from hkernels.functional.layer_norm import layer_norm  # noqa: E402
from hkernels.functional.matmul import matmul  # noqa: E402
from hkernels.functional.moe import moe  # noqa: E402
from hkernels.functional.qk_norm_rope import qk_norm_rope  # noqa: E402
from hkernels.functional.rms_norm import rms_norm  # noqa: E402
from hkernels.functional.rope import rope  # noqa: E402
from hkernels.functional.softmax import softmax  # noqa: E402
from hkernels.functional.swiglu import swiglu  # noqa: E402
from hkernels.hub import kernelize  # noqa: E402  (the same through transformers' kernel hooks)
from hkernels.introspect import backends, selected_backend  # noqa: E402
from hkernels.patch import patch, unpatch  # noqa: E402  (hkernels.patch(model) swaps them into a model)
from hkernels.requests import use_backend  # noqa: E402
from hkernels.warmup import warmup  # noqa: E402  (a server's first calls, paid at start)

trace_all()  # every op's custom ops visible to torch.compile (traced into the graph, not called back)
del trace_all

__version__ = "0.1.0"

__all__ = [
    "BackendUnavailableError",
    "CrossEntropyOutput",
    "HKernelsFallbackWarning",
    "add_rms_norm",
    "attention",
    "attention_varlen",
    "backends",
    "cross_entropy",
    "decode_attention",
    "fused_linear_cross_entropy",
    "geglu",
    "grouped_matmul",
    "kernelize",
    "layer_norm",
    "matmul",
    "moe",
    "nn",
    "ops",
    "patch",
    "qk_norm_rope",
    "references",
    "rms_norm",
    "rope",
    "selected_backend",
    "softmax",
    "swiglu",
    "unpatch",
    "use_backend",
    "warmup",
]
