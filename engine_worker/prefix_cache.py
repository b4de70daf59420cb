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
so it can never be matched through a re-cached parent: also a miss.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

ROOT_NODE = 0  # the empty prefix
NO_NODE = -1  # a request whose published chain is not in the cache (a key collision took it)


@dataclass(slots=True)
class CachedBlock:
    key: int
    tokens: tuple[int, ...]
    node: int  # this block's serial, unique for the cache's life
    parent_node: int  # the node of the prefix before it (ROOT_NODE for a first block)


class PrefixCache:
    """What each cached block holds. ``KVBlockManager`` owns the blocks: it keeps the unheld
    cached ones (LRU), asks ``holds`` on release and calls ``forget`` when it evicts one."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.root_key = secrets.randbits(63)
        self.block_of_key: dict[int, int] = {}
        self.entries: dict[int, CachedBlock] = {}  # block id -> what it holds
        self._next_node = ROOT_NODE + 1

    @staticmethod
    def chain_key(parent_key: int, tokens: tuple[int, ...]) -> int:
        return hash((parent_key, tokens))

    def match(self, token_ids: list[int], max_blocks: int) -> tuple[list[int], list[int], int]:
        """Longest cached run of full blocks at the start of ``token_ids`` (at most max_blocks).

        Returns (block ids, chain keys, node of the last block or ROOT_NODE); takes no
        references (the caller acquires)."""
        size = self.block_size
        found, keys = [], []
        key, node = self.root_key, ROOT_NODE
        for i in range(min(max_blocks, len(token_ids) // size)):
            tokens = tuple(token_ids[i * size : (i + 1) * size])
            key = self.chain_key(key, tokens)
            block = self.block_of_key.get(key)
            if block is None:
                break
            entry = self.entries[block]
            if entry.tokens != tokens or entry.parent_node != node:
                break  # a key collision: another prefix's block
            found.append(block)
            keys.append(key)
            node = entry.node
        return found, keys, node

    def publish(
        self, block: int, tokens: tuple[int, ...], parent_key: int | None, parent_node: int
    ) -> tuple[int, int]:
        """Publishes a full block whose KV is (or, within the current step, will be) computed
        after the prefix named by (parent_key, parent_node); ``parent_key`` None is the root.

        Returns the block's chain key and the node that now holds exactly this prefix: the
        block's own, an identical block already cached, or NO_NODE (the key is taken by another
        prefix, or the parent is not cached): the request's later blocks are then not shared."""
        key = self.chain_key(self.root_key if parent_key is None else parent_key, tokens)
        if parent_node == NO_NODE:
            return key, NO_NODE
        cached = self.block_of_key.get(key)
        if cached is not None:
            entry = self.entries[cached]
            same = entry.tokens == tokens and entry.parent_node == parent_node
            return key, entry.node if same else NO_NODE
        if block in self.entries:  # already published under another key (cannot happen twice)
            return key, NO_NODE
        node = self._next_node
        self._next_node += 1
        self.block_of_key[key] = block
        self.entries[block] = CachedBlock(key, tokens, node, parent_node)
        return key, node

    def holds(self, block: int) -> bool:
        return block in self.entries

    def forget(self, block: int) -> None:
        entry = self.entries.pop(block, None)
        if entry is not None:
            del self.block_of_key[entry.key]

    def __len__(self) -> int:
        return len(self.entries)
