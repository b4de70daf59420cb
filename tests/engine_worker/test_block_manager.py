"""KV block manager and prefix cache invariants, without a model."""

from __future__ import annotations

import pytest

from engine_worker.block_manager import KVBlockManager
from engine_worker.prefix_cache import PrefixCache


def test_allocate_release_returns_every_block():
    blocks = KVBlockManager(num_blocks=4, block_size=2)
    taken = blocks.allocate(3)
    assert blocks.num_available == 1 and blocks.num_used == 3
    with pytest.raises(RuntimeError):
        blocks.allocate(2)
    blocks.release(taken)
    assert blocks.num_available == 4 and blocks.ref_counts == [0, 0, 0, 0]
    with pytest.raises(RuntimeError, match="released more often"):
        blocks.release([taken[0]])


def test_prefix_cache_shares_verifies_and_evicts_lru():
    blocks = KVBlockManager(num_blocks=4, block_size=2)
    cache = PrefixCache(blocks)
    ids = [5, 6, 7, 8, 9]
    owned = blocks.allocate(2)
    keys = []
    parent = 0
    for i, block in enumerate(owned):
        tokens = tuple(ids[2 * i:2 * i + 2])
        parent = cache.chain_key(parent, tokens)
        cache.register(block, parent, tokens)
        keys.append(parent)
    found, found_keys = cache.match(ids, max_blocks=10)
    assert found == owned and found_keys == keys
    assert cache.match([5, 6, 7, 0], max_blocks=10)[0] == owned[:1]  # diverges in block 2
    assert cache.match([6, 5, 7, 8], max_blocks=10)[0] == []  # the chain needs the same head
    assert cache.match(ids, max_blocks=1)[0] == owned[:1]
    # A hash collision cannot hand out wrong KV: the real ids are compared on every hit.
    cache.tokens_of_block[owned[0]] = (0, 0)
    assert cache.match(ids, max_blocks=10)[0] == []
    cache.tokens_of_block[owned[0]] = (5, 6)

    blocks.release(owned)  # unheld but cached: available, still matchable
    assert blocks.num_available == 4 and cache.match(ids, 10)[0] == owned
    blocks.acquire(owned[0])
    assert blocks.ref_counts[owned[0]] == 1 and blocks.num_available == 3
    blocks.release([owned[0]])
    fresh = blocks.allocate(3)  # 2 free blocks, then the least recently released cached one
    assert owned[1] in fresh and owned[0] not in fresh
    assert cache.match(ids, 10)[0] == owned[:1] and len(cache) == 1
    blocks.release(fresh)
    assert blocks.num_available == 4 and sum(blocks.ref_counts) == 0
