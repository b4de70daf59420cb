"""Pieces of the serving benchmark (scripts/bench_serving.py): workloads, the in-process
baseline server, the systems under test, the runner, metrics and the report."""
