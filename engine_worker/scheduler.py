"""Continuous-batching scheduler: decides, each step, which tokens of which requests to compute.

Order of a step:
1. every running request, oldest first, gets its next tokens: one (decode) or a chunk of its
   prompt (chunked prefill, or recompute after preemption). When the KV pool has no block for
   it, the newest running request is preempted (its blocks freed, itself put back at the head
   of the queue; its emitted tokens stay, its prefix may stay in the prefix cache);
2. waiting requests are admitted while the batch has room (``max_batch_size``), the step has
   prefill budget (``prefill_max_batch_size`` requests, ``prefill_max_tokens`` tokens,
   ``prefill_max_token_keys`` token-keys: engine_worker/prefill_budget.py) and the pool has
   blocks: first those whose whole prompt fits in the short share of the budget (held back
   from step 1's prompt chunks), then the others first come, first served. A request never
   computes more than ``prefill_chunk_tokens`` in one step.
With ``--speculative ngram``, a decoding request may also verify drafts (engine_worker/
speculative.py): it computes its last token and up to ``num_speculative_tokens`` drafts, while
at most ``speculative_max_batch`` requests decode in the step. Drafts get KV blocks only when
blocks are free (they never preempt anyone); blocks past the accepted tokens are given back
after the step (``trim_blocks``), and only blocks of real tokens are ever published.

A request that is not ``ready`` (its grammar is still being built, or the grammar mask its last
step lacked is still being computed) is passed over, running or waiting, until it is.

A fresh request whose prompt the prefix cache holds whole (its full blocks, then a prompt tail
or a full block with its remaining tokens: ``PrefixCache.tail_source``) gets its last block's
slots copied from the cache and computes only its last token; after a tail that kept its
prompt's end (prefix_tails.py), none: it is scheduled with 0 tokens and samples from the kept
row. The step that computes a prompt's end registers its tail (``_publish_full_blocks``), and
the engine hands the row's final hidden state to ``keep_prompt_end`` after the forward.

Requests that ask for prompt logprobs need the logits of every prompt position they compute:
they never take blocks from the prefix cache (their own blocks are still published), and
together they compute at most ``prompt_logprob_tokens`` prompt positions per step, which bounds
the step's logits to that many rows of the vocabulary.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from engine_worker.block_manager import KVBlockManager
from engine_worker.prefill_budget import PrefillBudget, StepPace, chunk_cost, tokens_within_keys
from engine_worker.prefix_cache import ROOT_NODE, PrefixCache
from engine_worker.request import EngineRequest
from engine_worker.speculative import LookupContext, NgramProposer
from ipc.engine_config import PREFILL_TOKEN_KEYS_CPU, PREFILL_TOKENS_CPU, EngineConfig


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

    def add(self, request: EngineRequest, num_tokens: int) -> None:
        self.requests.append(request)
        self.num_new_tokens.append(num_tokens)
        self.token_keys += chunk_cost(request.num_computed, num_tokens)
        if request.is_decoding:
            self.decode_tokens += num_tokens
        else:
            self.prefill_tokens += num_tokens


class CachedPrefix(NamedTuple):
    blocks: list[int]  # cached full blocks to share
    keys: list[int]  # their chain keys
    node: int  # the prefix-cache node after them
    tokens: int  # tokens held in all (the full blocks', and a prompt tail's)
    tail: int | None = None  # the block whose first slots hold the rest but the last token
    end: torch.Tensor | None = None  # the tail's kept prompt end: its last token too is held


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
        self.copy_slots = copy_slots
        self.blocks = blocks
        self.prefix_cache = prefix_cache
        self.prompt_logprob_tokens = prompt_logprob_tokens
        # A scheduler built alone (no engine to resolve 0 for its device) takes the CPU's bound
        most_keys = config.prefill_max_token_keys or PREFILL_TOKEN_KEYS_CPU
        self.pace = StepPace(
            config.prefill_step_target_ms / 1e3, min(most_keys, PREFILL_TOKEN_KEYS_CPU), most_keys
        )
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

    def first_step_tokens(self, request: EngineRequest) -> int:
        """What a first step would compute of ``request``'s prompt: the part the prefix cache
        does not hold (a fully cached prompt computes its last token or nothing, and the idle
        window, sized by this, waits accordingly little), up to one chunk."""
        cached = self._cached_prefix(request).tokens
        keys = self.pace.keys
        return min(
            request.num_tokens - cached,
            self.config.prefill_chunk_tokens,
            self.config.prefill_max_tokens,
            tokens_within_keys(cached, keys),
        )

    def _cached_prefix(self, request: EngineRequest) -> CachedPrefix:
        """What the prefix cache holds of ``request``'s tokens: all of them only with a kept
        prompt end to sample from; otherwise at least one is left to compute, to sample from."""
        if self.prefix_cache is None or request.wants_prompt_logprobs:
            return CachedPrefix([], [], ROOT_NODE, 0)
        size, ids, salt = self.blocks.block_size, request.token_ids, request.cache_salt
        blocks, keys, node = self.prefix_cache.match(ids, (request.num_tokens - 1) // size, salt)
        if self.copy_slots is not None and request.num_generated == 0:
            tail = self.prefix_cache.tail_source(ids, keys, node, salt)
            if tail is not None:
                # A constrained request samples through its grammar's mask, whose step may
                # defer it: it computes its last token as before. A prompt of whole blocks
                # gets a cached full block here, whose block may also have been a shorter
                # prompt's tail block (its end is that prompt's position, not this one's).
                end = None
                if request.grammar is None and request.samples and request.num_tokens % size:
                    end = self.prefix_cache.tail_end(tail)
                held = request.num_tokens if end is not None else request.num_tokens - 1
                return CachedPrefix(blocks, keys, node, held, tail, end)
        return CachedPrefix(blocks, keys, node, len(blocks) * size)

    def schedule(self) -> ScheduledBatch:
        """Running requests first (decode rows, then the next chunks of prompts being
        prefilled, in admission order), then waiting ones: short prompts first, then the rest
        first come, first served. The short prompts' share of the prompt budget is held back
        while the running requests take theirs (prefill_budget.py states the rule)."""
        batch = ScheduledBatch()
        if self.prefix_cache is not None:
            self.prefix_cache.step += 1
        budget = self._budget()
        room = self.config.max_batch_size - len(self.running)
        short, tokens, keys = budget.short_prompts(
            self.waiting, self.config.prefill_chunk_tokens, room
        )
        budget.tokens, budget.keys, budget.slots = (
            budget.tokens - tokens,
            budget.keys - keys,
            budget.slots - len(short),
        )
        self._schedule_running(batch, budget)
        budget.tokens, budget.keys, budget.slots = (
            budget.tokens + tokens,
            budget.keys + keys,
            budget.slots + len(short),
        )
        self._admit_waiting(batch, budget, short)
        return batch

    def _budget(self) -> PrefillBudget:
        # The engine resolves 0 for its device; a scheduler built alone takes the CPU's.
        return PrefillBudget(
            tokens=self.config.prefill_max_tokens or PREFILL_TOKENS_CPU,
            keys=self.pace.keys,
            slots=self.config.prefill_max_batch_size,
            logprob_tokens=self.prompt_logprob_tokens,
        )

    def _schedule_running(self, batch: ScheduledBatch, budget: PrefillBudget) -> None:
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
            self._publish_full_blocks(request, request.num_computed + count)
            batch.add(request, count)
            position += 1

    def _admit_waiting(
        self, batch: ScheduledBatch, budget: PrefillBudget, short: list[EngineRequest]
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
            and budget.slots > 0
            and budget.tokens > 0
        ):
            first_ready = next((r for r in self.waiting if r.ready), None)
            if first_ready is None or not self._admit_one(first_ready, budget, batch, now):
                break  # FCFS: the first ready request waits for blocks, nobody overtakes it

    def _admit_one(
        self, request: EngineRequest, budget: PrefillBudget, batch: ScheduledBatch, now: float
    ) -> bool:
        admitted = self._admit(request, budget)
        if admitted is None:
            return False
        self.waiting.remove(request)
        self.running.append(request)
        if not request.t_scheduled:
            request.t_scheduled = now
        batch.cached_tokens += request.num_computed if request.num_generated == 0 else 0
        if request.num_generated == 0 and self.prefix_cache is not None:
            batch.queried_tokens += request.num_tokens
        budget.charge(request, request.num_computed, admitted)
        self._publish_full_blocks(request, request.num_computed + admitted)
        batch.add(request, admitted)
        return True

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

    def trim_blocks(self, request: EngineRequest) -> None:
        """Gives back the blocks past the request's tokens (they held rejected drafts' KV)."""
        keep = self.blocks.blocks_for(request.num_tokens)
        if len(request.block_ids) > keep:
            self.blocks.release(request.block_ids[keep:])
            del request.block_ids[keep:]

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
                self.free_blocks(request)
                return False
            self.preempt(victim)
            batch.preempted += 1
            if victim is request:
                return False
        if needed > 0:
            request.block_ids.extend(self.blocks.allocate(needed))
        return True

    def _admit(self, request: EngineRequest, budget: PrefillBudget) -> int | None:
        """Takes cached prefix blocks and fresh blocks for the first chunk (and copies a cached
        prompt tail into the first fresh one); the tokens to compute (0: a kept prompt end, it
        only samples), None = cannot yet (no budget or no blocks)."""
        if budget.slots <= 0:
            return None
        cached_blocks, keys, node, cached, tail, end = self._cached_prefix(request)
        wanted = min(request.num_tokens - cached, self.config.prefill_chunk_tokens)
        count = budget.chunk_tokens(request, cached, wanted)
        if count <= 0 < wanted:
            return None
        fresh = self.blocks.blocks_for(cached + count) - len(cached_blocks)
        # Cached blocks nobody holds are counted as available; taking them uses that up.
        reclaimed = sum(1 for b in cached_blocks if self.blocks.ref_counts[b] == 0)
        if fresh + reclaimed > self.blocks.num_available:
            return None
        for block in cached_blocks:
            self.blocks.acquire(block)
        request.block_ids = cached_blocks + self.blocks.allocate(fresh)
        if tail is not None:
            # Right after the allocation, before any forward writes: the only block it can have
            # evicted is the one it handed out, so a tail it evicted is the destination itself.
            assert self.copy_slots is not None and self.prefix_cache is not None
            destination = request.block_ids[len(cached_blocks)]
            if destination != tail:
                written = cached - len(cached_blocks) * self.blocks.block_size
                self.copy_slots(tail, destination, written)
            elif end is not None:  # the allocation dropped the tail's entry: it lives on here
                full = len(cached_blocks) * self.blocks.block_size
                tokens = tuple(request.token_ids[full : request.num_tokens])
                self.prefix_cache.register_tail(destination, tokens, node, request.cache_salt)
                self.prefix_cache.keep_tail_end(destination, end)
        request.block_keys = keys
        request.prefix_node = node
        request.num_computed = cached
        request.prompt_end = end  # a count of 0: it samples from the kept end
        if request.num_generated == 0:
            request.cached_tokens = cached
        return count

    def _publish_full_blocks(self, request: EngineRequest, computed_after_step: int) -> None:
        """Registers the blocks this step fills, so later (and same-step) requests can share."""
        if self.prefix_cache is None:
            return
        size = self.blocks.block_size
        full = min(computed_after_step, request.num_tokens) // size
        for index in range(len(request.block_keys), full):
            tokens = tuple(request.token_ids[index * size : (index + 1) * size])
            parent = request.block_keys[-1] if request.block_keys else None
            key, request.prefix_node = self.prefix_cache.publish(
                request.block_ids[index], tokens, parent, request.prefix_node, request.cache_salt
            )
            request.block_keys.append(key)
        if request.num_computed < request.prompt_len <= computed_after_step:
            full, rest = divmod(request.prompt_len, size)
            if rest and len(request.block_keys) == full:
                tokens = tuple(request.token_ids[full * size : request.prompt_len])
                self.prefix_cache.register_tail(
                    request.block_ids[full], tokens, request.prefix_node, request.cache_salt
                )

    def preempt(self, request: EngineRequest) -> None:
        self.running.remove(request)
        self.free_blocks(request)
        self.waiting.appendleft(request)

    def keep_prompt_end(self, request: EngineRequest, hidden: torch.Tensor) -> None:
        """Keeps the final hidden state of ``request``'s prompt's last row with the prompt tail
        this step registered for it (if it did: a prompt of whole blocks has none)."""
        full, rest = divmod(request.prompt_len, self.blocks.block_size)
        if self.prefix_cache is not None and rest and len(request.block_ids) > full:
            self.prefix_cache.keep_tail_end(request.block_ids[full], hidden)

    def free_blocks(self, request: EngineRequest) -> None:
        self.blocks.release(request.block_ids)
        request.block_ids = []
        request.block_keys = []
        request.prefix_node = ROOT_NODE
        request.num_computed = 0
        request.draft_ids = []

    def remove(self, request: EngineRequest) -> None:
        """Drops a finished or aborted request wherever it is and frees its blocks."""
        if request in self.running:
            self.running.remove(request)
        else:
            try:
                self.waiting.remove(request)
            except ValueError:
                pass
        self.free_blocks(request)
