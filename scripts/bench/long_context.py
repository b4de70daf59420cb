"""long-context: what two long prompts do to an unrelated stream (issue 38), through a cluster.

Two requests with --long-tokens prompts (max_tokens 4) arrive together; meanwhile an unrelated
request with a --short-tokens prompt streaming --stream-tokens tokens arrives every
--interval-s until both long ones have ended (at most --streams of them). Reported: the
unrelated streams' TTFT (p50, max) and their largest gap between two tokens, the long requests'
end-to-end time, and the load average. Prompts are random token ids, distinct per request and
per run (no prefix-cache hits).

    python -m scripts.bench long-context --max-model-len 8192 [--repeats 2]
"""

from __future__ import annotations

import os
import time

import numpy as np

from procs.model_store import resolve_model
from scripts.bench.options import add_shared, workload_parser
from scripts.bench.stats import describe_ms


def ids(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(3, 40000, size=n).tolist()


def one_run(client, args, rng: np.random.Generator) -> dict:
    long = [
        client.submit(prompt_token_ids=ids(rng, args.long_tokens), max_tokens=4, ignore_eos=True)
        for _ in range(2)
    ]
    t_start, streams = time.monotonic(), []
    while not all(h.done for h in long) and len(streams) < args.streams:
        streams.append(
            client.submit(
                prompt_token_ids=ids(rng, args.short_tokens),
                max_tokens=args.stream_tokens,
                ignore_eos=True,
                temperature=0,
            )
        )
        time.sleep(args.interval_s)
    results = [h.result() for h in streams]
    return {
        "ttft": [r.ttft_s for r in results],
        "gaps": [g for r in results for g in r.inter_token_s],
        "long_e2e": [h.result().t_received[-1] - t_start for h in long],
        "load": os.getloadavg()[0],
    }


def build_parser():
    p = workload_parser("long-context", __doc__)
    add_shared(p, "model")
    p.add_argument("--max-model-len", type=int, default=8192, help="the cluster's (default 8192)")
    p.add_argument("--long-tokens", type=int, default=7030, help="long prompts' length")
    p.add_argument("--short-tokens", type=int, default=32, help="unrelated prompts' length")
    p.add_argument("--stream-tokens", type=int, default=16, help="unrelated streams' tokens")
    p.add_argument("--interval-s", type=float, default=1.5, help="one unrelated stream per")
    p.add_argument("--streams", type=int, default=24, help="most unrelated streams in a run")
    p.add_argument("--repeats", type=int, default=1, help="runs (each with new prompts)")
    p.add_argument("--launch-flags", default="", help="`splitserve launch` flags, e.g. knobs")
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)

    from ipc.client import Client
    from scripts.bench.launcher import splitserve

    model = resolve_model(args.model)
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    rng = np.random.default_rng(0)
    with (
        splitserve(model, flags=args.launch_flags, max_model_len=args.max_model_len) as cluster,
        Client(cluster.client_addr, deadline_s=1200) as client,
    ):
        client.submit(prompt_token_ids=ids(rng, args.short_tokens), max_tokens=4).result()
        runs = [one_run(client, args, rng) for _ in range(args.repeats)]
    for i, run in enumerate(runs):
        print(
            f"run {i}: {len(run['ttft'])} unrelated streams; TTFT {describe_ms(run['ttft'])}; "
            f"largest gap {max(run['gaps']) * 1e3:.0f} ms; long prompts end at "
            f"{', '.join(f'{t:.1f}' for t in run['long_e2e'])} s; load {run['load']:.2f}"
        )
    ttft, gaps = [t for r in runs for t in r["ttft"]], [g for r in runs for g in r["gaps"]]
    print(
        f"all runs: unrelated TTFT p50 {np.percentile(ttft, 50) * 1e3:.0f} ms, max "
        f"{max(ttft) * 1e3:.0f} ms; inter-token gap p50 {np.percentile(gaps, 50) * 1e3:.0f}, "
        f"p99 {np.percentile(gaps, 99) * 1e3:.0f}, max {max(gaps) * 1e3:.0f} ms"
    )
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
