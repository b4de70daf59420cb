"""The prefix index and the routing rule: each case below fails for a rule that differs (load
imbalance decides first, then the cached share above the threshold, else the least loaded;
among equal loads the smallest cache, ties beyond that spread by turn; dead replicas never)."""

from __future__ import annotations

import pytest

from ipc.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from ipc.replica_router import (
    CACHE_AWARE,
    LEAST_LOADED,
    ROUND_ROBIN,
    NoLiveReplica,
    PrefixIndex,
    Router,
    RoutingThresholds,
    choose,
)

TEN = 10  # the request's full blocks


def test_imbalance_decides_before_the_cache():
    full = {0: TEN}
    # max - min = 90 > 64 and 100 > 10 * 1.5: imbalanced, so the cached replica loses.
    assert choose(CACHE_AWARE, full, TEN, {0: 100, 1: 10}, [0, 1]) == (1, "imbalanced")
    # Only 60 apart: balanced, the cache wins.
    assert choose(CACHE_AWARE, full, TEN, {0: 70, 1: 10}, [0, 1]) == (0, "cache_hit")
    # 80 apart but 300 <= 220 * 1.5: both conditions are needed.
    assert choose(CACHE_AWARE, full, TEN, {0: 300, 1: 220}, [0, 1]) == (0, "cache_hit")
    low = RoutingThresholds(balance_abs_threshold=2, balance_rel_threshold=1.0)
    assert choose(CACHE_AWARE, full, TEN, {0: 4, 1: 1}, [0, 1], low) == (1, "imbalanced")


def test_cache_share_must_exceed_the_threshold():
    loads = {0: 5, 1: 0}
    assert choose(CACHE_AWARE, {0: 3}, TEN, loads, [0, 1]) == (1, "balanced")  # 0.3: not above
    assert choose(CACHE_AWARE, {0: 4}, TEN, loads, [0, 1]) == (0, "cache_hit")
    assert choose(CACHE_AWARE, {0: 4, 1: 7}, TEN, loads, [0, 1]) == (1, "cache_hit")  # longest
    assert choose(CACHE_AWARE, {}, 0, loads, [0, 1]) == (1, "balanced")  # no full block


def test_ties_go_to_the_lower_load_then_the_lower_index():
    assert choose(CACHE_AWARE, {0: 6, 1: 6, 2: 6}, TEN, {0: 3, 1: 2, 2: 2}, [0, 1, 2]) == (
        1,
        "cache_hit",
    )
    assert choose(CACHE_AWARE, {}, TEN, {0: 1, 1: 1, 2: 1}, [2, 1, 0]) == (0, "balanced")
    assert choose(LEAST_LOADED, {1: TEN}, TEN, {0: 1, 1: 2}, [0, 1]) == (0, "balanced")


def test_below_the_threshold_the_smallest_cache_wins_among_the_least_loaded():
    # Issue 38: with no match the tie went to replica 0, which then cached every prefix.
    assert choose(CACHE_AWARE, {}, TEN, {0: 0, 1: 0}, [0, 1], cached={0: 40, 1: 0}) == (
        1,
        "balanced",
    )
    assert choose(CACHE_AWARE, {0: 2}, TEN, {0: 0, 1: 0}, [0, 1], cached={0: 40, 1: 3}) == (
        1,
        "balanced",
    )
    # Load still comes first (the index learns of blocks only after their prefill).
    assert choose(CACHE_AWARE, {}, TEN, {0: 0, 1: 1}, [0, 1], cached={0: 40, 1: 0}) == (
        0,
        "balanced",
    )
    router = Router(CACHE_AWARE)
    router.index.apply(0, [BlockStored([1, 2, 3], None, [0] * 12, 4)])
    assert router.route([7, 8], {0: 0, 1: 0}, [0, 1]) == (1, "balanced")


def test_ties_beyond_load_and_cache_spread_by_turn():
    turns = [choose(CACHE_AWARE, {}, TEN, {0: 2, 1: 0, 2: 0}, [0, 1, 2], turn=t) for t in range(4)]
    assert [r for r, _ in turns] == [1, 2, 1, 2]
    assert [choose(LEAST_LOADED, {}, TEN, {}, [0, 1], turn=t)[0] for t in range(3)] == [0, 1, 0]
    router = Router(LEAST_LOADED)
    assert [router.route([5], {0: 0, 1: 0}, [0, 1])[0] for _ in range(4)] == [0, 1, 0, 1]


def test_dead_replicas_are_never_chosen():
    loads = {0: 0, 1: 9, 2: 9}
    assert choose(CACHE_AWARE, {0: TEN}, TEN, loads, [1, 2]) == (1, "balanced")
    assert choose(LEAST_LOADED, {}, TEN, loads, [2]) == (2, "balanced")
    assert [choose(ROUND_ROBIN, {}, TEN, {}, [0, 2], turn=t)[0] for t in range(4)] == [0, 2, 0, 2]
    with pytest.raises(NoLiveReplica):
        choose(CACHE_AWARE, {0: TEN}, TEN, loads, [])
    with pytest.raises(ValueError, match="policy"):
        choose("random", {}, TEN, loads, [0])


def test_prefix_index_follows_stores_removals_and_restarts():
    index = PrefixIndex()
    index.apply(0, [BlockStored([1, 2, 3], None, [0] * 12, 4)])
    index.apply(1, [BlockStored([1, 2], None, [0] * 8, 4), BlockStored([9], 2, [0] * 4, 4)])
    assert index.longest_prefix([1, 2, 3, 4]) == {0: 3, 1: 2}
    assert index.longest_prefix([1, 9]) == {0: 1, 1: 2}
    assert index.longest_prefix([7, 2, 3]) == {}  # a prefix starts at the first block
    index.apply(0, [BlockRemoved([2])])  # block 3 stays but is cut off from the start
    assert index.longest_prefix([1, 2, 3]) == {0: 1, 1: 2}
    index.apply(1, [AllBlocksCleared()])  # replica 1 restarted
    assert index.longest_prefix([1, 2, 3]) == {0: 1} and index.blocks_of(1) == 0
    assert index.blocks_of(0) == 2


def test_router_sticks_to_the_replica_holding_the_prefix():
    router = Router(CACHE_AWARE)
    router.index.apply(1, [BlockStored([5, 6, 7], None, [0] * 12, 4)])
    assert router.route([5, 6, 7, 8], {0: 0, 1: 3}, [0, 1]) == (1, "cache_hit")
    assert router.route([4, 6], {0: 0, 1: 3}, [0, 1]) == (0, "balanced")
    rr = Router(ROUND_ROBIN)
    assert [rr.route([5], {}, [0, 1, 2])[0] for _ in range(4)] == [0, 1, 2, 0]
