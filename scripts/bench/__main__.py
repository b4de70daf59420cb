"""``python -m scripts.bench <workload> [options]``: the benchmark tool's one entry point."""

from __future__ import annotations

import importlib
import sys

# name -> (module, what it measures). Each module has main(argv) and a --help of its own.
WORKLOADS = {
    "serving": ("scripts.bench.serving", "the cluster against the in-process baseline"),
    "engine": ("scripts.bench.engine", "the engine alone: core, prefix, mixed, speculative"),
    "peer": ("scripts.bench.peer", "served against llama.cpp: serve, hops, startup"),
    "data-parallel": ("scripts.bench.data_parallel", "engine replicas under each routing"),
    "disaggregation": ("scripts.bench.disaggregation", "prefill/decode engines, KV transfer"),
    "edges": ("scripts.bench.edges", "a stream beside long contexts, huge prompts, hostile ones"),
}


def usage() -> str:
    lines = ["usage: python -m scripts.bench WORKLOAD [options]   (WORKLOAD --help for its own)"]
    lines += ["", "workloads (what each measures, and every figure: docs/benchmarks.md):"]
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
