#!/usr/bin/env python
"""Engine-only benchmarks on the default model (no processes, no sockets, no tokenizer).

  core    prefill tokens/s (one prompt of each --prefill-tokens length) and decode tokens/s at
          each --decode-batch, for our engine and for transformers ``generate`` (batched, left
          padding) in the same run, with ratios. Decode prompts have varied lengths (a batch of
          real requests rarely shares one length), drawn from one seed for both.
  prefix  --num-requests requests sharing a --shared-prefix-tokens system prompt plus a short
          unique question: prompt tokens computed and TTFT p50 with and without the prefix cache.
  sampling  decode tokens/s at the largest --decode-batch with each sampling setting (greedy,
          temperature, top-p, top-k, repetition penalty), for our engine and transformers
          ``generate`` with the same setting, in the same run.
  mixed   short requests decoding while --long-prompts prompts of --long-prompt-tokens arrive:
          inter-token latency (ITL) p50/p99 of the decoding requests with and without chunked
          prefill.
  peer    llama.cpp (llama-cpp-python, the optional `peer` extra) on the GGUF our default model
          comes from, same threads, same prompts, alternating with our engine: prefill tokens/s
          at each --prefill-tokens and decode tokens/s at batch 1, with ratios; then the batch-1
          bandwidth bound of each (weight bytes read per token / the measured read bandwidth)
          and, with --llama-bench PATH, llama.cpp's own llama-bench figures.
  kernels, formats, bandwidth  weight formats: the linear layers alone at each --kernel-rows,
          the engine in each --formats format, and batch-1 decode of each against the read
          bandwidth bound (scripts/bench/engine_formats.py).
  logprobs  decode steps at the largest --decode-batch with one request's (then every
          request's) top-20 logprobs switched on every other step; the logprob work of a step
          alone; prefill with prompt logprobs (scripts/bench/engine_logprobs.py).

Engines run --dtype/--weights; unset, 'core', 'sampling', 'prefix', 'mixed' and 'logprobs' run
dense float32 (as transformers does) and 'peer' runs the default launch (auto/auto). Every figure
is printed with the torch thread count it ran with (--threads).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch

from engine_worker.engine import Engine
from ipc.engine_config import WEIGHTS
from procs.model_store import resolve_model
from scripts.bench.engine_runs import (
    best_decode_rates,
    decode_prompts,
    default_launch_knobs,
    engine_decode_rate,
    engine_prefill_rate,
    hf_generate_seconds,
    load_hf,
    make_engine,
    params,
    print_rates,
    random_prompt,
)


def run_core(args) -> None:
    rng = np.random.default_rng(0)
    engine = make_engine(args, enable_prefix_cache=False, max_batch_size=max(args.decode_batch))
    hf = load_hf(args)
    rows = []
    for length in args.prefill_tokens:
        prompt = random_prompt(rng, length)
        ours = engine_prefill_rate(engine, prompt, args.repeats)
        theirs = length / min(hf_generate_seconds(hf, [prompt], 1) for _ in range(args.repeats))
        rows.append((f"prefill {length} tokens", ours, theirs))
    for batch in args.decode_batch:
        ours, theirs = best_decode_rates(args, engine, hf, decode_prompts(args, rng, batch))
        rows.append((f"decode batch {batch}", ours, theirs))
    print_rates(
        f"\ncore (threads={torch.get_num_threads()}, {args.dtype or 'float32'} for both, "
        f"{engine.model_name}; decode prompts {args.decode_prompt_tokens // 2}.."
        f"{args.decode_prompt_tokens * 3 // 2} tokens, {args.decode_tokens} new tokens)",
        rows,
    )


# --- sampling: decode throughput with each sampling setting -------------------------------------
# (name, our SamplingParams fields, transformers generate arguments): the same setting on both.
SAMPLING_CASES = [
    ("greedy", {}, {}),
    (
        "temperature 0.7",
        {"temperature": 0.7},
        {"do_sample": True, "temperature": 0.7, "top_k": 0, "top_p": 1.0},
    ),
    (
        "top-p 0.9",
        {"temperature": 0.7, "top_p": 0.9},
        {"do_sample": True, "temperature": 0.7, "top_k": 0, "top_p": 0.9},
    ),
    (
        "top-k 50",
        {"temperature": 0.7, "top_k": 50},
        {"do_sample": True, "temperature": 0.7, "top_k": 50, "top_p": 1.0},
    ),
    ("repetition 1.2", {"repetition_penalty": 1.2}, {"repetition_penalty": 1.2}),
]


def run_sampling(args) -> None:
    batch = max(args.decode_batch)
    engine = make_engine(args, enable_prefix_cache=False, max_batch_size=batch)
    hf = load_hf(args)
    prompts = decode_prompts(args, np.random.default_rng(0), batch)
    rows = [
        (name, *best_decode_rates(args, engine, hf, prompts, ours, theirs))
        for name, ours, theirs in SAMPLING_CASES
    ]
    print_rates(
        f"\nsampling (threads={torch.get_num_threads()}, "
        f"{args.dtype or 'float32'} for both, "
        f"decode batch {batch}, {args.decode_tokens} new tokens)",
        rows,
    )


# --- prefix: shared system prompt ---------------------------------------------------------------
def run_workload(engine: Engine, arrivals: dict[int, list[tuple[str, list[int], int]]]):
    """Steps the engine, adding requests at given steps; returns per-request timings."""
    arrived, first, emitted = {}, {}, {}
    prefill_tokens = step = 0
    while step in arrivals or engine.has_work() or any(s > step for s in arrivals):
        for request_id, prompt, max_tokens in arrivals.get(step, []):
            arrived[request_id] = time.monotonic()
            engine.add(request_id, prompt, params(max_tokens), arrival_time=arrived[request_id])
        out = engine.step()
        prefill_tokens += out.stats.prefill_tokens
        for request_id in out.request_ids:
            first.setdefault(request_id, out.t_step)
            emitted.setdefault(request_id, []).append(out.t_step)
        step += 1
    ttft = np.array([first[r] - arrived[r] for r in arrived]) * 1000
    return ttft, emitted, prefill_tokens


def run_prefix(args) -> None:
    rng = np.random.default_rng(1)
    system = random_prompt(rng, args.shared_prefix_tokens)
    questions = [rng.integers(100, 40000, size=16).tolist() for _ in range(args.num_requests)]
    arrivals = {0: [(f"q{i}", system + q, args.new_tokens) for i, q in enumerate(questions)]}
    print(
        f"\nprefix (threads={args.threads}): {args.num_requests} requests = "
        f"{args.shared_prefix_tokens}-token shared prompt + 16 unique tokens, all at once"
    )
    figures = {}
    for enabled in (False, True):
        engine = make_engine(args, enable_prefix_cache=enabled)
        ttft, _, computed = run_workload(engine, arrivals)
        figures[enabled] = (computed, float(np.percentile(ttft, 50)))
        print(
            f"  prefix cache {'on ' if enabled else 'off'}: prompt tokens computed {computed:7d}"
            f"   TTFT p50 {figures[enabled][1]:9.1f} ms   p99 {np.percentile(ttft, 99):9.1f} ms"
        )
    (off_tokens, off_ttft), (on_tokens, on_ttft) = figures[False], figures[True]
    print(
        f"  prefill tokens computed reduced by {100 * (1 - on_tokens / off_tokens):.1f}%, "
        f"TTFT p50 {off_ttft / on_ttft:.1f}x lower"
    )


# --- mixed: long prompts arriving during decode -------------------------------------------------
def run_mixed(args) -> None:
    rng = np.random.default_rng(2)
    decoders = [(f"d{i}", random_prompt(rng, 64), args.new_tokens * 8) for i in range(8)]
    arrivals: dict[int, list] = {0: decoders}
    for i in range(args.long_prompts):
        arrivals[5 + 10 * i] = [(f"long{i}", random_prompt(rng, args.long_prompt_tokens), 4)]
    print(
        f"\nmixed (threads={args.threads}): 8 requests decoding {args.new_tokens * 8} tokens; "
        f"{args.long_prompts} prompts of {args.long_prompt_tokens} tokens arrive meanwhile"
    )
    p99 = {}
    for chunk in (args.long_prompt_tokens, args.chunk_tokens):
        engine = make_engine(
            args,
            prefill_chunk_tokens=chunk,
            prefill_max_tokens=max(chunk, 64 * 8),
            enable_prefix_cache=False,
        )
        _, emitted, _ = run_workload(engine, arrivals)
        gaps = np.concatenate([np.diff(emitted[r]) for r, _, _ in decoders]) * 1000
        p99[chunk] = float(np.percentile(gaps, 99))
        label = "off" if chunk == args.long_prompt_tokens else f"{chunk} tokens"
        print(
            f"  chunked prefill {label:>11s}: ITL p50 {np.percentile(gaps, 50):8.1f} ms   "
            f"p99 {p99[chunk]:8.1f} ms   max {gaps.max():8.1f} ms"
        )
    print(
        f"  ITL p99 {p99[args.long_prompt_tokens] / p99[args.chunk_tokens]:.1f}x lower with "
        "chunked prefill"
    )


# --- peer: llama.cpp on the same GGUF -----------------------------------------------------------
def run_peer(args) -> None:
    from scripts.bench import peer_engine as pe

    if not pe.llama_cpp_available():
        raise SystemExit(pe.NEEDS_PEER_EXTRA)
    gguf = Path(args.gguf) if args.gguf else pe.default_gguf()
    rng = np.random.default_rng(3)
    engine = make_engine(
        args, enable_prefix_cache=False, max_batch_size=1, **default_launch_knobs(args)
    )
    longest = max(*args.prefill_tokens, args.decode_prompt_tokens + args.decode_tokens + 1)
    peer = pe.LlamaCppPeer(gguf, args.threads, n_ctx=longest + 16)
    warm = random_prompt(rng, 16)
    engine_decode_rate(engine, [warm], 2)  # warm-ups: first-call allocations on both sides
    peer.decode_rate(warm, 2)
    rows = []
    for length in args.prefill_tokens:
        prompt = random_prompt(rng, length)
        ours = theirs = 0.0
        for _ in range(args.repeats):  # alternating: a disturbance hits one run, not one side
            ours = max(ours, engine_prefill_rate(engine, prompt, 1))
            theirs = max(theirs, peer.prefill_rate(prompt, 1))
        rows.append((f"prefill {length} tokens", ours, theirs))
    prompt = random_prompt(rng, args.decode_prompt_tokens)
    decode = [0.0, 0.0]
    for _ in range(args.repeats):
        decode[0] = max(decode[0], engine_decode_rate(engine, [prompt], args.decode_tokens))
        decode[1] = max(decode[1], peer.decode_rate(prompt, args.decode_tokens))
    rows.append(("decode batch 1", *decode))
    peer.close()
    ours = (
        f"{engine.runner.model.weight_format.describe()}, activations {engine.runner.model.dtype}"
    )
    print_rates(
        f"\npeer (threads={args.threads} for both; ours {ours}; llama.cpp "
        f"{peer.version} on {gguf.name}; decode after a "
        f"{args.decode_prompt_tokens}-token prompt, {args.decode_tokens} new tokens)",
        rows,
        peer="llama.cpp",
    )
    bandwidth = pe.read_bandwidth_gbs(args.threads)
    print(
        f"batch-1 decode bandwidth bound (read bandwidth {bandwidth:.1f} GB/s at "
        f"{args.threads} threads):"
    )
    print(
        pe.bound_line(
            "engine", pe.weight_bytes_per_token(engine.runner.model), bandwidth, decode[0]
        )
    )
    print(
        pe.bound_line(
            "llama.cpp (GGUF as stored)", pe.gguf_weight_bytes_per_token(gguf), bandwidth, decode[1]
        )
    )
    if args.llama_bench:
        figures = pe.llama_bench(
            args.llama_bench, gguf, args.threads, args.prefill_tokens, args.decode_tokens
        )
        print(
            f"llama-bench (threads={args.threads}): "
            + ", ".join(f"{name} {rate:.1f} tok/s" for name, rate in figures)
        )


def run_weight_formats(args) -> None:
    from scripts.bench import engine_formats  # it imports this module

    {
        "kernels": engine_formats.run_kernels,
        "formats": engine_formats.run_formats,
        "bandwidth": engine_formats.run_bandwidth,
    }[args.workload](args)


def run_logprobs(args) -> None:
    from scripts.bench.engine_logprobs import run_logprobs as run  # it imports this module

    run(args)


def main() -> None:
    def ints(text: str) -> list[int]:
        return [int(x) for x in text.split(",")]

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "workloads",
        nargs="*",
        default=["core"],
        choices=[
            "core",
            "sampling",
            "prefix",
            "mixed",
            "peer",
            "kernels",
            "formats",
            "bandwidth",
            "logprobs",
        ],
        help="what to run (default: core)",
    )
    parser.add_argument("--model", default=None, help="HF checkpoint dir (default model if unset)")
    parser.add_argument(
        "--gguf",
        default=None,
        help="the GGUF llama.cpp runs in 'peer' (default: the one the default "
        "model is converted from)",
    )
    parser.add_argument(
        "--llama-bench",
        default=None,
        metavar="PATH",
        help="'peer' also runs this llama-bench binary (scripts/build_llama_server.sh builds one)",
    )
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument(
        "--dtype",
        default=None,
        choices=["auto", "float32", "bfloat16"],
        help="the engine's activations (and transformers' dtype in 'core' and "
        "'sampling'); default: float32, 'peer' auto",
    )
    parser.add_argument(
        "--weights",
        default=None,
        choices=list(WEIGHTS),
        help="the engine's weight format (default: dense in --dtype, 'peer' "
        "auto; splitserve launch --help says what each is)",
    )
    parser.add_argument(
        "--formats",
        default="fp32,bf16,int8,int4,auto",
        help="weight formats 'formats' and 'bandwidth' compare (fp32 and bf16 "
        "run their own dtype, the others the CPU's auto dtype)",
    )
    parser.add_argument(
        "--kernel-rows",
        type=ints,
        default=[1, 2, 4, 8, 16, 32, 256],
        help="rows (tokens) per linear call for 'kernels'",
    )
    parser.add_argument(
        "--kernel-repeats",
        type=int,
        default=5,
        help="interleaved runs of each format in 'kernels'; the best counts",
    )
    parser.add_argument("--kv-cache-tokens", type=int, default=65536)
    parser.add_argument(
        "--prefill-tokens",
        type=ints,
        default=[256, 1024],
        help="prompt lengths for the prefill figures (comma-separated)",
    )
    parser.add_argument(
        "--decode-batch",
        type=ints,
        default=[1, 8, 32],
        help="batch sizes for the decode figures (comma-separated)",
    )
    parser.add_argument(
        "--decode-prompt-tokens",
        type=int,
        default=128,
        help="mean decode prompt length; lengths vary from half to 1.5x",
    )
    parser.add_argument("--decode-tokens", type=int, default=32, help="tokens decoded per figure")
    parser.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="runs of each prefill/decode figure, both sides; the best counts",
    )
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--shared-prefix-tokens", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=8, help="tokens per request (prefix)")
    parser.add_argument("--long-prompts", type=int, default=3)
    parser.add_argument("--long-prompt-tokens", type=int, default=2048)
    parser.add_argument(
        "--chunk-tokens",
        type=int,
        default=256,
        help="prefill_chunk_tokens for the chunked run of 'mixed'",
    )
    args = parser.parse_args()
    args.model = resolve_model(args.model)
    torch.set_num_threads(args.threads)
    for workload in args.workloads:
        args.workload = workload
        {
            "core": run_core,
            "sampling": run_sampling,
            "prefix": run_prefix,
            "mixed": run_mixed,
            "peer": run_peer,
            "kernels": run_weight_formats,
            "formats": run_weight_formats,
            "bandwidth": run_weight_formats,
            "logprobs": run_logprobs,
        }[workload](args)


if __name__ == "__main__":
    main()
