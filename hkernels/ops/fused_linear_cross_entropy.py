"""Linear + cross-entropy, chunked over tokens, with the Helion cross-entropy kernel (the twin of
``triton_fallback/fused_linear_cross_entropy.py``).

For each chunk of tokens, PyTorch's matmuls make the logits chunk, the backend's cross-entropy kernel reads it and
writes the logits' gradient over it, and PyTorch's matmuls turn that into the gradients of hidden, weight and bias:
the loop every backend shares is ``hkernels/runtime/chunked.py``. Only one chunk's logits exist at a time.
"""

from __future__ import annotations

from hkernels.ops import cross_entropy
from hkernels.runtime import chunked as _chunked

fused_linear_cross_entropy_fwd, fused_linear_cross_entropy_bwd = _chunked.backend_functions(cross_entropy)
# traced at a symbolic token count, as the cross-entropy kernel is (the chunk loop: ``_chunked.chunk_bounds``)
SYMBOLIC = frozenset({"fused_linear_cross_entropy_fwd", "fused_linear_cross_entropy_grad", "loss_grad_scale_"})
