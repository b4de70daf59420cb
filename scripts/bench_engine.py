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
  kernels every weight format's linear layers on the model's own shapes (30 layers of distinct
          weights, in forward order, so they stream from memory as in a real step) at each
          --kernel-rows: ms per forward, and the crossover where dense bf16 overtakes each
          quantized format. torchao's CPU formats join when torchao is importable.
  formats the engine in each --formats weight format: prefill tokens/s and decode tokens/s at
          each --decode-batch, interleaved repeats, ratios to the first format.
  bandwidth  memory read bandwidth (a reduction over 1 GiB), the weight bytes a batch-1 decode
          step reads in each --formats format, and that format's measured batch-1 decode
          against the bound bandwidth / bytes.

Every figure is printed with the torch thread count it ran with (--threads).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine_worker.config import EngineConfig  # noqa: E402
from engine_worker.engine import Engine  # noqa: E402
from ipc.messages import SamplingParams  # noqa: E402
from procs.model_store import load_reference_model, resolve_model  # noqa: E402


def random_prompt(rng: np.random.Generator, length: int) -> list[int]:
    return [1] + rng.integers(100, 40000, size=length - 1).tolist()


def make_engine(args, **knobs) -> Engine:
    knobs.setdefault("kv_cache_tokens", args.kv_cache_tokens)
    knobs.setdefault("dtype", args.dtype)
    knobs.setdefault("weights", args.weights)
    return Engine(EngineConfig(model_path=str(args.model), num_threads=args.threads, **knobs))


def params(max_tokens: int, **sampling) -> SamplingParams:
    """Greedy unless ``sampling`` says otherwise; every requested token is generated."""
    return SamplingParams(max_tokens=max_tokens, **{"temperature": 0.0, **sampling},
                          ignore_eos=True)


# --- core: prefill and decode throughput against transformers ----------------------------------
def engine_prefill_rate(engine: Engine, prompt: list[int], repeats: int) -> float:
    best = float("inf")
    for r in range(repeats):
        engine.add(f"prefill{r}", prompt, params(1))
        start = time.perf_counter()
        while engine.has_work():
            engine.step()
        best = min(best, time.perf_counter() - start)
    return len(prompt) / best


def engine_decode_rate(engine: Engine, prompts: list[list[int]], new_tokens: int,
                       **sampling) -> float:
    """Decode tokens/s of ``new_tokens`` steps after everyone's prefill (the same count
    hf_decode_rate times). ``sampling``: SamplingParams fields (default greedy)."""
    engine_decode_rate.runs = getattr(engine_decode_rate, "runs", 0) + 1
    for i, prompt in enumerate(prompts):
        engine.add(f"decode{engine_decode_rate.runs}.{i}", prompt,
                   params(new_tokens + 1, **sampling))
    while engine.num_waiting or any(not r.num_generated for r in engine.scheduler.running):
        engine.step()  # prefill everyone first
    produced, start = 0, time.perf_counter()
    while engine.has_work():
        produced += len(engine.step().request_ids)
    return produced / (time.perf_counter() - start)


