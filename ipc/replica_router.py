"""Choosing an engine replica for a request: the prefix index and the routing rule.

Plain data in, plain data out, so the tokenizer workers and a Ray request router (or a test)
use the same code. ``PrefixIndex`` follows the replicas' KV events (``ipc.kv_events``) and says,
for a request's block ids (``ipc.block_hash``), how many leading blocks each replica holds.
``choose`` applies SGLang's cache-aware rule:

1. imbalanced (``max_load - min_load > balance_abs_threshold`` and
   ``max_load > min_load * balance_rel_threshold``): the least loaded replica;
2. else the replica with the longest cached prefix, if that prefix is more than
   ``cache_threshold`` of the request's full blocks;
3. else the least loaded replica, and among equally loaded ones the one whose cache holds the
   fewest blocks (SGLang's "smallest tree"), so an unrelated prefix starts on an idle replica
   instead of piling onto the one that cached everything before it.

"Least loaded" is always that: the lowest load, then the smallest cache, and a tie beyond that
goes round (the chooser's turn picks among the tied replicas), never always to the lowest
index. Load comes before cache size because the index only learns of a replica's blocks from
its events, after the prefill: a burst of new prefixes ordered by cache alone would all go to
the replica that looked emptiest when the burst began. Replicas not in ``live`` are never
chosen. A load is the replica's running + waiting requests plus the chooser's own in flight
to it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from ipc.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent

CACHE_AWARE = "cache_aware"
LEAST_LOADED = "least_loaded"
ROUND_ROBIN = "round_robin"
POLICIES = (CACHE_AWARE, LEAST_LOADED, ROUND_ROBIN)

# What decided a choice (the routing metric's outcome label).
OUTCOME_CACHE_HIT = "cache_hit"  # the longest cached prefix was long enough
OUTCOME_BALANCED = "balanced"  # least loaded, the cluster being balanced
OUTCOME_IMBALANCED = "imbalanced"  # least loaded, because the cluster was not
OUTCOME_ROUND_ROBIN = "round_robin"
OUTCOME_SKIP_PREFILL = "skip_prefill"  # disaggregated: straight to a decode engine caching it


@dataclass(frozen=True, slots=True)
class RoutingThresholds:
    """SGLang's router defaults."""

    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    cache_threshold: float = 0.3

    def __post_init__(self) -> None:
        if self.balance_abs_threshold < 0 or self.balance_rel_threshold < 1.0:
            raise ValueError("balance thresholds: absolute >= 0, relative >= 1")
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError("cache_threshold must be in [0, 1]")


class NoLiveReplica(RuntimeError):
    """Every replica is out of rotation (dead, restarting)."""


