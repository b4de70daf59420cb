"""engine: the engine alone on the default model (no processes, no sockets, no tokenizer).

  core      prefill tokens/s (one prompt of each --prefill-tokens length) and decode tokens/s at
            each --decode-batch, for our engine and for transformers ``generate`` (batched, left
            padding), interleaved, with ratios. Decode prompts have varied lengths (a batch of
            real requests rarely shares one length), drawn from one seed for both.
  sampling  decode tokens/s at the largest --decode-batch with each sampling setting (greedy,
            temperature, top-p, top-k, repetition penalty), ours and transformers' alike.
  prefix    --num-requests requests sharing a --shared-prefix-tokens system prompt plus a short
            unique question: prompt tokens computed and TTFT p50 with and without the prefix cache.
  cached    a fully cached prompt's first step, its tail from the prefix cache or its last
            block computed again, interleaved (scripts/bench/engine_cached.py).
  mixed     8 requests decoding while --long-prompts prompts of --long-prompt-tokens arrive:
            their inter-token latency (ITL) p50/p99 with and without chunked prefill.
  peer      llama.cpp's engine alone (its llama-bench, --llama-bench PATH, built with llama-server
            by scripts/build_llama_server.sh) on the GGUF our default model is served from, same
            threads, interleaved with our engine in the default launch: prefill tokens/s at each
            --prefill-tokens and batch-1 decode, ratios, and each one's bandwidth bound.
  kernels, formats, bandwidth  weight formats: the linear layers alone at each --kernel-rows,
            the engine in each --formats format, and batch-1 decode of each against the read
            bandwidth bound (scripts/bench/engine_formats.py).
  logprobs  decode steps at the largest --decode-batch with one request's (then every
            request's) top-20 logprobs switched on every other step; the logprob work of a step
            alone; prefill with prompt logprobs (scripts/bench/engine_logprobs.py).
  determinism  whether a row's numbers depend on the rest of its step, op by op and path by
            path; each --formats mode's distance from float32; what the default launch and
            --deterministic cost (--determinism-parts; scripts/bench/engine_determinism.py).

Engines run --dtype/--weights; unset, every workload but 'peer' runs dense float32 (as
transformers does) and 'peer' runs the default launch (auto/auto). Every figure is printed with
the torch thread count it ran with (--threads).
"""

from __future__ import annotations

import time
from functools import partial
from pathlib import Path

import numpy as np
import torch

from engine_worker.engine import Engine
from procs.model_store import resolve_model
from scripts.bench import (
    determinism_cost,
    engine_cached,
    engine_determinism,
    engine_formats,
    engine_logprobs,
)
from scripts.bench.engine_runs import (
    decode_prompts,
    decode_rate,
    default_launch_knobs,
    hf_decode_rate,
    hf_prefill_rate,
    load_hf,
    make_engine,
    params,
    prefill_rate,
    print_rates,
    random_prompt,
)
from scripts.bench.interleave import best_of, interleave
from scripts.bench.options import add_parts, add_shared, int_list, text_list, workload_parser


def run_core(args) -> None:
    rng = np.random.default_rng(0)
    engine = make_engine(args, enable_prefix_cache=False, max_batch_size=max(args.decode_batch))
    hf = load_hf(args)
    rows = []
    for length in args.prefill_tokens:
        prompt = random_prompt(rng, length)
        best = best_of(
            {
                "ours": partial(prefill_rate, engine, prompt),
                "hf": partial(hf_prefill_rate, hf, prompt),
            },
            args.repeats,
        )
        rows.append((f"prefill {length} tokens", best["ours"], best["hf"]))
    for batch in args.decode_batch:
        rows.append((f"decode batch {batch}", *decode_vs_hf(args, engine, hf, batch, {}, {})))
    print_rates(
        f"\ncore (threads={torch.get_num_threads()}, {args.dtype or 'float32'} for both, "
        f"{engine.model_name}; decode prompts {args.decode_prompt_tokens // 2}.."
        f"{args.decode_prompt_tokens * 3 // 2} tokens, {args.decode_tokens} new tokens)",
        rows,
    )


