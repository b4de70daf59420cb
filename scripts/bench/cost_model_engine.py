"""The cost-model engine: the real engine (scheduler, paged KV blocks, prefix cache, its KV
events) whose model forward is replaced by a wait as long as a cost model says a step takes.

Why: on this project's CPUs the real model's prefill is so slow, and the processes of two
replicas share so few cores, that CPU contention, not the routing, would decide a data-parallel
comparison. A replica that waits instead of computing leaves the cores to the tokenizer
workers, the detokenizer and the client, as an accelerator would, while everything the routing
acts on stays real: which blocks each replica's prefix cache holds and evicts, what each request
finds there, how long its prefill takes because of it, and every message on every socket.

The step time is ``base + prefill tokens x per_prefill_token + decode rows x per_decode_row``
(defaults loosely shaped like an 8B model on one H100: 6 ms a step, 60 us a prompt token, 50 us
a decoding request), divided by the replica's engine threads: a replica with twice the cores
is modelled twice as fast (ideal scaling, the best case for one big replica). The parameters
travel in the environment (``STEP_COST_ENV``), which the supervisor's children inherit.

Use it as a cluster's engine_factory: ``scripts.bench.cost_model_engine:make``; the model
directory only gives the engine a vocabulary and a tiny KV cache layout (fast_engine_model).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from engine_worker.model_runner import StepResult
from engine_worker.request import EngineRequest
from ipc.config import ClusterConfig

STEP_COST_ENV = "SPLITSERVE_BENCH_STEP_COST"  # "base_ms,prefill_us_per_token,decode_us_per_row"
FACTORY = "scripts.bench.cost_model_engine:make"


@dataclass(frozen=True, slots=True)
class StepCost:
    base_ms: float = 6.0
    prefill_us_per_token: float = 60.0
    decode_us_per_row: float = 50.0

    def seconds(self, prefill_tokens: int, decode_rows: int) -> float:
        return (
            self.base_ms * 1e-3
            + prefill_tokens * self.prefill_us_per_token * 1e-6
            + decode_rows * self.decode_us_per_row * 1e-6
        )

    def to_env(self) -> str:
        return f"{self.base_ms},{self.prefill_us_per_token},{self.decode_us_per_row}"

    @classmethod
    def from_env(cls) -> StepCost:
        text = os.environ.get(STEP_COST_ENV, "")
        return cls(*(float(v) for v in text.split(","))) if text else cls()


class CostModelRunner:
    """What the engine asks of its model runner (``run``, ``reset``, ``close``), waiting out the
    modelled step instead of computing it. The sampled token is a fixed function of the
    position: requests that share a prompt produce the same output, as at temperature 0."""

    def __init__(self, cost: StepCost, speed: float) -> None:
        self.cost, self.speed = cost, speed
        self.steps = 0
        self.modelled_s = 0.0

    def run(self, requests: list[EngineRequest], counts: list[int], kept_ends=None) -> StepResult:
        prefill = sum(c for r, c in zip(requests, counts) if r.num_computed < r.prompt_len)
        decode = len(requests) - sum(1 for r in requests if r.num_computed < r.prompt_len)
        seconds = self.cost.seconds(prefill, decode) / self.speed
        time.sleep(seconds)
        self.steps += 1
        self.modelled_s += seconds
        tokens: list[int | None] = [
            token_at(r.num_tokens) if r.num_computed + c == r.num_tokens and r.samples else None
            for r, c in zip(requests, counts)
        ]
        return StepResult(tokens, {}, [])

    def reset(self) -> None:
        pass

    def close(self) -> None:
        pass


def token_at(position: int) -> int:
    """The token the model samples after ``position`` tokens."""
    return 1000 + position % 997


def output_ids(prompt_tokens: int, count: int) -> list[int]:
    """What a request of ``prompt_tokens`` generates, ``count`` tokens of it: a client that gets
    only text back (over HTTP) resends a reply's exact ids with these."""
    return [token_at(prompt_tokens + i) for i in range(count)]


def make(config: ClusterConfig):
    """The cluster's engine_factory: the real engine on ``config.model_path``, model runner
    replaced."""
    from engine_worker.engine import Engine

    engine = Engine(config.engine, cache_events=True)
    engine.runner = CostModelRunner(  # type: ignore[assignment]
        StepCost.from_env(), speed=max(1, config.engine.engine_threads)
    )
    return engine
