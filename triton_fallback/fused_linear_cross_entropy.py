"""Linear + cross-entropy, chunked over tokens, with the hand-written Triton cross-entropy kernel: the twin of
``hkernels/ops/fused_linear_cross_entropy.py`` (the math and the chunk loop: ``hkernels/runtime/chunked.py``).
"""

from __future__ import annotations

from hkernels.runtime import chunked as _chunked
from triton_fallback import cross_entropy

fused_linear_cross_entropy_fwd, fused_linear_cross_entropy_bwd = _chunked.backend_functions(cross_entropy)

# The custom ops whose launches these host functions record at a symbolic length (see triton_fallback/rms_norm.py):
# at a symbolic T the chunk loop takes equal parts, as many as T's size class needs (``_chunked.chunk_bounds``).
SYMBOLIC = frozenset({"fused_linear_cross_entropy_fwd", "fused_linear_cross_entropy_grad", "loss_grad_scale_"})
