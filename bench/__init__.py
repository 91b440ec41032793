"""hkernels' benchmarks and the tools around them: ``python -m bench <command>`` (``python -m bench --help``)."""
