"""A stand-in engine for IPC tests that need no model: it satisfies the process loop's
``EngineLike`` (the type checker holds it to that, see ``make``).

It "generates" by echoing the prompt's ids cyclically, one token per request per step, and honours
max_tokens, stop_token_ids, eos, abort and the waiting-queue bound. It takes no grammars.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Sequence
from typing import Any

from engine_worker.interface import EngineLike, EngineLoad, EngineOverloaded
from ipc.codec import pack_ids
from ipc.config import ClusterConfig
from ipc.kv_events import KVCacheEvent
from ipc.messages import EngineStats, FinishRecord, RequestStart, SamplingParams, StepOutput
from ipc.structured import GrammarVocabulary
from runtime import start_progress


class FakeEngine:
    vocab_size = 49152
    max_model_len = 256
    eos_token_ids = [2]
    model_name = "fake-echo"
    wakeup_fd = None

    def __init__(self, max_waiting: int = 4096, step_s: float = 0.002) -> None:
        self.requests: dict[str, dict[str, Any]] = {}
        self.aborted: set[str] = set()
        self.max_waiting = max_waiting
        self.step_no = 0
        self.step_s = step_s

    def add(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams,
        arrival_time: float | None = None,
        grammar: str = "",
        cache_salt: str | None = None,
    ) -> None:
        if len(self.requests) >= self.max_waiting:
            raise EngineOverloaded("fake queue full")
        if len(prompt_token_ids) + 1 > self.max_model_len:
            raise ValueError("prompt too long")
        self.requests[request_id] = dict(
            ids=list(prompt_token_ids), sampling=sampling, n=0, t=arrival_time or time.monotonic()
        )

    def abort(self, request_id: str) -> None:
        self.aborted.add(request_id)

    def has_work(self) -> bool:
        return bool(self.requests)

    def step_delay_s(self) -> float:
        return 0.0

    def set_grammar_vocabulary(self, vocabulary: GrammarVocabulary) -> bool:
        return False

    def load(self) -> EngineLoad:
        return EngineLoad(running=len(self.requests), waiting=0)

    def take_cache_events(self) -> list[KVCacheEvent]:
        return []  # no prefix cache

    def close(self) -> None:
        pass

    def step(self) -> StepOutput:
        self.step_no += 1
        now = time.monotonic()
        out = StepOutput(step=self.step_no, t_step=now, stats=EngineStats())
        tokens = []
        for rid, r in list(self.requests.items()):
            if rid in self.aborted:
                self.aborted.discard(rid)
                del self.requests[rid]
                out.finished.append(FinishRecord(rid, "abort"))
                continue
            token = r["ids"][r["n"] % len(r["ids"])]
            if r["n"] == 0:
                out.started.append(RequestStart(rid, r["t"], now, 0))
            r["n"] += 1
            out.request_ids.append(rid)
            tokens.append(token)
            s = r["sampling"]
            reason = None
            if token in s.stop_token_ids or (token in self.eos_token_ids and not s.ignore_eos):
                reason = "stop"
            elif r["n"] >= s.max_tokens:
                reason = "length"
            if reason:
                del self.requests[rid]
                out.finished.append(FinishRecord(rid, reason))
        out.token_ids = pack_ids(tokens)
        time.sleep(self.step_s)
        return out


def make(config: ClusterConfig) -> EngineLike:
    """The cluster's engine_factory (tests.procs.fake_engine:make)."""
    return FakeEngine(config.engine.max_waiting_requests)


def make_slow(config: ClusterConfig) -> EngineLike:
    """20 ms a step, so requests stay in flight for seconds (fault tests)."""
    return FakeEngine(config.engine.max_waiting_requests, step_s=0.02)


START_S_ENV = "SPLITSERVE_TEST_FAKE_START_S"  # how long make_building / make_silent start


def make_building(config: ClusterConfig) -> EngineLike:
    """Takes SPLITSERVE_TEST_FAKE_START_S to start, saying all the while that it is alive (as a
    first start's kernel build does: ``start_progress.alive``, called every 0.1 s)."""
    deadline = time.monotonic() + float(os.environ[START_S_ENV])
    while time.monotonic() < deadline:
        start_progress.alive("building a stand-in for a kernel")
        time.sleep(0.1)
    return make(config)


def make_silent(config: ClusterConfig) -> EngineLike:
    """Takes SPLITSERVE_TEST_FAKE_START_S to start and says nothing meanwhile; a SIGTERM ends it
    at once (a test need not wait out the supervisor's grace for a worker that ignores it)."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    time.sleep(float(os.environ[START_S_ENV]))
    return make(config)
