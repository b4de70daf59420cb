"""What the engine benchmarks share (scripts/bench_engine.py and its workload modules): engines
on the benchmark's --dtype/--weights, prompts, sampling settings, and tokens/s of our engine
and of transformers ``generate`` measured the same way."""

from __future__ import annotations

import time

import numpy as np
import torch

from engine_worker.engine import Engine
from ipc.engine_config import EngineConfig
from ipc.messages import SamplingParams
from procs.model_store import load_reference_model

DENSE_WEIGHTS = {"float32": "fp32", "bfloat16": "bf16", "auto": "auto"}


def random_prompt(rng: np.random.Generator, length: int) -> list[int]:
    return [1] + rng.integers(100, 40000, size=length - 1).tolist()


def make_engine(args, **knobs) -> Engine:
    """An engine on --dtype/--weights (unset: dense float32, as transformers runs)."""
    knobs.setdefault("kv_cache_tokens", args.kv_cache_tokens)
    knobs.setdefault("dtype", args.dtype or "float32")
    knobs.setdefault("weights", args.weights or DENSE_WEIGHTS[knobs["dtype"]])
    # Figures are printed with the thread count they ran with: the engine keeps it.
    knobs.setdefault("adaptive_threads", False)
    return Engine(EngineConfig(model_path=str(args.model), engine_threads=args.threads, **knobs))


def default_launch_knobs(args) -> dict[str, str]:
    """What `splitserve launch` runs unless told otherwise (what 'peer' compares)."""
    return {"dtype": args.dtype or "auto", "weights": args.weights or "auto"}


def params(max_tokens: int, **sampling) -> SamplingParams:
    """Greedy unless ``sampling`` says otherwise; every requested token is generated."""
    return SamplingParams(
        max_tokens=max_tokens, **{"temperature": 0.0, **sampling}, ignore_eos=True
    )


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


def engine_decode_rate(
    engine: Engine, prompts: list[list[int]], new_tokens: int, **sampling
) -> float:
    """Decode tokens/s of ``new_tokens`` steps after everyone's prefill (the same count
    hf_decode_rate times). ``sampling``: SamplingParams fields (default greedy)."""
    engine_decode_rate.runs = getattr(engine_decode_rate, "runs", 0) + 1
    for i, prompt in enumerate(prompts):
        engine.add(
            f"decode{engine_decode_rate.runs}.{i}", prompt, params(new_tokens + 1, **sampling)
        )
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


def hf_decode_rate(model, prompts: list[list[int]], new_tokens: int, **sampling) -> float:
    """Decode tokens/s of ``new_tokens`` steps after the prefill, timed inside generate (the
    difference of two whole generate calls is mostly prefill noise at batch 32)."""
    clock = _StepClock()
    hf_generate_seconds(model, prompts, new_tokens + 1, clock, **sampling)
    assert len(clock.times) == new_tokens + 1, len(clock.times)
    return len(prompts) * new_tokens / (clock.times[-1] - clock.times[0])


def load_hf(args):
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    hf = load_reference_model(args.model, dtype)
    hf.generation_config.eos_token_id = None  # count every requested token
    return hf


def decode_prompts(args, rng: np.random.Generator, batch: int) -> list[list[int]]:
    low, high = args.decode_prompt_tokens // 2, args.decode_prompt_tokens * 3 // 2
    return [random_prompt(rng, int(n)) for n in rng.integers(low, high + 1, size=batch)]


def best_decode_rates(
    args,
    engine: Engine,
    hf,
    prompts: list[list[int]],
    ours_sampling: dict | None = None,
    hf_sampling: dict | None = None,
) -> tuple[float, float]:
    """Best of --repeats for both, alternating, so a disturbance hits one run, not one side."""
    hf_generate_seconds(hf, prompts, 2, **(hf_sampling or {}))  # warm-up
    ours = theirs = 0.0
    for _ in range(args.repeats):
        ours = max(
            ours, engine_decode_rate(engine, prompts, args.decode_tokens, **(ours_sampling or {}))
        )
        theirs = max(theirs, hf_decode_rate(hf, prompts, args.decode_tokens, **(hf_sampling or {})))
    return ours, theirs


def print_rates(
    title: str, rows: list[tuple[str, float, float]], peer: str = "transformers"
) -> None:
    print(title)
    print(f"{'':24s}{'engine tok/s':>14s}{peer:>14s}{'ratio':>8s}")
    for name, ours, theirs in rows:
        print(f"{name:24s}{ours:14.1f}{theirs:14.1f}{ours / theirs:8.2f}x")
