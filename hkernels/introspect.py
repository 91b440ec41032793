"""What the dispatcher offers and chooses, for a user to ask: the backends that can run an op here, and the backend a
call would run on now, with why."""

from __future__ import annotations

import inspect
from typing import Any

import torch

from hkernels import dispatch, registry
from hkernels.requests import check_op, ops, requested
from hkernels.runtime import interpret as _interpret


def backends(op: str | None = None) -> list[str] | dict[str, list[str]]:
    """Backends that can run ``op`` on this machine (CUDA present, or interpret mode), best first; without an op,
    {op: its backends} for every op."""
    if op is None:
        return {name: backends(name) for name in ops()}  # type: ignore[misc]
    check_op(op)
    kernels_here = torch.cuda.is_available()
    if not kernels_here and _interpret.enabled():
        _interpret.check()
        kernels_here = True
    out = [b for b in ("helion", "triton") if kernels_here and not isinstance(registry.load(op, b), str)]
    return [*out, "torch"]


class Selection(str):
    """A backend name (compares equal to it) that also says why it was chosen: ``.reason``."""

    reason: str

    def __new__(cls, backend: str, reason: str) -> Selection:
        self = super().__new__(cls, backend)
        self.reason = reason
        return self

    def __getnewargs__(self) -> tuple[str, str]:  # pickle and copy rebuild it with its reason
        return str(self), self.reason


def selected_backend(op: str, *args: Any, **kwargs: Any) -> Selection:
    """The backend a call ``hkernels.<op>(*args, **kwargs)`` would run its forward on now; ``.reason`` says why
    (asked for by name, measured faster on this arch for this shape bucket, a Helion failure, CPU tensors) and,
    where auto routes the backward elsewhere (attention's forward has buckets of its own), the backward's."""
    check_op(op)
    module = registry.load(op, "torch")
    assert not isinstance(module, str)
    bound = inspect.signature(getattr(module, op)).bind(*args, **kwargs)
    bound.apply_defaults()
    routed = getattr(module, "routed", None)  # where the kernel sees other tensors than the call's arguments
    tensors = routed(bound.arguments) if routed is not None else dispatch.tensors_of(tuple(bound.arguments.values()))
    request = requested(op)
    forward_fn = getattr(module, "forward_fn", None)  # where the call's options pick the function it runs
    fwd = forward_fn(bound.arguments) if forward_fn is not None else f"{op}_fwd"
    backend, reason = dispatch.select(op, request, tensors, bucket_fn=fwd)
    if request == "auto" and (backend, reason) == dispatch.measured_choice(op, tensors, fwd):
        # the backward's buckets: the op's own, or, for a function routed apart, its backward's before them
        bwd = None if fwd == f"{op}_fwd" else fwd.removesuffix("_fwd") + "_bwd"
        backward = dispatch.measured_choice(op, tensors, bwd)
        if backward is not None and backward[0] != backend:
            reason = f"{reason}; the backward: {backward[1]}"
    return Selection(backend, reason)
