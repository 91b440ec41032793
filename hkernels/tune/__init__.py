"""``python -m hkernels.tune``: tune hkernels on this GPU (see :mod:`hkernels.tune.command`).

Modules: ``command`` (the command line), ``helion_configs`` (step 1: Helion's autotuner), ``triton_settings``
(step 2: Triton launch settings), ``auto`` (step 3: the ``auto`` backend's buckets), ``cases`` (each op's inputs
and call), ``timing`` (the timers, shared with ``python -m bench``), ``tables`` (the JSON files).
``import hkernels`` imports none of them.
"""

from __future__ import annotations


def say(text: str) -> None:
    """A progress line on stdout, at once."""
    print(text, flush=True)


def main(argv: list[str] | None = None) -> int:
    """``python -m hkernels.tune`` with ``argv`` (default: the process's arguments)."""
    from hkernels.tune.command import main as run

    return run(argv)