class _StepClock:
    """A logits processor that only notes the time: generate calls it once per forward, right
    after that forward (the first call follows the prefill)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        return scores


def hf_generate_seconds(model, prompts: list[list[int]], new_tokens: int,
                        clock: _StepClock | None = None, **sampling) -> float:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), 2, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):  # left padding, as batched generation needs
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, pad_token_id=2,
                       logits_processor=[clock] if clock is not None else None,
                       **{"do_sample": False, **sampling})
    return time.perf_counter() - start


def hf_decode_rate(model, prompts: list[list[int]], new_tokens: int, **sampling) -> float:
    """Decode tokens/s of ``new_tokens`` steps after the prefill, timed inside generate (the
    difference of two whole generate calls is mostly prefill noise at batch 32)."""
    clock = _StepClock()
    hf_generate_seconds(model, prompts, new_tokens + 1, clock, **sampling)
    assert len(clock.times) == new_tokens + 1, len(clock.times)
    return len(prompts) * new_tokens / (clock.times[-1] - clock.times[0])


def load_hf(args):
    hf = load_reference_model(args.model, getattr(torch, args.dtype))
    hf.generation_config.eos_token_id = None  # count every requested token
    return hf


def decode_prompts(args, rng: np.random.Generator, batch: int) -> list[list[int]]:
    low, high = args.decode_prompt_tokens // 2, args.decode_prompt_tokens * 3 // 2
    return [random_prompt(rng, int(n)) for n in rng.integers(low, high + 1, size=batch)]


def best_decode_rates(args, engine: Engine, hf, prompts: list[list[int]],
                      ours_sampling: dict | None = None,
                      hf_sampling: dict | None = None) -> tuple[float, float]:
    """Best of --repeats for both, alternating, so a disturbance hits one run, not one side."""
    hf_generate_seconds(hf, prompts, 2, **(hf_sampling or {}))  # warm-up
    ours = theirs = 0.0
    for _ in range(args.repeats):
        ours = max(ours, engine_decode_rate(engine, prompts, args.decode_tokens,
                                            **(ours_sampling or {})))
        theirs = max(theirs, hf_decode_rate(hf, prompts, args.decode_tokens,
                                            **(hf_sampling or {})))
    return ours, theirs


def print_rates(title: str, rows: list[tuple[str, float, float]]) -> None:
    print(title)
    print(f"{'':24s}{'engine tok/s':>14s}{'transformers':>14s}{'ratio':>8s}")
    for name, ours, theirs in rows:
        print(f"{name:24s}{ours:14.1f}{theirs:14.1f}{ours / theirs:8.2f}x")


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
    print_rates(f"\ncore (threads={torch.get_num_threads()}, {args.dtype} for both, "
                f"{engine.model_name}; decode prompts {args.decode_prompt_tokens // 2}.."
                f"{args.decode_prompt_tokens * 3 // 2} tokens, {args.decode_tokens} new tokens)",
                rows)


# --- sampling: decode throughput with each sampling setting -------------------------------------
# (name, our SamplingParams fields, transformers generate arguments): the same setting on both.
SAMPLING_CASES = [
    ("greedy", {}, {}),
    ("temperature 0.7", {"temperature": 0.7},
     {"do_sample": True, "temperature": 0.7, "top_k": 0, "top_p": 1.0}),
    ("top-p 0.9", {"temperature": 0.7, "top_p": 0.9},
     {"do_sample": True, "temperature": 0.7, "top_k": 0, "top_p": 0.9}),
    ("top-k 50", {"temperature": 0.7, "top_k": 50},
     {"do_sample": True, "temperature": 0.7, "top_k": 50, "top_p": 1.0}),
    ("repetition 1.2", {"repetition_penalty": 1.2}, {"repetition_penalty": 1.2}),
]


def run_sampling(args) -> None:
    batch = max(args.decode_batch)
    engine = make_engine(args, enable_prefix_cache=False, max_batch_size=batch)
    hf = load_hf(args)
    prompts = decode_prompts(args, np.random.default_rng(0), batch)
    rows = [(name, *best_decode_rates(args, engine, hf, prompts, ours, theirs))
            for name, ours, theirs in SAMPLING_CASES]
    print_rates(f"\nsampling (threads={torch.get_num_threads()}, {args.dtype} for both, "
                f"decode batch {batch}, {args.decode_tokens} new tokens)", rows)


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
    print(f"\nprefix (threads={args.threads}): {args.num_requests} requests = "
          f"{args.shared_prefix_tokens}-token shared prompt + 16 unique tokens, all at once")
    figures = {}
    for enabled in (False, True):
        engine = make_engine(args, enable_prefix_cache=enabled)
        ttft, _, computed = run_workload(engine, arrivals)
        figures[enabled] = (computed, float(np.percentile(ttft, 50)))
        print(f"  prefix cache {'on ' if enabled else 'off'}: prompt tokens computed {computed:7d}"
              f"   TTFT p50 {figures[enabled][1]:9.1f} ms   p99 {np.percentile(ttft, 99):9.1f} ms")
    (off_tokens, off_ttft), (on_tokens, on_ttft) = figures[False], figures[True]
    print(f"  prefill tokens computed reduced by {100 * (1 - on_tokens / off_tokens):.1f}%, "
          f"TTFT p50 {off_ttft / on_ttft:.1f}x lower")


# --- mixed: long prompts arriving during decode -------------------------------------------------
def run_mixed(args) -> None:
    rng = np.random.default_rng(2)
    decoders = [(f"d{i}", random_prompt(rng, 64), args.new_tokens * 8) for i in range(8)]
    arrivals: dict[int, list] = {0: decoders}
    for i in range(args.long_prompts):
        arrivals[5 + 10 * i] = [(f"long{i}", random_prompt(rng, args.long_prompt_tokens), 4)]
    print(f"\nmixed (threads={args.threads}): 8 requests decoding {args.new_tokens * 8} tokens; "
          f"{args.long_prompts} prompts of {args.long_prompt_tokens} tokens arrive meanwhile")
    p99 = {}
    for chunk in (args.long_prompt_tokens, args.chunk_tokens):
        engine = make_engine(args, prefill_chunk_tokens=chunk,
                             prefill_max_tokens=max(chunk, 64 * 8), enable_prefix_cache=False)
        _, emitted, _ = run_workload(engine, arrivals)
        gaps = np.concatenate([np.diff(emitted[r]) for r, _, _ in decoders]) * 1000
        p99[chunk] = float(np.percentile(gaps, 99))
        label = "off" if chunk == args.long_prompt_tokens else f"{chunk} tokens"
        print(f"  chunked prefill {label:>11s}: ITL p50 {np.percentile(gaps, 50):8.1f} ms   "
              f"p99 {p99[chunk]:8.1f} ms   max {gaps.max():8.1f} ms")
    print(f"  ITL p99 {p99[args.long_prompt_tokens] / p99[args.chunk_tokens]:.1f}x lower with "
          "chunked prefill")


# --- weight formats: kernels, engine throughput, memory bandwidth -------------------------------
FORMAT_DTYPES = {"fp32": "float32"}  # every other format runs the engine's auto dtype


def kernel_formats() -> dict:
    """name -> (build(weight float32) -> layer with apply(x), activation dtype)."""
    from engine_worker.linear import DenseLinear, Int4Linear, Int8Linear, quantize_int4

    bf16 = torch.bfloat16
    formats = {
        "fp32": (DenseLinear, torch.float32),
        "bf16": (lambda w: DenseLinear(w.to(bf16)), bf16),
        "int8": (lambda w: Int8Linear.from_weight(w, bf16), bf16),
        "int4": (lambda w: Int4Linear(quantize_int4(w, bf16), bf16), bf16),
    }
    try:  # torchao's CPU weight-only formats (optional; not a dependency)
        from torchao.prototype.quantization.int4.inference_workflow import (
            PrototypeInt4WeightOnlyConfig)
        from torchao.quantization import Int8WeightOnlyConfig, quantize_

        def torchao(config):
            def build(w):
                layer = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=bf16)
                layer.weight.data = w.to(bf16)
                quantize_(layer, config)
                return type("TorchaoLinear", (), {"apply": lambda self, x: layer(x)})()
            return build

        formats["ao-int8"] = (torchao(Int8WeightOnlyConfig()), bf16)
        formats["ao-int4"] = (torchao(PrototypeInt4WeightOnlyConfig(group_size=32)), bf16)
    except Exception as exc:  # noqa: BLE001 - any import or config failure just skips them
        print(f"(torchao formats skipped: {type(exc).__name__}: {exc})")
    return formats


def run_kernels(args) -> None:
    from engine_worker.model_config import ModelConfig

    cfg = ModelConfig.from_dir(args.model)
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes = {"qkv": (q + 2 * kv, cfg.hidden_size), "o_proj": (cfg.hidden_size, q),
              "gate_up": (2 * cfg.intermediate_size, cfg.hidden_size),
              "down": (cfg.hidden_size, cfg.intermediate_size)}
    formats = kernel_formats()
    torch.manual_seed(0)
    models = {}
    for name, (build, dtype) in formats.items():
        layers = [{s: build(torch.randn(n, k) * 0.05) for s, (n, k) in shapes.items()}
                  for _ in range(cfg.num_layers)]
        models[name] = (layers, build(torch.randn(cfg.vocab_size, cfg.hidden_size) * 0.05), dtype)

    def call_ms(name: str, rows: int) -> dict[str, list[float]]:
        """ms of every call of one forward's worth of linear layers, per shape, in order."""
        layers, head, dtype = models[name]
        inputs = {s: torch.randn(rows, k).to(dtype) for s, (n, k) in shapes.items()}
        spent: dict[str, list[float]] = {s: [] for s in [*shapes, "lm_head"]}
        for layer in layers:
            for s in shapes:
                start = time.perf_counter()
                layer[s].apply(inputs[s])
                spent[s].append((time.perf_counter() - start) * 1e3)
        start = time.perf_counter()
        head.apply(torch.randn(rows, cfg.hidden_size).to(dtype))
        spent["lm_head"].append((time.perf_counter() - start) * 1e3)
        return spent

    print(f"\nkernels (threads={torch.get_num_threads()}, {cfg.num_layers} layers of "
          + ", ".join(f"{s} {n}x{k}" for s, (n, k) in shapes.items())
          + f", lm_head {cfg.vocab_size}x{cfg.hidden_size}; ms per forward: each call's best of "
          f"{args.kernel_repeats} interleaved runs, summed)")
    totals: dict[tuple[str, int], float] = {}
    with torch.inference_mode():
        # Warm-up at every size first: torch's bf16 GEMM ran a 60x slower path on the first
        # batch-1 calls of a fresh process, until other sizes had run.
        for rows in args.kernel_rows:
            for name in formats:
                call_ms(name, rows)
        for rows in args.kernel_rows:
            # Each call's minimum over the runs: on a shared machine a single short call often
            # runs undisturbed even when no whole forward does.
            best: dict[str, dict[str, list[float]]] = {}
            for _ in range(args.kernel_repeats):
                for name in formats:
                    for part, times in call_ms(name, rows).items():
                        kept = best.setdefault(name, {}).setdefault(part, times)
                        kept[:] = [min(a, b) for a, b in zip(kept, times)]
            print(f"rows {rows}:")
            for name, parts in best.items():
                sums = {part: sum(times) for part, times in parts.items()}
                layers_ms = sum(v for k, v in sums.items() if k != "lm_head")
                totals[name, rows] = layers_ms + sums["lm_head"]
                print(f"  {name:8s} total {totals[name, rows]:8.2f}   layers {layers_ms:8.2f}   "
                      f"lm_head {sums['lm_head']:7.2f}   | "
                      + "  ".join(f"{k} {sums[k]:.2f}" for k in shapes))
    for name in formats:
        if name in ("fp32", "bf16"):
            continue
        faster = [r for r in args.kernel_rows if totals[name, r] < totals["bf16", r]]
        print(f"{name}: faster than bf16 at rows {faster or 'none'}")


