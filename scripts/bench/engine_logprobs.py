"""The 'logprobs' workload of scripts/bench_engine.py: what logprobs cost, and who pays.

  decode  decode tokens/s at the largest --decode-batch when no request asks for logprobs, when
          one asks for its token's logprob and the top 20, and when all do; interleaved
          repeats, best of --repeats. The requests that do not ask must not pay (ratio ~1.00).
  row     the logprob work of one decode step alone (log-softmax of the asking rows, top-20,
          the sampled token's logprob, the copy to the host) for one row and for the whole
          batch, best of 200, against the step's own time.
  prompt  prefill tokens/s of one --prefill-tokens prompt (the first length) plain, with
          prompt_logprobs 0 and with 20 (what echo and scoring cost).
"""

from __future__ import annotations

import time

import numpy as np
import torch

from engine_worker.logprobs import SampledLogprobs
from scripts.bench_engine import (
    decode_prompts,
    engine_decode_rate,
    make_engine,
    params,
    random_prompt,
)

TOP = 20


def run_logprobs(args) -> None:
    batch = max(args.decode_batch)
    engine = make_engine(args, enable_prefix_cache=False, max_batch_size=batch)
    prompts = decode_prompts(args, np.random.default_rng(0), batch)
    cases = {"none asks": {}, f"1 of {batch} asks top {TOP}": {0: {"logprobs": TOP}},
             f"all {batch} ask top {TOP}": {i: {"logprobs": TOP} for i in range(batch)}}
    rates = dict.fromkeys(cases, 0.0)
    for _ in range(args.repeats):
        for name, overrides in cases.items():
            rates[name] = max(rates[name], engine_decode_rate(engine, prompts, args.decode_tokens,
                                                              overrides=overrides))
    base = rates["none asks"]
    print(f"\nlogprobs (threads={torch.get_num_threads()}, {args.dtype}, {engine.model_name}, "
          f"decode batch {batch}, {args.decode_tokens} new tokens, best of {args.repeats})")
    for name, rate in rates.items():
        print(f"  decode {name:24s}{rate:10.1f} tok/s{rate / base:8.3f}x")
    step_ms = batch / base * 1000
    vocab = engine.vocab_size
    for rows in (1, batch):
        ms = logprob_work_ms(batch, vocab, rows)
        print(f"  logprob work per step, {rows:2d} asking row(s): {ms:7.3f} ms "
              f"({100 * ms / step_ms:.2f}% of a {step_ms:.1f} ms step)")
    run_prompt_logprobs(args)


def logprob_work_ms(batch: int, vocab: int, rows: int, repeats: int = 200) -> float:
    """What the runner does for the asking rows of one step, timed alone, best of ``repeats``."""
    logits = torch.randn(batch, vocab)
    tokens = logits.argmax(dim=-1)
    best = float("inf")
    with torch.inference_mode():
        for _ in range(repeats):
            start = time.perf_counter()
            SampledLogprobs(logits, list(range(rows)), [TOP] * rows).finish(tokens)
            best = min(best, time.perf_counter() - start)
    return best * 1000


def run_prompt_logprobs(args) -> None:
    length = args.prefill_tokens[0]
    engine = make_engine(args, enable_prefix_cache=False)
    prompt = random_prompt(np.random.default_rng(3), length)
    cases = {"plain": {}, "prompt_logprobs 0": {"prompt_logprobs": 0},
             f"prompt_logprobs {TOP}": {"prompt_logprobs": TOP}}
    rates = dict.fromkeys(cases, 0.0)
    for r in range(args.repeats):
        for name, sampling in cases.items():
            engine.add(f"prompt{r}.{name}", prompt, params(1, **sampling))
            start = time.perf_counter()
            while engine.has_work():
                engine.step()
            rates[name] = max(rates[name], length / (time.perf_counter() - start))
    for name, rate in rates.items():
        print(f"  prefill {length} tokens, {name:18s}{rate:10.1f} tok/s"
              f"{rate / rates['plain']:8.3f}x")
