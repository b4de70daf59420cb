"""The detokenizer process: turns StepOutputs into per-client text streams.

Sockets:
    ROUTER  client_addr       (bound, ROUTER_MANDATORY) handshake, events out, aborts/bye in
    PULL    detokenizer_addr  (bound) StepOutput from the engine, RequestError from tokenizers,
                              ClusterNotice from the supervisor (a worker died / is back)
    PUSH    engine_addr       AbortRequests: client aborts, matched stop strings, gone clients

Every request it learns about (a RequestMeta or a RequestError) ends in exactly one terminal
StreamEvent to its client; a client that disappeared has its requests aborted in the engine.
When the supervisor reports the engine dead, every request held here ends with an "unavailable"
error at once and that engine's late outputs are dropped; every notice is forwarded to each client
with the ids of its requests known to be alive in the engine (see ipc.client_common.ClientCore).
"""

from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict
from pathlib import Path

import zmq

from detok_worker.request_state import RequestState
from ipc import codec
from ipc.config import ClusterConfig
from ipc.messages import (
    ERR_UNAVAILABLE,
    FINISH_ABORT,
    FINISH_ERROR,
    FINISH_STOP,
    NOTICE_DIED,
    AbortRequests,
    ClientAbort,
    ClientBye,
    ClientEvents,
    ClientHello,
    ClientWelcome,
    ClusterNotice,
    RequestError,
    StepOutput,
    StreamEvent,
)
from ipc.sockets import LINGER_MS, PullQueue, PushQueue, bind, configure
from runtime.model_files import load_tokenizer
from runtime.worker import WorkerRuntime

logger = logging.getLogger("splitserve.detokenizer")

MAX_IGNORED = 100_000  # ids stopped/abandoned here whose engine finish has not arrived yet
MAX_PENDING_ABORTS = 10_000  # per client: aborts for requests not seen yet
SHUTDOWN_QUIET_S = 0.3


class ClientInfo:
    __slots__ = ("request_ids", "pending_aborts")

    def __init__(self) -> None:
        self.request_ids: set[str] = set()
        # Aborts for requests not seen here yet, oldest first. Some never show up (ended before
        # the abort arrived, lost with a worker): the oldest are forgotten past the cap, which
        # is safe because every abort also goes to the engine at once.
        self.pending_aborts: OrderedDict[str, None] = OrderedDict()


