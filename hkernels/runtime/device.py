"""What the host knows about the device, asked once: multiprocessors, arch, the user cache directory; the host's
integer helpers; and the memos of launch settings, cleared together when the tables change."""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import torch


def cdiv(a: int, b: int) -> int:
    """⌈a / b⌉ on the host. (``triton.cdiv`` and ``triton.next_power_of_2`` are constexpr functions: ~1-3 µs a call
    from Python, and a launch computes a dozen of them.)"""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two ≥ n (1 for n ≤ 1), on the host."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def cache_dir() -> Path:
    """The user cache the tune command writes to: ``HKERNELS_CACHE_DIR``, else ``$XDG_CACHE_HOME/hkernels``, else
    ``~/.cache/hkernels`` (``hkernels.configs`` reads it through here)."""
    explicit = os.environ.get("HKERNELS_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "hkernels"


@functools.lru_cache(maxsize=8)
def _cuda_arch(index: int) -> str:
    major, minor = torch.cuda.get_device_capability(index)
    return f"sm{major}{minor}"


def cuda_arch(device: torch.device) -> str:
    """``sm<major><minor>`` of a CUDA device."""
    return _cuda_arch(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=8)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Multiprocessors of ``device`` (the one place that asks CUDA); a small stand-in on CPU (interpret mode),
    where it only shapes grids."""
    if device.type != "cuda":
        return 4
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


# Host-side memos of launch settings (a decode-size call's host work is what its caller waits for): cleared together
# by hkernels.configs.reload when the tables change.
_MEMOS: list[Any] = []


def memo(maxsize: int) -> Any:
    """``functools.lru_cache(maxsize)``, registered so that :func:`clear_memos` clears it."""
    def wrap(fn: Any) -> Any:
        cached = functools.lru_cache(maxsize=maxsize)(fn)
        _MEMOS.append(cached)
        return cached
    return wrap


def clear_memos() -> None:
    for cached in _MEMOS:
        cached.cache_clear()