def decode_vs_hf(args, engine, hf, batch: int, ours: dict, theirs: dict) -> tuple[float, float]:
    """Best decode tokens/s of ours and transformers', interleaved; ``ours``/``theirs``: the same
    sampling setting in each one's words."""
    prompts = decode_prompts(args, np.random.default_rng(batch), batch)
    hf_decode_rate(hf, prompts, 2, **theirs)  # warm-up
    best = best_of(
        {
            "ours": lambda: decode_rate(engine, prompts, args.decode_tokens, **ours),
            "hf": lambda: hf_decode_rate(hf, prompts, args.decode_tokens, **theirs),
        },
        args.repeats,
    )
    return best["ours"], best["hf"]


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
    rows = [
        (name, *decode_vs_hf(args, engine, hf, batch, ours, theirs))
        for name, ours, theirs in SAMPLING_CASES
    ]
    print_rates(
        f"\nsampling (threads={torch.get_num_threads()}, {args.dtype or 'float32'} for both, "
        f"decode batch {batch}, {args.decode_tokens} new tokens)",
        rows,
    )


def run_arrivals(engine: Engine, arrivals: dict[int, list[tuple[str, list[int], int]]]):
    """Steps the engine, adding requests at given steps; returns each request's TTFT (ms), the
    times of its tokens and the prompt tokens computed."""
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
        ttft, _, computed = run_arrivals(make_engine(args, enable_prefix_cache=enabled), arrivals)
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
        _, emitted, _ = run_arrivals(engine, arrivals)
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


def run_peer(args) -> None:
    """Our engine in the default launch against llama-bench, interleaved; best of --repeats."""
    from scripts.bench.launcher import default_gguf, llama_bench

    if not args.llama_bench:
        raise SystemExit(
            "engine peer needs --llama-bench PATH (scripts/build_llama_server.sh builds it)"
        )
    gguf = Path(args.gguf) if args.gguf else default_gguf()
    rng = np.random.default_rng(3)
    engine = make_engine(
        args, enable_prefix_cache=False, max_batch_size=1, **default_launch_knobs(args)
    )
    prompts = {n: random_prompt(rng, n) for n in args.prefill_tokens}
    context = random_prompt(rng, args.decode_prompt_tokens)
    decode_rate(engine, [random_prompt(rng, 16)], 2)  # warm-up: first-call allocations
    tg = f"tg{args.decode_tokens}"

    def ours() -> dict[str, float]:
        figures = {f"pp{n}": prefill_rate(engine, p) for n, p in prompts.items()}
        return figures | {tg: decode_rate(engine, [context], args.decode_tokens)}

    def theirs() -> dict[str, float]:
        run = partial(llama_bench, args.llama_bench, gguf, args.threads)
        return run(args.prefill_tokens, 0) | run([], args.decode_tokens, len(context))

    runs = interleave({"ours": ours, "theirs": theirs}, args.repeats)
    best = {side: {k: max(r[k] for r in rs) for k in rs[0]} for side, rs in runs.items()}
    rows = []
    for key, rate in best["ours"].items():
        name = f"prefill {key[2:]} tokens" if key.startswith("pp") else "decode batch 1"
        rows.append((name, rate, best["theirs"].get(key, float("nan"))))
    model = engine.runner.model
    print_rates(
        f"\npeer (threads={args.threads} for both; ours {model.weight_format.describe()}, "
        f"activations {model.dtype}; llama-bench on {gguf.name}; decode after a "
        f"{args.decode_prompt_tokens}-token prompt, {args.decode_tokens} new tokens; best of "
        f"{args.repeats} interleaved)",
        rows,
        peer="llama.cpp",
    )
    bandwidth = engine_formats.read_bandwidth_gbs(args.threads)
    print(f"batch-1 decode bandwidth bound (read {bandwidth:.1f} GB/s at {args.threads} threads):")
    for name, weight_bytes, rate in (
        ("engine", engine_formats.weight_bytes_per_token(model), rows[-1][1]),
        ("llama.cpp", engine_formats.gguf_weight_bytes_per_token(gguf), rows[-1][2]),
    ):
        print(engine_formats.bound_line(name, weight_bytes, bandwidth, rate))


