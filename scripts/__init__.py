"""Tools run from the repository root as modules (not installed with the package): the benchmark
tool ``python -m scripts.bench <workload>``, and the set-up / test commands beside them."""
