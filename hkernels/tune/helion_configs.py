"""Step 1 of the tune command: autotune the Helion kernels an op runs, keep a config only where it is faster.

Helion reads its settings when a kernel is defined, so this module sets the tuner's defaults before any kernel
module is imported (the tune command imports it first): ``HELION_AUTOTUNE_EFFORT`` quick, and precompilation off
unless ``HELION_AUTOTUNE_PRECOMPILE`` says otherwise (forked precompilation can outlive the timeout of the
autotuner's benchmark subprocesses).
"""

from __future__ import annotations

import datetime
import os
import time
from pathlib import Path
from typing import Any

import torch

import hkernels
from hkernels.tune import say, tables, timing
from hkernels.tune.cases import Case

# Before any Helion kernel is defined (``import hkernels`` defines none): Helion reads these then.
os.environ.setdefault("HELION_AUTOTUNE_PRECOMPILE", "")
os.environ.setdefault("HELION_AUTOTUNE_EFFORT", "quick")


def tune_helion(case: Case, arch: str, out: Path, budget_s: int | None = None) -> list[str]:
    """Autotune every Helion kernel the op runs at this shape; write a kernel's config where it beats the shipped
    one. Returns summary lines.

    The search starts from the shipped config (a seed of Helion's autotuner) and stops after ``budget_s`` seconds
    per kernel (Helion's own budget; None: the effort's whole search). The tuned and the shipped config are then
    timed against each other (GPU time, same inputs) and the tuned one is written only when it is at least 1%
    faster: a short or noisy search never leaves the user with a slower table than the one shipped.
    """
    import helion

    from hkernels.ops import _helion, _split

    with hkernels.use_backend("helion"), _helion.record() as launches:
        case.forward_backward()
    seen: dict[tuple[str, int], tuple[Any, tuple[Any, ...]]] = {}
    for kernel, args, n in launches:
        seen.setdefault((kernel.name, n), (kernel, args))
    lines = []
    for i, ((name, n), (kernel, args)) in enumerate(seen.items(), 1):
        if name in _split.KERNELS:
            # A split-row kernel: its programs wait for each other, so every launch must be cooperative and its
            # registers capped (hkernels/ops/_split.py); Helion's autotuner launches neither way and could hang.
            say(f"  helion {i}/{len(seen)}: {name}: a split-row kernel, not autotuned (its bucket's chunk, lag and "
                f"programs per SM are set by hand in its bucket)")
            lines.append(f"helion {name} n={n}: split-row kernel, not autotuned; shipped config kept")
            continue
        dtype = next(a.dtype for a in args if isinstance(a, torch.Tensor))
        device = next(a.device for a in args if isinstance(a, torch.Tensor))
        budget = f", budget {budget_s} s" if budget_s else ""
        say(f"  helion {i}/{len(seen)}: autotuning {name} at n={n} "
             f"({os.environ['HELION_AUTOTUNE_EFFORT']} effort{budget}, seeded with the shipped config)")
        bound = kernel.bind(tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args))  # see _helion
        shipped_bucket = _helion._bucket(arch, name, n, dtype)
        shipped = _helion._fit(helion.Config(**shipped_bucket["config"]), bound.config_spec.default_config())
        settings = kernel.settings
        saved = settings.autotune_seed_configs, settings.autotune_budget_seconds
        settings.autotune_seed_configs, settings.autotune_budget_seconds = [shipped], budget_s
        t0 = time.perf_counter()
        try:
            config = bound.autotune(args, force=True)
        except Exception as e:  # one kernel's failed search must not cost the others theirs; its table stays
            # (Helion raises NoConfigFound when none of its seeds and random configs works within the budget)
            why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            lines.append(f"helion {name} n={n}: search failed after {time.perf_counter() - t0:.0f} s ({why}); "
                         f"shipped config kept")
            say(f"  helion {i}/{len(seen)}: {name}: search failed ({why}); the shipped config stays")
            continue
        finally:
            settings.autotune_seed_configs, settings.autotune_budget_seconds = saved
        elapsed = time.perf_counter() - t0
        times = {}
        for label, cfg in (("shipped", shipped), ("tuned", config)):
            fn = bound.compile_config(cfg, allow_print=False)
            times[label] = timing.gpu_time_ms(lambda fn=fn, args=args: fn(*args), device)
        gain = times["shipped"] / times["tuned"]
        verdict = (f"{elapsed:.0f} s; shipped {times['shipped'] * 1e3:.1f} µs, tuned {times['tuned'] * 1e3:.1f} µs "
                   f"({gain:.3f}x)")
        if gain >= 1.01:
            bucket = {"min_n": n, "max_n": n, "dtypes": [str(dtype).removeprefix("torch.")],
                      "config": dict(config.config),
                      "tuned": f"{case.name}, {datetime.date.today()}, {elapsed:.0f} s, {gain:.3f}x the shipped"}
            # the host-side settings kept beside the config (programs per SM, a tile map's rows, ...)
            bucket.update({key: value for key, value in shipped_bucket.items()
                           if key not in ("min_n", "max_n", "dtypes", "config", "tuned")})
            tables.merge_buckets(out / "helion" / arch / f"{case.op}.json", name, bucket)
            lines.append(f"helion {name} n={n}: written, {verdict}: {config}")
            say(f"  helion {i}/{len(seen)}: {name}: {verdict}: written")
        else:
            lines.append(f"helion {name} n={n}: shipped config kept, {verdict}")
            say(f"  helion {i}/{len(seen)}: {name}: {verdict}: not faster, the shipped config stays")
    _helion.forget()
    return lines
