"""The I/O-free heart of both clients: ids, records, deadlines, routing of events and notices,
and what a worker's death means for each open request. No sockets, no threads: the sync and
asyncio clients bring those.

Request ids on the wire are the user's ids prefixed with the client's id, so two clients using
the same ids never collide in the engine; users only ever see their own ids."""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import logging
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import zmq

from ipc import codec
from ipc.client.errors import BadRequestError, OverloadedError, UnavailableError
from ipc.client.queries import Builder
from ipc.client.records import HandleBase, RequestRecord, unavailable_event
from ipc.client.requests import build_submit
from ipc.messages import (
    ERR_DUPLICATE_REQUEST,
    FINISH_ABORT,
    FINISH_STOP,
    NOTICE_DIED,
    NOTICE_READY,
    ClientBye,
    ClientEvents,
    ClientHello,
    ClientWelcome,
    ClusterNotice,
    StreamEvent,
    SubmitRequest,
)
from ipc.queries import EngineStatsReport, TokenizeResult

H = TypeVar("H", bound=HandleBase)
logger = logging.getLogger("splitserve.client")


@dataclass(slots=True)
class Routed:
    """What ClientCore.route found in one frame beyond events (see there)."""

    welcome: ClientWelcome | None = None
    lost: list[tuple[str, StreamEvent]] = field(default_factory=list)
    retry: bool = False  # lost before an engine ran them: ClientCore.resubmit may send them again


def encode_request(msg: Any, request_id: str | None) -> bytes:
    """The frame of a message for a tokenizer worker; what the wire cannot carry (a lone
    surrogate in any string, an integer past 64 bits) is the caller's BadRequestError, naming
    the field as submit() takes it (sampling keywords are flat there)."""
    try:
        return codec.encode(msg)
    except codec.EncodeError as exc:
        param = exc.path.removeprefix("sampling.")
        message = str(exc).removeprefix("sampling.")
        raise BadRequestError(message, request_id, param or None) from None


