"""Benchmarks and model tools. They live in a source checkout, not in the installed package: run
them from the repository root as modules, e.g. ``python -m scripts.bench_serving --help``."""
