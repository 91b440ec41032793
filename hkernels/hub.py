"""hkernels through transformers' own kernel hooks: the Hugging Face ``kernels`` package's mapping and ``kernelize``.

transformers 5 marks the layers a kernel may replace with ``kernels.use_kernel_forward_from_hub(name)``: Llama's
RMSNorm as ``"RMSNorm"`` (the same computation in every class so marked) and ``apply_rotary_pos_emb`` as
``"rotary_pos_emb"`` (a function: ``kernels`` makes it a module, and each attention module gets its own copy
through ``use_kernelized_func``). ``kernels.kernelize(model, mode=...)`` sets the forward of every marked layer to
the layer the current mapping names for its device and mode. :func:`mapping` names hkernels' layers for both, in
every mode (training, inference, each with or without ``torch.compile``), on CUDA devices of compute capability
8.0 and newer (and on CPU tensors in interpret mode), with no network: its repository objects ``load()`` the layer
classes of this module.

    import kernels, hkernels
    with kernels.use_kernel_mapping(hkernels.hub.mapping()):
        kernels.kernelize(model, mode=kernels.Mode.TRAINING | kernels.Mode.TORCH_COMPILE)

:func:`kernelize` does that and then :func:`hkernels.patch`-es what transformers does not mark (the MLP, the loss,
the experts; attention on request), and says when an op it was asked for replaces nothing. ``kernels`` is an
optional dependency (``pip install "hkernels[hub]"``); without it :func:`hkernels.patch` replaces the same layers
as modules.

The mapping takes every ``"rotary_pos_emb"`` to be the full rotate_half rotation, as transformers' own mapping
does; the layer raises on tables of another width (a partial or half-table rotation). :func:`kernelize` keeps
hkernels' rope only in the modules :func:`hkernels.patch` knows compute it (``HF_ROPE_MODULES``). Tested with
kernels 0.16 (transformers 5.17) and 0.19 (transformers 5.25). Before 0.19, kernels shares the module-level
function among the attention modules: kernelizing one model's rope then kernelizes every model of that module,
as :func:`hkernels.patch` does, and :func:`hkernels.unpatch` restores it for all.
"""

from __future__ import annotations

import logging
import sys
import warnings
from typing import Any

import torch
from torch import nn

import hkernels.patch  # noqa: F401  (the module: hkernels.patch is also the function)
from hkernels.functional.rms_norm import rms_norm
from hkernels.runtime import interpret as _interpret

_patch = sys.modules["hkernels.patch"]

Tensor = torch.Tensor


class RMSNorm(nn.Module):
    """The forward of a module marked ``"RMSNorm"`` (its ``weight`` [N] and ``variance_epsilon``) on
    :func:`hkernels.rms_norm`. Stateless, as ``kernels`` requires: it runs as the marked module's forward."""

    can_torch_compile = True
    has_backward = True

    def forward(self, hidden_states: Tensor) -> Tensor:
        return rms_norm(hidden_states, self.weight, self.variance_epsilon, casting="llama")

    forward.hkernels_layer = True  # type: ignore[attr-defined]  (on the function: kernels allows no new members)


class RotaryPosEmb(nn.Module):
    """``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)`` (marked ``"rotary_pos_emb"``) on
    :func:`hkernels.rope`: q, k [B, H, S, D] (``unsqueeze_dim=1``) or [B, S, H, D] (2); cos, sin [B, S, D]."""

    can_torch_compile = True
    has_backward = True

    def forward(self, q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, unsqueeze_dim: int = 1) -> tuple[Tensor, Tensor]:
        if cos.shape[-1] != q.shape[-1]:
            raise ValueError(f"hkernels.rope: apply_rotary_pos_emb with cos/sin of width {cos.shape[-1]} for a head "
                             f"dim of {q.shape[-1]} is not the full rotate_half rotation hkernels computes; leave "
                             "this model's rotary_pos_emb out of the kernel mapping")
        return _patch._rotate(q, k, cos, sin, unsqueeze_dim)

    forward.hkernels_layer = True  # type: ignore[attr-defined]


# The names transformers marks -> (the op, hkernels' layer)
LAYERS: dict[str, tuple[str, type[nn.Module]]] = {"RMSNorm": ("rms_norm", RMSNorm),
                                                   "rotary_pos_emb": ("rope", RotaryPosEmb)}
HOOKED_OPS = tuple(op for op, _ in LAYERS.values())


class Repository:
    """A ``kernels`` repository object with no network behind it: ``load()`` returns one of this module's layer
    classes. Equal (and hashed) by the layer, so ``kernels`` loads each once."""

    def __init__(self, layer: type[nn.Module]) -> None:
        self.layer = layer
        self.layer_name = layer.__name__

    def load(self) -> type[nn.Module]:
        return self.layer

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Repository) and other.layer is self.layer

    def __hash__(self) -> int:
        return hash((Repository, self.layer))

    def __str__(self) -> str:
        return f"hkernels.hub.{self.layer_name}"


_REPOSITORIES = {name: Repository(layer) for name, (_, layer) in LAYERS.items()}


def _kernels() -> Any:
    try:
        import kernels
    except ImportError as e:
        raise ImportError("hkernels.hub needs the Hugging Face kernels package: pip install 'hkernels[hub]' (or "
                          "use hkernels.patch, which needs nothing more)") from e
    return kernels


