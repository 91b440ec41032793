"""grouped_matmul: the experts of a mixture of experts, ``y[rows of group e] = x[rows] @ weight[e]ᵀ``.

The public function and its checks, its autograd (custom ops ``hkernels::grouped_matmul_fwd`` and ``_bwd``), then
the reference math and the torch backend. Kernels: ``hkernels/ops/grouped_matmul.py`` (Helion),
``triton_fallback/grouped_matmul.py``.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from hkernels import dispatch
from hkernels.functional._base import (
    Autocast,
    Public,
    Tensor,
    autograd,
    call,
    check_range,
    check_same,
    check_tensor,
    compute_dtype,
    torch_traces_when,
)
from hkernels.runtime.routing import group_ends, zero_rows_past

OP = "grouped_matmul"
_INT = (torch.int32, torch.int64)


def grouped_matmul(x: Tensor, weight: Tensor, group_sizes: Tensor) -> Tensor:
    """Rows of ``x`` grouped by expert, in order, each group times its expert's weight: ``y[rows of group e] =
    x[rows] @ weight[e]ᵀ``.

    x: [T, K]; weight: [E, N, K] (each expert an ``nn.Linear`` weight, [out, in]); group_sizes: [E] int32/int64 on
    x's device, group e being the next group_sizes[e] rows (zero-size groups allowed) -> [T, N] in x's dtype
    (float32 accumulation). No host sync: the sizes are read on the device, so they are not checked against T
    there (``HKERNELS_CHECK=1`` checks them). A negative size counts as 0, groups reaching past row T are cut at
    T, and rows past the sizes' sum get zeros (their gradients too). Differentiable in x and weight.
    """
    return _CALLS(x, weight, group_sizes)


def _check(x: Any, weight: Any, group_sizes: Any) -> None:
    check_tensor(OP, "x", x, (2,))
    check_tensor(OP, "weight", weight, (3,))
    check_same(OP, ("x", "weight"), x, weight, shape=False)
    if weight.shape[2] != x.shape[1]:
        raise ValueError(f"hkernels.grouped_matmul: weight [E, N, K] = {list(weight.shape)} does not fit x [T, K] = "
                         f"{list(x.shape)}: its last dim must be K = {x.shape[1]}")
    if not isinstance(group_sizes, torch.Tensor) or group_sizes.dtype not in _INT or group_sizes.dim() != 1:
        got = (f"{group_sizes.dtype} of shape {list(group_sizes.shape)}" if isinstance(group_sizes, torch.Tensor)
               else type(group_sizes).__name__)
        raise TypeError(f"hkernels.grouped_matmul: group_sizes must be a 1-d int32 or int64 tensor, got {got}")
    if group_sizes.shape[0] != weight.shape[0]:
        raise ValueError(f"hkernels.grouped_matmul: group_sizes has {group_sizes.shape[0]} entries for "
                         f"{weight.shape[0]} experts (weight's first dim)")
    if group_sizes.device != x.device:
        raise ValueError(f"hkernels.grouped_matmul: group_sizes is on {group_sizes.device} but x is on {x.device}")


def _values(x: Tensor, weight: Tensor, group_sizes: Tensor) -> None:
    T = x.shape[0]
    check_range(OP, "group_sizes", group_sizes, 0, T + 1)
    total = int(group_sizes.sum())
    if total > T:
        raise ValueError(f"hkernels.grouped_matmul: group_sizes sum to {total}, past the T = {T} rows of x")


def _body(request: str, x: Tensor, weight: Tensor, group_sizes: Tensor) -> Tensor:
    return call(_fwd, x, weight, group_sizes, request)


# ------------------------------------------------------------------------------------------------------ autograd


def _unit_rows(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


@torch.library.custom_op("hkernels::grouped_matmul_fwd", mutates_args=())
def _fwd(x: Tensor, weight: Tensor, group_sizes: Tensor, backend: str) -> Tensor:
    if x.numel() == 0 or weight.numel() == 0:  # nothing for a kernel to do (K = 0: zeros)
        backend = "torch"
    return dispatch.run(OP, "grouped_matmul_fwd", backend, _unit_rows(x), weight, group_sizes)


@_fwd.register_fake
def _(x: Tensor, weight: Tensor, group_sizes: Tensor, backend: str) -> Tensor:
    return x.new_empty((x.shape[0], weight.shape[1]))


@torch.library.custom_op("hkernels::grouped_matmul_bwd", mutates_args=())
def _bwd(dy: Tensor, x: Tensor, weight: Tensor, group_sizes: Tensor, need_x: bool, need_weight: bool,
         backend: str) -> tuple[Tensor, Tensor]:
    if x.numel() == 0 or weight.numel() == 0:
        backend = "torch"
    dx, dw = dispatch.run(OP, "grouped_matmul_bwd", backend, _unit_rows(dy), _unit_rows(x), weight, group_sizes,
                          need_x, need_weight)
    return (dx if dx is not None else x.new_empty(0)), (dw if dw is not None else weight.new_empty(0))


@_bwd.register_fake
def _(dy: Tensor, x: Tensor, weight: Tensor, group_sizes: Tensor, need_x: bool, need_weight: bool,
      backend: str) -> tuple[Tensor, Tensor]:
    return (x.new_empty(x.shape) if need_x else x.new_empty(0),
            weight.new_empty(weight.shape) if need_weight else weight.new_empty(0))


def _setup(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    x, weight, group_sizes, backend = inputs
    ctx.save_for_backward(x, weight, group_sizes)
    ctx.backend = backend
    ctx.set_materialize_grads(False)


def _backward(ctx: Any, dy: Tensor | None) -> tuple[Tensor | None, ...]:
    # dx[rows_e] = dy[rows_e] @ weight[e];  dweight[e] = dy[rows_e]ᵀ @ x[rows_e]
    if dy is None:
        return (None,) * 4
    x, weight, group_sizes = ctx.saved_tensors
    need_x, need_weight = ctx.needs_input_grad[:2]
    dx, dw = call(_bwd, dy, x, weight, group_sizes, need_x, need_weight, ctx.backend)
    return (dx if need_x else None), (dw if need_weight else None), None, None


autograd(_fwd, _backward, _setup)


# ------------------------------------------------------------------------------- reference and the torch backend


def _groups(group_sizes: Tensor, rows: int) -> list[tuple[int, int]]:
    """(start, end) rows of each group, the sizes clamped as the kernels read them (one host sync)."""
    ends = torch.cumsum(group_sizes.clamp(min=0), 0).clamp(max=rows).tolist()
    return list(zip([0, *ends[:-1]], ends, strict=True))


def reference(x: Tensor, weight: Tensor, group_sizes: Tensor) -> Tensor:
    """y[rows of group e] = x[rows] @ weight[e]ᵀ, zeros past the groups; float32 accumulation for 16-bit inputs."""
    ct = compute_dtype(x.dtype)
    y = x.new_zeros((x.shape[0], weight.shape[1]), dtype=ct)
    for e, (start, end) in enumerate(_groups(group_sizes, x.shape[0])):
        if end > start:
            y[start:end] = x[start:end].to(ct) @ weight[e].to(ct).T
    return y.to(x.dtype)


def grouped_matmul_fwd(x: Tensor, weight: Tensor, group_sizes: Tensor) -> Tensor:
    if grouped_mm_takes(x, weight):
        offs = group_ends(group_sizes, x.shape[0])[:-1]
        y = grouped_mm(x, weight.transpose(1, 2), offs)
        if y is not None:
            return zero_rows_past(y, offs[-1:])
    return reference(x, weight, group_sizes)


def grouped_matmul_bwd(dy: Tensor, x: Tensor, weight: Tensor, group_sizes: Tensor, need_x: bool, need_weight: bool
                       ) -> tuple[Tensor | None, Tensor | None]:
    """(dx [T, K] or None, dweight [E, N, K] or None), written out (a custom op's implementation runs without
    autograd)."""
    if grouped_mm_takes(dy, x, weight):
        offs = group_ends(group_sizes, x.shape[0])[:-1]
        dx = grouped_mm(dy, weight, offs) if need_x else None
        dw = weight_grads(grouped_mm(dy.t(), x, offs), offs) if need_weight else None
        if (dx is not None or not need_x) and (dw is not None or not need_weight):
            return (zero_rows_past(dx, offs[-1:]) if dx is not None else None), dw
    ct = compute_dtype(x.dtype)
    dx = torch.zeros(x.shape, dtype=ct, device=x.device) if need_x else None
    dw = torch.zeros(weight.shape, dtype=ct, device=x.device) if need_weight else None
    for e, (start, end) in enumerate(_groups(group_sizes, x.shape[0])):
        if end > start:
            g = dy[start:end].to(ct)
            if dx is not None:
                dx[start:end] = g @ weight[e].to(ct)
            if dw is not None:
                dw[e] = g.T @ x[start:end].to(ct)
    return (dx.to(x.dtype) if dx is not None else None), (dw.to(weight.dtype) if dw is not None else None)


# PyTorch's grouped GEMM, ``torch._grouped_mm`` (CUTLASS on sm90; a loop of matmuls on a CPU in recent PyTorch): the
# torch backend's path for bfloat16, its one dtype, on rows aligned to 16 bytes. Its rows past the last offset are
# left unwritten, so callers zero them; a device type where it raised keeps the loop above (one warning).
_GROUPED_MM_REFUSED: set[str] = set()


def grouped_mm_takes(*tensors: Tensor) -> bool:
    """Whether ``torch._grouped_mm`` takes these operands: bfloat16, non-empty, every dim but the rows a multiple of
    8 elements, unit inner stride, the other strides multiples of 8 elements (16 bytes) that do not overlap rows,
    aligned start."""
    t0 = tensors[0]
    if t0.dtype != torch.bfloat16 or t0.device.type in _GROUPED_MM_REFUSED or not hasattr(torch, "_grouped_mm"):
        return False
    for t in tensors:
        dims = t.shape[1:] if t.dim() == 2 else t.shape  # a 2-d operand's rows are the grouped (any) dim
        if (t.dtype != t0.dtype or t.stride(-1) != 1 or t.storage_offset() % 8 != 0
                or any(type(n) is int and n == 0 for n in t.shape) or any(n % 8 != 0 for n in dims[-2:])):
            return False
        for d in range(t.dim() - 1):  # rows apart, a multiple of 16 bytes (not an expanded, stride-0 dim)
            if t.stride(d) % 8 != 0 or t.stride(d) < t.shape[d + 1] * t.stride(d + 1):
                return False
    return True


def grouped_mm(a: Tensor, b: Tensor, offs: Tensor) -> Tensor | None:
    """``torch._grouped_mm(a, b, offs=offs)``, or None (and the device type keeps the loop) where it raises."""
    try:
        return torch._grouped_mm(a, b, offs=offs)
    except torch.OutOfMemoryError:
        raise
    except (RuntimeError, NotImplementedError) as e:
        _GROUPED_MM_REFUSED.add(a.device.type)
        warnings.warn(f"hkernels: torch._grouped_mm failed on {a.device.type} ({e}); the torch backend's grouped "
                      f"matmuls there run a loop of matmuls from now on", dispatch.HKernelsFallbackWarning,
                      stacklevel=3)
        return None


def weight_grads(dw: Tensor | None, offs: Tensor) -> Tensor | None:
    """A grouped weight gradient [E, ...] of ``torch._grouped_mm`` over the rows (``offs``: each group's end) with an
    empty group's entry zero: sm90's kernel writes zeros there, not every GPU's does (pytorch#172439: Blackwell),
    so elsewhere they are set here, with no host sync."""
    if dw is None or zeroes_empty_groups(dw.device):
        return dw
    empty = torch.diff(offs, prepend=offs.new_zeros(1)) == 0
    return torch.where(empty.view(-1, *[1] * (dw.dim() - 1)), 0, dw)


def zeroes_empty_groups(device: torch.device) -> bool:
    """``torch._grouped_mm`` writes zeros for an empty group of a weight gradient on this device (sm90 and the CPU's
    loop of matmuls do)."""
    return device.type != "cuda" or torch.cuda.get_device_capability(device)[0] == 9


def _torch_takes(name: str, args: tuple[Any, ...]) -> bool:
    """The torch backend's call runs ``torch._grouped_mm``, reading nothing on the host (traceable into a graph):
    the forward's (x, weight, ...), the backward's (dy, x, weight, ...); on a GPU, only where its kernel is known
    to run (sm90: inside a graph there is no falling back to the loop)."""
    return grouped_mm_traces(*args[:2]) if name.endswith("_fwd") else grouped_mm_traces(*args[:3])


def grouped_mm_traces(*tensors: Tensor) -> bool:
    """:func:`grouped_mm_takes`, on a device where ``torch._grouped_mm``'s kernel is known to run."""
    device = tensors[0].device
    return grouped_mm_takes(*tensors) and (device.type != "cuda" or torch.cuda.get_device_capability(device) == (9, 0))


torch_traces_when(OP, _torch_takes)


# Under autocast: as each group's matmul, in autocast's dtype.
_CALLS = Public(OP, _check, _body, values=_values, autocast=Autocast("lower", ("aten::mm",)))
