"""Benchmarks (not tests): run one with ``python -m bench.<name>``."""
