"""engine: the engine alone on the default model (no processes, no sockets, no tokenizer).

  core         prefill tokens/s (one prompt of each --prefill-tokens length) and decode tokens/s
               at each --decode-batch, for our engine and for transformers ``generate`` (batched,
               left padding), interleaved, with ratios. Decode prompts have varied lengths (a
               batch of real requests rarely shares one length), drawn from one seed for both.
  prefix       --num-requests requests sharing a --shared-prefix-tokens system prompt plus a
               short unique question: prompt tokens computed and TTFT p50 with and without the
               prefix cache.
  mixed        8 requests decoding while --long-prompts prompts of --long-prompt-tokens arrive:
               their inter-token latency (ITL) p50/p99 with and without chunked prefill.
  speculative  n-gram drafts against plain decoding, greedy, --max-tokens each: --texts
               ``summary`` (a ~500-token passage of the docs), ``code`` (rewrite ~300 tokens of
               Python) and ``chat`` (nothing to copy), --rounds batches at each --streams, both
               engines in turn: tokens/s, TPOT, ITL p50 (a step's tokens are 0 apart, as a
               client sees them), acceptance, and whether greedy output is the same.

core, prefix and mixed run --dtype/--weights (unset: dense float32, as transformers does);
speculative runs the default launch's. Every figure is printed with its torch thread count.
"""

from __future__ import annotations

import itertools
import os
import re
import time
from functools import partial
from pathlib import Path

import numpy as np
import torch

from engine_worker.engine import Engine
from ipc.codec import unpack_ids
from ipc.engine_config import WEIGHTS, EngineConfig
from ipc.messages import SamplingParams
from procs.config_flags import add_knob_flags, knob_values
from procs.model_store import resolve_model
from runtime.model_files import load_tokenizer
from scripts.bench.interleave import best_of
from scripts.bench.options import add_parts, add_shared, int_list, text_list, workload_parser
from tests.chat_prompts import QUESTIONS, chat_prompt_ids

DENSE_WEIGHTS = {"float32": "fp32", "bfloat16": "bf16", "auto": "auto"}
REPO = Path(__file__).resolve().parents[2]
_run_ids = itertools.count()  # request ids stay unique across runs on one engine


def random_prompt(rng: np.random.Generator, length: int) -> list[int]:
    return [1] + rng.integers(100, 40000, size=length - 1).tolist()


def decode_prompts(args, rng: np.random.Generator, batch: int) -> list[list[int]]:
    """Varied lengths (a batch of real requests rarely shares one), half to 1.5x the mean."""
    low, high = args.decode_prompt_tokens // 2, args.decode_prompt_tokens * 3 // 2
    return [random_prompt(rng, int(n)) for n in rng.integers(low, high + 1, size=batch)]


def make_engine(args, **knobs) -> Engine:
    """An engine on --dtype/--weights (unset: dense float32, as transformers runs)."""
    knobs.setdefault("kv_cache_tokens", args.kv_cache_tokens)
    knobs.setdefault("dtype", args.dtype or "float32")
    knobs.setdefault("weights", args.weights or DENSE_WEIGHTS[knobs["dtype"]])
    # Figures are printed with the thread count they ran with: the engine keeps it.
    knobs.setdefault("adaptive_threads", False)
    return Engine(EngineConfig(model_path=str(args.model), engine_threads=args.threads, **knobs))


def params(max_tokens: int) -> SamplingParams:
    """Greedy; every requested token is generated."""
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def prefill_rate(engine: Engine, prompt: list[int]) -> float:
    """Prompt tokens/s of one request's prefill to its first token."""
    engine.add(f"prefill{next(_run_ids)}", prompt, params(1))
    start = time.perf_counter()
    while engine.has_work():
        engine.step()
    return len(prompt) / (time.perf_counter() - start)


def decode_rate(engine: Engine, prompts: list[list[int]], new_tokens: int) -> float:
    """Tokens/s of ``new_tokens`` decode steps of the whole batch after everyone's prefill (the
    count hf_decode_rate times too)."""
    for i, prompt in enumerate(prompts):
        engine.add(f"decode{next(_run_ids)}.{i}", prompt, params(new_tokens + 1))
    while engine.num_waiting or any(not r.num_generated for r in engine.scheduler.running):
        engine.step()
    start, produced = time.perf_counter(), 0
    while engine.requests:
        produced += len(engine.step().request_ids)
    return produced / (time.perf_counter() - start)