class Detokenizer:
    def __init__(self, config: ClusterConfig, ctx: zmq.Context) -> None:
        self.config = config
        self.runtime = WorkerRuntime("detokenizer", 0, config, ctx)
        self.tokenizer = load_tokenizer(config.model_path)
        self.router = configure(ctx.socket(zmq.ROUTER), receives=True, sndhwm=100_000)
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # never drop silently: raise instead
        self.router.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a reconnecting client takes over
        bind(self.router, config.client_addr, config.curve)
        self.inbox: PullQueue[StepOutput | RequestError | ClusterNotice] = PullQueue(
            ctx, config.detokenizer_addr, StepOutput, RequestError, ClusterNotice,
            curve=config.curve)
        self.to_engine = PushQueue(ctx, config.engine_addr, curve=config.curve)
        self.welcome = codec.encode(ClientWelcome(
            tokenizer_addrs=config.tokenizer_addrs,
            model=config.model_name or Path(config.model_path).name,
            max_model_len=config.engine.max_model_len, vocab_size=config.vocab_size,
            max_waiting_requests=config.engine.max_waiting_requests))
        self.clients: dict[bytes, ClientInfo] = {}
        self.states: dict[str, RequestState] = {}
        self.ignored: OrderedDict[str, None] = OrderedDict()
        self.outgoing: dict[bytes, list[StreamEvent]] = {}
        self.aborts: list[str] = []
        self.outgoing_notices: dict[bytes, list[ClusterNotice]] = {}  # sent after the events
        self.dead_engine_pids: set[int] = set()
        self.notices = 0
        self.steps = 0
        self.busy_s = 0.0
        self.events_sent = 0

    # --- main loop ----------------------------------------------------------------------------
    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        poller.register(self.inbox.socket, zmq.POLLIN)
        self.runtime.announce([self.router.getsockopt_string(zmq.LAST_ENDPOINT),
                               self.inbox.address])
        while not self.runtime.stopping:
            self.runtime.maybe_heartbeat(self.stats())
            ready = dict(poller.poll(min(self.runtime.heartbeat_due_in_ms(), 100)))
            self.serve_once(ready)
        self.shutdown(poller)

    def serve_once(self, ready: dict) -> None:
        t0 = time.monotonic()
        if self.router in ready:
            self.handle_client_messages()
        if self.inbox.socket in ready:
            for frame in self.inbox.drain_frames(256):
                try:
                    msg = self.inbox.decode(frame)
                except codec.DecodeError as exc:
                    logger.error("dropped a malformed frame from the engine/tokenizers: %s", exc)
                    continue
                if isinstance(msg, StepOutput):
                    self.handle_step(msg)
                elif isinstance(msg, ClusterNotice):
                    self.handle_notice(msg)
                else:
                    self.handle_request_error(msg)
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
        now = time.monotonic()
        for rid in list(self.states):
            self._finish(rid, FINISH_ABORT, now, error="unavailable: the cluster shut down",
                         code=ERR_UNAVAILABLE)
        self.flush()
        self.router.close(linger=LINGER_MS)
        self.inbox.close()
        self.to_engine.close()
        self.runtime.close()

    # --- clients ------------------------------------------------------------------------------
    def handle_client_messages(self) -> None:
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
                msg = codec.decode_as(frame, ClientHello, ClientAbort, ClientBye)
            except codec.DecodeError as exc:
                logger.warning("dropped a malformed client message: %s", exc)
                continue
            if isinstance(msg, ClientHello):
                self.clients.setdefault(client_id, ClientInfo())
                self._send_frame(client_id, self.welcome)
            elif isinstance(msg, ClientAbort):
                self.client_abort(client_id, msg.request_ids)
            else:
                self.client_gone(client_id, reason="said goodbye")

    def client_abort(self, client_id: bytes, request_ids: list[str]) -> None:
        info = self.clients.get(client_id)
        if info is None:
            return
        for rid in request_ids:
            # Known here: the engine answers with finish "abort". Not seen yet: tell the engine
            # now too (it remembers unknown ids for a while; after a detokenizer restart this
            # process never sees the metas of older requests) and abort again when it shows up.
            self.aborts.append(rid)
            if rid not in info.request_ids:
                info.pending_aborts[rid] = None
                info.pending_aborts.move_to_end(rid)
                if len(info.pending_aborts) > MAX_PENDING_ABORTS:
                    info.pending_aborts.popitem(last=False)

    def client_gone(self, client_id: bytes, reason: str) -> None:
        info = self.clients.pop(client_id, None)
        self.outgoing.pop(client_id, None)
        self.outgoing_notices.pop(client_id, None)
        if info is None:
            return
        logger.info("client %r %s; aborting its %d requests", client_id, reason,
                    len(info.request_ids))
        for rid in info.request_ids:
            self.states.pop(rid, None)
            self._ignore(rid)
            self.aborts.append(rid)

    # --- engine / tokenizer output ------------------------------------------------------------
    def handle_notice(self, notice: ClusterNotice) -> None:
        """A worker died or is back (from the supervisor): end what died with it, tell clients."""
        self.notices += 1
        logger.warning("%s[%d] (pid %d) %s%s", notice.role, notice.index, notice.pid,
                       notice.event, f": {notice.detail}" if notice.detail else "")
        if notice.event == NOTICE_DIED and notice.role == "engine":
            if notice.pid:
                self.dead_engine_pids.add(notice.pid)
            now = time.monotonic()
            message = (f"unavailable: the engine died ({notice.detail or 'exited'}); "
                       "the request was lost with it")
            for rid in list(self.states):
                self._finish(rid, FINISH_ERROR, now, error=message, code=ERR_UNAVAILABLE)
            self.ignored.clear()  # their engine finishes will never come
        tokenizer_died = notice.event == NOTICE_DIED and notice.role == "tokenizer"
        for client_id, info in self.clients.items():
            alive = []
            if tokenizer_died:  # its requests already in the engine are not lost
                alive = [rid for rid in info.request_ids
                         if self.states[rid].meta.tokenizer_index == notice.index]
            self._queue_notice(client_id, ClusterNotice(
                event=notice.event, role=notice.role, index=notice.index, pid=notice.pid,
                detail=notice.detail, alive_ids=alive))

    def handle_step(self, out: StepOutput) -> None:
        if out.engine_pid and out.engine_pid in self.dead_engine_pids:
            return  # a dead engine's late output: its requests already ended here
        self.steps += 1
        for meta in out.new_requests:
            info = self.clients.get(meta.client_id)
            if meta.request_id in self.states:
                logger.warning("ignored a second meta for request %r", meta.request_id)
            elif info is None:  # its client is gone (or never said hello)
                self._ignore(meta.request_id)
                self.aborts.append(meta.request_id)
            else:
                self.states[meta.request_id] = RequestState(meta)
                info.request_ids.add(meta.request_id)
                if meta.request_id in info.pending_aborts:
                    del info.pending_aborts[meta.request_id]
                    self.aborts.append(meta.request_id)
        for start in out.started:
            if (state := self.states.get(start.request_id)) is not None:
                state.on_start(start)
        interval = self.config.stream_interval_tokens
        ids = codec.unpack_id_list(out.token_ids)
        if len(ids) != len(out.request_ids):
            logger.error("step %d has %d tokens for %d requests; dropped its tokens",
                         out.step, len(ids), len(out.request_ids))
            ids = []
        finishing = {record.request_id for record in out.finished}
        for rid, token_id in zip(out.request_ids, ids):
            state = self.states.get(rid)
            if state is None:
                continue  # stopped here already, or its client is gone
            if state.on_token(self.tokenizer, token_id, out.t_step):
                self._finish(rid, FINISH_STOP, out.t_step, stopped_by_string=True)
                self._ignore(rid)
                self.aborts.append(rid)  # frees its KV blocks in the engine
            elif rid not in finishing and state.should_stream(interval):
                self._queue(state.meta.client_id, state.delta())
        for record in out.finished:
            rid = record.request_id
            if rid in self.ignored:  # already ended here (stop string or gone client)
                del self.ignored[rid]
                continue
            if rid in self.states:
                self._finish(rid, record.reason, out.t_step, error=record.error, code=record.code)

    def handle_request_error(self, err: RequestError) -> None:
        info = self.clients.get(err.client_id)
        if info is None:
            return
        info.pending_aborts.pop(err.request_id, None)
        self._queue(err.client_id, StreamEvent(
            request_id=err.request_id, finished=True, finish_reason=FINISH_ERROR,
            error=err.message, error_code=err.code))

    # --- helpers ------------------------------------------------------------------------------
    def _finish(self, rid: str, reason: str, t: float, *, stopped_by_string: bool = False,
                error: str = "", code: str = "") -> None:
        state = self.states.pop(rid)
        info = self.clients.get(state.meta.client_id)
        if info is not None:
            info.request_ids.discard(rid)
        self._queue(state.meta.client_id, state.final(
            reason, t, stopped_by_string=stopped_by_string,
            error=error, error_code=code))

    def _ignore(self, rid: str) -> None:
        self.ignored[rid] = None
        if len(self.ignored) > MAX_IGNORED:
            self.ignored.popitem(last=False)

    def _queue(self, client_id: bytes, event: StreamEvent) -> None:
        self.outgoing.setdefault(client_id, []).append(event)

    def _queue_notice(self, client_id: bytes, notice: ClusterNotice) -> None:
        self.outgoing_notices.setdefault(client_id, []).append(notice)

    def flush(self) -> None:
        """One ClientEvents per client per pass, then the aborts this pass produced."""
        outgoing, self.outgoing = self.outgoing, {}
        for client_id, events in outgoing.items():
            if client_id in self.clients:
                self.events_sent += len(events)
                self._send_frame(client_id, codec.encode(ClientEvents(events=events)))
        notices, self.outgoing_notices = self.outgoing_notices, {}
        for client_id, queued in notices.items():
            for notice in queued:
                if client_id in self.clients:
                    self._send_frame(client_id, codec.encode(notice))
        if self.aborts:
            aborts, self.aborts = self.aborts, []
            try:
                self.to_engine.put(AbortRequests(request_ids=aborts), timeout_ms=5000)
            except zmq.Again:
                logger.error("the engine is not reading; %d aborts not delivered", len(aborts))

    def _send_frame(self, client_id: bytes, frame: bytes) -> None:
        try:
            self.router.send_multipart([client_id, frame], zmq.NOBLOCK)
        except zmq.Again:
            self.client_gone(client_id, reason="stopped reading (its queue is full)")
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            self.client_gone(client_id, reason="is gone")

    def stats(self) -> dict[str, float]:
        return {"clients": len(self.clients), "open_requests": len(self.states),
                "steps": self.steps, "busy_s": self.busy_s, "events_sent": self.events_sent,
                "notices": self.notices,
                "pid": os.getpid()}


def main(config: ClusterConfig, index: int = 0) -> None:
    ctx = zmq.Context()
    try:
        Detokenizer(config, ctx).run()
    finally:
        ctx.term()
