"""ReplicaRouting against real publishers on real sockets (no engine processes): the prefix index
follows the KV events, the loads follow ReplicaLoad reports plus the worker's own requests in
flight, and the supervisor's notices take a replica out of rotation and back."""

from __future__ import annotations

import time

import pytest
import zmq

from ipc.block_hash import block_hashes
from ipc.codec import pack_ids
from ipc.config import ClusterConfig
from ipc.kv_events import AllBlocksCleared, BlockStored
from ipc.messages import (
    LOAD_TOPIC,
    NOTICE_DIED,
    NOTICE_READY,
    ClusterNotice,
    ReplicaLoad,
    RequestMeta,
    SamplingParams,
    TokenizedRequest,
)
from runtime.kv_publisher import EventSink, KVEventPublisher
from tokenizer_worker.routing import ReplicaRouting

WORKER = 1
PROMPT = list(range(100, 164))  # 4 blocks of 16


@pytest.fixture
def parts(tmp_path):
    config = ClusterConfig.build(
        "m", str(tmp_path), engines=2, tokenizer_workers=2, routing_balance_abs_threshold=2
    )
    ctx = zmq.Context()
    publishers = [
        KVEventPublisher(
            ctx,
            [
                EventSink(
                    config.engine_events_addr(r),
                    replay_address=config.engine_events_replay_addr(r),
                    side=True,
                )
            ],
            data_parallel_rank=r,
        )
        for r in range(2)
    ]
    routing = ReplicaRouting(config, WORKER, ctx)
    yield routing, publishers
    routing.close()
    for publisher in publishers:
        publisher.close()
    ctx.term()


def until(routing: ReplicaRouting, predicate, resend=None, timeout_s: float = 10.0) -> None:
    """Receives until ``predicate()``; ``resend`` publishes again meanwhile (a load report
    has no replay: one sent before the subscription is connected is gone, as is any
    superseded one in a cluster, where the next step brings the next)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "not reached in time"
        if resend is not None:
            resend()
        routing.receive()
        time.sleep(0.005)


def request(n: int) -> TokenizedRequest:
    return TokenizedRequest(
        f"r{n}", pack_ids(PROMPT), SamplingParams(), RequestMeta(f"r{n}", b"c", len(PROMPT))
    )


def load(replica: int, pid: int, running: int, received: int) -> ReplicaLoad:
    return ReplicaLoad(replica, pid, running, 0, 0.1, [0, received])


def test_routing_follows_events_loads_and_notices(parts):
    routing, (zero, one) = parts
    for publisher in (zero, one):
        publisher.publish([AllBlocksCleared()])
    one.publish([BlockStored(block_hashes(PROMPT, 16), None, PROMPT, 16)])
    until(routing, lambda: routing.router.index.blocks_of(1) == 4)
    first = request(1)
    assert routing.route(first) == 1
    assert (first.meta.engine_index, first.meta.routing_outcome) == (1, "cache_hit")
    assert first.meta.routing_s > 0
    # Replica 1 reports 5 running and has not received this worker's request yet: its load is
    # 6 against 0, imbalanced past the threshold of 2.
    busy = load(1, 501, running=5, received=0)
    until(routing, lambda: routing.reported[1] == 5, lambda: one.publish_side(LOAD_TOPIC, busy))
    second = request(2)
    assert routing.route(second) == 0 and second.meta.routing_outcome == "imbalanced"
    assert routing.stats()["replica_load_1"] == 6 and routing.stats()["replica_load_0"] == 1
    # It received the first one, and is idle again: the prefix wins.
    idle = load(1, 501, running=0, received=1)
    until(routing, lambda: routing.reported[1] == 0, lambda: one.publish_side(LOAD_TOPIC, idle))
    assert routing.sent == [1, 1] and routing.received[1] == 1
    assert routing.route(request(3)) == 1
    # Dead: out of rotation, its blocks forgotten; ready again: back.
    routing.on_notice(ClusterNotice(NOTICE_DIED, "engine", 1, pid=501))
    assert routing.router.index.blocks_of(1) == 0
    assert routing.route(request(4)) == 0
    routing.on_notice(ClusterNotice(NOTICE_READY, "engine", 1, pid=502))
    assert routing.live == {0, 1}
    # Its replacement counts afresh: what this worker sent the old one is not in flight.
    fresh = load(1, 502, running=0, received=0)
    until(routing, lambda: routing.pids[1] == 502, lambda: one.publish_side(LOAD_TOPIC, fresh))
    assert routing.sent[1] == 0
    stats = routing.stats()
    assert stats["routed"] == 4 and stats["routed_cache_hit"] == 2
    assert stats["replicas_live"] == 2 and stats["lost_event_batches"] == 0
    # Replica 0 never reported: its load is the two requests this worker sent it.
    assert (stats["replica_load_0"], stats["replica_load_1"]) == (2, 0)


def test_a_worker_that_restarted_counts_only_its_own_requests_in_flight(parts):
    """The first report it hears may count what its predecessor sent (never less than its
    own): nothing of that is taken for this worker's requests in flight."""
    routing, (_, one) = parts
    assert routing.route(request(1)) in (0, 1)
    first = load(1, 600, running=0, received=40)
    until(routing, lambda: routing.pids[1] == 600, lambda: one.publish_side(LOAD_TOPIC, first))
    assert routing.sent[1] == 40 and routing.received[1] == 40