def run_formats(args) -> None:
    rng = np.random.default_rng(0)
    formats = args.formats.split(",")
    # KV for the largest decode batch only: five engines share the machine's memory.
    kv_tokens = max(max(args.prefill_tokens), max(args.decode_batch) * (
        args.decode_prompt_tokens * 3 // 2 + args.decode_tokens + 2 * 16)) + 64
    engines = {f: make_engine(args, weights=f, dtype=FORMAT_DTYPES.get(f, "auto"),
                              enable_prefix_cache=False, max_batch_size=max(args.decode_batch),
                              kv_cache_tokens=kv_tokens)
               for f in formats}
    rows = []
    for length in args.prefill_tokens:
        prompt = random_prompt(rng, length)
        rates = dict.fromkeys(formats, 0.0)
        for _ in range(args.repeats):
            for f in formats:
                rates[f] = max(rates[f], engine_prefill_rate(engines[f], prompt, 1))
        rows.append((f"prefill {length} tokens", rates))
    for batch in args.decode_batch:
        prompts = decode_prompts(args, rng, batch)
        rates = dict.fromkeys(formats, 0.0)
        for _ in range(args.repeats):
            for f in formats:
                rates[f] = max(rates[f], engine_decode_rate(engines[f], prompts, args.decode_tokens))
        rows.append((f"decode batch {batch}", rates))
    base = formats[0]
    print(f"\nformats (threads={torch.get_num_threads()}, tokens/s, best of {args.repeats} "
          f"interleaved; ratio to {base}; {args.decode_tokens} new tokens)")
    for f in formats:
        print(f"  {f}: {engines[f].runner.model.weight_format.describe()}, "
              f"dtype {engines[f].runner.model.dtype}")
    print(f"{'':24s}" + "".join(f"{f:>16s}" for f in formats))
    for name, rates in rows:
        print(f"{name:24s}" + "".join(
            f"{rates[f]:9.1f} {rates[f] / rates[base]:5.2f}x" for f in formats))
    args.format_rates = {name: rates for name, rates in rows}


def read_bandwidth_gbs(repeats: int = 7) -> float:
    """Read bandwidth of a float32 sum over 1 GiB (far beyond any cache), best of ``repeats``."""
    buffer = torch.ones(1 << 28, dtype=torch.float32)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - start)
    return buffer.numel() * 4 / best / 1e9


def decode_bytes_per_token(model) -> int:
    """Weight bytes one batch-1 decode step reads: every linear layer's decode copy, one
    embedding row and the norms (KV reads are left out: a few KiB at short context)."""
    layers = sum(layer.qkv.nbytes + layer.o_proj.nbytes + layer.gate_up.nbytes
                 + layer.down.nbytes + 2 * layer.input_norm.numel() * layer.input_norm.element_size()
                 for layer in model.layers)
    return layers + model.lm_head.nbytes + model.embed[0].numel() * model.embed.element_size()


def run_bandwidth(args) -> None:
    formats = args.formats.split(",")
    gbs = read_bandwidth_gbs()
    args.decode_batch = [1]
    if not getattr(args, "format_rates", None):
        run_formats(args)
    measured = args.format_rates["decode batch 1"]
    print(f"\nbandwidth (threads={torch.get_num_threads()}): measured read bandwidth "
          f"{gbs:.1f} GB/s (float32 sum over 1 GiB, best of 7)")
    print(f"{'':8s}{'MB read/token':>15s}{'bound tok/s':>13s}{'decode b=1':>12s}{'of bound':>10s}"
          f"{'achieved GB/s':>15s}")
    for f in formats:
        engine = make_engine(args, weights=f, dtype=FORMAT_DTYPES.get(f, "auto"),
                             kv_cache_tokens=1024)
        nbytes = decode_bytes_per_token(engine.runner.model)
        bound = gbs * 1e9 / nbytes
        print(f"{f:8s}{nbytes / 1e6:15.1f}{bound:13.1f}{measured[f]:12.1f}"
              f"{100 * measured[f] / bound:9.0f}%{measured[f] * nbytes / 1e9:15.1f}")


def main() -> None:
    def ints(text: str) -> list[int]:
        return [int(x) for x in text.split(",")]

    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("workloads", nargs="*", default=["core"],
                        choices=["core", "sampling", "prefix", "mixed", "kernels", "formats",
                                 "bandwidth"],
                        help="what to run (default: core)")
    parser.add_argument("--model", default=None, help="HF checkpoint dir (default model if unset)")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="weights and activations, for the engine and transformers alike")
    parser.add_argument("--weights", default=None, choices=["auto", "bf16", "fp32", "int8", "int4"],
                        help="the engine's weight format in core/sampling/prefix/mixed "
                             "(default: dense in --dtype, as transformers runs)")
    parser.add_argument("--formats", default="fp32,bf16,int8,int4,auto",
                        help="weight formats compared by 'formats' and 'bandwidth' (fp32 runs "
                             "float32 activations, the others the CPU's auto dtype)")
    parser.add_argument("--kernel-rows", type=ints, default=[1, 2, 4, 8, 16, 32, 256],
                        help="rows (tokens) per linear call for 'kernels'")
    parser.add_argument("--kernel-repeats", type=int, default=5,
                        help="interleaved runs of each format in 'kernels'; the best counts")
    parser.add_argument("--kv-cache-tokens", type=int, default=65536)
    parser.add_argument("--prefill-tokens", type=ints, default=[256, 1024],
                        help="prompt lengths for the prefill figures (comma-separated)")
    parser.add_argument("--decode-batch", type=ints, default=[1, 8, 32],
                        help="batch sizes for the decode figures (comma-separated)")
    parser.add_argument("--decode-prompt-tokens", type=int, default=128,
                        help="mean decode prompt length; lengths vary from half to 1.5x")
    parser.add_argument("--decode-tokens", type=int, default=32, help="tokens decoded per figure")
    parser.add_argument("--repeats", type=int, default=2,
                        help="runs of each prefill/decode figure, both sides; the best counts")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--shared-prefix-tokens", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=8, help="tokens per request (prefix)")
    parser.add_argument("--long-prompts", type=int, default=3)
    parser.add_argument("--long-prompt-tokens", type=int, default=2048)
    parser.add_argument("--chunk-tokens", type=int, default=256,
                        help="prefill_chunk_tokens for the chunked run of 'mixed'")
    args = parser.parse_args()
    args.model = resolve_model(args.model)
    args.weights = args.weights or {"float32": "fp32", "bfloat16": "bf16"}[args.dtype]
    torch.set_num_threads(args.threads)
    for workload in args.workloads:
        {"core": run_core, "sampling": run_sampling, "prefix": run_prefix,
         "mixed": run_mixed, "kernels": run_kernels, "formats": run_formats,
         "bandwidth": run_bandwidth}[workload](args)


if __name__ == "__main__":
    main()
