"""KV block manager and prefix cache invariants, without a model."""

from __future__ import annotations

import pytest

from engine_worker.block_manager import KVBlockManager
from engine_worker.prefix_cache import NO_NODE, ROOT_NODE, PrefixCache


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


def publish_chain(cache, blocks, ids):
    """Publishes ``ids`` (whole blocks) into fresh blocks, as the scheduler does."""
    size = blocks.block_size
    owned = blocks.allocate(len(ids) // size)
    keys, node = [], ROOT_NODE
    for i, block in enumerate(owned):
        key, node = cache.publish(
            block, tuple(ids[i * size : (i + 1) * size]), keys[-1] if keys else None, node
        )
        keys.append(key)
    return owned, keys, node


def test_prefix_cache_shares_verifies_and_evicts_lru():
    cache = PrefixCache(block_size=2)
    blocks = KVBlockManager(num_blocks=4, block_size=2, prefix_cache=cache)
    ids = [5, 6, 7, 8, 9]
    owned, keys, node = publish_chain(cache, blocks, ids[:4])
    found, found_keys, found_node = cache.match(ids, max_blocks=10)
    assert found == owned and found_keys == keys and found_node == node != ROOT_NODE
    assert cache.match([5, 6, 7, 0], max_blocks=10)[0] == owned[:1]  # diverges in block 2
    assert cache.match([6, 5, 7, 8], max_blocks=10)[0] == []  # the chain needs the same head
    assert cache.match(ids, max_blocks=1)[0] == owned[:1]
    # A hash collision cannot hand out wrong KV: the real ids are compared on every hit.
    cache.entries[owned[0]].tokens = (0, 0)
    assert cache.match(ids, max_blocks=10)[0] == []
    cache.entries[owned[0]].tokens = (5, 6)

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


def test_prefix_cache_refuses_a_block_whose_chain_key_collides(monkeypatch):
    """Chain keys that ignore the prefix (a forced collision): [Y][Z] must not get the Z block
    computed after [X], although its key and its own tokens are the same."""
    monkeypatch.setattr(PrefixCache, "chain_key", staticmethod(lambda parent, tokens: hash(tokens)))
    cache = PrefixCache(block_size=2)
    blocks = KVBlockManager(num_blocks=8, block_size=2, prefix_cache=cache)
    x, y, z, w = [1, 2], [3, 4], [5, 6], [7, 8]
    after_x, _, _ = publish_chain(cache, blocks, x + z)
    after_y, _, _ = publish_chain(cache, blocks, y + w)
    found, _, _ = cache.match(y + z + [9], max_blocks=10)
    assert found == after_y[:1]  # [Y] is a hit; [Z] after [X] is refused
    assert cache.match(x + z + [9], max_blocks=10)[0] == after_x  # the real prefix still hits
    # Publishing [Y][Z] cannot take the key [X][Z] holds: the chain stops being shared there,
    # and so does everything after it.
    owned, keys, node = publish_chain(cache, blocks, y + z + w)
    assert node == NO_NODE
    assert cache.match(y + z + w + [9], max_blocks=10)[0] == after_y[:1]


def test_prefix_cache_never_matches_through_a_recached_parent():
    cache = PrefixCache(block_size=2)
    blocks = KVBlockManager(num_blocks=2, block_size=2, prefix_cache=cache)
    first, _, _ = publish_chain(cache, blocks, [1, 2, 3, 4])
    blocks.release(first[:1])  # the head becomes evictable, its child stays held
    taken = blocks.allocate(1)  # no free block: evicts the head, whose node is gone for good
    assert taken == first[:1] and cache.match([1, 2, 3, 4, 0], 10)[0] == []
    blocks.release(taken + first[1:])
    head, _, _ = publish_chain(cache, blocks, [1, 2])  # the same head, cached again: a new node
    # The old child names the old head's node, so it is not served after the new one.
    assert cache.match([1, 2, 3, 4, 0], 10)[0] == head


def test_cached_blocks_nobody_holds_count_as_available_until_taken():
    cache = PrefixCache(block_size=2)
    blocks = KVBlockManager(num_blocks=4, block_size=2, prefix_cache=cache)
    owned, _, _ = publish_chain(cache, blocks, [1, 2, 3, 4])
    blocks.release(owned)  # both cached, unheld: 4 available
    assert blocks.can_allocate(2, owned) and not blocks.can_allocate(3, owned)
    assert blocks.can_allocate(4) and not blocks.can_allocate(5)
    blocks.acquire(owned[0])  # held now: sharing it takes nothing more from the pool
    assert blocks.can_allocate(2, owned) and not blocks.can_allocate(3, owned)
    assert blocks.can_allocate(3, owned[:1]) and not blocks.can_allocate(4, owned[:1])
    blocks.release(owned[:1])
