"""The I/O-free heart of both clients: what arrives (events, notices, a lost connection, time
passing, closing) means for each open request, and the frames the client must send about it.
No sockets, no threads: the sync and asyncio clients bring those, hand every frame they receive
to ``on_frame`` and send what it returns. The sending side is ipc.client.outbox.Outbox."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from ipc import codec
from ipc.client.notices import lost_with
from ipc.client.outbox import Outbox
from ipc.client.records import (
    HandleBase,
    RequestRecord,
    closed_event,
    timeout_event,
    unavailable_event,
)
from ipc.messages import (
    ERR_DUPLICATE_REQUEST,
    FINISH_STOP,
    NOTICE_READY,
    ClientAbort,
    ClientBye,
    ClientEvents,
    ClientHello,
    ClientWelcome,
    ClusterNotice,
    StreamEvent,
)
from ipc.messages.queries import EngineStatsReport, TokenizeResult

logger = logging.getLogger("splitserve.client")


@dataclass(slots=True)
class Routed:
    """What ClientCore.route found in one frame beyond events (see there)."""

    lost: list[tuple[str, StreamEvent]] = field(default_factory=list)
    retry: bool = False  # lost before an engine ran them: ClientCore.resubmit may send them again


class ClientCore(Outbox):
    """The open requests' faults and endings; no sockets, no threads (the clients bring those).

    Faults: a ClusterNotice "tokenizer i died" finds exactly the requests that were still in it
    (those the detokenizer does not list alive): each is sent again to a live worker under a
    fresh wire id, up to ``tokenizer_retries`` times, and otherwise ends with an "unavailable"
    error. "engine died" ends everything open; a lost detokenizer connection ends everything open
    too, and submits are refused until the restarted detokenizer welcomed us again. A ClientAbort
    for the old wire ids of all of them goes back to the cluster (a copy the dead worker had
    already passed on is then freed, and its events, under a wire id no longer open, are dropped
    here).
    With several engine replicas, "engine replica r died" (``resend_unstarted``) is handled like
    a tokenizer's death for every open request not listed alive that has produced nothing
    (``notices.lost_with``).

    The four ways in, each returning the frames the caller sends on its detokenizer connection,
    in order: ``on_frame`` (a frame from the detokenizer), ``on_disconnect`` (that connection
    dropped), ``on_tick`` (time passed: deadlines), and ``abort_frame``; ``submit``/``send``
    hand requests to the tokenizer ``pipes``; ``shut`` + ``end_open`` close."""

    def on_notice(self, notice: ClusterNotice) -> tuple[list[tuple[str, StreamEvent]], bool]:
        """A worker died or is back: the open requests lost with it (and whether they may be
        sent again, see notices.lost_with)."""
        if notice.event == NOTICE_READY and notice.role == "tokenizer":
            self.down.discard(notice.index)
        elif notice.role == "tokenizer" and notice.event != NOTICE_READY:
            self.down.add(notice.index)
        return lost_with(notice, self.records)

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

    def route(self, frame: bytes) -> Routed:
        """One frame from the detokenizer: its events go to their handles, a restarted
        detokenizer's welcome ends the reconnect. Returns the open requests a notice says were
        lost, which ``on_frame`` aborts in the cluster, sends again with ``resubmit`` where
        ``retry`` says so, and ends with ``end_lost``."""
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
            lost, retry = self.on_notice(msg)
            return Routed(lost=lost, retry=retry)
        if isinstance(msg, ClientWelcome):  # a restarted detokenizer answered our hello
            self.reconnecting, self.welcome = False, msg
            return Routed()
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

    # --- the ways in that answer with frames for the detokenizer connection -----------------
    def on_frame(self, frame: bytes) -> list[bytes]:
        """A frame from the detokenizer: events to their handles, and the requests a notice
        says were lost aborted in the cluster, sent again where they may be, or ended."""
        routed = self.route(frame)
        return self._settle(routed.lost, routed.retry)

    def on_disconnect(self) -> list[bytes]:
        """The detokenizer connection dropped: a new hello (its replacement binds the same
        address), and every open request ends."""
        return [self.hello_frame(), *self._settle(self.on_disconnected(), retry=False)]

    def on_tick(self, now: float) -> list[bytes]:
        """Requests past their deadline end with a timeout error and are aborted."""
        expired = self.expired(now)
        for wire_id in expired:
            self.apply(self.records[wire_id], timeout_event(wire_id, self.deadline_s), now)
        return [codec.encode(ClientAbort(expired))] if expired else []

    def abort_frame(self, record: RequestRecord) -> bytes | None:
        """The ClientAbort for one request (None once closed: closing aborts everything)."""
        with self.lock:  # a resend either happened (new wire id) or will see the flag
            record.aborted = True
            return None if self.closed else codec.encode(ClientAbort([record.wire_id]))

    def shut(self) -> bool:
        """Refuses every later submit; False if the client was closed already."""
        with self.lock:
            was_closed, self.closed = self.closed, True
        return not was_closed

    def end_open(self) -> None:
        """Every request still open ends with a "client closed" error (after ``shut``)."""
        now = time.monotonic()
        for wire_id, handle in list(self.records.items()):
            self.apply(handle, closed_event(wire_id), now)

    def _settle(self, lost: list[tuple[str, StreamEvent]], retry: bool) -> list[bytes]:
        if not lost:
            return []
        frame = codec.encode(ClientAbort([wire_id for wire_id, _ in lost]))
        self.end_lost(self.resubmit(lost) if retry else lost)
        return [frame]

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