class ClientCore:
    """Ids, records and deadlines; no sockets, no threads (the clients bring those).

    Faults: each request is sent on the socket of one tokenizer worker and remembers which, so a
    ClusterNotice "tokenizer i died" finds exactly the requests that were still in it (those the
    detokenizer does not list alive): each is sent again to a live worker under a fresh wire id,
    up to ``tokenizer_retries`` times, and otherwise ends with an "unavailable" error. "engine
    died" ends everything open; a lost detokenizer connection ends everything open too, and
    submits are refused until the restarted detokenizer welcomed us again. The caller sends a
    ClientAbort for the old wire ids of all of them (a copy the dead worker had already passed on
    is then freed, and its events, under a wire id no longer open, are dropped here).

    With several engine replicas, "engine replica r died" (``resend_unstarted``) is handled like
    a tokenizer's death for every open request not listed alive that has produced nothing."""

    def __init__(self, deadline_s: float | None, tokenizer_retries: int = 1) -> None:
        if tokenizer_retries < 0:
            raise BadRequestError("tokenizer_retries must be >= 0")
        self.client_id = f"c{secrets.token_hex(8)}".encode()
        self.deadline_s = deadline_s
        self.tokenizer_retries = tokenizer_retries
        self.records: dict[str, HandleBase] = {}  # wire id -> handle
        self.open_ids: set[str] = set()  # the callers' request ids of those records
        self._deadlines: list[tuple[float, str]] = []
        self._heap_lock = threading.Lock()  # the sync client pushes and pops from two threads
        self._counter = itertools.count()
        self._next_tokenizer = 0
        self.down: set[int] = set()  # tokenizer workers reported dead and not back yet
        self.reconnecting = False  # the detokenizer connection dropped; no welcome since

    def new_record(self, request_id: str | None, deadline_s: float | None) -> RequestRecord:
        seq = next(self._counter)
        if request_id is None:
            request_id = f"r{seq}"
        elif request_id in self.open_ids:
            raise BadRequestError(f"request_id {request_id!r} is already in flight", request_id)
        limit = deadline_s if deadline_s is not None else self.deadline_s
        deadline = time.monotonic() + limit if limit else None
        record = RequestRecord(request_id, self._wire_id(seq, request_id), deadline)
        self._watch_deadline(record)
        return record

    def _wire_id(self, seq: int, request_id: str) -> str:
        # Unique per submission, even when the caller reuses a request_id once it has ended: an
        # abort that crossed the first one's finish must never end the second on arrival.
        return f"{self.client_id.decode()}:{seq}:{request_id}"

    def _watch_deadline(self, record: RequestRecord) -> None:
        if record.deadline is not None:
            with self._heap_lock:
                heapq.heappush(self._deadlines, (record.deadline, record.wire_id))

    def submit(
        self,
        socks: list[zmq.Socket],
        make_handle: Callable[[RequestRecord], H],
        request_id: str | None,
        deadline_s: float | None,
        **request: Any,
    ) -> H:
        """Builds, registers and sends one request without blocking; returns its handle.

        ``socks``: one PUSH per tokenizer worker (see _send). Raises BadRequestError for
        invalid arguments, OverloadedError when every tokenizer's pipe is full, UnavailableError
        while the detokenizer reconnects (the request was not accepted and is forgotten)."""
        return self.send(
            socks,
            make_handle,
            request_id,
            deadline_s,
            lambda wire_id, t: build_submit(self.client_id, wire_id, t_submit=t, **request),
        )

    def send(
        self,
        socks: list[zmq.Socket],
        make_handle: Callable[[RequestRecord], H],
        request_id: str | None,
        deadline_s: float | None,
        build: Builder,
    ) -> H:
        """submit() for any message for a tokenizer worker (a SubmitRequest, a TokenizeRequest
        query): ``build`` makes it from its wire id and submit time."""
        if self.reconnecting:
            raise UnavailableError(
                "the detokenizer connection was lost; reconnecting, retry shortly", request_id
            )
        record = self.new_record(request_id, deadline_s)
        msg = build(record.wire_id, time.monotonic())
        record.t_submit = msg.t_submit
        record.query = not isinstance(msg, SubmitRequest)
        record.pending = msg
        frame = encode_request(msg, record.request_id)
        if len(frame) > codec.MAX_FRAME_BYTES:  # the tokenizer's socket would drop it unseen
            raise BadRequestError(
                f"the request is {len(frame)} bytes encoded; the limit is {codec.MAX_FRAME_BYTES}",
                record.request_id,
            )
        handle = make_handle(record)
        self.records[record.wire_id] = handle
        self.open_ids.add(record.request_id)
        if self.reconnecting:
            # The receiver thread saw the detokenizer connection drop after the check above: it
            # may have listed the open requests before this one was registered, and the restarted
            # detokenizer would drop this one's events until our new hello. Not sent: refuse it.
            self.forget(record)
            raise UnavailableError(
                "the detokenizer connection was lost; reconnecting, retry shortly",
                record.request_id,
            )
        if self._send(socks, record, frame):
            return handle
        self.forget(record)
        raise OverloadedError(
            "every tokenizer worker's queue is full; retry later", record.request_id
        )

    def _send(self, socks: list[zmq.Socket], record: RequestRecord, frame: bytes) -> bool:
        """Round-robin over the tokenizer workers, live ones first (a dead one's socket queues
        for its replacement, the last resort); False when none took it."""
        n = len(socks)
        first = self._next_tokenizer
        order = [(first + k) % n for k in range(n)]
        if self.down:
            order.sort(key=lambda i: i in self.down)  # stable: round-robin among the live ones
        for i in order:
            try:
                socks[i].send(frame, zmq.NOBLOCK, copy=False)
            except zmq.Again:
                continue
            record.tokenizer = i
            self._next_tokenizer = (i + 1) % n
            return True
        return False

    def open_query(
        self, make_handle: Callable[[RequestRecord], H], deadline_s: float | None, build: Builder
    ) -> tuple[H, bytes]:
        """Registers a query for the detokenizer itself (EngineStatsQuery); returns its handle
        and the frame, which the caller sends on its DEALER."""
        if self.reconnecting:
            raise UnavailableError(
                "the detokenizer connection was lost; reconnecting, retry shortly"
            )
        record = self.new_record(None, deadline_s)
        record.query = True
        frame = codec.encode(build(record.wire_id, time.monotonic()))
        handle = make_handle(record)
        self.records[record.wire_id] = handle
        self.open_ids.add(record.request_id)
        return handle, frame

    def resubmit(
        self, socks: list[zmq.Socket], lost: list[tuple[str, StreamEvent]]
    ) -> list[tuple[str, StreamEvent]]:
        """Sends the requests a dead tokenizer held to live workers, each under a fresh wire id
        (its t_submit kept: its latency counts from the first send); returns the ones that are
        not sent again (out of retries, no worker with room), which end as ``lost`` says,
        and those the caller had aborted, which end with reason "abort".

        The caller serializes this with submit() and with reading a wire id for an abort (the
        sync client's lock), so an abort either sees the new wire id or stops the resend."""
        still_lost = []
        for wire_id, event in lost:
            handle = self.records.get(wire_id)
            record = handle.record if handle is not None else None
            if record is not None and record.aborted:
                still_lost.append(
                    (
                        wire_id,
                        StreamEvent(request_id=wire_id, finished=True, finish_reason=FINISH_ABORT),
                    )
                )
                continue
            if (
                record is None
                or record.pending is None
                or record.resubmits >= self.tokenizer_retries
            ):
                still_lost.append((wire_id, event))
                continue
            new_id = self._wire_id(next(self._counter), record.request_id)
            msg = dataclasses.replace(record.pending, request_id=new_id)
            frame = codec.encode(msg)
            # The new id may be a digit longer: a frame past the limit would be dropped unseen.
            if len(frame) > codec.MAX_FRAME_BYTES or not self._send(socks, record, frame):
                still_lost.append((wire_id, event))
                continue
            # Registered under the new id before the old one goes: apply() on the receiver
            # thread and a user thread's check of open_ids never see the request missing.
            assert handle is not None  # record is not None above
            self.records[new_id] = handle
            self.records.pop(wire_id, None)
            record.wire_id, record.pending = new_id, msg
            record.resubmits += 1
            self._watch_deadline(record)
        return still_lost

    def on_notice(self, notice: ClusterNotice) -> list[tuple[str, StreamEvent]]:
        """A worker died or is back: the terminal events for the open requests lost with it."""
        if notice.event == NOTICE_READY:
            if notice.role == "tokenizer":
                self.down.discard(notice.index)
            return []
        if notice.event != NOTICE_DIED:
            return []
        detail = f" ({notice.detail})" if notice.detail else ""
        if notice.role == "engine" and not notice.resend_unstarted:
            message = f"unavailable: the engine died{detail}; the request was lost with it"
            # list(): atomic against a submitting thread. Queries never reach the engine.
            lost = [wid for wid, h in list(self.records.items()) if not h.record.query]
        elif notice.role in ("tokenizer", "engine"):
            # Lost: the open requests not past the dead worker, which the detokenizer does not
            # list alive (a tokenizer: those sent to it; an engine replica: any not started).
            tokenizer = notice.role == "tokenizer"
            if tokenizer:
                self.down.add(notice.index)
            message = (
                f"unavailable: tokenizer worker {notice.index} died{detail} before the request "
                "reached the engine"
                if tokenizer
                else f"unavailable: engine replica {notice.index} died{detail} before the "
                "request produced anything"
            ) + ", and it could not be sent again; retry it"
            alive = set(notice.alive_ids)
            lost = [
                wid
                for wid, h in list(self.records.items())
                if (h.record.tokenizer == notice.index if tokenizer else not h.record.query)
                and not h.record.seen
                and wid not in alive
            ]
        else:
            return []
        return [(wid, unavailable_event(wid, message)) for wid in lost]

    def on_disconnected(self) -> list[tuple[str, StreamEvent]]:
        """The detokenizer connection dropped: every open request's stream is gone with it."""
        self.reconnecting = True
        message = "unavailable: the connection to the detokenizer was lost (it died or stopped)"
        return [(wid, unavailable_event(wid, message)) for wid in list(self.records)]

    def hello_frame(self) -> bytes:
        """The first frame on the detokenizer connection (again after every reconnect)."""
        return codec.encode(ClientHello(self.client_id))

    @staticmethod
    def bye_frame() -> bytes:
        """The last one: abort whatever is still in flight."""
        return codec.encode(ClientBye())

    def on_welcome(self) -> None:
        self.reconnecting = False

    def route(self, frame: bytes) -> Routed:
        """One frame from the detokenizer: its events go to their handles. Returns the welcome of
        a restarted detokenizer and the open requests a notice says were lost, which the caller
        aborts in the cluster, sends again with ``resubmit`` where ``retry`` says so, and ends
        with ``end_lost``."""
        try:
            msg = codec.decode_as(
                frame, ClientEvents, ClusterNotice, ClientWelcome, TokenizeResult, EngineStatsReport
            )
        except codec.DecodeError:
            return Routed()  # not from a splitserve detokenizer; nothing to attribute it to
        if isinstance(msg, (TokenizeResult, EngineStatsReport)):
            # A query's reply is its terminal event; the caller reads it from the record.
            if (handle := self.records.get(msg.request_id)) is not None:
                handle.record.reply = msg
                self.apply(
                    handle,
                    StreamEvent(msg.request_id, finished=True, finish_reason=FINISH_STOP),
                    time.monotonic(),
                )
            return Routed()
        if isinstance(msg, ClusterNotice):
            retry = msg.role == "tokenizer" or msg.resend_unstarted
            return Routed(lost=self.on_notice(msg), retry=retry)
        if isinstance(msg, ClientWelcome):  # a restarted detokenizer answered our hello
            self.on_welcome()
            return Routed(welcome=msg)
        now = time.monotonic()
        assert isinstance(msg, ClientEvents)
        for event in msg.events:
            if event.error_code == ERR_DUPLICATE_REQUEST:
                # About a copy this client never sent (its wire ids are unique per submission;
                # someone else used its client id): the open request it names goes on.
                logger.warning(
                    "a copy of request %r was refused: %s", event.request_id, event.error
                )
                continue
            if (handle := self.records.get(event.request_id)) is not None:
                self.apply(handle, event, now)
        return Routed()

    def end_lost(self, lost: list[tuple[str, StreamEvent]]) -> None:
        now = time.monotonic()
        for wire_id, event in lost:
            if (handle := self.records.get(wire_id)) is not None:
                self.apply(handle, event, now)

    def apply(self, handle: HandleBase, event: StreamEvent, now: float) -> None:
        """Routes one event to its handle; a terminal event forgets the request."""
        delta = handle.record.apply(event, now)
        if event.finished:
            self.forget(handle.record)
        handle.deliver(delta)

    def forget(self, record: RequestRecord) -> None:
        self.records.pop(record.wire_id, None)
        self.open_ids.discard(record.request_id)

    def expired(self, now: float) -> list[str]:
        """Wire ids whose deadline passed and that are still open."""
        out = []
        with self._heap_lock:
            while self._deadlines and self._deadlines[0][0] <= now:
                deadline, wire_id = heapq.heappop(self._deadlines)
                handle = self.records.get(wire_id)
                # The same wire id may be open again (a user request_id reused after the first
                # one ended or was refused): only the record this entry was pushed for expires.
                if handle is not None and handle.record.deadline == deadline:
                    out.append(wire_id)
        return out

    def next_deadline_ms(self, cap_ms: int) -> int:
        with self._heap_lock:
            if not self._deadlines:
                return cap_ms
            first = self._deadlines[0][0]
        return max(0, min(cap_ms, int((first - time.monotonic()) * 1000) + 1))