# --- transformers, the reference --------------------------------------------------------------
def hf_generate_seconds(model, prompts: list[list[int]], new_tokens: int, clock=None) -> float:
    """Seconds of one batched ``generate``; ``clock``: a logits processor it calls once per
    forward, right after that forward (the first call follows the prefill)."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), 2, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):  # left padding, as batched generation needs
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=2,
            logits_processor=[clock] if clock is not None else None,
            do_sample=False,
        )
    return time.perf_counter() - start


def hf_prefill_rate(model, prompt: list[int]) -> float:
    return len(prompt) / hf_generate_seconds(model, [prompt], 1)


def hf_decode_rate(model, prompts: list[list[int]], new_tokens: int) -> float:
    """Decode tokens/s of ``new_tokens`` steps after the prefill, timed inside generate (the
    difference of two whole generate calls is mostly prefill noise at batch 32)."""
    times: list[float] = []

    def clock(input_ids, scores):
        times.append(time.perf_counter())
        return scores

    hf_generate_seconds(model, prompts, new_tokens + 1, clock)
    assert len(times) == new_tokens + 1, len(times)
    return len(prompts) * new_tokens / (times[-1] - times[0])


def load_hf(args):
    from transformers import AutoModelForCausalLM

    from procs.model_store import gguf_file

    gguf = gguf_file(args.model)  # a GGUF directory is dequantized on the way in
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    hf = AutoModelForCausalLM.from_pretrained(
        str(args.model), dtype=dtype, **({"gguf_file": gguf.name} if gguf else {})
    ).eval()
    hf.generation_config.eos_token_id = None  # count every requested token
    return hf


def run_core(args) -> None:
    """Best prefill and decode tokens/s of ours and transformers', interleaved."""
    rng = np.random.default_rng(0)
    engine = make_engine(args, enable_prefix_cache=False, max_batch_size=max(args.decode_batch))
    hf = load_hf(args)
    rows = []
    for length in args.prefill_tokens:
        prompt = random_prompt(rng, length)
        cases = {
            "ours": partial(prefill_rate, engine, prompt),
            "hf": partial(hf_prefill_rate, hf, prompt),
        }
        best = best_of(cases, args.repeats)
        rows.append((f"prefill {length} tokens", best["ours"], best["hf"]))
    for batch in args.decode_batch:
        prompts = decode_prompts(args, np.random.default_rng(batch), batch)
        hf_decode_rate(hf, prompts, 2)  # warm-up
        cases = {
            "ours": partial(decode_rate, engine, prompts, args.decode_tokens),
            "hf": partial(hf_decode_rate, hf, prompts, args.decode_tokens),
        }
        best = best_of(cases, args.repeats)
        rows.append((f"decode batch {batch}", best["ours"], best["hf"]))
    print(
        f"\ncore (threads={torch.get_num_threads()}, {args.dtype or 'float32'} for both, "
        f"{engine.model_name}; decode prompts {args.decode_prompt_tokens // 2}.."
        f"{args.decode_prompt_tokens * 3 // 2} tokens, {args.decode_tokens} new tokens)"
    )
    print(f"{'':24s}{'engine tok/s':>14s}{'transformers':>14s}{'ratio':>8s}")
    for name, ours, theirs in rows:
        print(f"{name:24s}{ours:14.1f}{theirs:14.1f}{ours / theirs:8.2f}x")


def run_arrivals(engine: Engine, arrivals: dict[int, list[tuple[str, list[int], int]]]):
    """Steps the engine, adding requests at given steps; returns each request's TTFT (ms), the
    times of its tokens, the prompt tokens computed and each request's tokens."""
    arrived, first, emitted, tokens = {}, {}, {}, {}
    prefill_tokens = step = 0
    while step in arrivals or engine.has_work() or any(s > step for s in arrivals):
        for request_id, prompt, max_tokens in arrivals.get(step, []):
            arrived[request_id] = time.monotonic()
            engine.add(request_id, prompt, params(max_tokens), arrival_time=arrived[request_id])
        out = engine.step()
        prefill_tokens += out.stats.prefill_tokens
        for request_id, token in zip(out.request_ids, unpack_ids(out.token_ids)):
            first.setdefault(request_id, out.t_step)
            emitted.setdefault(request_id, []).append(out.t_step)
            tokens.setdefault(request_id, []).append(int(token))
        step += 1
    ttft = np.array([first[r] - arrived[r] for r in arrived]) * 1000
    return ttft, emitted, prefill_tokens, tokens


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
        ttft, _, computed, _ = run_arrivals(engine, arrivals)
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
        emitted = run_arrivals(engine, arrivals)[1]
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


