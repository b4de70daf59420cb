"""One request's state inside the engine."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from engine_worker.prefix_cache import ROOT_NODE
from engine_worker.sampler import RequestSampler
from engine_worker.speculative import LookupContext
from ipc.messages import FINISH_LENGTH, FINISH_STOP, SamplingParams

if TYPE_CHECKING:
    from engine_worker.grammar_builder import RequestGrammar


class EngineRequest:
    """Tokens are prompt + generated; ``num_computed`` of them have their KV in the cache. Only
    the scheduler (engine_worker/scheduler/) changes the scheduling state after construction.

    A step computes ``token_ids[num_computed:num_computed + n]``; when that reaches the end of
    ``token_ids`` the step samples one new token. Decode is the case n == 1, chunked prefill and
    recompute after preemption are the cases where the end is not reached yet."""

    __slots__ = (
        "request_id",
        "token_ids",
        "prompt_len",
        "params",
        "sampler",
        "stop_ids",
        "max_total_len",
        "t_arrived",
        "t_scheduled",
        "num_computed",
        "block_ids",
        "block_keys",
        "prefix_node",
        "cached_tokens",
        "started_sent",
        "num_generated",
        "samples",
        "prompt_logprobs_from",
        "grammar",
        "cache_salt",
        "speculates",
        "draft_ids",
        "lookup",
    )

    def __init__(
        self,
        request_id: str,
        token_ids: list[int],
        params: SamplingParams,
        sampler: RequestSampler,
        stop_ids: frozenset[int],
        max_model_len: int,
        t_arrived: float,
        cache_salt: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.token_ids = token_ids
        self.prompt_len = len(token_ids)
        self.params = params
        self.sampler = sampler
        self.stop_ids = stop_ids
        self.max_total_len = min(max_model_len, self.prompt_len + params.max_new_tokens)
        self.t_arrived = t_arrived
        self.t_scheduled = 0.0
        self.num_computed = 0
        self.block_ids: list[int] = []
        self.block_keys: list[int] = []  # prefix-cache chain keys of the leading full blocks
        self.prefix_node = ROOT_NODE  # the prefix-cache node holding exactly those blocks
        self.cached_tokens = 0
        self.started_sent = False
        self.num_generated = 0
        self.samples = (
            params.max_new_tokens > 0
        )  # max_tokens 0: the prompt is scored, nothing drawn
        # The next prompt position whose logprob is still to be sent (positions from 1 have one);
        # prompt_len when none are wanted, or all were sent.
        self.prompt_logprobs_from = 1 if params.prompt_logprobs is not None else self.prompt_len
        self.grammar: RequestGrammar | None = None  # the matcher, for a constrained request
        self.cache_salt = cache_salt  # shares cached blocks only with requests of the same salt
        # Speculative decoding (engine_worker/speculative.py): whether this request may get
        # drafts, the drafts its scheduled step verifies after its last token, and its tokens as
        # the proposer reads them.
        self.speculates = False
        self.draft_ids: list[int] = []
        self.lookup: LookupContext | None = None

    @property
    def ready(self) -> bool:
        """False while the request's grammar is still being built, or while the mask its last
        step lacked is still being computed: it waits, others go on."""
        return self.grammar is None or self.grammar.schedulable()

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def remaining(self) -> int:
        """Tokens to compute before the next sample."""
        return len(self.token_ids) - self.num_computed

    @property
    def is_decoding(self) -> bool:
        return self.num_generated > 0 and self.remaining == 1

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Prompt logprobs are still to be computed: the request computes every prompt position
        itself (a block taken from the prefix cache has no logits)."""
        return self.prompt_logprobs_from < self.prompt_len

    def step_tokens(self, start: int, count: int) -> list[int]:
        """The ``count`` tokens a step computes from position ``start``: the request's own, then
        its drafts."""
        tokens = self.token_ids[start : start + count]
        if len(tokens) < count:
            tokens += self.draft_ids[: count - len(tokens)]
        return tokens

    def append_token(self, token: int) -> None:
        """Adds a sampled token; its KV is computed by the next step that schedules it."""
        self.token_ids.append(token)
        self.num_generated += 1

    def finish_reason(self) -> str | None:
        """Why the request is done after its last sampled token, or None if it goes on."""
        if self.num_generated == 0:
            # Scoring only (max_tokens 0): done once the whole prompt is computed.
            return FINISH_LENGTH if not self.samples and self.remaining == 0 else None
        if self.token_ids[-1] in self.stop_ids:
            return FINISH_STOP
        if len(self.token_ids) >= self.max_total_len:
            return FINISH_LENGTH
        return None


def checked_prompt(
    prompt_token_ids: Sequence[int] | np.ndarray, vocab_size: int, max_model_len: int
) -> np.ndarray:
    """The prompt as a 1-D integer array, or ValueError saying what is wrong with it."""
    ids = np.asarray(prompt_token_ids)
    if ids.ndim != 1 or ids.size == 0:
        raise ValueError("the prompt must be a non-empty 1-D sequence of token ids")
    if not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"token ids must be integers, got dtype {ids.dtype}")
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise ValueError(
            f"token ids must be in [0, {vocab_size}), got range "
            f"[{int(ids.min())}, {int(ids.max())}]"
        )
    if ids.size >= max_model_len:
        raise ValueError(
            f"the prompt has {ids.size} tokens; max_model_len is "
            f"{max_model_len}, which leaves no room for a generated token"
        )
    return ids