def run_determinism(args) -> None:
    """Each of --determinism-parts (scripts/bench/engine_determinism.py says what each is)."""
    parts = {
        "ops": engine_determinism.run_ops,
        "paths": engine_determinism.run_paths,
        "forced": engine_determinism.run_forced,
        "mc": engine_determinism.run_mc,
        "attention": determinism_cost.run_attention,
        "cost": determinism_cost.run_cost,
    }
    for part in args.determinism_parts:
        parts[part](args)


WORKLOADS = {
    "core": run_core,
    "sampling": run_sampling,
    "prefix": run_prefix,
    "cached": engine_cached.run_cached,
    "mixed": run_mixed,
    "peer": run_peer,
    "kernels": engine_formats.run_kernels,
    "formats": engine_formats.run_formats,
    "bandwidth": engine_formats.run_bandwidth,
    "logprobs": engine_logprobs.run_logprobs,
    "determinism": run_determinism,
}


def build_parser():
    p = workload_parser("engine", __doc__)
    add_parts(p, list(WORKLOADS), ["core"])
    add_shared(p, "model", "threads", "dtype", "weights", "prefill_tokens", "gguf")
    add_shared(p, "decode_tokens", "repeats", repeats=2)
    p.add_argument(
        "--decode-batch",
        type=int_list,
        default=[1, 8, 32],
        metavar="N[,N...]",
        help="batch sizes of the decode figures (default: 1,8,32)",
    )
    p.add_argument(
        "--decode-prompt-tokens",
        type=int,
        default=128,
        help="mean decode prompt length; lengths vary from half to 1.5x (default: 128)",
    )
    p.add_argument("--kv-cache-tokens", type=int, default=65536, help="(default: 65536)")
    p.add_argument(
        "--llama-bench",
        default=None,
        metavar="PATH",
        help="'peer': the llama-bench binary (scripts/build_llama_server.sh builds it)",
    )
    p.add_argument(
        "--formats",
        type=text_list,
        default=["fp32", "bf16", "int8", "int4", "auto"],
        help="weight formats 'formats' and 'bandwidth' compare (fp32 and bf16 run their own "
        "dtype, the others the CPU's auto dtype) (default: fp32,bf16,int8,int4,auto)",
    )
    p.add_argument(
        "--kernel-rows",
        type=int_list,
        default=[1, 2, 4, 8, 16, 32, 256],
        help="'kernels': rows (tokens) per linear call (default: 1,2,4,8,16,32,256)",
    )
    p.add_argument(
        "--kernel-repeats",
        type=int,
        default=5,
        help="'kernels': interleaved runs of each format; each call's best counts (default: 5)",
    )
    p.add_argument(
        "--determinism-parts",
        type=text_list,
        default=["ops", "paths", "forced"],
        help="'determinism': any of ops,paths,forced,mc,attention,cost (its module "
        "scripts/bench/engine_determinism.py says what each is) (default: ops,paths,forced)",
    )
    p.add_argument(
        "--mc-jsonl",
        default="tests/evals/facts_mc.jsonl",
        help="'determinism' mc: the multiple-choice items (default: %(default)s)",
    )
    g = p.add_argument_group("prefix and mixed")
    g.add_argument("--num-requests", type=int, default=32, help="'prefix' (default: 32)")
    g.add_argument("--shared-prefix-tokens", type=int, default=1024, help="(default: 1024)")
    g.add_argument("--new-tokens", type=int, default=8, help="tokens per request (default: 8)")
    g.add_argument("--long-prompts", type=int, default=3, help="'mixed' (default: 3)")
    g.add_argument("--long-prompt-tokens", type=int, default=2048, help="(default: 2048)")
    g.add_argument(
        "--chunk-tokens",
        type=int,
        default=256,
        help="prefill_chunk_tokens of the chunked run of 'mixed' (default: 256)",
    )
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    args.model = resolve_model(args.model)
    torch.set_num_threads(args.threads)
    for workload in args.workloads:
        WORKLOADS[workload](args)
