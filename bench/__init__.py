"""Comparative benchmarks: ``python -m bench``."""
