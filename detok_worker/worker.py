"""The detokenizer process: DetokenizerCore (core.py) between its sockets.

Sockets:
    ROUTER  client_addr       (bound, ROUTER_MANDATORY) handshake, events and replies out,
                              aborts/bye/engine-stats queries in
    PULL    detokenizer_addr  (bound) StepOutput from the engines, RequestError and
                              TokenizeResult from tokenizers, ClusterNotice from the supervisor
    PUSH    engine_addr(r)    AbortRequests, one PUSH per engine replica: client aborts, matched
                              stop strings, gone clients; to the request's replica, or to every
                              replica while its meta (which says where it runs) has not arrived

Each pass: receive and decode whatever is ready, hand it to the core, then send what the core
produced: welcomes, one ClientEvents per client followed by its notices, one AbortRequests. A
client whose queue is full (it stopped reading) or that is unreachable is dropped, and its
requests are aborted in the same pass. When the supervisor reports an engine dead, the core
ends the requests it held with an "unavailable" error (with several replicas: those that had
produced tokens; see DetokenizerCore.on_notice, and ipc.client.core.ClientCore for what clients
do with the notices).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import zmq

from detok_worker.core import EVERY_REPLICA, DetokenizerCore
from ipc import codec
from ipc.config import ClusterConfig
from ipc.messages import (
    ERR_UNAVAILABLE,
    FINISH_ABORT,
    AbortRequests,
    ClientAbort,
    ClientBye,
    ClientEvents,
    ClientHello,
    ClientWelcome,
    ClusterNotice,
    RequestError,
    StepOutput,
)
from ipc.messages.queries import EngineStatsQuery, TokenizeResult
from ipc.sockets import LINGER_MS, PullQueue, PushQueue, bind, configure
from runtime.model_files import load_tokenizer
from runtime.worker import WorkerRuntime, run_on_context

logger = logging.getLogger("splitserve.detokenizer")

SHUTDOWN_QUIET_S = 0.3
_MORE, _LAST = int(zmq.SNDMORE | zmq.NOBLOCK), int(zmq.NOBLOCK)


class Detokenizer:
    def __init__(self, config: ClusterConfig, ctx: zmq.Context) -> None:
        self.config = config
        self.runtime = WorkerRuntime("detokenizer", 0, config, ctx)
        self.core = DetokenizerCore(
            load_tokenizer(config.model_path),
            stream_interval_tokens=config.stream_interval_tokens,
            engines=config.engines,
            routing_policy=config.routing_policy if config.routes else "",
            roles=[config.engine_role(r) for r in range(config.engines)],
        )
        self.router = configure(ctx.socket(zmq.ROUTER), receives=True, sndhwm=100_000)
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # never drop silently: raise instead
        self.router.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a reconnecting client takes over
        bind(self.router, config.client_addr, config.curve)
        self.inbox: PullQueue[StepOutput | RequestError | ClusterNotice | TokenizeResult] = (
            PullQueue(
                ctx,
                config.detokenizer_addr,
                StepOutput,
                RequestError,
                ClusterNotice,
                TokenizeResult,
                curve=config.curve,
            )
        )
        self.to_engines = [PushQueue(ctx, a, curve=config.curve) for a in config.engine_addrs]
        self.welcome = codec.encode(
            ClientWelcome(
                tokenizer_addrs=config.tokenizer_addrs,
                model=config.model_name or Path(config.model_path).name,
                max_model_len=config.engine.max_model_len,
                vocab_size=config.vocab_size,
                max_waiting_requests=config.engine.max_waiting_requests,
            )
        )
        self.busy_s = 0.0
        self.events_sent = 0
        self.woke = 0.0  # when the current pass began (its events carry it: t_detok_woke)

    # --- main loop ----------------------------------------------------------------------------
    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        poller.register(self.inbox.socket, zmq.POLLIN)
        self.runtime.announce(
            [self.router.getsockopt_string(zmq.LAST_ENDPOINT), self.inbox.address]
        )
        while not self.runtime.stopping:
            self.runtime.maybe_heartbeat(self.stats)
            ready = dict(poller.poll(min(self.runtime.heartbeat_due_in_ms(), 100)))
            self.serve_once(ready)
        self.shutdown(poller)

    def serve_once(self, ready: dict) -> None:
        t0 = self.woke = time.monotonic()
        if self.router in ready:
            self.receive_from_clients()
        if self.inbox.socket in ready:
            self.receive_from_inbox()
        self.flush()
        self.busy_s += time.monotonic() - t0

    def shutdown(self, poller: zmq.Poller) -> None:
        """Forwards what is still arriving, then ends every open request with a terminal event."""
        quiet_until = time.monotonic() + SHUTDOWN_QUIET_S
        while time.monotonic() < quiet_until:
            ready = dict(poller.poll(20))
            if ready:
                self.serve_once(ready)
                quiet_until = time.monotonic() + SHUTDOWN_QUIET_S
        self.core.end_all(
            FINISH_ABORT,
            time.monotonic(),
            error="unavailable: the cluster shut down",
            code=ERR_UNAVAILABLE,
        )
        self.flush()
        self.router.close(linger=LINGER_MS)
        self.inbox.close()
        for queue in self.to_engines:
            queue.close()
        self.runtime.close()

    # --- in -----------------------------------------------------------------------------------
    def receive_from_clients(self) -> None:
        while True:
            try:
                parts = self.router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(parts) != 2:
                logger.warning("dropped a client message with %d frames", len(parts))
                continue
            client_id, frame = parts
            try:
                msg = codec.decode_as(frame, ClientHello, ClientAbort, ClientBye, EngineStatsQuery)
            except codec.DecodeError as exc:
                logger.warning("dropped a malformed client message: %s", exc)
                continue
            if isinstance(msg, ClientHello):
                self.core.on_hello(client_id)
            elif isinstance(msg, ClientAbort):
                self.core.on_client_abort(client_id, msg.request_ids)
            elif isinstance(msg, EngineStatsQuery):
                self.core.on_stats_query(client_id, msg.request_id)
            else:
                self.core.on_client_gone(client_id, reason="said goodbye")

    def receive_from_inbox(self) -> None:
        for msg in self.inbox.drain(256, _log_malformed):
            if isinstance(msg, StepOutput):
                self.core.on_step_output(msg)
            elif isinstance(msg, ClusterNotice):
                self.core.on_notice(msg, time.monotonic())
            elif isinstance(msg, TokenizeResult):
                self.core.on_tokenize_result(msg)
            else:
                self.core.on_request_error(msg)

    # --- out ----------------------------------------------------------------------------------
    def flush(self) -> None:
        """Welcomes, then per client its events, its notices and its replies, then the aborts of
        the pass (including those of clients dropped while sending)."""
        out = self.core.take_output()
        for client_id in out.welcomes:
            self._send_frame(client_id, self.welcome)
        for client_id in out.events.keys() | out.notices.keys() | out.replies.keys():
            events = out.events.get(client_id)
            if events and self.core.has_client(client_id):
                self.events_sent += len(events)
                sent = time.monotonic()
                for event in events:
                    event.t_detok_woke, event.t_detok_sent = self.woke, sent
                self._send_frame(client_id, codec.encode(ClientEvents(events=events)))
            for message in [*out.notices.get(client_id, ()), *out.replies.get(client_id, ())]:
                if self.core.has_client(client_id):
                    self._send_frame(client_id, codec.encode(message))
        # Dropping a client while sending queues nothing but the aborts of its requests.
        self.send_aborts(out.aborts + self.core.take_output().aborts)

    def send_aborts(self, aborts: list[tuple[str, int]]) -> None:
        """One AbortRequests per replica that has any (every replica gets those of requests
        whose replica is not known here)."""
        by_replica: dict[int, list[str]] = {}
        for rid, replica in aborts:
            targets = range(len(self.to_engines)) if replica == EVERY_REPLICA else (replica,)
            for target in targets:
                if 0 <= target < len(self.to_engines):
                    by_replica.setdefault(target, []).append(rid)
        for replica, ids in by_replica.items():
            try:
                self.to_engines[replica].put(AbortRequests(request_ids=ids), timeout_ms=5000)
            except zmq.Again:
                logger.error(
                    "engine[%d] is not reading; %d aborts not delivered", replica, len(ids)
                )

    def _send_frame(self, client_id: bytes, frame: bytes) -> None:
        # Two plain sends, not send_multipart: it costs more than the sends themselves (per
        # token). A ROUTER refuses a message at its first part (unreachable, queue full).
        try:
            self.router.send(client_id, _MORE)
            self.router.send(frame, _LAST)
        except zmq.Again:
            self.core.on_client_gone(client_id, reason="stopped reading (its queue is full)")
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            self.core.on_client_gone(client_id, reason="is gone")

    def stats(self) -> dict[str, float]:
        return self.core.stats() | {
            "busy_s": self.busy_s,
            "events_sent": self.events_sent,
            "pid": os.getpid(),
        }


def _log_malformed(frame: bytes, exc: codec.DecodeError) -> None:
    logger.error("dropped a malformed frame from the engine/tokenizers: %s", exc)


def main(config: ClusterConfig, index: int = 0) -> None:
    run_on_context(lambda ctx: Detokenizer(config, ctx))
