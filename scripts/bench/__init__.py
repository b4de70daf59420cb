"""The benchmark tool: ``python -m scripts.bench <workload> [options]`` (``--help`` on each).

Workloads: serving (the cluster against the in-process baseline; rate sweeps; the fast engine),
engine (the engine alone: core, prefix, mixed, speculative), peer (served against llama.cpp's
llama-server; hops and start-up as parts), data-parallel (replicas behind the routing) and edges
(legal but large work beside an unrelated stream). They share one options module, one statistics
module, one HTTP client, one report writer, one launcher of systems under test and one A/B
interleaver. The tests' tiny random model (tests/tiny_model.py) is the fast engine's model too.
"""
