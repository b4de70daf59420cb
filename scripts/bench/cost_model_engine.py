"""The cost-model engine (why: docs/data-parallel.md): the real engine (scheduler, paged KV
blocks, prefix cache, its KV events) whose model forward is a wait as long as a step costs:
``base + prefill tokens x per_prefill_token + decode rows x per_decode_row`` (defaults loosely an
8B model on one H100: 6 ms, 60 us, 50 us), divided by the replica's engine threads. The
parameters travel in the environment (``STEP_COST_ENV``) to the supervisor's children. A
cluster's engine_factory (``FACTORY``); the model directory gives a vocabulary and a KV layout.
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

    def run(self, requests: list[EngineRequest], counts: list[int], kept_ends=None) -> StepResult:
        prefill = sum(c for r, c in zip(requests, counts) if r.num_computed < r.prompt_len)
        decode = len(requests) - sum(1 for r in requests if r.num_computed < r.prompt_len)
        time.sleep(self.cost.seconds(prefill, decode) / self.speed)
        tokens: list[int | None] = [
            token_at(r.num_tokens) if r.num_computed + c == r.num_tokens and r.samples else None
            for r, c in zip(requests, counts)
        ]
        return StepResult(tokens, {}, [])

    def reset(self) -> None:
        pass

    def expert_stats(self) -> dict:
        return {}

    def close(self) -> None:
        pass


def token_at(position: int) -> int:
    """The token the model samples after ``position`` tokens."""
    return 1000 + position % 997


def make(config: ClusterConfig):
    """The cluster's engine_factory: the real engine on ``config.model_path``, model runner
    replaced."""
    from engine_worker.engine import Engine

    engine = Engine(config.engine, cache_events=True)
    engine.runner = CostModelRunner(  # type: ignore[assignment]
        StepCost.from_env(), speed=max(1, config.engine.engine_threads)
    )
    return engine
