"""``python -m scripts.bench disaggregation``: prefill/decode disaggregation (docs/
disaggregation.md).

``transfer``: one 2,048-token prompt's KV (the default model's layout: 30 layers, 3 KV heads,
head dim 64, bf16, ~47 MB) through the shared-memory transport, export + import, against a
plain memcpy of as many bytes on this machine.

``serving`` (default): issue 40's workload, each mode for the same fixed ``--duration``:
``--streams`` streams decode ``--stream-tokens`` each (one restarted as each ends, so that many
always decode) while unique ``--prompt-tokens`` prompts (``--prompt-output`` tokens out) arrive
as a Poisson process at each of ``--rates`` per second (the same arrival times in every mode).
Modes, interleaved over ``--repeats`` at each rate: colocated (one engine, every engine thread),
data parallel (2 engines, a core each) and PD (1 prefill + 1 decode engine, a core each; both
pinned). Reported, over the requests submitted in the window: the streams' inter-token latency
p50/p99 and output tokens/s (deltas received in it), the long prompts' TTFT p50, and goodput:
the share of requests meeting TTFT <= ``--slo-ttft-s`` and TPOT <= ``--slo-tpot-ms``. The
workload goes on past the window for as long as a request meeting both can take (TTFT + (tokens
- 1) x TPOT, for the longest), then everything is aborted: a request of the window unfinished by
then missed an SLO, and counts so (a long prompt without a first token counts its wait then as
its TTFT, a lower bound). Then the lowest rate where colocated goodput falls below 90%.
"""

from __future__ import annotations

import argparse
import itertools
import os
import random
import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from scripts.bench.interleave import interleave, load, progress
from scripts.bench.options import add_shared, text_list, workload_parser
from scripts.bench.stats import median_summary, percentiles
from scripts.bench.sweep import parse_rates

if TYPE_CHECKING:
    from ipc.client import GenerationResult, RequestHandle

MODES = {
    "colocated": dict(engines=1),
    "data-parallel": dict(engines=2, pin_engine_cores=True),
    "pd": dict(prefill_engines=1, decode_engines=1, pin_engine_cores=True),
    "colocated-1-thread": dict(engines=1, engine_threads=1),  # not by default: a diagnosis
}


def transfer(args: argparse.Namespace) -> None:
    from engine_worker.kv_transfer import KVGeometry, SharedMemoryExporter, SharedMemoryImporter

    shape = (30, 3, 256, 16, 64)  # layers, kv heads, blocks, block size, head dim
    keys, values = (torch.randn(shape).to(torch.bfloat16) for _ in range(2))
    their_keys, their_values = torch.zeros_like(keys), torch.zeros_like(values)
    blocks = args.prompt_tokens // 16
    path = f"/dev/shm/splitserve-kv-bench-{time.monotonic_ns()}"
    exporter = SharedMemoryExporter(path, KVGeometry.of(keys), blocks)
    importer = SharedMemoryImporter(KVGeometry.of(keys))
    rng = random.Random(0)
    times: dict[str, list[float]] = {"consecutive": [], "scattered": []}
    copies = []
    try:
        for n in range(args.repeats * 10):
            for layout, samples in times.items():
                if layout == "consecutive":  # a fresh allocation on both sides
                    first, into_first = rng.randrange(256 - blocks), rng.randrange(256 - blocks)
                    sent = list(range(first, first + blocks))
                    into = list(range(into_first, into_first + blocks))
                else:
                    sent, into = rng.sample(range(256), blocks), rng.sample(range(256), blocks)
                start = time.perf_counter()
                kv = exporter.export(n + 1, keys, values, sent)
                assert kv is not None
                assert importer.import_blocks(kv, their_keys, their_values, into)
                samples.append(time.perf_counter() - start)
                exporter.release(n + 1)
            source = keys[:, :, :blocks].contiguous()
            target = torch.empty_like(source)
            start = time.perf_counter()
            for _ in range(4):  # 2 copies (out and in) of keys and values: the transfer's bytes
                target.copy_(source)
            copies.append(time.perf_counter() - start)
    finally:
        importer.close()
        exporter.close()
    moved = kv.nbytes
    print(f"KV of {args.prompt_tokens} tokens: {moved / 1e6:.1f} MB; load {load()}")
    for layout, samples in times.items():
        p50 = float(np.median(samples))
        print(f"transfer, {layout} blocks, p50 {p50 * 1e3:.2f} ms = {moved / p50 / 1e9:.2f} GB/s")
    memcpy = float(np.median(copies))
    rate = 2 * moved / memcpy / 1e9
    print(f"memcpy of 2 x the bytes p50 {memcpy * 1e3:.2f} ms = {rate:.2f} GB/s")


