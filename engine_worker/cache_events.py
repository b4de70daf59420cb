"""What the prefix cache stored and evicted during a step, as KV events (``ipc.kv_events``).

The prefix cache calls ``stored`` for every block it newly holds and ``removed`` for every block
it evicts, in the order they happen; the engine takes the step's events after the step and the
engine process hands them to its publisher. Consecutive blocks of one chain stored in a row
(what one request adds in a step) become one BlockStored, consecutive evictions one
BlockRemoved, so a step costs a few small objects, not one per block.
"""

from __future__ import annotations

import logging

from ipc.block_hash import external_id
from ipc.config import ClusterConfig
from ipc.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    parse_kv_events_config,
    plan_endpoint,
)
from runtime.kv_publisher import EventSink

logger = logging.getLogger("splitserve.engine")

# Batches the cluster-internal stream keeps for replay: what a restarted tokenizer worker can
# rebuild its view of this replica from (a step that changed the cache is one batch).
INTERNAL_REPLAY_STEPS = 10_000


class CacheEventRecorder:
    """Starts with AllBlocksCleared: a fresh engine's cache is empty, whatever a consumer knew
    of the engine it replaces."""

    def __init__(self, block_size: int, medium: str) -> None:
        self.block_size = block_size
        self.medium = medium
        self.events: list[KVCacheEvent] = [AllBlocksCleared()]

    def stored(self, parent: bytes | None, digest: bytes, tokens: tuple[int, ...]) -> None:
        """A block whose digest (``ipc.block_hash``) is ``digest``, after ``parent``'s."""
        parent_id = None if parent is None else external_id(parent)
        block_id = external_id(digest)
        last = self.events[-1] if self.events else None
        if isinstance(last, BlockStored) and last.block_hashes[-1] == parent_id:
            last.block_hashes.append(block_id)
            last.token_ids.extend(tokens)
        else:
            self.events.append(
                BlockStored([block_id], parent_id, list(tokens), self.block_size, self.medium)
            )

    def removed(self, digest: bytes) -> None:
        last = self.events[-1] if self.events else None
        if isinstance(last, BlockRemoved):
            last.block_hashes.append(external_id(digest))
        else:
            self.events.append(BlockRemoved([external_id(digest)], self.medium))

    def take(self) -> list[KVCacheEvent]:
        events, self.events = self.events, []
        return events


def event_sinks(config: ClusterConfig, index: int) -> list[EventSink]:
    """Where replica ``index`` publishes: the cluster-internal stream (the tokenizer workers
    follow it) and, when ``--kv-events-config`` asks, the user's endpoint (port + index)."""
    sinks = [
        EventSink(
            config.engine_events_addr(index),
            replay_address=config.engine_events_replay_addr(index),
            buffer_steps=INTERNAL_REPLAY_STEPS,
            curve=config.curve,
            side=True,  # the replica's load too (ipc.messages.ReplicaLoad)
        )
    ]
    user = parse_kv_events_config(config.engine.kv_events_config)
    if user is None or not user.publishes:
        return sinks
    curve = config.curve is not None
    plans = [plan_endpoint(user.endpoint, index, curve=curve)]
    if user.replay_endpoint:
        plans.append(plan_endpoint(user.replay_endpoint, index, curve=curve, replay=True))
    for plan in plans:
        if plan.narrowed_from:
            logger.warning(
                "KV events: %s listens on loopback only, as %s (beyond loopback needs CURVE: "
                "--listen or --require-curve)",
                plan.narrowed_from,
                plan.address,
            )
    sinks.append(
        EventSink(
            plans[0].address,
            bind=plans[0].bind,
            replay_address=plans[1].address if len(plans) > 1 else None,
            topic=user.topic.encode(),
            buffer_steps=user.buffer_steps,
            hwm=user.hwm,
            curve=config.curve,
        )
    )
    return sinks


def event_queue_max(config: ClusterConfig) -> int:
    user = parse_kv_events_config(config.engine.kv_events_config)
    return user.max_queue_size if user is not None else 100_000
