"""The engine deployment's Serve request router: the in-cluster router's score, over Serve's
replicas.

Serve runs one of these in each process that holds a handle to the engine deployment (the
ingress replicas). For every request it reads the block ids the ingress hashed
(``calls.EngineCall``) and scores the candidate replicas with ``ipc.replica_router`` exactly as a
tokenizer worker scores its engines: the prefix index follows each replica's KV events (the
endpoint its routing stats advertise, replayed from the start when first seen), and a
replica's load is the larger of the requests this process has in flight to it and the load the
replica last reported (which counts the other ingress replicas' requests too, as of Serve's
latest routing-stats poll), plus the requests chosen for it and not yet sent. The choice comes
first in the ranks returned, the others after it by load, so Serve falls through to them only
when the chosen replica is at max_ongoing_requests.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from typing import Any

import zmq
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from ipc.replica_router import CACHE_AWARE, Router, RoutingThresholds
from ipc.sockets import CurveKeys
from procs.serve_ray.calls import EngineCall
from runtime.kv_subscriber import KVEventSubscriber

logger = logging.getLogger("splitserve.serve_ray")
FOLLOW_INTERVAL_S = 0.05  # how often queued KV events are applied between requests


class TokenPrefixRouter(RequestRouter):
    def initialize_state(
        self,
        policy: str = CACHE_AWARE,
        balance_abs_threshold: int = 64,
        balance_rel_threshold: float = 1.5,
        cache_threshold: float = 0.3,
    ) -> None:
        self.router = Router(
            policy, RoutingThresholds(balance_abs_threshold, balance_rel_threshold, cache_threshold)
        )
        self.uses_cache = policy == CACHE_AWARE
        self.ctx = zmq.Context()
        self.numbers: dict[ReplicaID, int] = {}  # the prefix index's name for each replica
        self.followed: dict[ReplicaID, KVEventSubscriber] = {}
        self.in_flight: Counter[ReplicaID] = Counter()
        # Chosen but not sent yet: Serve may choose for several requests (probing queue lengths
        # in between) before it sends the first, and each must see the others' choices.
        self.chosen: Counter[ReplicaID] = Counter()
        self.decisions: Counter[str] = Counter()
        self.follower: asyncio.Task | None = None

    # --- what the replicas say ----------------------------------------------------------------
    def _number(self, replica_id: ReplicaID) -> int:
        return self.numbers.setdefault(replica_id, len(self.numbers))

    def _follow(self, replicas: list[RunningReplica]) -> None:
        """Subscribes to the KV events of each replica whose routing stats name them."""
        for replica in replicas:
            meta = replica.routing_stats.get("kv_event_metadata")
            if not self.uses_cache or replica.replica_id in self.followed or not meta:
                continue
            key = replica.routing_stats.get("curve_public_key") or ""
            self.followed[replica.replica_id] = KVEventSubscriber(
                self.ctx,
                meta["endpoint"],
                meta.get("replay_endpoint"),
                curve=CurveKeys(key) if key else None,
            )
            logger.info("following the KV events of %s at %s", replica.replica_id, meta["endpoint"])
        if self.follower is None and self.uses_cache:
            self.follower = self._event_loop.create_task(self._keep_following())

    def _receive(self) -> None:
        for replica_id, subscriber in list(self.followed.items()):
            for received in subscriber.receive():
                self.router.index.apply(self._number(replica_id), received.batch.events)

    async def _keep_following(self) -> None:
        # Off the request path: a request then finds the events applied already.
        while True:
            await asyncio.sleep(FOLLOW_INTERVAL_S)
            self._receive()

    def _forget(self, replica_id: ReplicaID) -> None:
        subscriber = self.followed.pop(replica_id, None)
        if subscriber is not None:
            subscriber.close()
        if replica_id in self.numbers:
            self.router.index.clear(self.numbers[replica_id])
        self.in_flight.pop(replica_id, None)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        present = {r.replica_id for r in replicas}
        for replica_id in [r for r in self.followed if r not in present]:
            self._forget(replica_id)
        self._follow(replicas)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._forget(replica_id)

    def on_send_request(self, replica_id: ReplicaID) -> None:
        super().on_send_request(replica_id)
        self.in_flight[replica_id] += 1
        if self.chosen[replica_id] > 0:
            self.chosen[replica_id] -= 1
        if not self.num_pending_requests:  # a choice that fell through is not counted forever
            self.chosen.clear()

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        super().on_request_completed(replica_id, internal_request_id)
        if self.in_flight[replica_id] > 0:
            self.in_flight[replica_id] -= 1

    # --- the choice ---------------------------------------------------------------------------
    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        self._follow(candidate_replicas)
        self._receive()
        by_number = {self._number(r.replica_id): r for r in candidate_replicas}
        loads = {
            n: max(self.in_flight[r.replica_id], int(r.routing_stats.get("load", 0)))
            + self.chosen[r.replica_id]
            for n, r in by_number.items()
        }
        call = engine_call(pending_request)
        block_ids = list(call.block_ids) if call is not None else []
        blocks = call.prompt_blocks if call is not None else 0
        chosen, outcome = self.router.route(block_ids, loads, by_number, prompt_blocks=blocks)
        self.decisions[outcome] += 1
        self.chosen[by_number[chosen].replica_id] += 1
        rest = sorted((n for n in by_number if n != chosen), key=lambda n: (loads[n], n))
        return [[by_number[n]] for n in (chosen, *rest)]


def engine_call(pending: PendingRequest | None) -> EngineCall | None:
    args: list[Any] = list(pending.args) if pending is not None else []
    return next((a for a in args if isinstance(a, EngineCall)), None)
