"""Plain-PyTorch references: the truth the kernels are tested against, and the ``torch`` backend.

The first part is one function per op, written like the math. Math runs in float32 for 16-bit inputs (as the
kernels do) and in the input's own precision for float32 and float64, so ``reference.rms_norm(x.double(), ...)``
is the float64 reference the tests use. Results come back in the input's dtype.

The second part is the ``torch`` backend: ``<op>_fwd`` / ``<op>_bwd`` with the same signatures as the Helion
(``hkernels/ops``) and Triton (``triton_fallback``) backends, on 2-D ``[M, N]`` inputs, normalising over N.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def rms_norm(x: Tensor, weight: Tensor | None = None, eps: float = 1e-6) -> Tensor:
    """y = x / sqrt(mean(x², last dim) + eps) * weight.  x: [..., N], weight: [N]."""
    xf = x.to(_compute_dtype(x.dtype))
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.to(xf.dtype)
    return y.to(x.dtype)


def layer_norm(x: Tensor, weight: Tensor | None = None, bias: Tensor | None = None, eps: float = 1e-5) -> Tensor:
    """y = (x - mean) / sqrt(var + eps) * weight + bias over the last dim (biased variance).  x: [..., N]."""
    xf = x.to(_compute_dtype(x.dtype))
    mean = xf.mean(-1, keepdim=True)
    var = (xf - mean).pow(2).mean(-1, keepdim=True)
    y = (xf - mean) * torch.rsqrt(var + eps)
    if weight is not None:
        y = y * weight.to(xf.dtype)
    if bias is not None:
        y = y + bias.to(xf.dtype)
    return y.to(x.dtype)


def softmax(x: Tensor, dim: int = -1) -> Tensor:
    """y = exp(x - max(x)) / sum(exp(x - max(x))) along ``dim``."""
    xf = x.to(_compute_dtype(x.dtype))
    e = torch.exp(xf - xf.amax(dim, keepdim=True))
    return (e / e.sum(dim, keepdim=True)).to(x.dtype)


# ---------------------------------------------------------------------------------------------------------
# The torch backend. Forward returns what the backward of every backend needs; the backward formulas are the
# analytic ones (the tests hold them against autograd of the float64 reference above).
# ---------------------------------------------------------------------------------------------------------


def rms_norm_fwd(x: Tensor, weight: Tensor | None, eps: float) -> tuple[Tensor, Tensor]:
    """x: [M, N] -> (y [M, N] in x.dtype, rstd [M] float32)."""
    xf = x.to(_compute_dtype(x.dtype))
    rstd = torch.rsqrt(xf.pow(2).mean(-1) + eps)
    y = xf * rstd[:, None]
    if weight is not None:
        y = y * weight.to(xf.dtype)
    return y.to(x.dtype), rstd.float()


def rms_norm_bwd(dy: Tensor, x: Tensor, weight: Tensor | None, rstd: Tensor) -> tuple[Tensor, Tensor | None]:
    """dx = rstd·(w·dy) − x·rstd³·mean(w·dy·x);  dw = Σ_rows dy·x·rstd."""
    ct = _compute_dtype(x.dtype)
    xf, dyf, r = x.to(ct), dy.to(ct), rstd.to(ct)[:, None]
    wdy = dyf * weight.to(ct) if weight is not None else dyf
    dx = r * wdy - xf * r.pow(3) * (wdy * xf).mean(-1, keepdim=True)
    dw = (dyf * xf * r).sum(0).to(weight.dtype) if weight is not None else None
    return dx.to(x.dtype), dw


def layer_norm_fwd(
    x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    """x: [M, N] -> (y [M, N] in x.dtype, mean [M] float32, rstd [M] float32)."""
    xf = x.to(_compute_dtype(x.dtype))
    mean = xf.mean(-1)
    rstd = torch.rsqrt((xf - mean[:, None]).pow(2).mean(-1) + eps)
    y = (xf - mean[:, None]) * rstd[:, None]
    if weight is not None:
        y = y * weight.to(xf.dtype)
    if bias is not None:
        y = y + bias.to(xf.dtype)
    return y.to(x.dtype), mean.float(), rstd.float()


def layer_norm_bwd(
    dy: Tensor, x: Tensor, weight: Tensor | None, bias: Tensor | None, mean: Tensor, rstd: Tensor
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """x̂ = (x−mean)·rstd;  dx = rstd·(w·dy − mean(w·dy) − x̂·mean(w·dy·x̂));  dw = Σ dy·x̂;  db = Σ dy."""
    ct = _compute_dtype(x.dtype)
    dyf = dy.to(ct)
    xhat = (x.to(ct) - mean.to(ct)[:, None]) * rstd.to(ct)[:, None]
    wdy = dyf * weight.to(ct) if weight is not None else dyf
    dx = (wdy - wdy.mean(-1, keepdim=True) - xhat * (wdy * xhat).mean(-1, keepdim=True)) * rstd.to(ct)[:, None]
    dw = (dyf * xhat).sum(0).to(weight.dtype) if weight is not None else None
    db = dyf.sum(0).to(bias.dtype) if bias is not None else None
    return dx.to(x.dtype), dw, db


def softmax_fwd(x: Tensor) -> Tensor:
    """x: [M, N] -> softmax over N, in x.dtype."""
    return softmax(x, -1)


def softmax_bwd(dy: Tensor, y: Tensor) -> Tensor:
    """dx = y·(dy − Σ dy·y)."""
    ct = _compute_dtype(y.dtype)
    yf, dyf = y.to(ct), dy.to(ct)
    return (yf * (dyf - (dyf * yf).sum(-1, keepdim=True))).to(y.dtype)