# --- speculative decoding ---------------------------------------------------------------------
def passages(tokenizer, count: int, tokens: int, kind: str) -> list[str]:
    """``count`` texts of about ``tokens`` tokens: paragraphs of docs/*.md (summary) or the
    leading lines of Python modules (code)."""
    if kind == "summary":
        paragraphs = [
            p.strip()
            for f in sorted((REPO / "docs").glob("*.md"))
            for p in f.read_text().split("\n\n")
            if len(p) > 200 and not p.lstrip().startswith(("|", "```", "#"))
        ]
    else:
        paragraphs = [
            re.sub(r'""".*?"""', "", f.read_text(), count=1, flags=re.S).strip()
            for f in sorted((REPO / "engine_worker").glob("*.py"))
        ]
    out = []
    for start in range(len(paragraphs)):
        text, end = "", start
        while end < len(paragraphs) and len(tokenizer.encode(text).ids) < tokens:
            text = (text + "\n\n" + paragraphs[end]).strip()
            end += 1
        if kind == "code":
            lines, text = text.split("\n"), ""
            for line in lines:  # cut at about `tokens` tokens, on a line
                if len(tokenizer.encode(text).ids) >= tokens:
                    break
                text += line + "\n"
        out.append(text)
        if len(out) == count:
            break
    return out


# What each text asks (the passage goes in the braces), and the passage's length in tokens.
ASKS = {
    "summary": ("Summarize this passage, quoting its key sentences:\n\n{}", 500),
    "code": (
        "Rewrite this Python code with one change: rename the variable `request` to `req` "
        "everywhere. Output the whole code.\n\n```python\n{}```",
        300,
    ),
}


def workload_prompts(model_dir, name: str, count: int) -> list[list[int]]:
    if name == "chat":
        questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(count)]
    else:
        ask, tokens = ASKS[name]
        texts = passages(load_tokenizer(model_dir), count, tokens, name)
        questions = [ask.format(text) for text in texts]
    return chat_prompt_ids(model_dir, questions)[1]


def summarize(runs: list[dict]) -> dict:
    """Output tokens/s (decode only: from each batch's first token), TPOT mean, ITL p50."""
    decode_s = out_tokens = 0.0
    tpots, gaps = [], []
    for run in runs:
        first = min(t[0] for t in run["times"])
        last = max(t[-1] for t in run["times"])
        decode_s += last - first
        out_tokens += sum(len(t) - 1 for t in run["tokens"])
        for times in run["times"]:
            if len(times) > 1:
                tpots.append((times[-1] - times[0]) / (len(times) - 1))
                gaps += list(np.diff(times))
    return {
        "tok_s": out_tokens / decode_s,
        "tpot_ms": 1e3 * float(np.mean(tpots)),
        "itl_p50_ms": 1e3 * float(np.median(gaps)),
    }


