"""What a call asks for: the ``use_backend`` scopes and ``HKERNELS_BACKEND``, resolved per op.

Strongest first:
  1. ``with hkernels.use_backend(...)`` scopes, innermost first (a context variable: per thread, per task);
  2. ``HKERNELS_BACKEND``: ``auto`` | ``helion`` | ``triton`` | ``torch``, optionally with per-op overrides, e.g.
     ``HKERNELS_BACKEND=helion,softmax=triton``; read at call time, parsed again only when its text changes;
  3. ``auto``.
A call pays two dict lookups for it (:func:`requested`); what the request resolves to is the dispatcher's
(``hkernels/dispatch.py``).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from hkernels import registry

REQUESTS: tuple[str, ...] = ("auto", *registry.BACKENDS)


def ops() -> list[str]:
    """Names of every op hkernels provides."""
    return sorted(registry.OPS)


def check_op(op: str) -> None:
    if op not in registry.OPS:
        raise ValueError(f"hkernels: unknown op {op!r}; ops are: {', '.join(ops())}")


def check_request(value: str, where: str) -> str:
    if value not in REQUESTS:
        raise ValueError(f"hkernels: unknown backend {value!r} in {where}; valid backends are: {', '.join(REQUESTS)}")
    return value


@dataclass(frozen=True)
class _Layer:
    default: str | None
    per_op: tuple[tuple[str, str], ...]


class _Scope:
    """The ``use_backend`` layers in effect, innermost last, with what they resolve to per ``HKERNELS_BACKEND``
    text (remembered: a call pays two dict lookups, not a parse)."""

    __slots__ = ("layers", "resolved")

    def __init__(self, layers: tuple[_Layer, ...]) -> None:
        self.layers = layers
        self.resolved: dict[bytes | str | None, dict[str, str]] = {}

    def resolve(self, env: bytes | str | None) -> dict[str, str]:
        layers = self.layers
        if env:
            text = env.decode() if isinstance(env, bytes) else env
            layers = (_parse_env(text), *layers)
        out = {}
        for op in registry.OPS:
            out[op] = "auto"
            for layer in reversed(layers):
                choice = dict(layer.per_op).get(op, layer.default)
                if choice is not None:
                    out[op] = choice
                    break
        if len(self.resolved) > 64:  # a process that keeps rewriting the variable
            self.resolved.clear()
        self.resolved[env] = out
        return out


_ROOT = _Scope(())
_SCOPES: dict[tuple[_Layer, ...], _Scope] = {(): _ROOT}


def _scope(layers: tuple[_Layer, ...]) -> _Scope:
    """The scope of these layers: one object per distinct stack, so that entering the same scope again (a scope
    per call) finds what it resolved to already."""
    found = _SCOPES.get(layers)
    if found is None:
        if len(_SCOPES) > 256:
            _SCOPES.clear()
            _SCOPES[()] = _ROOT
        found = _SCOPES[layers] = _Scope(layers)
    return found
_SCOPE: contextvars.ContextVar[_Scope] = contextvars.ContextVar("hkernels_backend_scope", default=_ROOT)
_ENV = "HKERNELS_BACKEND"
try:  # the environment's own mapping: one dict lookup instead of os.environ's encode/decode per read
    _environ_data: dict[Any, Any] = os.environ._data  # type: ignore[attr-defined]
    _env_key: Any = os.environ.encodekey(_ENV)  # type: ignore[attr-defined]
except AttributeError:  # pragma: no cover (an os.environ without them)
    _environ_data, _env_key = None, None  # type: ignore[assignment]


def _env_text() -> bytes | str | None:
    if _environ_data is not None:
        return _environ_data.get(_env_key)
    return os.environ.get(_ENV)  # pragma: no cover


def env_key(name: str) -> Any:
    """The key :func:`env_value` reads ``name`` by."""
    return os.environ.encodekey(name) if _environ_data is not None else name  # type: ignore[attr-defined]


def env_value(key: Any) -> bytes | str | None:
    """The environment's value now of the variable of ``key`` (from :func:`env_key`): one dict lookup."""
    if _environ_data is not None:
        return _environ_data.get(key)
    return os.environ.get(key)  # pragma: no cover


@functools.lru_cache(maxsize=64)
def _parse_env(text: str) -> _Layer:
    default: str | None = None
    per_op: dict[str, str] = {}
    for raw in text.split(","):
        item = raw.strip()
        if not item:
            continue
        if "=" in item:
            op, _, value = (s.strip() for s in item.partition("="))
            check_op(op)
            value = check_request(value.lower(), f"HKERNELS_BACKEND={text!r}")
            if per_op.get(op, value) != value:
                raise ValueError(f"hkernels: HKERNELS_BACKEND={text!r} asks for two backends for {op} "
                                 f"({per_op[op]} and {value}); give one")
            per_op[op] = value
        else:
            value = check_request(item.lower(), f"HKERNELS_BACKEND={text!r}")
            if default is not None and default != value:
                raise ValueError(f"hkernels: HKERNELS_BACKEND={text!r} names two default backends ({default} and "
                                 f"{value}); give one, and per-op choices as op=backend (e.g. helion,softmax=triton)")
            default = value
    return _Layer(default, tuple(per_op.items()))


def requested(op: str) -> str:
    """What the current scope and ``HKERNELS_BACKEND`` ask for ``op``: auto, helion, triton or torch."""
    scope = _SCOPE.get()
    env = _env_text()
    found = scope.resolved.get(env)
    if found is None:
        found = scope.resolve(env)
    return found[op]


@contextlib.contextmanager
def use_backend(default: str | None = None, /, **per_op: str) -> Iterator[None]:
    """Run the enclosed calls on a backend: ``use_backend("triton")``, ``use_backend(softmax="torch")``.

    Beats ``HKERNELS_BACKEND``; an inner scope beats an outer one; scopes are per thread (context variables).
    """
    if default is not None:
        check_request(default, "use_backend()")
    for op, value in per_op.items():
        check_op(op)
        check_request(value, f"use_backend({op}=...)")
    token = _SCOPE.set(_scope((*_SCOPE.get().layers, _Layer(default, tuple(per_op.items())))))
    try:
        yield
    finally:
        _SCOPE.reset(token)
