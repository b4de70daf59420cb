"""A tokenizer worker's choice of engine replica (several engines only; docs/data-parallel.md).

``ReplicaRouting`` follows every replica's event stream (``runtime.kv_subscriber``: the KV events
feed the prefix index of an ``ipc.replica_router.Router``, the ``ReplicaLoad`` messages its loads),
hears from the supervisor which replicas are dead (a ClusterNotice in the worker's inbox), and
picks the replica of each tokenized request. What it picked, what decided it and how long that
took go into the request's meta, so the detokenizer knows where the request runs and counts the
decisions for /metrics.

Hashing a prompt's blocks costs a few microseconds a block the first time (``ipc.block_hash``),
so the request's path hashes only as far as some replica holds the prompt's blocks (a later block
cannot extend a cached prefix), and each worker hashes the blocks the KV events announce into
its memo as the events arrive (``BlockHasher.learn``), off any request's path: a chat's turn
finds its history there, whichever worker routed the turn before.

A replica's load is its running + waiting requests as of its latest report, plus this worker's
requests on their way to it: what this worker sent there minus what the replica reports having
received from it (exact: nothing is guessed about what finished). A worker that restarts catches
up through each replica's replay socket before its first choice is informed by it.

Prefill/decode disaggregation (docs/disaggregation.md): the prefill engine is chosen as above
among the prefill engines; the decode engine the request moves to after its first token is the
least loaded decode engine (running + waiting as of its latest report, plus what this worker
sent it since that report), then the one with the most free KV blocks. The prefill engine hands
the request to that one (``RequestMeta.decode_index``). A prompt a decode engine caches all but
``pd_skip_prefill_tokens`` of goes straight to it instead (outcome ``skip_prefill``): it computes
the rest and decodes, with no prefill engine and no KV transfer on the way.
"""

from __future__ import annotations

import logging
import time
from collections import Counter

import zmq

from ipc import codec
from ipc.block_hash import BlockHasher
from ipc.config import ClusterConfig
from ipc.kv_events import BlockStored
from ipc.messages import (
    LOAD_TOPIC,
    NOTICE_DIED,
    NOTICE_READY,
    ClusterNotice,
    ReplicaLoad,
    TokenizedRequest,
)
from ipc.replica_router import (
    CACHE_AWARE,
    OUTCOME_SKIP_PREFILL,
    Router,
    choose_decode,
    skip_prefill,
)
from runtime.kv_subscriber import KVEventSubscriber

logger = logging.getLogger("splitserve.tokenizer")