def mapping(ops: str | list[str] | tuple[str, ...] | None = None) -> dict[str, Any]:
    """The ``kernels`` mapping {marked name: {device: {mode: repository}}} that puts the marked layers of ``ops``
    (default: every op transformers marks, ``rms_norm`` and ``rope``) on hkernels, for ``kernels.
    use_kernel_mapping`` or ``kernels.register_kernel_mapping``."""
    kernels = _kernels()
    Mode, Device, CUDAProperties = kernels.Mode, kernels.Device, kernels.CUDAProperties
    wanted = set(HOOKED_OPS if ops is None else ([ops] if isinstance(ops, str) else ops))
    unknown = wanted - set(HOOKED_OPS)
    if unknown:
        raise ValueError(f"hkernels.hub.mapping: no marked layer for op(s) {sorted(unknown)}; transformers marks "
                         f"{', '.join(HOOKED_OPS)}")
    modes = (Mode.TRAINING, Mode.INFERENCE, Mode.TRAINING | Mode.TORCH_COMPILE, Mode.INFERENCE | Mode.TORCH_COMPILE)
    # A capability range narrower than "any": kernels prefers the narrowest matching entry, so this one wins over a
    # mapping registered for every CUDA device (transformers' own), whichever was registered first.
    cuda = Device(type="cuda", properties=CUDAProperties(min_capability=80, max_capability=999))
    out: dict[str, Any] = {}
    for name, (op, _) in LAYERS.items():
        if op in wanted:
            per_mode = dict.fromkeys(modes, _REPOSITORIES[name])
            out[name] = {cuda: per_mode, **({"cpu": per_mode} if _interpret.enabled() else {})}
    return out


def kernelize(model: nn.Module, mode: Any = None, *, device: str | torch.device | None = None,
              ops: str | list[str] | tuple[str, ...] | None = None, strict: bool = True) -> list[_patch.Replacement]:
    """Put ``model`` on hkernels through transformers' hooks first: ``kernels.kernelize`` with :func:`mapping` for
    the layers transformers marks (the norms, rope), then :func:`hkernels.patch` for the rest of ``ops`` (the MLP,
    the loss, the experts, norms that are not marked, such as ``torch.nn.RMSNorm``). ``ops`` as
    :func:`hkernels.patch`'s; ``mode``: a ``kernels.Mode`` (default: training or inference as ``model.training``
    says; add ``Mode.TORCH_COMPILE`` for a compiled model); ``device``: the device type the model runs on (default:
    its parameters'). Returns every replacement; :func:`hkernels.unpatch` undoes them. As :func:`hkernels.patch`,
    an op that replaces nothing raises (``strict=False``: warns)."""
    kernels = _kernels()
    wanted, named = _patch._ops_arg(ops)
    if not isinstance(model, nn.Module):
        raise TypeError(f"hkernels.hub.kernelize: model must be a torch.nn.Module, got {type(model).__name__}")
    if mode is None:
        mode = kernels.Mode.TRAINING if model.training else kernels.Mode.INFERENCE
    if device is None:
        param = next(model.parameters(), None)
        device = "cuda" if param is not None and param.is_cuda else "cpu"
    elif isinstance(device, torch.device):
        device = device.type
    tally = _patch._Tally(wanted)
    hooked = [op for op in HOOKED_OPS if op in wanted]
    if hooked:
        # kernels says, for each marked layer no mapping names (activations, ...), that it keeps its forward (a
        # log record, or a warning before 0.19): not hkernels' to say.
        quiet = logging.getLogger("kernels")
        level = quiet.level
        quiet.setLevel(logging.ERROR)
        before = {id(m) for m in _marked(model) if _patch._kernelized(m)}
        try:
            with kernels.use_kernel_mapping(mapping(hooked)), warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=r"\s*No kernel mapping found for layer")
                kernels.kernelize(model, mode=mode, device=device)
        finally:
            quiet.setLevel(level)
        for r in _kernelized(model):
            if id(r.new) in before:
                tally.ours[r.op] += 1
            else:
                tally.add(r)
        model.__dict__.setdefault(_patch._RECORD, []).extend(tally.done)
        if tally.ours.get("rope") or any(r.op == "rope" for r in tally.done):
            tally.passes.discard("rope")  # the attention modules' own copies run hkernels: the module's function stays
        if any(r.op in ("rms_norm", "rope") for r in tally.done) or tally.ours.get("rms_norm") or tally.ours.get(
                "rope"):
            # the attention modules' q_norm, k_norm and rope run hkernels through the hooks: their forward stays
            tally.passes.discard("qk_norm_rope")
    _patch.run(model, tally, "hkernels.hub.kernelize")
    _patch.verdict(model, tally, named, strict, "hkernels.hub.kernelize")
    return tally.done


def _marked(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` a kernel mapping can reach: marked layers and per-model copies of marked functions."""
    out = []
    for m in model.modules():
        if hasattr(type(m), "kernel_layer_name"):
            out.append(m)
        out.extend(getattr(m, "_kernel_funcs", {}).values())
    return out


def _kernelized(model: nn.Module) -> list[_patch.Replacement]:
    """What ``kernels.kernelize`` has put on hkernels in ``model`` with :func:`mapping`: marked modules, and the
    copies of marked functions the attention modules hold (``where``: the module path, then ``:`` and the
    function; kernels 0.19 gives each module its own copy, 0.16 shares the module-level function, listed once). A
    function in a module that is not known to compute the full rotate_half rotation gets its own forward back."""
    out, seen = [], set()
    for path, m in model.named_modules():
        where = path or "<model>"
        if _patch._kernelized(m):
            op = LAYERS[type(m).kernel_layer_name][0]
            out.append(_patch.Replacement(where, op, "kernelized", type(m).forward, m))
        for name, fn in getattr(m, "_kernel_funcs", {}).items():
            if not _patch._kernelized(fn) or id(fn) in seen:
                continue
            seen.add(id(fn))
            if type(m).__module__ not in _patch.HF_ROPE_MODULES:
                _patch.unkernelize(fn)
                continue
            out.append(_patch.Replacement(f"{where}:{name}", "rope", "kernelized", type(fn).forward, fn))
    return out
