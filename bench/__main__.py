"""``python -m bench <command> [options]``: hkernels' benchmarks and the tools around them.

With no command, or an option first (``python -m bench --quick``), it runs the benchmark (``run``). torch.compile's
on-disk caches go to a directory of this tree of hkernels unless ``TORCHINDUCTOR_CACHE_DIR`` is set
(``bench.cli.keyed_compile_cache``).
``python -m bench <command> --help`` lists a command's options.
"""

from __future__ import annotations

import importlib
import sys

# command -> (module with main(argv) -> exit status, one line for the command list)
COMMANDS: dict[str, tuple[str, str]] = {
    "run": ("bench.run", "the benchmark: time and check every op x shape x mode x backend (the default command)"),
    "compare": ("bench.compare", "what got slower or faster between two results.json files, beyond their noise"),
    "train": ("bench.train", "whole training steps of a Llama-style decoder: eager, hkernels, torch.compile, Liger"),
    "sweep": ("bench.sweep", "time candidate launch settings of the norm and softmax kernels"),
    "sweep-llm": ("bench.sweep_llm", "time candidate launch settings of the loss, matmul and attention kernels"),
    "latency": ("bench.latency", "per-call latency (or GPU time) with the backends interleaved round by round"),
    "first-call": ("bench.first_call", "how long the first call of each op takes in a fresh process (compiling)"),
    "auto-table": ("bench.auto_table", "the auto backend's table from measured results files"),
    "profile-train": ("bench.profile_train", "where a training step spends its time, eager against hkernels"),
    "autocast": ("bench.autocast", "each op under torch.autocast against the same op on 16-bit inputs, both times"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [
        "usage: python -m bench <command> [options]",
        "       python -m bench [run options]   (no command: run)",
        "",
        "hkernels' benchmarks and the tools around them.",
        "",
        "commands:",
        *(f"  {name:<{width}}  {line}" for name, (_, line) in COMMANDS.items()),
        "",
        "python -m bench <command> --help lists a command's options.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] in (["-h"], ["--help"], ["help"]):
        print(usage())
        return 0
    if not argv or argv[0].startswith("-"):
        command, rest = "run", argv
    elif argv[0] in COMMANDS:
        command, rest = argv[0], argv[1:]
    else:
        print(f"python -m bench: unknown command {argv[0]!r}\n\n{usage()}", file=sys.stderr)
        return 2
    from bench import cli

    cli.keyed_compile_cache()  # (before any compile: a graph compiled with another tree's kernels is not found)
    module = importlib.import_module(COMMANDS[command][0])
    return module.main(rest)


if __name__ == "__main__":
    sys.exit(main())
