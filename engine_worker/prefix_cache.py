"""Prefix cache keyed by token ids: full KV blocks shared by requests whose ids share a prefix.

Why a hash chain rather than a radix tree: every cached unit is one full block, so a chain key
``hash((parent_key, block_token_ids))`` names a block together with its whole prefix, a lookup is
one dict probe per block, and eviction can drop any unheld block on its own (the LRU order lives
in ``KVBlockManager``; a child evicted before its parent just ends a later match earlier).

A hit is exact, whatever the hash does. Each cached block is a node with a serial number that is
never reused, and it records the node of the prefix it was computed after. A match accepts a
block only if its real token ids equal the request's and its recorded parent is the node matched
just before it (the root for the first block), so by induction every accepted block holds exactly
the request's prefix. Two prefixes whose chain keys collide (the key is 64 bits; it starts from a
per-process random salt, so collisions cannot be searched offline) cost a miss, never another
prompt's KV. A node whose parent was evicted keeps a parent serial no node will ever have again,
so it can never be matched through a re-cached parent: also a miss (and a block published after
an evicted parent is not cached at all).

A request's ``cache_salt`` enters the chain key of its first block and is compared on a hit of
a first block, so requests with different salts (or none) never share a block, whatever the
keys do.

With a ``CacheEventRecorder``, each cached block also carries its external digest
(``ipc.block_hash``: what KV-event consumers and the routers recompute from token ids), and the
recorder hears of every block stored and evicted.

Besides full blocks, the cache holds prompt tails (``engine_worker.prefix_tails``): the prompt
tokens of a request's last, partial block, which a later identical prompt copies so that it
computes its last token alone. ``step`` counts scheduling steps: a block is read by a copy only
from the step after the one that computes it (sharing a block needs no such wait: every layer
writes its keys and values before any attention reads them).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import torch

from engine_worker.cache_events import CacheEventRecorder
from engine_worker.prefix_tails import TailIndex
from ipc.block_hash import next_block_digest

ROOT_NODE = 0  # the empty prefix
NO_NODE = -1  # a request whose published chain is not in the cache (a key collision took it)


@dataclass(slots=True)
class CachedBlock:
    key: int
    tokens: tuple[int, ...]
    node: int  # this block's serial, unique for the cache's life
    parent_node: int  # the node of the prefix before it (ROOT_NODE for a first block)
    salt: str | None = None  # a first block's cache_salt (None for every later block)
    digest: bytes = b""  # the external digest, when events are recorded
    step: int = 0  # the scheduling step that computes it


class PrefixCache:
    """What each cached block holds. ``KVBlockManager`` owns the blocks: it keeps the unheld
    cached ones (LRU), asks ``holds`` on release and calls ``forget`` when it evicts one."""

    def __init__(self, block_size: int, events: CacheEventRecorder | None = None) -> None:
        self.block_size = block_size
        self.events = events
        self.root_key = secrets.randbits(63)
        self.block_of_key: dict[int, int] = {}
        self.entries: dict[int, CachedBlock] = {}  # block id -> what it holds
        self.tails = TailIndex()
        self.step = 0  # the current scheduling step (``next_step``)
        self._next_node = ROOT_NODE + 1

    def next_step(self) -> None:
        """A scheduling step begins (the scheduler's, once a step): what earlier steps computed
        is readable by a copy from now on."""
        self.step += 1

    @staticmethod
    def chain_key(parent_key: int, tokens: tuple[int, ...]) -> int:
        return hash((parent_key, tokens))

    def root_for(self, salt: str | None) -> int:
        """The key a chain starts from: the cache's own, or one per salt."""
        return self.root_key if salt is None else hash((self.root_key, salt))

    def match(
        self, token_ids: list[int], max_blocks: int, salt: str | None = None
    ) -> tuple[list[int], list[int], int]:
        """Longest cached run of full blocks at the start of ``token_ids`` (at most max_blocks)
        for a request with this ``salt``.

        Returns (block ids, chain keys, node of the last block or ROOT_NODE); takes no
        references (the caller acquires)."""
        size = self.block_size
        found, keys = [], []
        key, node = self.root_for(salt), ROOT_NODE
        for i in range(min(max_blocks, len(token_ids) // size)):
            tokens = tuple(token_ids[i * size : (i + 1) * size])
            key = self.chain_key(key, tokens)
            block = self._child(key, tokens, node, salt)
            if block is None:
                break
            found.append(block)
            keys.append(key)
            node = self.entries[block].node
            salt = None  # only a first block carries it
        return found, keys, node

    def _child(self, key: int, tokens: tuple[int, ...], node: int, salt: str | None) -> int | None:
        """The cached block with chain key ``key`` if it holds ``tokens`` right after ``node``
        (and, for a first block, carries ``salt``); None on a miss or a key collision."""
        block = self.block_of_key.get(key)
        if block is None:
            return None
        entry = self.entries[block]
        if entry.tokens != tokens or entry.parent_node != node or entry.salt != salt:
            return None  # a key collision: another prefix's (or salt's) block
        return block

    def tail_source(
        self, token_ids: list[int], keys: list[int], node: int, salt: str | None
    ) -> int | None:
        """After a match of full blocks (``keys``, ending at ``node``), a computed block whose
        first slots hold every remaining token of ``token_ids`` but the last: a prompt tail
        with exactly these tokens, or (when a whole block remains) the cached full block of
        them. None: the remainder is computed."""
        size = self.block_size
        rest = tuple(token_ids[len(keys) * size :])
        if not 1 < len(rest) <= size or node == NO_NODE:
            return None
        salt = salt if not keys else None  # only a first block carries it
        if len(rest) < size:
            return self.tails.find(node, salt, rest, self.step)
        parent_key = keys[-1] if keys else self.root_for(salt)
        block = self._child(self.chain_key(parent_key, rest), rest, node, salt)
        return block if block is not None and self.entries[block].step < self.step else None

    def tail_end(self, block: int) -> torch.Tensor | None:
        """The final hidden state kept for the last token of ``block``'s prompt tail, if any."""
        return self.tails.end(block)

    def keep_tail_end(self, block: int, hidden: torch.Tensor) -> None:
        self.tails.keep_end(block, hidden)

    def register_tail(
        self, block: int, tokens: tuple[int, ...], node: int, salt: str | None
    ) -> None:
        """Records that ``block`` holds the prompt tail ``tokens`` after ``node``'s full blocks
        (computed in this step); ``salt`` matters for a tail with no full block before it."""
        if node != NO_NODE:
            self.tails.register(node, salt if node == ROOT_NODE else None, tokens, block, self.step)

    def publish(
        self,
        block: int,
        tokens: tuple[int, ...],
        parent_key: int | None,
        parent_node: int,
        salt: str | None = None,
    ) -> tuple[int, int]:
        """Publishes a full block whose KV is (or, within the current step, will be) computed
        after the prefix named by (parent_key, parent_node); ``parent_key`` None is the root
        (the first block, which carries the request's ``salt``).

        Returns the block's chain key and the node that now holds exactly this prefix: the
        block's own, an identical block already cached, or NO_NODE (the key is taken by another
        prefix, or the parent is not cached): the request's later blocks are then not shared."""
        first = parent_key is None
        key = self.chain_key(self.root_for(salt) if parent_key is None else parent_key, tokens)
        if parent_node == NO_NODE:
            return key, NO_NODE
        parent = None if parent_key is None else self._entry(parent_key, parent_node)
        if not first and parent is None:
            return key, NO_NODE  # evicted since: a block after it could never be matched
        cached = self.block_of_key.get(key)
        if cached is not None:
            entry = self.entries[cached]
            same = entry.tokens == tokens and entry.parent_node == parent_node
            return key, entry.node if same and entry.salt == (salt if first else None) else NO_NODE
        if block in self.entries:  # already published under another key (cannot happen twice)
            return key, NO_NODE
        node = self._next_node
        self._next_node += 1
        entry = CachedBlock(key, tokens, node, parent_node, salt if first else None, step=self.step)
        if self.events is not None:
            parent_digest = None if parent is None else parent.digest
            entry.digest = next_block_digest(parent_digest, tokens, entry.salt)
            self.events.stored(parent_digest, entry.digest, tokens)
        self.block_of_key[key] = block
        self.entries[block] = entry
        return key, node

    def _entry(self, key: int, node: int) -> CachedBlock | None:
        """The cached block holding the prefix (key, node), if it is still cached."""
        block = self.block_of_key.get(key)
        entry = None if block is None else self.entries[block]
        return entry if entry is not None and entry.node == node else None

    def holds(self, block: int) -> bool:
        return block in self.entries or self.tails.holds(block)

    def forget(self, block: int) -> None:
        self.tails.forget(block)
        entry = self.entries.pop(block, None)
        if entry is not None:
            del self.block_of_key[entry.key]
            if self.events is not None:
                self.events.removed(entry.digest)

    def __len__(self) -> int:
        return len(self.entries)