def run_mode(args: argparse.Namespace, mode: str, rate: float) -> dict[str, float]:
    from ipc.client import Client
    from procs.launch_cluster import launch_cluster

    knobs = {"engine_threads": args.engine_threads, **MODES[mode], "max_model_len": 4096}
    arrivals, ids = (random.Random(f"{args.seed}-{rate}-{what}") for what in ("t", "ids"))
    longest = max(args.stream_tokens, args.prompt_output)
    grace = args.slo_ttft_s + (longest - 1) * args.slo_tpot_ms / 1e3
    with launch_cluster(args.model, **knobs) as cluster, Client(cluster.client_addr) as client:

        def submit(tokens: int, out: int) -> RequestHandle:
            prompt = [ids.randrange(100, 40000) for _ in range(tokens)]
            return client.submit(prompt_token_ids=prompt, max_tokens=out, ignore_eos=True)

        for warm in [submit(512, 2) for _ in range(2)]:  # every engine measures its step pace
            warm.result(timeout=600)
        t0 = time.monotonic()
        window, stop = t0 + args.duration, t0 + args.duration + grace
        arrival = t0 + arrivals.expovariate(rate)  # the same times in every mode
        running = [submit(64, args.stream_tokens) for _ in range(args.streams)]
        streams, prompts = list(running), []
        while (now := time.monotonic()) < stop:
            for i, handle in enumerate(running):
                if handle.done:
                    running[i] = submit(64, args.stream_tokens)
                    streams.append(running[i])
            while arrival <= now:  # one the loop is late for goes at once
                prompts.append(submit(args.prompt_tokens, args.prompt_output))
                arrival += arrivals.expovariate(rate)
            time.sleep(0.01)
        for handle in streams + prompts:
            handle.abort()  # a request of the window still running missed an SLO by now
        done = [[h.result(timeout=120, check=False) for h in hs] for hs in (streams, prompts)]
    stream_results, long = ([r for r in rs if r.t_submit < window] for rs in done)
    figures = judge(args, stream_results, long, t0, window, stop)
    progress(f"{mode} at {rate:g}/s: {figures} (load {load()})")
    return figures


def judge(args, streams: list, long: list, t0: float, window: float, stop: float) -> dict:
    """The window's figures (see the module's doc)."""

    def meets(r: GenerationResult) -> bool:
        n, times = len(r.token_ids), r.t_received
        return bool(
            r.finish_reason == "length"
            and times[0] - r.t_submit <= args.slo_ttft_s
            and (n < 2 or (times[-1] - times[0]) / (n - 1) * 1e3 <= args.slo_tpot_ms)
        )

    gaps = [b - a for r in streams for a, b in itertools.pairwise(r.t_received) if b < window]
    tokens = sum(
        sum(t0 <= t < window for t in r.t_received) * len(r.token_ids) / len(r.t_received)
        for r in streams
        if r.t_received
    )
    ttfts = [(r.t_received[0] if r.t_received else stop) - r.t_submit for r in long]
    itl = percentiles(gaps, scale=1e3)
    good = [meets(r) for r in streams + long]
    return {
        "itl_p50_ms": itl["p50"],
        "itl_p99_ms": itl["p99"],
        "stream_tok_s": tokens / args.duration,
        "long": len(long),
        "long_ttft_p50_ms": float(np.median(ttfts)) * 1e3 if ttfts else float("nan"),
        "long_good": sum(good[len(streams) :]),
        "requests": len(good),
        "goodput_pct": 100 * sum(good) / len(good),
        "goodput_rps": sum(good) / args.duration,
        "load_1min": os.getloadavg()[0],
    }


def serving(args: argparse.Namespace) -> None:
    print(
        f"{args.streams} streams x {args.stream_tokens} tokens beside {args.prompt_tokens}-token "
        f"prompts; window {args.duration:g} s; SLO TTFT <= {args.slo_ttft_s:g} s, TPOT <= "
        f"{args.slo_tpot_ms:g} ms; load at the start {load()}"
    )
    print(
        "| rate /s | mode | ITL p50 / p99 ms | stream tok/s | long TTFT p50 ms | long good "
        "/ arrived | goodput % (req/s) | load (1 min, median) |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    below = None
    for rate in args.rates:
        cases = {m: (lambda m=m, r=rate: run_mode(args, m, r)) for m in args.modes}
        runs = interleave(cases, args.repeats)
        for mode, figures in runs.items():
            m = median_summary(figures)
            print(
                f"| {rate:g} | {mode} | {m['itl_p50_ms']:.1f} / {m['itl_p99_ms']:.1f} | "
                f"{m['stream_tok_s']:.1f} | {m['long_ttft_p50_ms']:.0f} | "
                f"{m['long_good']:.0f} / {m['long']:.0f} | {m['goodput_pct']:.0f} "
                f"({m['goodput_rps']:.2f}) | {m['load_1min']:.1f} |",
                flush=True,
            )
            if mode == "colocated" and below is None and m["goodput_pct"] < 90:
                below = rate
    print(f"colocated goodput below 90% from rate: {below}; load average at the end: {load()}")


def build_parser() -> argparse.ArgumentParser:
    p = workload_parser("disaggregation", __doc__)
    p.add_argument("what", nargs="?", default="serving", choices=("serving", "transfer"))
    add_shared(p, "model", "repeats", repeats=2)
    modes = ",".join(MODES)
    p.add_argument("--modes", type=text_list, default=list(MODES)[:3], help=f"any of {modes}")
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--stream-tokens", type=int, default=256)
    p.add_argument("--prompt-tokens", type=int, default=2048)
    p.add_argument("--rates", type=parse_rates, default=[0.05, 0.1, 0.2], help="prompts/s")
    p.add_argument("--prompt-output", type=int, default=16, help="tokens out per long prompt")
    p.add_argument("--duration", type=float, default=60.0, help="the window, s (every mode)")
    p.add_argument("--slo-ttft-s", type=float, default=2.0)
    p.add_argument("--slo-tpot-ms", type=float, default=60.0)
    p.add_argument("--engine-threads", type=int, default=2, help="split between the engines")
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    {"transfer": transfer, "serving": serving}[args.what](args)


if __name__ == "__main__":
    main()