class ReplicaRouting:
    def __init__(self, config: ClusterConfig, worker_index: int, ctx: zmq.Context) -> None:
        self.worker_index = worker_index
        self.replicas = range(config.engines)
        self.prefill, self.decode = config.prefill_indices, config.decode_indices
        self.skip_tokens = config.pd_skip_prefill_tokens
        self.router = Router(config.routing_policy, config.routing_thresholds)
        self.uses_cache = config.routing_policy == CACHE_AWARE
        self.hasher = BlockHasher(config.engine.block_size)
        self.subscribers = [
            KVEventSubscriber(
                ctx,
                config.engine_events_addr(r),
                config.engine_events_replay_addr(r),
                curve=config.curve,
                side_topics=(LOAD_TOPIC,),
            )
            for r in self.replicas
        ]
        self.live = set(self.replicas)
        self.reported = [0] * config.engines  # running + waiting, from the latest load
        self.sent = [0] * config.engines  # requests this worker sent to each replica
        self.received = [0] * config.engines  # ...that the replica reports having received
        self.pids = [0] * config.engines  # the process each replica's latest load came from
        self.free_blocks = [0] * config.engines  # KV blocks available, from the latest load
        self.sent_since_load = [0] * config.engines  # decode engines: sent since their report
        self.decode_turn = 0
        self.decisions: Counter[str] = Counter()
        self.routing_s = 0.0
        self.learn_s = 0.0  # hashing the announced blocks into the memo, off the request path
        self.lost_batches = 0

    # --- what the replicas say ----------------------------------------------------------------
    @property
    def sockets(self) -> list[zmq.Socket]:
        return [sock for sub in self.subscribers for sock in sub.sockets]

    def receive(self) -> None:
        """Applies every event batch and load report that arrived (never waits)."""
        for replica, subscriber in zip(self.replicas, self.subscribers):
            for received in subscriber.receive():
                self.lost_batches += received.lost_before
                if self.uses_cache:
                    self.router.index.apply(replica, received.batch.events)
                    self._learn(received.batch.events)
            for _, _, payload in subscriber.take_side():
                try:
                    load = codec.decode_as(payload, ReplicaLoad)
                except codec.DecodeError as exc:
                    logger.warning("undecodable load report of engine[%d]: %s", replica, exc)
                    continue
                self._on_load(replica, load)

    def _learn(self, events: list) -> None:
        t_start = time.perf_counter()
        for event in events:
            if isinstance(event, BlockStored):
                self.hasher.learn(event.parent_block_hash, event.block_hashes, event.token_ids)
        self.learn_s += time.perf_counter() - t_start

    def _on_load(self, replica: int, load: ReplicaLoad) -> None:
        received = (
            load.received_from[self.worker_index]
            if self.worker_index < len(load.received_from)
            else 0
        )
        if load.pid != self.pids[replica]:
            # The first report this worker hears from the replica may count what a worker of its
            # index sent before it restarted (never less than what this one sent); a replica
            # that restarted counts afresh, and what this worker sent the one before is lost
            # with it or counted in the new one's.
            first = not self.pids[replica]
            self.sent[replica] = max(self.sent[replica], received) if first else received
            self.pids[replica] = load.pid
        self.reported[replica] = load.running + load.waiting
        self.free_blocks[replica] = load.kv_blocks_available
        self.sent_since_load[replica] = 0
        self.received[replica] = received

    def on_notice(self, notice: ClusterNotice) -> None:
        """A replica died (out of rotation; its cache is gone) or is ready again (back in
        rotation; its event stream starts over from its replay socket)."""
        if notice.role != "engine" or notice.index not in self.replicas:
            return
        if notice.event == NOTICE_DIED:
            self.live.discard(notice.index)
            self.router.index.clear(notice.index)
            # What was on its way to it is lost, or reaches the replacement, whose counts start
            # from 0 (its first report takes this worker's new count for its baseline).
            self.reported[notice.index] = self.sent[notice.index] = 0
            self.received[notice.index] = self.pids[notice.index] = 0
            self.free_blocks[notice.index] = self.sent_since_load[notice.index] = 0
        elif notice.event == NOTICE_READY:
            self.live.add(notice.index)
            self.subscribers[notice.index].start_over()
        logger.info(
            "engine[%d] %s; replicas in rotation: %s", notice.index, notice.event, sorted(self.live)
        )

    # --- the choice ---------------------------------------------------------------------------
    def route(self, request: TokenizedRequest) -> int:
        """Picks the replica for ``request``, writes it into its meta, and counts it as sent.
        With every replica out of rotation it still picks one: its socket keeps the request
        for the replacement."""
        t_start = time.perf_counter()
        block_ids: list[int] = []
        if self.uses_cache:
            held = self.router.index.held
            block_ids = self.hasher.hashes(request.token_ids, request.cache_salt, held)
        tokens = len(request.token_ids) // 4  # packed int32 ids
        skip = self._skip_prefill(block_ids, tokens)
        if skip is not None:  # computed and decoded there: decode_index stays -1
            replica, outcome = skip, OUTCOME_SKIP_PREFILL
            self.sent_since_load[skip] += 1
        else:
            loads = self.prefill_loads()
            live = self.live.intersection(self.prefill) or self.prefill
            blocks = tokens // self.hasher.block_size
            replica, outcome = self.router.route(block_ids, loads, live, prompt_blocks=blocks)
            if self.decode:
                request.meta.decode_index = self._choose_decode()
        self.sent[replica] += 1
        elapsed = time.perf_counter() - t_start
        self.decisions[outcome] += 1
        self.routing_s += elapsed
        meta = request.meta
        meta.engine_index, meta.routing_outcome, meta.routing_s = replica, outcome, elapsed
        return replica

    def prefill_loads(self) -> dict[int, int]:
        """Each prefill replica's load as this worker sees it: its latest report plus what this
        worker sent that the report had not counted yet."""
        return {r: self.reported[r] + max(0, self.sent[r] - self.received[r]) for r in self.prefill}

    def _skip_prefill(self, block_ids: list[int], tokens: int) -> int | None:
        """The decode engine caching all but ``pd_skip_prefill_tokens`` of the prompt, if any
        (disaggregated, cache_aware): the request skips the prefill engines and the transfer."""
        if not (self.decode and self.skip_tokens and block_ids):
            return None
        loads = {d: self.reported[d] + self.sent_since_load[d] for d in self.decode}
        matched = self.router.index.longest_prefix(block_ids)
        live = self.live.intersection(self.decode)
        size = self.hasher.block_size
        return skip_prefill(matched, tokens, size, live, loads, self.skip_tokens)

    def _choose_decode(self) -> int:
        loads = {d: self.reported[d] + self.sent_since_load[d] for d in self.decode}
        free = {d: self.free_blocks[d] for d in self.decode}
        live = self.live.intersection(self.decode) or self.decode
        decode = choose_decode(loads, free, live, self.decode_turn)
        self.decode_turn += 1
        self.sent_since_load[decode] += 1
        return decode

    def stats(self) -> dict[str, float]:
        routed = sum(self.decisions.values())
        return {
            "routed": routed,
            "routing_us_mean": self.routing_s / routed * 1e6 if routed else 0.0,
            "learn_s": self.learn_s,
            "learned_blocks": self.hasher.learned,
            "hash_hits": self.hasher.hits,
            "hash_misses": self.hasher.misses,
            "replicas_live": len(self.live),
            **{f"replica_load_{r}": float(load) for r, load in self.prefill_loads().items()},
            "index_blocks": sum(self.router.index.blocks_of(r) for r in self.replicas),
            "lost_event_batches": self.lost_batches,
            **{f"routed_{outcome}": float(n) for outcome, n in self.decisions.items()},
        }

    def close(self) -> None:
        for subscriber in self.subscribers:
            subscriber.close()
