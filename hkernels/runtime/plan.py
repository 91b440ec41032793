"""Plans: what the first call of a signature decided, replayed by every later call of that signature.

A call of an op makes the same decisions every time it sees the same signature (dtypes, shapes, strides, pointer
alignment, devices, scalar arguments, grad mode): which backend runs it, which compiled Helion function, which
compiled Triton kernel for each launch. The first call of a signature *records* each decision, in order, as a
(tag, value) slot of a :class:`Plan`; later calls *replay* the plan: each place that would decide asks
:func:`recall` for the next slot instead. A replayed call still runs its Python (allocations, grids), but none
of the lookups, binding or specialisation keys that the first call paid for.

The caller that owns a plan must key it by everything its decisions read. A slot's tag (the kernel, the function
name, the custom op) is checked on replay, so a plan that was keyed too coarsely fails loudly instead of
launching another call's kernel. The cursor (which plan, which slot) is per thread: autograd runs backward on its
own threads, and two threads may replay one plan at once.

Torch-free and Triton-free: importable by every layer (the dispatcher, Helion's runner, the Triton launcher).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any


class PlanDivergedError(RuntimeError):
    """A replayed call asked for a decision its plan did not record: the plan's key missed something it depends
    on. Never expected; raised rather than launching what another call decided."""


class Plan:
    """The recorded decisions of one call signature: ``slots`` is None until its first call has finished. ``fast``:
    optionally, a function its owner built from them that does the whole call directly (no replay needed)."""

    __slots__ = ("fast", "slots")

    def __init__(self) -> None:
        self.slots: list[tuple[Any, Any]] | None = None
        self.fast: Callable[..., Any] | None = None

    def find(self, tag: Any) -> Any:
        """The value recorded for ``tag`` (its first slot), or None."""
        for recorded, value in self.slots or ():
            if recorded == tag:
                return value
        return None


class _Cursor(threading.local):
    slots: list[tuple[Any, Any]] | None = None  # the plan being replayed or recorded on this thread
    i = 0  # next slot to replay
    recording = False


_cursor = _Cursor()

# Above 0 while a custom op's body is traced into a compiled graph (hkernels' decomposition under torch.compile,
# ``hkernels/functional/_base.py``): every launch is then recorded as Triton's kernel higher-order op
# (``hkernels/runtime/launch.py``), which Inductor's generated code launches itself, and no plan is recorded or
# replayed (a traced call's shapes may be symbolic).
TRACING = 0


@contextlib.contextmanager
def tracing() -> Iterator[None]:
    """Launches inside the scope are traced into the graph (``torch.library.wrap_triton``), not run."""
    global TRACING
    TRACING += 1
    try:
        yield
    finally:
        TRACING -= 1

# False while a tool needs every decision made afresh (the tune command records what Helion launches).
enabled = True


def recall(tag: Any) -> Any:
    """While replaying: the value recorded for the next slot, whose tag must be ``tag``. Otherwise None (the
    caller decides, then calls :func:`keep`)."""
    c = _cursor
    slots = c.slots
    if slots is None or c.recording:
        return None
    i = c.i
    c.i = i + 1
    try:
        recorded, value = slots[i]
    except IndexError:
        recorded, value = None, None
    if recorded is not tag and recorded != tag:
        raise PlanDivergedError(f"hkernels: a replayed call asked for {tag!r} where its plan recorded {recorded!r}")
    return value


def keep(tag: Any, value: Any) -> None:
    """While recording: append (tag, value) as the next slot. Otherwise nothing."""
    c = _cursor
    if c.recording:
        c.slots.append((tag, value))  # type: ignore[union-attr]


def reserve(tag: Any) -> int:
    """While recording: append a slot for ``tag`` whose value is known only after the work it decides has run (and
    recorded slots of its own): :func:`fill` sets it, :func:`rewind` drops what a failed attempt recorded after it.
    Returns the slot's index (-1 when not recording)."""
    c = _cursor
    if not c.recording:
        return -1
    c.slots.append((tag, None))  # type: ignore[union-attr]
    return len(c.slots) - 1  # type: ignore[arg-type]


def rewind(index: int) -> None:
    """Drop every slot recorded after the reserved slot ``index``."""
    if index >= 0:
        del _cursor.slots[index + 1:]  # type: ignore[index]


def fill(index: int, value: Any) -> None:
    if index >= 0:
        slots = _cursor.slots
        slots[index] = (slots[index][0], value)  # type: ignore[index]


def active() -> bool:
    """A plan is being recorded or replayed on this thread."""
    return _cursor.slots is not None


def run(plan: Plan, fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
    """``fn(*args)``, replaying ``plan`` (or recording it, on its first call). A call that raises records
    nothing. Nests: an op called while another's plan runs gets its own plan."""
    c = _cursor
    saved = c.slots, c.i, c.recording
    slots = plan.slots
    if slots is not None:
        c.slots, c.i, c.recording = slots, 0, False
        try:
            return fn(*args)
        finally:
            c.slots, c.i, c.recording = saved
    recorded: list[tuple[Any, Any]] = []
    c.slots, c.i, c.recording = recorded, 0, True
    try:
        out = fn(*args)
    finally:
        c.slots, c.i, c.recording = saved
    plan.slots = recorded  # published whole: a thread replaying it never sees a half-recorded list
    return out


def outside(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` with no plan in effect on this thread (for work whose decisions are not the plan's)."""
    c = _cursor
    saved = c.slots, c.i, c.recording
    c.slots, c.i, c.recording = None, 0, False
    try:
        return fn(*args)
    finally:
        c.slots, c.i, c.recording = saved


# ---------------------------------------------------------------- binders: a backend function set up per signature


def bind(module: ModuleType, fn: str, args: tuple[Any, ...], plain: bool = False) -> Callable[..., Any] | None:
    """The backend function's binding for these arguments, or None (no binder: a replaced function, such as a test's
    spy, has none; or binding failed, which the unbound function does not). ``plain``: a backend whose functions
    keep nothing per signature (torch): the function is its own binding, so the one-step paths take it too."""
    function = getattr(module, fn)
    binder = getattr(function, "bind", None)
    if binder is None:
        if not plain:
            return None
        binder = lambda *_: function
    try:
        bound = binder(*args)
    except Exception:  # the call itself ran: keep running it unbound
        return None
    try:
        bound.hk_module = module  # which backend it is of (a caller may bind the same function with other options)
    except AttributeError:
        return None
    return bound


def rebind(bound: Callable[..., Any], fn: str, *args: Any, **options: Any) -> Callable[..., Any] | None:
    """``fn`` of the backend ``bound`` (a bound function of the dispatcher's ``run``) bound again for ``args`` with
    ``options`` (e.g. ``stats=False``), or None where its binder does not take them."""
    module = getattr(bound, "hk_module", None)
    binder = getattr(getattr(module, fn, None), "bind", None)
    if binder is None:
        return None
    try:
        return binder(*args, **options)
    except Exception:
        return None
