"""The benchmark tool: ``python -m scripts.bench <workload> [options]`` (docs/benchmarks.md)."""
