"""``python -m scripts.bench disaggregation``: prefill/decode disaggregation (docs/
disaggregation.md).

``transfer``: one 2,048-token prompt's KV (the default model's layout: 30 layers, 3 KV heads,
head dim 64, bf16, ~47 MB) through the shared-memory transport, export + import, against a
plain memcpy of as many bytes on this machine.

``serving`` (default): issue 40's workload. Streams decode ``--stream-tokens`` each while unique
``--prompt-tokens`` prompts arrive as a Poisson process at ``--rate`` per second; each mode runs
in turn, interleaved over ``--repeats``: colocated (one engine, every engine thread), data
parallel (2 engines, a core each) and PD (1 prefill + 1 decode engine, a core each). Reported:
the streams' inter-token latency p50/p99 and output tokens/s, the prompts' TTFT p50, the KV
transfer p50; with the load average beside them.
"""

from __future__ import annotations

import argparse
import random
import threading
import time

import numpy as np
import torch

from scripts.bench.interleave import interleave, load, progress
from scripts.bench.options import add_shared, text_list, workload_parser
from scripts.bench.stats import median_summary, percentiles

MODES = {
    "colocated": dict(engines=1),
    "data-parallel": dict(engines=2, pin_engine_cores=True),
    "pd": dict(prefill_engines=1, decode_engines=1, pin_engine_cores=True),
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


def run_mode(args: argparse.Namespace, mode: str) -> dict[str, float]:
    from ipc.client import Client
    from procs.launch_cluster import launch_cluster

    knobs = dict(MODES[mode], engine_threads=args.engine_threads, max_model_len=4096)
    rng = random.Random(args.seed)
    with launch_cluster(args.model, **knobs) as cluster, Client(cluster.client_addr) as client:
        client.submit(prompt_token_ids=[100] * 32, max_tokens=4).result(timeout=300)
        streams = [
            client.submit(
                prompt_token_ids=[rng.randrange(100, 40000) for _ in range(64)],
                max_tokens=args.stream_tokens,
                ignore_eos=True,
            )
            for _ in range(args.streams)
        ]
        prompts, stop = [], threading.Event()

        def arrivals() -> None:
            while not stop.wait(rng.expovariate(args.rate)):
                ids = [rng.randrange(100, 40000) for _ in range(args.prompt_tokens)]
                prompts.append(client.submit(prompt_token_ids=ids, max_tokens=8, ignore_eos=True))

        sender = threading.Thread(target=arrivals, daemon=True)
        sender.start()
        results = [h.result(timeout=1800) for h in streams]
        stop.set()
        sender.join()
        for handle in prompts:  # past saturation a backlog builds: the streams' span is the run
            handle.abort()
        long = [h.result(timeout=1800, check=False) for h in prompts]
    itl = percentiles([g for r in results for g in r.inter_token_s], scale=1e3)
    span = max(r.t_received[-1] for r in results) - min(r.t_submit for r in results)
    ttfts = [r.ttft_s for r in long if r.ttft_s is not None and r.finish_reason != "abort"]
    moves = [r.timings.kv_transfer_s for r in long + results if r.timings.kv_transfer_s]
    figures = {
        "itl_p50_ms": itl["p50"],
        "itl_p99_ms": itl["p99"],
        "stream_tok_s": sum(len(r.token_ids) for r in results) / span,
        "prompts": len(ttfts),  # completed (the rest were aborted at the end)
        "ttft_p50_ms": float(np.median(ttfts)) * 1e3 if ttfts else float("nan"),
        "kv_transfer_p50_ms": float(np.median(moves)) * 1e3 if moves else 0.0,
    }
    progress(f"{mode}: {figures} (load {load()})")
    return figures


def serving(args: argparse.Namespace) -> None:
    runs = interleave({m: (lambda m=m: run_mode(args, m)) for m in args.modes}, args.repeats)
    print("| mode | ITL p50 / p99 ms | stream tok/s | prompts | TTFT p50 ms | KV move ms |")
    print("| --- | --- | --- | --- | --- | --- |")
    for mode, figures in runs.items():
        median = median_summary(figures)
        print(
            f"| {mode} | {median['itl_p50_ms']:.1f} / {median['itl_p99_ms']:.1f} | "
            f"{median['stream_tok_s']:.1f} | {median['prompts']:.0f} | "
            f"{median['ttft_p50_ms']:.0f} | {median['kv_transfer_p50_ms']:.2f} |"
        )
    print(f"load average at the end: {load()}")


def build_parser() -> argparse.ArgumentParser:
    p = workload_parser("disaggregation", __doc__)
    p.add_argument("what", nargs="?", default="serving", choices=("serving", "transfer"))
    add_shared(p, "model", "repeats", repeats=2)
    p.add_argument("--modes", type=text_list, default=list(MODES), help="any of " + ",".join(MODES))
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--stream-tokens", type=int, default=256)
    p.add_argument("--prompt-tokens", type=int, default=2048)
    p.add_argument("--rate", type=float, default=0.2, help="long prompts per second (Poisson)")
    p.add_argument("--engine-threads", type=int, default=2, help="split between the engines")
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    transfer(args) if args.what == "transfer" else serving(args)


if __name__ == "__main__":
    main()
