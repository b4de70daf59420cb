"""Continuous-batching scheduler: decides, each step, which tokens of which requests to compute,
and applies what the step computed to them. It alone changes a request's scheduling state (its
computed count, blocks, drafts, tokens); the engine adds requests, calls ``schedule``, runs the
batch, hands the result to ``update_from_output`` and reports what that returns.

Order of ``schedule``:
1. every running request, oldest first, gets its next tokens: one (decode) or a chunk of its
   prompt (chunked prefill, or recompute after preemption). When the KV pool has no block for
   it, the newest running request is preempted (its blocks freed, itself put back at the head
   of the queue; its emitted tokens stay, its prefix may stay in the prefix cache);
2. waiting requests are admitted while the batch has room (``max_batch_size``), the step has
   prefill budget (requests, tokens, token-keys paced to a step time: engine_worker/
   prefill_budget.py) and the pool has blocks: first those whose whole prompt fits in the
   short share of the budget (held back from step 1's prompt chunks), then the others first
   come, first served. A request never
   computes more than ``prefill_chunk_tokens`` in one step.
With ``--speculative ngram``, a decoding request may also verify drafts (engine_worker/
speculative.py): it computes its last token and up to ``num_speculative_tokens`` drafts, while
at most ``speculative_max_batch`` requests decode in the step. Drafts get KV blocks only when
blocks are free (they never preempt anyone); blocks past the accepted tokens are given back
after the step (``update_from_output``), and only blocks of real tokens are ever published.

A request that is not ``ready`` (its grammar is still being built, or the grammar mask its last
step lacked is still being computed) is passed over, running or waiting, until it is.

Requests that ask for prompt logprobs take no cached blocks (prefix_sharing.py, which also
keeps prompt tails) and together compute at most ``prompt_logprob_tokens`` prompt positions per
step, which bounds the step's logits to that many rows of the vocabulary.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from engine_worker.block_manager import KVBlockManager
from engine_worker.prefill_budget import SHORT_LANE_KEYS, Budget, StepPace, tokens_within_keys
from engine_worker.prefix_cache import ROOT_NODE, PrefixCache
from engine_worker.request import EngineRequest
from engine_worker.scheduler.batch import Finished, ScheduledBatch, StepUpdate
from engine_worker.scheduler.prefix_sharing import PrefixSharing
from engine_worker.speculative import (
    LookupContext,
    NgramProposer,
    SpeculationCounters,
    may_speculate,
)
from ipc.engine_config import PREFILL_TOKEN_KEYS_CPU, PREFILL_TOKENS_CPU, EngineConfig
from ipc.messages import ERR_BAD_REQUEST, FINISH_ERROR

if TYPE_CHECKING:
    from engine_worker.model_runner import StepResult


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        blocks: KVBlockManager,
        prefix_cache: PrefixCache | None,
        prompt_logprob_tokens: int = 1024,
        copy_slots: Callable[[int, int, int], None] | None = None,
    ) -> None:
        """``copy_slots(source, destination, count)`` copies a block's first slots (every
        layer's keys and values); without it, prompt tails are never taken from the cache."""
        self.config = config
        self.blocks = blocks
        self.prefix = PrefixSharing(blocks, prefix_cache, copy_slots)
        self.prompt_logprob_tokens = prompt_logprob_tokens
        most_keys = config.prefill_max_token_keys or PREFILL_TOKEN_KEYS_CPU  # (built alone)
        target_s, keys = config.prefill_step_target_ms / 1e3, min(most_keys, PREFILL_TOKEN_KEYS_CPU)
        self.pace = StepPace(target_s, keys, most_keys)
        self.waiting: deque[EngineRequest] = deque()
        self.running: list[EngineRequest] = []  # admission order: the last one is the newest
        self.proposer = (
            NgramProposer(
                config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max
            )
            if config.speculative == "ngram"
            else None
        )
        self.propose_s = 0.0  # time spent proposing drafts, since start
        self.speculation = SpeculationCounters(config.num_speculative_tokens)

    @property
    def copy_slots(self) -> Callable[[int, int, int], None] | None:
        return self.prefix.copy_slots

    @copy_slots.setter
    def copy_slots(self, copy_slots: Callable[[int, int, int], None] | None) -> None:
        self.prefix.copy_slots = copy_slots  # (a benchmark compares with tails off)

    # --- what the engine loop asks ----------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def is_idle(self) -> bool:
        return not (self.running or self.waiting)

    def has_ready(self, unready_waiting: int = 0) -> bool:
        """Whether a running or waiting request is ready to be scheduled. ``unready_waiting``:
        waiting requests known not to be (grammars being built): when they are all the waiting
        ones, the queue is not looked at."""
        return any(r.ready for r in self.running) or (
            len(self.waiting) > unready_waiting and any(r.ready for r in self.waiting)
        )

    def add(self, request: EngineRequest) -> None:
        """Queues a new request at the back (its grammar, if any, attached already)."""
        request.speculates = self.proposer is not None and may_speculate(
            request.params, request.sampler, constrained=request.grammar is not None
        )
        self.waiting.append(request)

    def first_step_tokens(self, request: EngineRequest) -> int:
        """What a first step would compute of ``request``'s prompt: the part the prefix cache
        does not hold (a fully cached prompt computes its last token or nothing, and the idle
        window, sized by this, waits accordingly little), up to one chunk."""
        cached = self.prefix.cached(request).tokens
        keys = self.pace.keys
        return min(
            request.num_tokens - cached,
            self.config.prefill_chunk_tokens,
            self.config.prefill_max_tokens,
            tokens_within_keys(cached, keys),
        )

    # --- schedule -----------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        """Running requests first (decode rows, then the next chunks of prompts being
        prefilled, in admission order), then waiting ones: short prompts first, then the rest
        first come, first served. The short prompts' share of the prompt budget is held back
        while the running requests take theirs (prefill_budget.py states the rule)."""
        batch = ScheduledBatch()
        self.prefix.next_step()
        budget = self._budget()
        room = self.config.max_batch_size - len(self.running)
        short, share = budget.short_prompts(self.waiting, self.config.prefill_chunk_tokens, room)
        budget.withhold(share)
        self._schedule_running(batch, budget)
        budget.give_back(share)
        self._admit_waiting(batch, budget, short)
        return batch

    def _budget(self) -> Budget:
        return Budget(
            tokens=self.config.prefill_max_tokens or PREFILL_TOKENS_CPU,
            keys=self.pace.keys,
            sequences=self.config.prefill_max_batch_size,
            logprob_tokens=self.prompt_logprob_tokens,
            lane_keys=SHORT_LANE_KEYS if self.pace.target_s > 0 else 0,
        )

    def _schedule_running(self, batch: ScheduledBatch, budget: Budget) -> None:
        """Every running request's next tokens: one (with drafts: more) for a decoding one, the
        next chunk of its prompt for a prefilling one, as far as the budget goes."""
        position = 0
        propose = self.proposer is not None and (
            sum(1 for r in self.running if r.is_decoding) <= self.config.speculative_max_batch
        )
        while position < len(self.running):
            request = self.running[position]
            if not request.ready:
                position += 1
                continue
            if request.is_decoding:
                count = 1 + (self._draft(request) if propose else 0)
            else:
                wanted = min(request.remaining, self.config.prefill_chunk_tokens)
                count = budget.chunk_tokens(request, request.num_computed, wanted)
                if count <= 0:
                    position += 1
                    continue
            if not self._grow(request, count, batch):
                continue  # preempted or failed: it left self.running at `position`
            if not request.is_decoding:
                budget.charge(request, request.num_computed, count)
            self.prefix.publish(request, request.num_computed + count)
            batch.add(request, count)
            position += 1

    def _admit_waiting(
        self, batch: ScheduledBatch, budget: Budget, short: list[EngineRequest]
    ) -> None:
        """Admits ``short`` (waiting requests whose whole prompt fits in the short share), then
        waiting requests in arrival order, while the batch, the budget and the pool have room.
        A request whose grammar is still being built is passed over, not waited for."""
        now = time.monotonic()
        for request in short:
            if len(self.running) >= self.config.max_batch_size:
                return
            if not self._admit_one(request, budget, batch, now):
                break  # no blocks for it: the queue's first ready request waits for them
        while (
            self.waiting
            and len(self.running) < self.config.max_batch_size
            and budget.sequences > 0
            and budget.tokens > 0
        ):
            first_ready = next((r for r in self.waiting if r.ready), None)
            if first_ready is None or not self._admit_one(first_ready, budget, batch, now):
                break  # FCFS: the first ready request waits for blocks, nobody overtakes it

    def _admit_one(
        self, request: EngineRequest, budget: Budget, batch: ScheduledBatch, now: float
    ) -> bool:
        admitted = self._admit(request, budget)
        if admitted is None:
            return False
        count, kept_end = admitted
        self.waiting.remove(request)
        self.running.append(request)
        if not request.t_scheduled:
            request.t_scheduled = now
        batch.cached_tokens += request.num_computed if request.num_generated == 0 else 0
        if request.num_generated == 0 and self.prefix.cache is not None:
            batch.queried_tokens += request.num_tokens
        budget.charge(request, request.num_computed, count)
        self.prefix.publish(request, request.num_computed + count)
        batch.add(request, count, kept_end)
        return True

    def _admit(
        self, request: EngineRequest, budget: Budget
    ) -> tuple[int, torch.Tensor | None] | None:
        """Takes cached prefix blocks and fresh blocks for the first chunk (and copies a cached
        prompt tail into the first fresh one); the tokens to compute and, for a count of 0, the
        kept prompt end it samples from; None = cannot yet (no budget or no blocks)."""
        if budget.sequences <= 0:
            return None
        found = self.prefix.cached(request)
        wanted = min(request.num_tokens - found.tokens, self.config.prefill_chunk_tokens)
        count = budget.chunk_tokens(request, found.tokens, wanted)
        if count <= 0 < wanted:
            return None
        fresh = self.blocks.blocks_for(found.tokens + count) - len(found.blocks)
        if not self.blocks.can_allocate(fresh, found.blocks):
            return None
        self.prefix.take(request, found, fresh)
        request.num_computed = found.tokens
        if request.num_generated == 0:
            request.cached_tokens = found.tokens
        return count, found.end

    def _draft(self, request: EngineRequest) -> int:
        """Sets the request's drafts for this step and returns how many: none when it does not
        speculate, when the lookup finds nothing, or when they would need KV blocks that are not
        free. Never past ``max_total_len``: the step emits at most one token more than drafts."""
        request.draft_ids = []
        if self.proposer is None or not request.speculates:
            return 0
        t_start = time.perf_counter()
        if request.lookup is None:
            request.lookup = LookupContext(request.max_total_len)
        context = request.lookup.sync(request.token_ids)
        drafts = self.proposer.propose(context, request.max_total_len - request.num_tokens - 1)
        self.propose_s += time.perf_counter() - t_start
        tokens = request.num_computed + 1 + len(drafts)
        if self.blocks.blocks_for(tokens) - len(request.block_ids) > self.blocks.num_available:
            return 0
        request.draft_ids = drafts
        return len(drafts)

    def _grow(self, request: EngineRequest, count: int, batch: ScheduledBatch) -> bool:
        """Gives ``request`` blocks for ``count`` more tokens, preempting newer requests."""
        needed = self.blocks.blocks_for(request.num_computed + count) - len(request.block_ids)
        while needed > self.blocks.num_available:
            victim = self.running[-1]
            if victim is request and len(self.running) == 1:
                capacity = self.blocks.num_blocks * self.blocks.block_size
                tokens = request.num_computed + count
                message = (
                    f"the request needs {tokens} tokens of KV cache, which holds {capacity} tokens"
                )
                batch.failed.append((request, message))
                self.running.pop()
                self._free_blocks(request)
                return False
            self._preempt(victim)
            batch.preempted += 1
            if victim is request:
                return False
        if needed > 0:
            request.block_ids.extend(self.blocks.allocate(needed))
        return True

    def _preempt(self, request: EngineRequest) -> None:
        self.running.remove(request)
        self._free_blocks(request)
        self.waiting.appendleft(request)

    # --- update from a step's output ----------------------------------------------------------
    def update_from_output(self, batch: ScheduledBatch, result: StepResult | None) -> StepUpdate:
        """Applies what the step computed to its requests (``result``: None when the batch was
        empty), in this order: the requests the schedule failed end first; prompt ends are kept
        with their tails (before anything frees a block); prompt-logprob positions advance; then
        each request in the batch's order: a deferred one (late grammar mask) takes back its last
        token, the others advance past what they computed, rejected drafts are rolled back,
        sampled tokens appended (a run cut at its first stop) and blocks past them given back;
        a request that ends is removed here, its blocks freed."""
        update = StepUpdate(
            finished=[
                Finished(r, FINISH_ERROR, error, ERR_BAD_REQUEST) for r, error in batch.failed
            ]
        )
        if result is None:
            return update
        for index, hidden in result.prompt_ends.items():
            self.prefix.keep_end(batch.requests[index], hidden)
        if result.prompt_logprobs:  # always ahead of the request's first token
            by_id = {r.request_id: r for r in batch.requests}
            for entry in result.prompt_logprobs:
                by_id[entry.request_id].prompt_logprobs_from = (
                    entry.start + len(entry.logprobs) // 4
                )
        update.prompt_logprobs = result.prompt_logprobs
        deferred = set(result.deferred)
        for index, (request, count) in enumerate(zip(batch.requests, batch.num_new_tokens)):
            if index in deferred:  # its grammar mask was late: the last token is computed again
                request.num_computed += count - 1
                update.deferred.append(request)
                continue
            drafts, request.draft_ids = len(request.draft_ids), []
            request.num_computed += count - drafts
            token = result.tokens[index]
            if token is not None:
                self._append_run(request, index, token, drafts, result, update)
            elif request.samples or request.remaining:
                continue  # a prefill chunk that did not reach the end of the prompt
            self._after_step(request, token, update)
        return update

    def _append_run(
        self,
        request: EngineRequest,
        index: int,
        token: int,
        drafts: int,
        result: StepResult,
        update: StepUpdate,
    ) -> None:
        """Appends the sampled token and, after drafts, the accepted ones (their KV is there),
        cut at the first stop; gives back the blocks that held rejected drafts' KV."""
        run = [token, *result.accepted.get(index, ())]
        logprobs = [result.logprobs.get(index), *result.accepted_logprobs.get(index, ())]
        for position, (token, entry) in enumerate(zip(run, logprobs + [None] * len(run))):
            if position:  # an accepted draft (or the token after it): its KV is there
                request.num_computed += 1
            request.append_token(token)
            if entry is not None:
                entry.row = len(update.tokens)
                update.logprobs.append(entry)
            update.request_ids.append(request.request_id)
            update.tokens.append(token)
            if request.finish_reason() is not None:
                break  # the run is cut at its first stop
        if drafts:
            self.speculation.record(drafts, len(run) - 1)
            keep = self.blocks.blocks_for(request.num_tokens)
            if len(request.block_ids) > keep:
                self.blocks.release(request.block_ids[keep:])
                del request.block_ids[keep:]

    def _after_step(self, request: EngineRequest, token: int | None, update: StepUpdate) -> None:
        """A request that emitted (or scored its whole prompt): started, finished, or on."""
        if not request.started_sent:
            request.started_sent = True
            update.started.append(request)
        reason = request.finish_reason()  # a complete grammar ends it at the next settle
        if reason is not None:
            self.remove(request)
            update.finished.append(Finished(request, reason))
        elif request.grammar is not None and token is not None:
            update.constrained.append((request, token))

    # --- letting go ---------------------------------------------------------------------------
    def remove(self, request: EngineRequest) -> None:
        """Drops a finished or aborted request wherever it is and frees its blocks."""
        if request in self.running:
            self.running.remove(request)
        else:
            try:
                self.waiting.remove(request)
            except ValueError:
                pass
        self._free_blocks(request)

    def _free_blocks(self, request: EngineRequest) -> None:
        self.blocks.release(request.block_ids)
        request.block_ids, request.block_keys, request.draft_ids = [], [], []
        request.prefix_node, request.num_computed = ROOT_NODE, 0
