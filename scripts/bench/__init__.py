"""The benchmark tool: ``python -m scripts.bench <workload> [options]`` (``--help`` on each).

Workloads: serving (the cluster against the in-process baseline and the HTTP frontend; rate
sweeps; the fast engine), engine (the engine alone against transformers, weight formats,
logprobs, and llama.cpp's engine), peer (served against llama.cpp's llama-server), structured
(what constraining output costs) and grammar (what a grammar costs alone, and the backends
compared). They share one options module, one statistics module, one HTTP client, one launcher
of systems under test and one A/B interleaver. ``tiny_model`` writes the small random-weight
model the tests and the fast engine use.
"""
