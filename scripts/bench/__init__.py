"""Pieces of the serving benchmark (scripts/bench_serving.py): workloads, the in-process
baseline server, the cluster target, the runner, metrics and the report."""
