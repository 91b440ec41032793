"""``python -m hkernels.tune``: see :mod:`hkernels.tune.command`."""

from hkernels.tune.command import main

if __name__ == "__main__":  # Helion's autotuner may start worker processes: keep the work under this guard
    raise SystemExit(main())
