"""The two values that cross the engine/scheduler seam each step: what to compute
(``ScheduledBatch``, from ``Scheduler.schedule``) and what the step's output did to the requests
(``StepUpdate``, from ``Scheduler.update_from_output``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from engine_worker.prefill_budget import chunk_cost
from engine_worker.request import EngineRequest
from ipc.messages import PromptLogprobs, TokenLogprobs


@dataclass(slots=True)
class ScheduledBatch:
    requests: list[EngineRequest] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    prefill_tokens: int = 0
    decode_tokens: int = 0
    token_keys: int = 0  # prefill_budget.chunk_cost of every row: what the step's time grows with
    cached_tokens: int = 0
    queried_tokens: int = 0  # prompt tokens looked up in the prefix cache (first admissions)
    preempted: int = 0
    failed: list[tuple[EngineRequest, str]] = field(default_factory=list)
    # Requests scheduled with 0 tokens (by index in ``requests``): the prefix cache kept their
    # prompt's end with its prompt tail (prefix_tails.py), the final hidden state they sample from.
    kept_ends: dict[int, torch.Tensor] = field(default_factory=dict)

    def add(
        self, request: EngineRequest, num_tokens: int, kept_end: torch.Tensor | None = None
    ) -> None:
        if kept_end is not None:
            self.kept_ends[len(self.requests)] = kept_end
        self.requests.append(request)
        self.num_new_tokens.append(num_tokens)
        self.token_keys += chunk_cost(request.num_computed, num_tokens)
        if request.is_decoding:
            self.decode_tokens += num_tokens
        else:
            self.prefill_tokens += num_tokens


class Finished(NamedTuple):
    """A request the scheduler has let go (removed, its blocks freed), and why."""

    request: EngineRequest
    reason: str
    error: str = ""
    code: str = ""


@dataclass(slots=True)
class StepUpdate:
    """What one step did to its requests, each list in the batch's order: the tokens emitted
    (one entry per token in ``request_ids`` and ``tokens``: a request's run of accepted drafts
    is cut at its first stop) and the logprob entries of those that asked (``row``: the entry's
    index in ``tokens``), the prompt logprobs computed, the requests that started (their first
    token, or their scored prompt), those that finished, those whose grammar mask was late (they
    sampled nothing), and each still running constrained request's sampled token."""

    request_ids: list[str] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)
    started: list[EngineRequest] = field(default_factory=list)
    finished: list[Finished] = field(default_factory=list)
    deferred: list[EngineRequest] = field(default_factory=list)
    constrained: list[tuple[EngineRequest, int]] = field(default_factory=list)
