"""Prefix cache keyed by token ids: full KV blocks shared by requests whose ids share a prefix.

Why a hash chain rather than a radix tree: every cached unit is one full block, so a chain key
``hash((parent_key, block_token_ids))`` names a block together with its whole prefix, a lookup is
one dict probe per block, and eviction can drop any unheld block on its own (the LRU order lives
in ``KVBlockManager``; a child evicted before its parent just ends a later match earlier). Each
hit is verified against the block's real token ids, so a hash collision can only cost a miss,
never a wrong answer. Python's hash of a tuple of ints is not salted per process, but nothing
relies on that: the cache lives and dies with the engine.
"""

from __future__ import annotations

from engine_worker.block_manager import KVBlockManager

ROOT_KEY = 0


class PrefixCache:
    def __init__(self, blocks: KVBlockManager) -> None:
        self.blocks = blocks
        self.block_of_key: dict[int, int] = {}
        self.key_of_block: dict[int, int] = {}
        self.tokens_of_block: dict[int, tuple[int, ...]] = {}
        blocks.on_evict = self.forget
        blocks.is_cached = self.key_of_block.__contains__

    @staticmethod
    def chain_key(parent_key: int, tokens: tuple[int, ...]) -> int:
        return hash((parent_key, tokens))

    def match(self, token_ids: list[int], max_blocks: int) -> tuple[list[int], list[int]]:
        """Longest cached run of full blocks at the start of ``token_ids`` (at most max_blocks).

        Returns (block ids, chain keys); takes no references (the caller acquires)."""
        size = self.blocks.block_size
        found, keys = [], []
        key = ROOT_KEY
        for i in range(min(max_blocks, len(token_ids) // size)):
            tokens = tuple(token_ids[i * size:(i + 1) * size])
            key = self.chain_key(key, tokens)
            block = self.block_of_key.get(key)
            if block is None or self.tokens_of_block[block] != tokens:
                break
            found.append(block)
            keys.append(key)
        return found, keys

    def register(self, block: int, key: int, tokens: tuple[int, ...]) -> None:
        """Publishes a full block whose KV is (or, within the current step, will be) computed."""
        if key in self.block_of_key or block in self.key_of_block:
            return  # an identical block is already cached, or this block already is
        self.block_of_key[key] = block
        self.key_of_block[block] = key
        self.tokens_of_block[block] = tokens

    def forget(self, block: int) -> None:
        key = self.key_of_block.pop(block, None)
        if key is not None:
            del self.block_of_key[key]
            del self.tokens_of_block[block]

    def __len__(self) -> int:
        return len(self.block_of_key)
