"""The 'logprobs' workload of the engine benchmark (scripts/bench/engine.py): what logprobs cost,
and who pays.

decode  one batch of the largest --decode-batch decoding --decode-tokens steps, where the
        first request asks for its token's logprob and the top 20 on every other step only
        (then, in a second run, every request does): adjacent steps of the same batch
        compare with and without, so load on a shared machine and the growing context hit
        both sides alike. Step time median and best, and decode tokens/s from the median.
row     the logprob work of one decode step alone (log-softmax of the asking rows, top-20,
        the sampled token's logprob, the copy to the host) for one row and for the whole
        batch, best of 200.
prompt  prefill tokens/s of one --prefill-tokens prompt (the first length) plain, with
        prompt_logprobs 0 and with 20 (what echo and scoring cost), interleaved, best of
        --repeats.
"""

from __future__ import annotations

import itertools
import statistics
import time

import numpy as np
import torch

from engine_worker.engine import Engine
from engine_worker.logprobs import SampledLogprobs
from scripts.bench.engine_runs import (
    decode_prompts,
    make_engine,
    params,
    prefill_all,
    prefill_rate,
    random_prompt,
)
from scripts.bench.interleave import best_of

TOP = 20
_runs = itertools.count()


def run_logprobs(args) -> None:
    batch = max(args.decode_batch)
    engine = make_engine(args, enable_prefix_cache=False, max_batch_size=batch)
    prompts = decode_prompts(args, np.random.default_rng(0), batch)
    print(
        f"\nlogprobs (threads={torch.get_num_threads()}, {engine.runner.model.dtype}, "
        f"{engine.model_name}, "
        f"decode batch {batch}, {args.decode_tokens} steps alternating off/on)"
    )
    print(f"  {'':26s}{'median ms':>10s}{'best ms':>9s}{'tok/s':>8s}{'ratio':>8s}")
    for asking in ([0], list(range(batch))):
        off, on = alternating_step_ms(engine, prompts, args.decode_tokens, asking)
        who = "1 request asks" if len(asking) == 1 else f"all {batch} ask"
        for name, times in (("none asks", off), (f"{who} top {TOP}", on)):
            median = statistics.median(times)
            print(
                f"  {name:26s}{median:10.2f}{min(times):9.2f}{batch / median * 1000:8.1f}"
                f"{median / statistics.median(off):8.3f}x"
            )
    for rows in (1, batch):
        print(
            f"  logprob work alone, {rows:2d} asking row(s): "
            f"{logprob_work_ms(batch, engine.vocab_size, rows):.3f} ms per step"
        )
    run_prompt_logprobs(args)


def alternating_step_ms(
    engine: Engine, prompts: list[list[int]], steps: int, asking: list[int]
) -> tuple[list[float], list[float]]:
    """Decode step times (ms) of one batch, with the ``asking`` requests' logprobs off on even
    steps and on (top 20) on odd ones."""
    run = next(_runs)
    ids = [f"lp{run}.{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts):
        engine.add(request_id, prompt, params(steps + 2))
    prefill_all(engine)
    samplers = [engine.requests[ids[i]].sampler for i in asking]
    times: tuple[list[float], list[float]] = ([], [])
    for step in range(steps):
        on = step % 2
        for sampler in samplers:
            sampler.logprobs = TOP if on else None
        start = time.perf_counter()
        out = engine.step()
        times[on].append((time.perf_counter() - start) * 1000)
        assert len(out.logprobs) == (len(asking) if on else 0)
    while engine.has_work():
        engine.step()
    return times


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
    cases = {
        "plain": {},
        "prompt_logprobs 0": {"prompt_logprobs": 0},
        f"prompt_logprobs {TOP}": {"prompt_logprobs": TOP},
    }
    rates = best_of(
        {
            name: lambda extra=extra: prefill_rate(engine, prompt, **extra)
            for name, extra in cases.items()
        },
        args.repeats,
    )
    for name, rate in rates.items():
        print(
            f"  prefill {length} tokens, {name:18s}{rate:10.1f} tok/s{rate / rates['plain']:8.3f}x"
        )
