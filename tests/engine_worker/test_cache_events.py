"""The engine's prefix cache as KV events, on the tiny model: what it stores (external ids
recomputed here from the token ids, parent links, token ids), what it evicts, that the events
always describe exactly the blocks the cache holds, and cache_salt isolation."""

from __future__ import annotations

import random

import pytest

from engine_worker.engine import Engine
from ipc.block_hash import block_hashes, external_id
from ipc.engine_config import EngineConfig
from ipc.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from tests.engine_worker.helpers import collect, greedy

SIZE = 16


def engine_with_events(model_dir, **knobs) -> Engine:
    config = EngineConfig(model_path=str(model_dir), block_size=SIZE, **knobs)
    return Engine(config, cache_events=True)


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 49000) for _ in range(length)]


def follow(held: dict[int, tuple], events) -> None:
    """Applies events to a consumer's view: block id -> (parent id, tokens)."""
    for event in events:
        if isinstance(event, AllBlocksCleared):
            held.clear()
        elif isinstance(event, BlockStored):
            parent = event.parent_block_hash
            for i, block in enumerate(event.block_hashes):
                assert block not in held, "stored twice without a removal"
                held[block] = (parent, tuple(event.token_ids[i * SIZE : (i + 1) * SIZE]))
                parent = block
        elif isinstance(event, BlockRemoved):
            for block in event.block_hashes:
                assert held.pop(block, None) is not None, "removed a block never stored"


def cache_view(engine: Engine) -> set[int]:
    assert engine.prefix_cache is not None
    return {external_id(e.digest) for e in engine.prefix_cache.entries.values()}


def test_block_stored_names_the_prompt_blocks_and_their_parents(tiny_model_dir):
    engine = engine_with_events(tiny_model_dir, kv_cache_tokens=2048)
    assert engine.take_cache_events() == [AllBlocksCleared()]
    first = prompt(1, 3 * SIZE + 5)
    engine.add("a", first, greedy(2))
    collect(engine)
    events = engine.take_cache_events()
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert len(stored) == 1  # one request, one step: one event for its new blocks
    assert stored[0].block_hashes == block_hashes(first, SIZE)
    assert stored[0].parent_block_hash is None and stored[0].token_ids == first[: 3 * SIZE]
    assert stored[0].medium == "CPU" and stored[0].block_size == SIZE

    # Sharing two blocks, then its own: one event whose parent is the second shared block.
    second = first[: 2 * SIZE] + prompt(2, 2 * SIZE + 1)
    engine.add("b", second, greedy(1))
    results = collect(engine)
    assert results["b"]["start"].cached_tokens == 2 * SIZE
    (event,) = engine.take_cache_events()
    assert isinstance(event, BlockStored)
    assert event.parent_block_hash == block_hashes(first, SIZE)[1]
    assert event.block_hashes == block_hashes(second, SIZE)[2:]
    assert event.token_ids == second[2 * SIZE : 4 * SIZE]


def test_events_follow_the_cache_through_decode_and_eviction(tiny_model_dir):
    engine = engine_with_events(tiny_model_dir, kv_cache_tokens=10 * SIZE, max_model_len=8 * SIZE)
    held: dict[int, tuple] = {}
    removed = 0
    for i in range(9):  # more than the pool holds: older blocks are evicted
        ids = prompt(10 + i % 5, 2 * SIZE + 3)
        engine.add(f"r{i}", ids, greedy(SIZE, ignore_eos=True))  # decode fills a block too
        for _ in range(3):
            if engine.has_work():
                engine.step()
        if i % 3 == 2:
            collect(engine)
        events = engine.take_cache_events()
        removed += sum(len(e.block_hashes) for e in events if isinstance(e, BlockRemoved))
        follow(held, events)
        assert set(held) == cache_view(engine)
        for block in held:  # a chain back to the start hashes to the block's id
            chain, link = [], block
            while link in held:
                chain.append(link)
                link = held[link][0]
            if link is None:
                tokens = [t for b in reversed(chain) for t in held[b][1]]
                assert block_hashes(tokens, SIZE)[-1] == block
    assert removed > 0
    collect(engine)
    follow(held, engine.take_cache_events())
    assert set(held) == cache_view(engine)


def test_salted_requests_never_share_blocks(tiny_model_dir):
    engine = engine_with_events(tiny_model_dir, kv_cache_tokens=2048)
    ids = prompt(3, 4 * SIZE + 1)

    def cached(name, salt):
        engine.add(name, ids, greedy(1), cache_salt=salt)
        return collect(engine)[name]["start"].cached_tokens

    assert cached("a1", "tenant-a") == 0
    assert cached("b1", "tenant-b") == 0
    assert cached("plain", None) == 0
    assert cached("a2", "tenant-a") == 4 * SIZE
    assert cached("plain2", None) == 4 * SIZE
    stored = [e for e in engine.take_cache_events() if isinstance(e, BlockStored)]
    assert [e.block_hashes for e in stored] == [
        block_hashes(ids, SIZE, "tenant-a"),
        block_hashes(ids, SIZE, "tenant-b"),
        block_hashes(ids, SIZE),
    ]
    with pytest.raises(ValueError, match="cache_salt"):
        engine.add("bad", ids, greedy(1), cache_salt="")


def test_without_events_nothing_is_recorded(tiny_model_dir):
    engine = Engine(EngineConfig(model_path=str(tiny_model_dir), kv_cache_tokens=1024))
    engine.add("a", prompt(4, 40), greedy(1))
    collect(engine)
    assert engine.take_cache_events() == []
    assert engine.prefix_cache is not None
    assert all(e.digest == b"" for e in engine.prefix_cache.entries.values())
