"""``python -m scripts.bench <workload> [options]``: the benchmark tool's one entry point."""

from __future__ import annotations

import importlib
import sys

# name -> (module, what it measures). Each module has main(argv) and a --help of its own.
WORKLOADS = {
    "serving": (
        "scripts.bench.serving",
        "the cluster against the in-process baseline and the HTTP frontend: submit path, "
        "TTFT and its parts, throughput; rate sweeps; --fast-engine (also `splitserve bench`)",
    ),
    "engine": (
        "scripts.bench.engine",
        "the engine alone: against transformers, prefix cache, chunked prefill, sampling, "
        "weight formats and kernels, the bandwidth bound, logprobs, llama.cpp's engine",
    ),
    "speculative": (
        "scripts.bench.speculative",
        "n-gram speculative decoding against plain decoding: summaries, code rewrites, chat; "
        "1 and 8 streams",
    ),
    "peer": (
        "scripts.bench.peer",
        "served against llama.cpp's llama-server: same GGUF, same HTTP client, same run",
    ),
    "hops": (
        "scripts.bench.hops",
        "one stream's time per hop: engine step -> detokenizer -> HTTP worker -> client, and a "
        "cached prompt's first token through every stage",
    ),
    "startup": (
        "scripts.bench.startup",
        "a launch from nothing to ready and to its first token, against llama-server's",
    ),
    "structured": (
        "scripts.bench.structured",
        "what constraining the output costs: batch decode, TTFT, other streams' ITL",
    ),
    "grammar": (
        "scripts.bench.grammar",
        "a grammar's own cost (compile, build, per-step mask), and llguidance against xgrammar",
    ),
    "data-parallel": (
        "scripts.bench.data_parallel",
        "engine replicas routed by the tokenizer workers: cache_aware, round_robin, "
        "least_loaded and one replica on multi-turn chats; the routing's own cost",
    ),
    "disaggregation": (
        "scripts.bench.disaggregation",
        "prefill/decode engines against one engine and 2 replicas: decoding streams' ITL beside "
        "long prompts; the KV transfer against memcpy",
    ),
    "serve-ray": (
        "scripts.bench.serve_ray",
        "the multi-turn chats through the Ray Serve ingress: our router against Ray's "
        "PrefixCacheAffinityRouter and power of two; the Serve path's TTFT overhead",
    ),
    "long-prompts": (
        "scripts.bench.long_prompts",
        "an unrelated stream's TTFT alone and beside 7.2 MB prompts (refused from their length)",
    ),
    "long-context": (
        "scripts.bench.long_context",
        "two long prompts arriving beside unrelated short streams: their TTFT and largest gap",
    ),
    "http-body": (
        "scripts.bench.http_body",
        "how long a frontend's event loop stalls while it reads and validates a large body",
    ),
}


def usage() -> str:
    lines = ["usage: python -m scripts.bench WORKLOAD [options]   (WORKLOAD --help for its own)"]
    lines += ["", "workloads:"]
    lines += [f"  {name:11s} {what}" for name, (_, what) in WORKLOADS.items()]
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
