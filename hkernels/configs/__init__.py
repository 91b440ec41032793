"""Tuned data, per GPU arch: where it is shipped, where the tune command writes it, and how the two combine.

Shipped with the package (``hkernels/configs/``):
  ``<arch>/<op>.json``   Helion configs: ``{kernel name: [bucket, ...]}``, a bucket ``{"max_n": N or null,
                         "config": {...}}`` (see ``hkernels/ops/_helion.py``);
  ``auto/<arch>.json``   the ``auto`` backend's choice: ``{op: [{"max_rows", "max_n", "backend", "measured"}, ...]}``
                         (made by ``python -m bench.auto_table`` from H200 benchmarks).
Written by ``python -m hkernels.tune`` on the user's GPU, in the user cache (``HKERNELS_CACHE_DIR``, else
``$XDG_CACHE_HOME/hkernels``, else ``~/.cache/hkernels``): ``helion/<arch>/<op>.json`` and ``auto/<arch>.json``,
same formats, and ``triton/<arch>/<op>.json`` (searched Triton launch settings, read by
``triton_fallback/_common.py``). A user Helion bucket list is tried before the shipped one of the same kernel; a
user auto bucket list is tried before the shipped one of its op. Arch names are ``sm<major><minor>``;
``interpret`` in interpret mode.
"""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable
from importlib import resources
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# The user cache and a device's arch live at the bottom of the import order, where the Triton launchers read them too.
from hkernels.runtime import interpret as _interpret
from hkernels.runtime.device import cache_dir, clear_memos, cuda_arch

__all__ = ["DEFAULT_ARCH", "auto_bucket", "auto_table", "cache_dir", "cuda_arch", "helion_table", "on_reload", "reload",
           "routed_tensor", "shape_key"]

DEFAULT_ARCH = "sm90"


def _read(path: Any) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:  # a broken user file must not break every call: say so once, ignore it
        import warnings

        warnings.warn(f"hkernels: ignoring {path}: {type(e).__name__}: {e}", RuntimeWarning, stacklevel=3)
        return {}


@functools.lru_cache(maxsize=16)
def helion_table(arch: str) -> dict[str, list[dict[str, Any]]]:
    """Helion config buckets per kernel for ``arch`` (the shipped sm90 ones when none are shipped for it), user
    buckets first."""
    root = resources.files(__name__)
    folder = root.joinpath(arch)
    if not folder.is_dir():
        folder = root.joinpath(DEFAULT_ARCH)
    table: dict[str, list[dict[str, Any]]] = {}
    for path in sorted(folder.iterdir(), key=lambda p: p.name):
        if path.name.endswith(".json"):
            table.update(json.loads(path.read_text()))
    user = cache_dir() / "helion" / arch
    if user.is_dir():
        for path in sorted(user.glob("*.json")):
            for kernel, buckets in _read(path).items():
                table[kernel] = [*buckets, *table.get(kernel, [])]
    return table


@functools.lru_cache(maxsize=16)
def auto_table(arch: str) -> dict[str, tuple[dict[str, Any], ...]]:
    """The auto backend's buckets per op for ``arch``: the user's (tuned) first, then the shipped ones; empty for
    an arch nobody measured. A bucket may bound n from below with ``min_n`` (the tune command's are exact in n)."""
    table: dict[str, tuple[dict[str, Any], ...]] = {}
    for source, data in (("shipped", _read(resources.files(__name__).joinpath("auto", f"{arch}.json"))),
                         ("tuned", _read(cache_dir() / "auto" / f"{arch}.json"))):
        for op, buckets in data.items():
            if not op.startswith("_"):  # tuned buckets go first; the shipped ones still cover the rest
                table[op] = (*({**bucket, "source": source} for bucket in buckets), *table.get(op, ()))
    return table


_reload_hooks: list[Callable[[], None]] = []


def on_reload(hook: Callable[[], None]) -> None:
    """Call ``hook`` whenever the tables are re-read (the dispatcher forgets the routes it chose from them)."""
    _reload_hooks.append(hook)


def reload() -> None:
    """Forget the tables read so far (after the tune command wrote new ones in this process)."""
    import sys

    helion_table.cache_clear()
    auto_table.cache_clear()
    for hook in _reload_hooks:
        hook()
    clear_memos()
    helion_runner = sys.modules.get("hkernels.ops._helion")
    if helion_runner is not None:  # configs chosen and kernels compiled from the old tables
        helion_runner._config.cache_clear()
        helion_runner._compiled.clear()
        helion_runner._replays.clear()


# ------------------------------------------------------------------------------ the auto table's bucket of a call


def shape_key(tensors: tuple[torch.Tensor, ...]) -> tuple[int, int]:
    """(rows, n) of a call as the auto table buckets it: the last dim of its first tensor of 2 or more dims (of its
    first tensor when none has 2) and that tensor's other elements. A loss's backward passes its per-row factors
    [T] before the gradient [T, V]: it is bucketed by [T, V], as its forward is, not by rows of T elements."""
    t = routed_tensor(tensors)
    n = t.shape[-1] if t.dim() else 1
    rows = t.numel() // n if n else 0
    # (a symbolic row count: the buckets for any number of rows, with no guard on it)
    return (rows if type(rows) is int else sys.maxsize), n


def routed_tensor(tensors: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The first tensor of 2 or more dims (the first tensor when none has 2): what a call is bucketed by."""
    for t in tensors:
        if t.dim() >= 2:
            return t
    return tensors[0]


def auto_bucket(op: str, tensors: tuple[torch.Tensor, ...], fn: str | None = None) -> tuple[str, dict[str, Any]] | None:
    """(arch, the auto-table bucket covering this call) or None (CPU tensors, or nothing measured). A table may
    give one of an op's functions buckets of its own (key ``"<op>:<fn>"``, e.g. attention's forward, measured
    alone, where the op's buckets sum forward and forward+backward); the user's tuned buckets still come first."""
    t = tensors[0]
    if t.is_cuda:
        arch = cuda_arch(t.device)
    elif _interpret.enabled():
        arch = "interpret"  # nothing shipped; a user table there lets the tests exercise this path on a CPU
    else:
        return None
    table = auto_table(arch)
    buckets = table.get(op, ())
    own = table.get(f"{op}:{fn}", ()) if fn is not None else ()
    if own:
        buckets = tuple(b for source in ("tuned", "shipped") for b in (*own, *buckets) if b["source"] == source)
    if not buckets:
        return None
    rows, n = shape_key(tensors)
    for bucket in buckets:
        if (bucket["max_rows"] is None or rows <= bucket["max_rows"]) and (
                bucket["max_n"] is None or n <= bucket["max_n"]) and n >= bucket.get("min_n", 0):
            return arch, bucket
    return None
