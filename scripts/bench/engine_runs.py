"""What the engine-alone workloads share (engine, engine_formats, engine_logprobs, structured):
engines on the benchmark's --dtype/--weights, prompts, sampling, the one prefill loop and the one
decode loop, and transformers' ``generate`` timed the same way."""

from __future__ import annotations

import itertools
import select
import time
from dataclasses import dataclass

import numpy as np
import torch

from engine_worker.engine import Engine
from ipc.engine_config import EngineConfig
from ipc.messages import SamplingParams
from procs.model_store import gguf_file

DENSE_WEIGHTS = {"float32": "fp32", "bfloat16": "bf16", "auto": "auto"}
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


def default_launch_knobs(args) -> dict[str, str]:
    """What `splitserve launch` runs unless told otherwise (what llama.cpp is compared with)."""
    return {"dtype": args.dtype or "auto", "weights": args.weights or "auto"}


def params(max_tokens: int, **sampling) -> SamplingParams:
    """Greedy unless ``sampling`` says otherwise; every requested token is generated."""
    return SamplingParams(
        max_tokens=max_tokens, **{"temperature": 0.0, **sampling}, ignore_eos=True
    )


def prefill_rate(engine: Engine, prompt: list[int], **sampling) -> float:
    """Prompt tokens/s of one request's prefill to its first token."""
    engine.add(f"prefill{next(_run_ids)}", prompt, params(1, **sampling))
    start = time.perf_counter()
    while engine.has_work():
        engine.step()
    return len(prompt) / (time.perf_counter() - start)


def prefill_all(engine: Engine) -> None:
    """Steps until every request has its first token (grammars built, prompts prefilled), so
    that what follows is decode alone."""
    while engine.num_waiting or any(not r.num_generated for r in engine.scheduler.running):
        if engine.has_work():
            engine.step()
        else:  # a constrained request waits while its grammar is built off the step
            time.sleep(0.0005)


@dataclass(frozen=True, slots=True)
class DecodeRun:
    rate: float  # tokens/s over the decode steps only
    seconds: float
    constrained: int  # rows still under their grammar when decode began


def decode_run(
    engine: Engine, prompts: list[list[int]], new_tokens: int, *, grammar: str = "", **sampling
) -> DecodeRun:
    """``new_tokens`` decode steps of the whole batch after everyone's prefill (the count
    hf_decode_rate times too); ``grammar``: every row constrained by it."""
    names = [f"decode{next(_run_ids)}.{i}" for i in range(len(prompts))]
    for name, prompt in zip(names, prompts):
        engine.add(name, prompt, params(new_tokens + 1, **sampling), grammar=grammar)
    prefill_all(engine)
    constrained = sum(engine.requests[n].grammar is not None for n in names if n in engine.requests)
    start = time.perf_counter()
    produced = step_until_done(engine)
    elapsed = time.perf_counter() - start
    return DecodeRun(produced / elapsed, elapsed, constrained)


def step_until_done(engine: Engine) -> int:
    """Steps until every request has ended; returns the tokens produced. A constrained row whose
    mask is late is not work: the loop sleeps on the engine's wake-up pipe then, as the engine
    process does."""
    produced = 0
    while engine.requests:
        if engine.has_work():
            produced += len(engine.step().request_ids)
        else:
            select.select([engine.wakeup_fd], [], [], 1.0)
    return produced


def decode_rate(engine: Engine, prompts: list[list[int]], new_tokens: int, **sampling) -> float:
    return decode_run(engine, prompts, new_tokens, **sampling).rate


# --- transformers, the reference --------------------------------------------------------------
class _StepClock:
    """A logits processor that only notes the time: generate calls it once per forward, right
    after that forward (the first call follows the prefill)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        return scores


def hf_generate_seconds(
    model, prompts: list[list[int]], new_tokens: int, clock: _StepClock | None = None, **sampling
) -> float:
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
            **{"do_sample": False, **sampling},
        )
    return time.perf_counter() - start


def hf_prefill_rate(model, prompt: list[int]) -> float:
    return len(prompt) / hf_generate_seconds(model, [prompt], 1)


def hf_decode_rate(model, prompts: list[list[int]], new_tokens: int, **sampling) -> float:
    """Decode tokens/s of ``new_tokens`` steps after the prefill, timed inside generate (the
    difference of two whole generate calls is mostly prefill noise at batch 32)."""
    clock = _StepClock()
    hf_generate_seconds(model, prompts, new_tokens + 1, clock, **sampling)
    assert len(clock.times) == new_tokens + 1, len(clock.times)
    return len(prompts) * new_tokens / (clock.times[-1] - clock.times[0])


def load_hf(args):
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    gguf = gguf_file(args.model)  # transformers dequantizes a GGUF on the way in
    extra = {"gguf_file": gguf.name} if gguf else {}
    hf = AutoModelForCausalLM.from_pretrained(str(args.model), dtype=dtype, **extra).eval()
    hf.generation_config.eos_token_id = None  # count every requested token
    return hf


def print_rates(
    title: str, rows: list[tuple[str, float, float]], peer: str = "transformers"
) -> None:
    print(title)
    print(f"{'':24s}{'engine tok/s':>14s}{peer:>14s}{'ratio':>8s}")
    for name, ours, theirs in rows:
        print(f"{name:24s}{ours:14.1f}{theirs:14.1f}{ours / theirs:8.2f}x")
