"""Pieces of the serving benchmark (scripts/bench_serving.py): the systems under test (the
in-process baseline server, the cluster, the HTTP frontend), workloads, the runner, metrics, the
targets and the report, and the tiny random-weight model tool."""
