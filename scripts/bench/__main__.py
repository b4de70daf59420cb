"""``python -m scripts.bench <workload> [options]``: the benchmark tool's one entry point."""

from __future__ import annotations

import importlib
import sys

# name -> (module, what it measures). Each module has main(argv) and a --help of its own.
WORKLOADS = {
    "serving": (
        "scripts.bench.serving",
        "the cluster (through the SDK) against the in-process baseline: submit path, "
        "TTFT and its parts, throughput; rate sweeps; --fast-engine",
    ),
    "engine": (
        "scripts.bench.engine",
        "the engine alone: core (against transformers), prefix cache, mixed (chunked prefill), "
        "speculative decoding",
    ),
    "peer": (
        "scripts.bench.peer",
        "served against llama.cpp's llama-server: serve (closed loop), hops (one stream hop by "
        "hop), startup (to ready and to the first token)",
    ),
    "data-parallel": (
        "scripts.bench.data_parallel",
        "engine replicas routed by the tokenizer workers: cache_aware, round_robin, "
        "least_loaded and one replica on multi-turn chats",
    ),
    "disaggregation": (
        "scripts.bench.disaggregation",
        "prefill/decode engines against one engine and 2 replicas: decoding streams' ITL beside "
        "long prompts; the KV transfer against memcpy",
    ),
    "edges": (
        "scripts.bench.edges",
        "an unrelated stream beside long contexts, 7.2 MB prompts or hostile schemas",
    ),
}


def usage() -> str:
    lines = ["usage: python -m scripts.bench WORKLOAD [options]   (WORKLOAD --help for its own)"]
    lines += ["", "workloads:"]
    lines += [f"  {name:14s} {what}" for name, (_, what) in WORKLOADS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in WORKLOADS:
        print(f"unknown workload {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    importlib.import_module(WORKLOADS[name][0]).main(rest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
