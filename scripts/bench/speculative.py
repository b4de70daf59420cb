"""Speculative decoding (n-gram drafts) against plain decoding, the engine alone, same process.

Three workloads of chat prompts on the default model (greedy, ``--max-tokens`` each):
  summary  summarize a ~500-token passage (paragraphs of this repository's docs)
  code     rewrite a ~300-token Python snippet (from this repository) with one change
  chat     short questions with nothing to copy (the proposer finds little)
each at every ``--streams`` count (requests decoding together; ``--rounds`` batches of that many,
one after another). Both engines are built once and run each batch in turn (off, on, on, off,
...), so load on the machine weighs alike on both. Per run: output tokens/s, the mean time per
output token of a stream (TPOT) and ITL p50 (gaps between a stream's tokens, pooled; tokens one
step emits together are 0 apart, as a streaming client sees them), acceptance; and the ratios.
Greedy output is the same either way (tests/engine_worker/test_speculative_real.py): the
script checks it too.

``--llama-server PATH``: then llama.cpp's server on the same model's GGUF, one stream, one slot,
``--threads`` threads, without and with ``--spec-type ngram-simple``, on the same prompts (its own
decode timings: predicted tokens over predicted ms).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import re
import time
from pathlib import Path

import httpx
import numpy as np

from engine_worker.engine import Engine
from ipc.codec import unpack_ids
from ipc.engine_config import EngineConfig
from ipc.messages import SamplingParams
from procs.model_store import ensure_default_model
from runtime.model_files import load_tokenizer
from scripts.bench.chat_prompts import QUESTIONS, chat_prompt_ids
from scripts.bench.launcher import LlamaServer, default_gguf

REPO = Path(__file__).resolve().parents[2]
_ids = itertools.count()


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


def workload_prompts(model_dir, name: str, count: int) -> list[list[int]]:
    fast = load_tokenizer(model_dir)
    if name == "chat":
        questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(count)]
    elif name == "summary":
        questions = [
            f"Summarize this passage, quoting its key sentences:\n\n{text}"
            for text in passages(fast, count, 500, "summary")
        ]
    else:
        questions = [
            "Rewrite this Python code with one change: rename the variable `request` to `req` "
            f"everywhere. Output the whole code.\n\n```python\n{text}```"
            for text in passages(fast, count, 300, "code")
        ]
    return chat_prompt_ids(model_dir, questions)[1]


def run_batch(engine: Engine, prompts: list[list[int]], max_tokens: int) -> dict:
    """Runs the prompts together to the end; per request, its tokens and their times."""
    names = [f"b{next(_ids)}" for _ in prompts]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for name, prompt in zip(names, prompts):
        engine.add(name, prompt, params)
    tokens: dict[str, list[int]] = {n: [] for n in names}
    times: dict[str, list[float]] = {n: [] for n in names}
    t_start = time.perf_counter()
    while engine.requests:
        out = engine.step()
        now = time.perf_counter()
        for rid, token in zip(out.request_ids, unpack_ids(out.token_ids)):
            tokens[rid].append(int(token))
            times[rid].append(now)
    wall = time.perf_counter() - t_start
    return {"tokens": [tokens[n] for n in names], "times": [times[n] for n in names], "wall": wall}


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


def llama_rates(args, model_dir: Path, workloads: list[str]) -> None:
    """Decode tokens/s of one llama-server stream, without and with ngram-simple drafts."""
    prompts = {w: workload_prompts(model_dir, w, args.rounds) for w in workloads}
    rates: dict[tuple[str, str], float] = {}
    for name, extra in (("plain", ""), ("ngram-simple", "--spec-type ngram-simple")):
        server = LlamaServer(
            args.llama_server, default_gguf(), args.threads, 1, 4096, extra_args=extra
        )
        with contextlib.closing(server):
            url = server.url.removesuffix("/v1")  # its native /completion endpoint
            for workload, batch in prompts.items():
                tokens = seconds = 0.0
                for prompt in batch:
                    body = {"prompt": prompt, "n_predict": args.max_tokens, "temperature": 0}
                    body |= {"ignore_eos": True, "cache_prompt": False}
                    timings = httpx.post(f"{url}/completion", json=body, timeout=600).json()
                    tokens += timings["timings"]["predicted_n"]
                    seconds += timings["timings"]["predicted_ms"] / 1e3
                rates[name, workload] = tokens / seconds
    print(f"\nllama-server, 1 stream, {args.threads} thread(s): decode tok/s plain / ngram-simple")
    for workload in workloads:
        plain, spec = rates["plain", workload], rates["ngram-simple", workload]
        print(f"{workload:9s}{plain:10.1f}{spec:10.1f}{spec / plain:7.2f}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m scripts.bench speculative", description=__doc__)
    p.add_argument("--workloads", default="summary,code,chat")
    p.add_argument("--streams", default="1,8", help="requests decoding together, per run")
    p.add_argument("--rounds", type=int, default=2, help="batches per (workload, streams)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--num-speculative-tokens", type=int, default=3)
    p.add_argument("--prompt-lookup-min", type=int, default=2)
    p.add_argument("--prompt-lookup-max", type=int, default=4)
    p.add_argument(
        "--speculative-max-batch", type=int, default=8, help="8: speculate at every --streams"
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--llama-server", default="", help="llama-server binary: measure it too")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    model_dir = ensure_default_model()
    if args.llama_server:
        llama_rates(args, Path(model_dir), args.workloads.split(","))
    knobs = dict(
        model_path=str(model_dir),
        kv_cache_tokens=32768,
        max_batch_size=64,
        adaptive_threads=False,
        engine_threads=args.threads,
    )
    engines = {
        "off": Engine(EngineConfig(**knobs)),
        "ngram": Engine(
            EngineConfig(
                **knobs,
                speculative="ngram",
                num_speculative_tokens=args.num_speculative_tokens,
                prompt_lookup_min=args.prompt_lookup_min,
                prompt_lookup_max=args.prompt_lookup_max,
                speculative_max_batch=args.speculative_max_batch,
            )
        ),
    }
    print(f"load before: {os.getloadavg()[0]:.2f}; {args}")
    header = f"{'workload':9s}{'streams':>8s}{'tok/s off':>11s}{'tok/s on':>10s}{'ratio':>7s}"
    header += f"{'TPOT off':>10s}{'TPOT on':>9s}{'ITLp50 off':>12s}{'ITLp50 on':>11s}"
    header += f"{'accept':>8s}{'same':>6s}"
    rows = [header]
    for workload in args.workloads.split(","):
        for streams in (int(s) for s in args.streams.split(",")):
            prompts = workload_prompts(model_dir, workload, streams * args.rounds)
            runs: dict[str, list[dict]] = {"off": [], "ngram": []}
            counters = engines["ngram"].speculation
            before = (counters.draft_tokens, counters.accepted_tokens)
            for r in range(args.rounds):
                batch = prompts[r * streams : (r + 1) * streams]
                order = ("off", "ngram") if r % 2 == 0 else ("ngram", "off")
                for mode in order:
                    runs[mode].append(run_batch(engines[mode], batch, args.max_tokens))
            same = all(a["tokens"] == b["tokens"] for a, b in zip(runs["off"], runs["ngram"]))
            drafted = counters.draft_tokens - before[0]
            accepted = (counters.accepted_tokens - before[1]) / drafted if drafted else 0.0
            off, on = summarize(runs["off"]), summarize(runs["ngram"])
            rows.append(
                f"{workload:9s}{streams:8d}{off['tok_s']:11.1f}{on['tok_s']:10.1f}"
                f"{on['tok_s'] / off['tok_s']:7.2f}{off['tpot_ms']:10.1f}{on['tpot_ms']:9.1f}"
                f"{off['itl_p50_ms']:12.1f}{on['itl_p50_ms']:11.1f}{accepted:8.2f}"
                f"{'yes' if same else 'NO':>6s}"
            )
            print(rows[-1], flush=True)
    print(f"load after: {os.getloadavg()[0]:.2f}")
    print("\n".join(rows))
    spent = engines["ngram"].scheduler.propose_s
    print(f"proposer: {spent * 1e3:.1f} ms in all, {engines['ngram'].speculation.drafts} drafts")
    return 0
