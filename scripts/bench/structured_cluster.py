"""The cluster-level structured-output benchmarks of scripts/bench_structured.py: time to first
token with a cached grammar, and the inter-token latency of unconstrained requests while new
schemas are being compiled. A real cluster on the model, driven through the SDK."""

from __future__ import annotations

import time

import numpy as np

from ipc.client import Client
from procs.launch_cluster import launch_cluster
from scripts.bench.grammar_specs import NESTED_SCHEMA, large_schema


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "bench", "schema": schema}}


def ask(k: int, what: str = "as a JSON object") -> list[dict]:
    # Distinct prompts of one length: no request is served from another's prefix cache blocks.
    return [{"role": "user", "content": f"Describe the fictional person number {1000 + k} {what}."}]


def _cluster(args):
    return launch_cluster(str(args.model), tokenizer_workers=1, max_model_len=2048)


def _summary(ms: np.ndarray) -> str:
    return (
        f"p50 {np.percentile(ms, 50):8.1f}  p90 {np.percentile(ms, 90):8.1f}  "
        f"p99 {np.percentile(ms, 99):8.1f}  mean {ms.mean():8.1f} ms"
    )


def run_ttft(args) -> None:
    """One request at a time, alternating plain and constrained (which goes first alternates
    too); the constrained one's grammar is cached in the tokenizer and in the engine."""
    fmt = schema_format(NESTED_SCHEMA)
    ttft: dict[str, list[float]] = {"plain": [], "cached grammar": []}
    with _cluster(args) as cluster, Client(cluster.client_addr, deadline_s=600) as client:
        client.submit(messages=ask(0), max_tokens=4, temperature=0).result()
        client.submit(
            messages=ask(1), max_tokens=4, temperature=0, response_format=fmt
        ).result()  # compiled, built, cached
        k = 2
        for i in range(args.requests):
            modes = list(ttft) if i % 2 == 0 else list(reversed(ttft))
            for mode in modes:
                extra = {"response_format": fmt} if mode != "plain" else {}
                result = client.submit(
                    messages=ask(k), max_tokens=2, temperature=0, **extra
                ).result()
                k += 1
                assert result.ttft_s is not None
                ttft[mode].append(result.ttft_s)
    print(f"\nttft: {args.requests} requests each, one at a time, interleaved")
    for mode, values in ttft.items():
        print(f"  {mode:15s} {_summary(np.array(values) * 1e3)}")
    plain, cached = (np.percentile(ttft[m], 50) for m in ttft)
    print(
        f"  cached grammar / plain, p50: {cached / plain:.3f}x  (mean "
        f"{np.mean(ttft['cached grammar']) / np.mean(ttft['plain']):.3f}x)"
    )


def run_itl(args) -> None:
    """--streams unconstrained requests decode; meanwhile a request arrives every
    --arrival-interval-ms, with a new large schema (never cached: compiled in the tokenizer,
    built on the engine's grammar thread) or, in the baseline, the same request without one."""
    gaps: dict[str, list[float]] = {"no schema": [], "new schemas": []}
    arrivals = {mode: 0 for mode in gaps}
    interval = args.arrival_interval_ms / 1000
    variant = 0
    with _cluster(args) as cluster, Client(cluster.client_addr, deadline_s=600) as client:
        client.submit(messages=ask(0), max_tokens=4, temperature=0).result()
        client.submit(
            messages=ask(1),
            max_tokens=1,
            temperature=0,
            response_format=schema_format(large_schema(args.schema_fields)),
        ).result()  # imports and first compile, warm
        k = 2
        for rep in range(args.repeats):
            for mode in list(gaps) if rep % 2 == 0 else list(reversed(gaps)):
                streams = [
                    client.submit(
                        messages=ask(k + i, "in detail"),
                        temperature=0,
                        max_tokens=args.stream_tokens,
                        ignore_eos=True,
                    )
                    for i in range(args.streams)
                ]
                k += args.streams
                for h in streams:  # every stream is decoding before the arrivals start
                    next(iter(h.stream()))
                t_start, extra = time.monotonic(), []
                while not all(h.done for h in streams):
                    options = {}
                    if mode == "new schemas":
                        variant += 1
                        options["response_format"] = schema_format(
                            {**large_schema(args.schema_fields), "title": f"variant {variant}"}
                        )
                    extra.append(
                        client.submit(messages=ask(k), max_tokens=1, temperature=0, **options)
                    )
                    k += 1
                    time.sleep(interval)
                for h in streams:
                    result = h.result()
                    gaps[mode].extend(
                        g
                        for g, t in zip(result.inter_token_s, result.t_received[1:])
                        if t >= t_start
                    )
                for h in extra:
                    h.result()
                arrivals[mode] += len(extra)
    print(
        f"\nitl: {args.streams} unconstrained streams of {args.stream_tokens} tokens, a "
        f"request every {args.arrival_interval_ms:g} ms, {args.repeats} runs per mode, "
        f"interleaved"
    )
    for mode, values in gaps.items():
        print(f"  {mode:12s} ({arrivals[mode]:3d} arrivals) {_summary(np.array(values) * 1e3)}")
    p99 = {mode: np.percentile(values, 99) for mode, values in gaps.items()}
    p50 = {mode: np.percentile(values, 50) for mode, values in gaps.items()}
    print(
        f"  new schemas / no schema: p99 {p99['new schemas'] / p99['no schema']:.3f}x, "
        f"p50 {p50['new schemas'] / p50['no schema']:.3f}x"
    )
