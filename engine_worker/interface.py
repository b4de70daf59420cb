"""What the engine process loop (worker.py) may ask of an engine, written down once.

``Engine`` (engine.py) is the real one; tests run the process loop around stand-ins (a model-free
echo engine in tests/procs/fake_engine.py). Both satisfy ``EngineLike`` under the type checker,
so the loop calls these methods and nothing else, and never probes an engine for what it has.

This module imports no torch: the process loop and the stand-ins load without it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from ipc.kv_events import KVCacheEvent
from ipc.messages import SamplingParams, StepOutput
from ipc.structured import GrammarVocabulary


class EngineOverloaded(RuntimeError):
    """``add`` refused a request because the waiting queue is full: back-pressure, retry later.
    Every engine raises this class, so the loop can tell overload from a bad request."""


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """The engine's gauges between steps (heartbeats and routing read them)."""

    running: int
    waiting: int
    kv_blocks_total: int = 0  # 0: the engine keeps no paged KV cache (a stand-in)
    kv_blocks_used: int = 0  # held by a running request
    kv_blocks_available: int = 0  # free, or holding only a cached prefix (evictable)
    grammar_rows_deferred: int = 0  # steps a constrained row sat out waiting for its mask


class EngineLike(Protocol):
    """An engine as the process loop drives it: ``add`` and ``abort`` between steps, ``step``
    while ``has_work``. Request ids are the cluster's wire ids; an engine never tokenizes."""

    @property
    def model_name(self) -> str: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def wakeup_fd(self) -> int | None:
        """A descriptor that becomes readable when work appears without a message (a grammar
        built in the background); None when there is no such work."""

    def add(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams,
        arrival_time: float | None = None,
        grammar: str = "",
        cache_salt: str | None = None,
    ) -> None:
        """Queues a request. Raises EngineOverloaded when full, ValueError for bad input."""

    def abort(self, request_id: str) -> None:
        """Ends the request at the next step (a finish record with reason abort); an id that
        has not arrived yet is remembered, so it ends as soon as it does."""

    def has_work(self) -> bool: ...

    def step_delay_s(self) -> float:
        """Seconds the loop should still wait for more arrivals before stepping (0: now)."""

    def step(self) -> StepOutput: ...

    def set_grammar_vocabulary(self, vocabulary: GrammarVocabulary) -> bool:
        """Takes the vocabulary grammars are built against; False if it was not needed."""

    def load(self) -> EngineLoad: ...

    def take_cache_events(self) -> list[KVCacheEvent]:
        """The KV events of the prefix cache since the last call (the loop publishes them after
        each step; an engine without a prefix cache has none)."""

    def close(self) -> None:
        """Stops background threads; the loop calls it once, on its way out."""