def run_speculative(args) -> None:
    knobs = dict(model_path=str(args.model), kv_cache_tokens=32768, max_batch_size=64)
    knobs |= dict(adaptive_threads=False, engine_threads=args.threads)
    ngram = knob_values(args, ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"))
    ngram |= dict(speculative="ngram", speculative_max_batch=args.speculative_max_batch)
    engines = {
        "off": Engine(EngineConfig(**knobs)),
        "ngram": Engine(EngineConfig(**knobs, **ngram)),
    }
    print(f"\nspeculative (threads={args.threads}, load {os.getloadavg()[0]:.2f})")
    print(
        f"{'workload':9s}{'streams':>8s}{'tok/s off':>11s}{'tok/s on':>10s}{'ratio':>7s}"
        f"{'TPOT off':>10s}{'TPOT on':>9s}{'ITLp50 off':>12s}{'ITLp50 on':>11s}"
        f"{'accept':>8s}{'same':>6s}"
    )
    counters = engines["ngram"].speculation
    for workload in args.texts:
        for streams in args.streams:
            prompts = workload_prompts(args.model, workload, streams * args.rounds)
            runs: dict[str, list[dict]] = {"off": [], "ngram": []}
            before = (counters.draft_tokens, counters.accepted_tokens)
            for r in range(args.rounds):
                batch = prompts[r * streams : (r + 1) * streams]
                for mode in ("off", "ngram") if r % 2 == 0 else ("ngram", "off"):
                    names = [f"b{next(_run_ids)}" for _ in batch]
                    requests = [(n, p, args.max_tokens) for n, p in zip(names, batch)]
                    _, times, _, tokens = run_arrivals(engines[mode], {0: requests})
                    runs[mode].append({"tokens": [tokens[n] for n in names],
                                       "times": [times[n] for n in names]})  # fmt: skip
            same = all(a["tokens"] == b["tokens"] for a, b in zip(runs["off"], runs["ngram"]))
            drafted = counters.draft_tokens - before[0]
            accepted = (counters.accepted_tokens - before[1]) / drafted if drafted else 0.0
            off, on = summarize(runs["off"]), summarize(runs["ngram"])
            print(
                f"{workload:9s}{streams:8d}{off['tok_s']:11.1f}{on['tok_s']:10.1f}"
                f"{on['tok_s'] / off['tok_s']:7.2f}{off['tpot_ms']:10.1f}{on['tpot_ms']:9.1f}"
                f"{off['itl_p50_ms']:12.1f}{on['itl_p50_ms']:11.1f}{accepted:8.2f}"
                f"{'yes' if same else 'NO':>6s}",
                flush=True,
            )
    spent = engines["ngram"].scheduler.propose_s
    print(f"proposer: {spent * 1e3:.1f} ms in all, {counters.drafts} drafts; load after: "
          f"{os.getloadavg()[0]:.2f}")  # fmt: skip


WORKLOADS = {
    "core": run_core,
    "prefix": run_prefix,
    "mixed": run_mixed,
    "speculative": run_speculative,
}


def build_parser():
    p = workload_parser("engine", __doc__)
    add_parts(p, list(WORKLOADS), ["core"])
    add_shared(p, "model", "repeats", repeats=2)
    p.add_argument("--threads", type=int, default=2, help="torch threads (default: 2)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], help="activations")
    p.add_argument("--weights", choices=list(WEIGHTS), help="weight format (splitserve launch)")
    p.add_argument(
        "--prefill-tokens",
        type=int_list,
        default=[256, 1024],
        metavar="N[,N...]",
        help="prompt lengths of the prefill figures (default: 256,1024)",
    )
    p.add_argument("--decode-tokens", type=int, default=32, help="per figure (default: 32)")
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
    g = p.add_argument_group("prefix and mixed")
    g.add_argument("--num-requests", type=int, default=32, help="'prefix' (default: 32)")
    g.add_argument("--shared-prefix-tokens", type=int, default=1024, help="(default: 1024)")
    g.add_argument("--new-tokens", type=int, default=8, help="tokens per request (default: 8)")
    g.add_argument("--long-prompts", type=int, default=3, help="'mixed' (default: 3)")
    g.add_argument("--long-prompt-tokens", type=int, default=2048, help="(default: 2048)")
    g.add_argument("--chunk-tokens", type=int, default=256, help="'mixed' chunked (default: 256)")
    s = p.add_argument_group("speculative")
    s.add_argument(
        "--texts",
        type=text_list,
        default=["summary", "code", "chat"],
        help="any of summary,code,chat (default: all)",
    )
    s.add_argument("--streams", type=int_list, default=[1, 8], help="requests decoding together")
    s.add_argument("--rounds", type=int, default=2, help="batches per (text, streams)")
    s.add_argument("--max-tokens", type=int, default=128, help="tokens per request")
    speculative_knobs = ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max")
    speculative_knobs += ("speculative_max_batch",)  # 8 below: speculate at every --streams
    add_knob_flags(s, EngineConfig, speculative_knobs, defaults={"speculative_max_batch": 8})
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    args.model = resolve_model(args.model)
    torch.set_num_threads(args.threads)
    for workload in args.workloads:
        WORKLOADS[workload](args)
