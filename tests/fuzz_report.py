"""The fuzz of tests/test_fuzz.py as a report: every failing example of one op and backend, not only the first.

    python -m tests.fuzz_report record OP BACKEND N OUT.jsonl [DEVICE [SEED]]   # N examples; a JSON line each
    python -m tests.fuzz_report replay OP BACKEND 'CHOICES' [DEVICE]      # one recorded example again

pytest stops a hypothesis test at its first failure and then shrinks it, and on the GPU a CUDA fault ends the
process: a GPU run with minutes to spend learns one failure per op that way. Here each example's drawn
choices, error and last frames are written as it finishes (a time limit keeps what was written), and a
recorded example replays from its choices on any device (``cpu`` with HKERNELS_INTERPRET=1).
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from typing import Any

import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from tests.test_fuzz import DTYPES, Draw, run_case


class _Logged:
    """hypothesis' ``data``, with every draw written down by label."""

    def __init__(self, data: Any) -> None:
        self.data, self.choices = data, []

    def draw(self, strategy: Any, label: str | None = None) -> Any:
        v = self.data.draw(strategy, label=label)
        self.choices.append([label, v if isinstance(v, (int, float, str, bool, type(None))) else str(v)])
        return v


class _Replay:
    """Recorded choices handed back in order (the strategies are not consulted)."""

    def __init__(self, choices: list[list[Any]]) -> None:
        self.choices = list(choices)

    def draw(self, strategy: Any, label: str | None = None) -> Any:
        recorded, v = self.choices.pop(0)
        if recorded != label:
            raise ValueError(f"the recorded draw is {recorded!r}, the maker asks for {label!r}: another version?")
        return getattr(torch, v[6:]) if isinstance(v, str) and v.startswith("torch.") else v


def record(op: str, backend: str, n: int, out: str, device: torch.device, seed: int | None = None) -> dict[str, int]:
    """Without ``seed`` the examples are hypothesis' derandomized ones: the same N inputs on every run (of one
    hypothesis version), as in the test; a seed draws another N."""
    counts = {"examples": 0, "failed": 0}
    t0 = time.time()
    with open(out, "w", buffering=1) as log:

        @settings(max_examples=n, derandomize=seed is None, database=None, deadline=None,
                  suppress_health_check=list(HealthCheck), phases=[Phase.generate])
        @given(data=st.data())
        def fuzz(data: Any) -> None:
            logged = _Logged(data)
            d = Draw(logged, logged.draw(st.sampled_from(DTYPES), label="dtype"))
            counts["examples"] += 1
            row: dict[str, Any] = {"i": counts["examples"], "ok": None}  # None: hypothesis stopped the example
            try:
                run_case(op, backend, d, device)
                row["ok"] = True
            except Exception as e:
                counts["failed"] += 1
                row = {**row, "ok": False, "error": f"{type(e).__name__}: {e}"[:1500],
                       "tb": traceback.format_exc().splitlines()[-14:]}
                if "CUDA error" in str(e):  # the context is lost: later examples would only repeat it
                    raise
            finally:
                log.write(json.dumps({**row, "choices": logged.choices, "t": round(time.time() - t0, 1)}) + "\n")

        if seed is not None:
            fuzz = hypothesis_seed(seed)(fuzz)
        try:
            fuzz()
        except Exception as e:
            log.write(json.dumps({"stopped": f"{type(e).__name__}: {str(e)[:500]}"}) + "\n")
    return counts


def replay(op: str, backend: str, choices: list[list[Any]], device: torch.device) -> None:
    r = _Replay(choices)
    run_case(op, backend, Draw(r, r.draw(None, "dtype")), device)


def main(argv: list[str]) -> None:
    mode, op, backend = argv[:3]
    if mode == "record":
        device = torch.device(argv[5] if len(argv) > 5 else "cuda")
        seed = int(argv[6]) if len(argv) > 6 else None
        print(op, backend, record(op, backend, int(argv[3]), argv[4], device, seed))
    elif mode == "replay":
        replay(op, backend, json.loads(argv[3]), torch.device(argv[4] if len(argv) > 4 else "cuda"))
        print("passed:", op, backend)
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