class PrefixIndex:
    """Block id -> the replicas holding it, from each replica's events. A replica that starts
    (or restarts) publishes AllBlocksCleared first, which drops what it held before."""

    def __init__(self) -> None:
        self._holders: dict[int, set[int]] = {}
        self._held: dict[int, set[int]] = {}  # replica -> its block ids, to clear it at once

    def apply(self, replica: int, events: Iterable[KVCacheEvent]) -> None:
        for event in events:
            if isinstance(event, BlockStored):
                self.stored(replica, event.block_hashes)
            elif isinstance(event, BlockRemoved):
                self.removed(replica, event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                self.clear(replica)

    def stored(self, replica: int, block_ids: Iterable[int]) -> None:
        held = self._held.setdefault(replica, set())
        for block in block_ids:
            self._holders.setdefault(block, set()).add(replica)
            held.add(block)

    def removed(self, replica: int, block_ids: Iterable[int]) -> None:
        held = self._held.get(replica, set())
        for block in block_ids:
            holders = self._holders.get(block)
            if holders is not None:
                holders.discard(replica)
                if not holders:
                    del self._holders[block]
            held.discard(block)

    def clear(self, replica: int) -> None:
        self.removed(replica, list(self._held.pop(replica, ())))

    def held(self, block_id: int) -> bool:
        """Whether any replica holds the block."""
        return block_id in self._holders

    def blocks_of(self, replica: int) -> int:
        return len(self._held.get(replica, ()))

    def longest_prefix(self, block_ids: Sequence[int]) -> dict[int, int]:
        """Replica -> how many of the leading ``block_ids`` it holds (replicas holding none
        are left out)."""
        matched: dict[int, int] = {}
        if not block_ids:
            return matched
        holders = self._holders
        alive = set(holders.get(block_ids[0], ()))
        for position, block in enumerate(block_ids[1:], 1):
            if not alive:
                return matched
            here = holders.get(block)
            if here is None or not here >= alive:  # some replicas' prefixes end here
                for replica in alive if here is None else alive - here:
                    matched[replica] = position
                alive = set() if here is None else alive & here
        for replica in alive:
            matched[replica] = len(block_ids)
        return matched


def choose(
    policy: str,
    matched: Mapping[int, int],
    prompt_blocks: int,
    loads: Mapping[int, int],
    live: Iterable[int],
    thresholds: RoutingThresholds = RoutingThresholds(),
    turn: int = 0,
    cached: Mapping[int, int] | None = None,
) -> tuple[int, str]:
    """(replica, outcome) for one request. ``matched``: replica -> leading blocks it holds
    (``PrefixIndex.longest_prefix``); ``prompt_blocks``: the request's full blocks;
    ``loads``: replica -> load (absent: 0); ``turn``: the chooser's counter (round robin's
    turn, and which of several tied replicas takes a request); ``cached``: replica -> blocks
    its cache holds (``PrefixIndex.blocks_of``; absent: 0)."""
    candidates = sorted(set(live))
    if not candidates:
        raise NoLiveReplica("no engine replica is in rotation")
    if policy == ROUND_ROBIN:
        return candidates[turn % len(candidates)], OUTCOME_ROUND_ROBIN
    if policy not in POLICIES:
        raise ValueError(f"routing policy must be one of {POLICIES}, got {policy!r}")
    load = {r: loads.get(r, 0) for r in candidates}
    least_loaded = _least_loaded(candidates, load, cached or {}, turn)
    if policy == LEAST_LOADED:
        return least_loaded, OUTCOME_BALANCED
    highest, lowest = max(load.values()), load[least_loaded]
    if (
        highest - lowest > thresholds.balance_abs_threshold
        and highest > lowest * thresholds.balance_rel_threshold
    ):
        return least_loaded, OUTCOME_IMBALANCED
    best = min(candidates, key=lambda r: (-matched.get(r, 0), load[r], r))
    if prompt_blocks and matched.get(best, 0) / prompt_blocks > thresholds.cache_threshold:
        return best, OUTCOME_CACHE_HIT
    return least_loaded, OUTCOME_BALANCED


def _least_loaded(
    candidates: list[int], load: Mapping[int, int], cached: Mapping[int, int], turn: int
) -> int:
    """The lowest load, then the fewest cached blocks; ``turn`` picks among what still ties."""
    rank = {r: (load[r], cached.get(r, 0)) for r in candidates}
    lowest = min(rank.values())
    tied = [r for r in candidates if rank[r] == lowest]
    return tied[turn % len(tied)]


def choose_decode(
    loads: Mapping[int, int], free_blocks: Mapping[int, int], live: Iterable[int], turn: int = 0
) -> int:
    """The decode engine for a request (prefill/decode disaggregation): the least loaded, then
    the one with the most free KV blocks; ``turn`` picks among what still ties."""
    candidates = sorted(set(live))
    if not candidates:
        raise NoLiveReplica("no decode engine is in rotation")
    rank = {r: (loads.get(r, 0), -free_blocks.get(r, 0)) for r in candidates}
    lowest = min(rank.values())
    tied = [r for r in candidates if rank[r] == lowest]
    return tied[turn % len(tied)]


def skip_prefill(
    matched: Mapping[int, int],
    prompt_tokens: int,
    block_size: int,
    live: Iterable[int],
    loads: Mapping[int, int],
    max_uncached: int,
) -> int | None:
    """Prefill/decode disaggregation: the decode engine a prompt goes to straight, skipping the
    prefill engines, or None. It is the live decode engine caching the longest prefix of it
    (``matched``, as for ``choose``; then the least loaded), when that prefix leaves at most
    ``max_uncached`` of the prompt's ``prompt_tokens`` to compute (0: never)."""
    candidates = [d for d in sorted(set(live)) if matched.get(d, 0) > 0]
    if max_uncached <= 0 or not candidates:
        return None
    best = min(candidates, key=lambda d: (-matched[d], loads.get(d, 0), d))
    return best if prompt_tokens - matched[best] * block_size <= max_uncached else None


class Router:
    """A policy, its thresholds, a prefix index and round robin's turn: what a chooser keeps."""

    def __init__(self, policy: str, thresholds: RoutingThresholds = RoutingThresholds()) -> None:
        if policy not in POLICIES:
            raise ValueError(f"routing policy must be one of {POLICIES}, got {policy!r}")
        self.policy = policy
        self.thresholds = thresholds
        self.index = PrefixIndex()
        self._turn = 0

    def route(
        self,
        block_ids: Sequence[int],
        loads: Mapping[int, int],
        live: Iterable[int],
        prompt_blocks: int | None = None,
    ) -> tuple[int, str]:
        """``prompt_blocks``: the prompt's full blocks when ``block_ids`` stops early (after
        the first block no replica holds; see BlockHasher.hashes), else len(block_ids)."""
        matched = self.index.longest_prefix(block_ids) if self.policy == CACHE_AWARE else {}
        total = len(block_ids) if prompt_blocks is None else prompt_blocks
        live = sorted(set(live))
        cached = {r: self.index.blocks_of(r) for r in live}
        choice = choose(
            self.policy, matched, total, loads, live, self.thresholds, self._turn, cached
        )
        self._turn += 1
        return choice
