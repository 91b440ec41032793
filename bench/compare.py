"""python -m bench compare OLD.json NEW.json: what got slower or faster beyond the noise of the two runs.

Rows are matched by (op, shape, dtype, mode, backend). Times are first scaled by each run's own copy bandwidth
(the machines are shared: a run on a slower moment should not read as a regression of every kernel), then a
change counts when it exceeds the noise of both rows: the sum of their (p80 - p20) / median spreads, at least
--min-change. Exit status 1 when something regressed. Runs without timings (interpret mode on a CPU) are compared
by their checks instead: exit status 1 when a row that passed in OLD fails in NEW.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from bench import cli


def _rows(path: Path) -> tuple[dict[tuple, dict], float]:
    data = json.loads(path.read_text())
    copy = float(data.get("env", {}).get("copy_gbps") or 0) or 1.0
    rows = {}
    for r in data["rows"]:
        if r.get("ms") and not r.get("error"):
            rows[(r["op"], r["m"], r["n"], r.get("k", 0), r["dtype"], r["mode"], r["backend"])] = r
    return rows, copy


def _timed(path: Path) -> bool:
    return bool(json.loads(path.read_text()).get("env", {}).get("timed", True))


def _compare_checks(old_path: Path, new_path: Path) -> int:
    """Runs without timings: which rows pass (ran, error within tolerance) in each; 1 when one passed and fails."""
    from bench.harness import TOLERANCE

    def passed(path: Path) -> dict[tuple, bool]:
        rows = json.loads(path.read_text())["rows"]
        return {(r["op"], r["m"], r["n"], r.get("k", 0), r["dtype"], r["mode"], r["backend"]):
                not r.get("error") and r.get("max_err") is not None and r["max_err"] <= TOLERANCE[r["dtype"]]
                for r in rows}

    old, new = passed(old_path), passed(new_path)
    common = sorted(set(old) & set(new))
    broke = [k for k in common if old[k] and not new[k]]
    mended = [k for k in common if new[k] and not old[k]]
    print(f"runs without timings (interpret mode on a CPU): no times to compare; {len(common)} rows in both, "
          f"{sum(new[k] for k in common)} of them pass in {new_path}")
    only_old, only_new = len(set(old) - set(new)), len(set(new) - set(old))
    if only_old or only_new:
        print(f"{only_old} rows only in {old_path}, {only_new} only in {new_path}")
    print(f"\nrows that passed and now fail: {len(broke)}")
    for k in broke:
        print(f"  fails   {' '.join(map(str, k))}")
    print(f"rows that failed and now pass: {len(mended)}")
    for k in mended:
        print(f"  passes  {' '.join(map(str, k))}")
    return 1 if broke else 0


def _graph(row: dict) -> bool:
    return "graph" in str(row.get("timing", "graph"))


def main(argv: list[str] | None = None) -> int:
    p = cli.parser("compare", __doc__)
    p.add_argument("old", type=Path, help="the earlier run's results.json")
    p.add_argument("new", type=Path, help="the later run's results.json")
    p.add_argument("--min-change", type=float, default=0.03, help="smallest relative change reported (0.03 = 3%%)")
    p.add_argument("--raw", action="store_true", help="compare raw times, not scaled by each run's copy bandwidth")
    args = p.parse_args(argv)
    for path in (args.old, args.new):
        if not path.is_file():
            p.error(f"no such results file: {path} (python -m bench writes results.json in its --out folder)")
    if not all(_timed(path) for path in (args.old, args.new)):
        return _compare_checks(args.old, args.new)
    old, old_copy = _rows(args.old)
    new, new_copy = _rows(args.new)
    scale = 1.0 if args.raw else new_copy / old_copy  # a faster machine moment would make new times look better
    # A per-call latency (--latency, or a failed graph capture) against a GPU time would read as a huge change.
    common = sorted(k for k in set(old) & set(new) if _graph(old[k]) == _graph(new[k]))
    mixed = len(set(old) & set(new)) - len(common)
    worse, better = [], []
    for key in common:
        o, n = old[key], new[key]
        ratio = n["ms"] * scale / o["ms"]  # > 1: slower
        noise = max(args.min_change, (o.get("spread") or 0) + (n.get("spread") or 0))
        shape = f"{key[1]}x{key[2]}" + (f"x{key[3]}" if key[3] else "")
        line = (
            f"{key[0]} {shape} {key[4]} {key[5]} {key[6]}: {o['ms']:.4f} -> {n['ms']:.4f} ms "
            f"({(ratio - 1) * 100:+.1f}% after scaling, noise ±{noise * 100:.1f}%)"
        )
        if ratio > 1 + noise:
            worse.append((ratio, line))
        elif ratio < 1 / (1 + noise):
            better.append((ratio, line))
    print(f"{len(common)} rows in both runs; copy {old_copy:.0f} -> {new_copy:.0f} GB/s (times scaled by {scale:.3f})")
    if mixed:
        print(f"{mixed} rows skipped: GPU time (graph) in one run, per-call time in the other")
    only_old, only_new = len(set(old) - set(new)), len(set(new) - set(old))
    if only_old or only_new:
        print(f"{only_old} rows only in {args.old}, {only_new} only in {args.new}")
    print(f"\nregressions beyond noise: {len(worse)}")
    for _, line in sorted(worse, reverse=True):
        print(f"  slower  {line}")
    print(f"improvements beyond noise: {len(better)}")
    for _, line in sorted(better):
        print(f"  faster  {line}")
    return 1 if worse else 0


if __name__ == "__main__":
    sys.exit(main())
