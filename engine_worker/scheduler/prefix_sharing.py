"""The scheduler's side of the prefix cache: what a fresh request finds cached, taking those
blocks (and copying a prompt tail), publishing the blocks a step fills, and keeping the final
hidden state of a prompt's end with its tail.

A fresh request whose prompt the prefix cache holds whole (its full blocks, then a prompt tail
or a full block with its remaining tokens: ``PrefixCache.tail_source``) gets its last block's
slots copied from the cache and computes only its last token; after a tail that kept its
prompt's end (prefix_tails.py), none: it is scheduled with 0 tokens and samples from the kept
row. The step that computes a prompt's end registers its tail (``publish``); the model runner
returns that row's final hidden state with the step's result, and ``keep_end`` stores it.

Requests that ask for prompt logprobs need the logits of every prompt position they compute:
they never take blocks from the prefix cache (their own blocks are still published).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from engine_worker.block_manager import KVBlockManager
from engine_worker.prefix_cache import ROOT_NODE, PrefixCache
from engine_worker.request import EngineRequest


class CachedPrefix(NamedTuple):
    blocks: list[int]  # cached full blocks to share
    keys: list[int]  # their chain keys
    node: int  # the prefix-cache node after them
    tokens: int  # tokens held in all (the full blocks', and a prompt tail's)
    tail: int | None = None  # the block whose first slots hold the rest but the last token
    end: torch.Tensor | None = None  # the tail's kept prompt end: its last token too is held


class PrefixSharing:
    """``copy_slots(source, destination, count)`` copies a block's first slots (every layer's
    keys and values); without it, prompt tails are never taken from the cache. Without a
    prefix cache, nothing is found and nothing published."""

    def __init__(
        self,
        blocks: KVBlockManager,
        cache: PrefixCache | None,
        copy_slots: Callable[[int, int, int], None] | None,
    ) -> None:
        self.blocks, self.cache, self.copy_slots = blocks, cache, copy_slots

    def next_step(self) -> None:
        if self.cache is not None:
            self.cache.next_step()

    def cached(self, request: EngineRequest) -> CachedPrefix:
        """What the prefix cache holds of ``request``'s tokens: all of them only with a kept
        prompt end to sample from; otherwise at least one is left to compute, to sample from."""
        if self.cache is None or request.wants_prompt_logprobs:
            return CachedPrefix([], [], ROOT_NODE, 0)
        size, ids, salt = self.blocks.block_size, request.token_ids, request.cache_salt
        blocks, keys, node = self.cache.match(ids, (request.num_tokens - 1) // size, salt)
        if self.copy_slots is not None and request.num_generated == 0:
            tail = self.cache.tail_source(ids, keys, node, salt)
            if tail is not None:
                # A constrained request samples through its grammar's mask, whose step may
                # defer it: it computes its last token as before. A prompt of whole blocks
                # gets a cached full block here, whose block may also have been a shorter
                # prompt's tail block (its end is that prompt's position, not this one's).
                end = None
                if request.grammar is None and request.samples and request.num_tokens % size:
                    end = self.cache.tail_end(tail)
                held = request.num_tokens if end is not None else request.num_tokens - 1
                return CachedPrefix(blocks, keys, node, held, tail, end)
        return CachedPrefix(blocks, keys, node, len(blocks) * size)

    def take(self, request: EngineRequest, found: CachedPrefix, fresh: int) -> None:
        """Gives ``request`` the cached blocks ``found`` and ``fresh`` new ones (the caller
        checked ``KVBlockManager.can_allocate``), and copies a cached prompt tail into the first
        fresh one."""
        for block in found.blocks:
            self.blocks.acquire(block)
        request.block_ids = found.blocks + self.blocks.allocate(fresh)
        if found.tail is not None:
            self._copy_tail(request, found)
        request.block_keys = found.keys
        request.prefix_node = found.node

    def _copy_tail(self, request: EngineRequest, found: CachedPrefix) -> None:
        # Right after the allocation, before any forward writes: the only block it can have
        # evicted is the one it handed out, so a tail it evicted is the destination itself.
        assert self.copy_slots is not None and self.cache is not None and found.tail is not None
        size = self.blocks.block_size
        destination = request.block_ids[len(found.blocks)]
        if destination != found.tail:
            self.copy_slots(found.tail, destination, found.tokens - len(found.blocks) * size)
        elif found.end is not None:  # the allocation dropped the tail's entry: it lives on here
            tokens = tuple(request.token_ids[len(found.blocks) * size : request.num_tokens])
            self.cache.register_tail(destination, tokens, found.node, request.cache_salt)
            self.cache.keep_tail_end(destination, found.end)

    def publish(self, request: EngineRequest, computed_after_step: int) -> None:
        """Registers the blocks this step fills, so later (and same-step) requests can share,
        and the prompt tail of a prompt whose end this step computes."""
        if self.cache is None:
            return
        size = self.blocks.block_size
        full = min(computed_after_step, request.num_tokens) // size
        for index in range(len(request.block_keys), full):
            tokens = tuple(request.token_ids[index * size : (index + 1) * size])
            parent = request.block_keys[-1] if request.block_keys else None
            key, request.prefix_node = self.cache.publish(
                request.block_ids[index], tokens, parent, request.prefix_node, request.cache_salt
            )
            request.block_keys.append(key)
        if request.num_computed < request.prompt_len <= computed_after_step:
            full, rest = divmod(request.prompt_len, size)
            if rest and len(request.block_keys) == full:
                tokens = tuple(request.token_ids[full * size : request.prompt_len])
                self.cache.register_tail(
                    request.block_ids[full], tokens, request.prefix_node, request.cache_salt
                )

    def keep_end(self, request: EngineRequest, hidden: torch.Tensor) -> None:
        """Keeps the final hidden state of ``request``'s prompt's last row with the prompt tail
        this step registered for it (if it did: a prompt of whole blocks has none)."""
        full, rest = divmod(request.prompt_len, self.blocks.block_size)
        if self.cache is not None and rest and len(request.block_ids) > full:
            self.cache.keep_tail_end(request.block_ids[full], hidden)
