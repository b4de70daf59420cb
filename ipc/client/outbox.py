"""The sending side of the client's core: ids, records and deadlines of the open requests, and
handing them to the tokenizer workers' pipes (again, under a fresh wire id, when a worker died
holding them). No sockets, no threads: ``Pipes`` is what a transport provides.

Request ids on the wire are the user's ids prefixed with the client's id, so two clients using
the same ids never collide in the engine; users only ever see their own ids."""

from __future__ import annotations

import dataclasses
import itertools
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from ipc import codec
from ipc.client.deadlines import Deadlines
from ipc.client.errors import BadRequestError, OverloadedError, UnavailableError
from ipc.client.queries import Builder
from ipc.client.records import HandleBase, RequestRecord
from ipc.client.requests import build_submit, encode_request
from ipc.messages import FINISH_ABORT, ClientWelcome, StreamEvent, SubmitRequest

H = TypeVar("H", bound=HandleBase)


class Pipes(Protocol):
    """The client's way to its tokenizer workers, one pipe each (the transport's sockets)."""

    def __len__(self) -> int: ...

    def offer(self, index: int, frame: bytes) -> bool:
        """Hands ``frame`` to worker ``index`` without waiting; False when its pipe is full."""


class Outbox:
    """The open requests and their way out. Each request is sent on the pipe of one tokenizer
    worker and remembers which (``record.tokenizer``), so that worker's death finds exactly the
    requests it held (ClientCore decides which were lost; ``resubmit`` sends them again)."""

    def __init__(self, deadline_s: float | None, tokenizer_retries: int = 1) -> None:
        if tokenizer_retries < 0:
            raise BadRequestError("tokenizer_retries must be >= 0")
        self.client_id = f"c{secrets.token_hex(8)}".encode()
        self.deadline_s = deadline_s
        self.tokenizer_retries = tokenizer_retries
        self.records: dict[str, HandleBase] = {}  # wire id -> handle
        self.open_ids: set[str] = set()  # the callers' request ids of those records
        self.deadlines = Deadlines()
        # Sends to the pipes and wire-id changes: the sync client submits and aborts from user
        # threads while its receiver thread sends lost requests again.
        self.lock = threading.Lock()
        self._counter = itertools.count()
        self._next_tokenizer = 0
        self.down: set[int] = set()  # tokenizer workers reported dead and not back yet
        self.reconnecting = False  # the detokenizer connection dropped; no welcome since
        self.closed = False
        self.welcome: ClientWelcome | None = None
        self.pipes: Pipes | None = None

    def connected(self, welcome: ClientWelcome, pipes: Pipes) -> None:
        """The handshake is done: the cluster's welcome, and a pipe per tokenizer worker."""
        self.welcome, self.pipes = welcome, pipes

    def new_record(self, request_id: str | None, deadline_s: float | None) -> RequestRecord:
        """A record with a fresh wire id (not yet registered: see ``register``)."""
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
            self.deadlines.watch(record.deadline, record.wire_id)

    def submit(
        self,
        make_handle: Callable[[RequestRecord], H],
        request_id: str | None,
        deadline_s: float | None,
        **request: Any,
    ) -> H:
        """Builds, registers and sends one request without blocking; returns its handle.

        Raises BadRequestError for invalid arguments, OverloadedError when every tokenizer's
        pipe is full, UnavailableError while the detokenizer reconnects or once the client is
        closed (the request was not accepted and is forgotten)."""
        return self.send(
            make_handle,
            request_id,
            deadline_s,
            lambda wire_id, t: build_submit(self.client_id, wire_id, t_submit=t, **request),
        )

    def send(
        self,
        make_handle: Callable[[RequestRecord], H],
        request_id: str | None,
        deadline_s: float | None,
        build: Builder,
    ) -> H:
        """submit() for any message for a tokenizer worker (a SubmitRequest, a TokenizeRequest
        query): ``build`` makes it from its wire id and submit time."""
        with self.lock:
            return self._send_new(make_handle, request_id, deadline_s, build)

    def _send_new(
        self,
        make_handle: Callable[[RequestRecord], H],
        request_id: str | None,
        deadline_s: float | None,
        build: Builder,
    ) -> H:
        self._check_open(request_id)
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
        self.register(record, handle)
        if self.reconnecting:
            # The receiver thread saw the detokenizer connection drop after the check above: it
            # may have listed the open requests before this one was registered, and the restarted
            # detokenizer would drop this one's events until our new hello. Not sent: refuse it.
            self.forget(record)
            raise UnavailableError(
                "the detokenizer connection was lost; reconnecting, retry shortly",
                record.request_id,
            )
        if self._offer(record, frame):
            return handle
        self.forget(record)
        raise OverloadedError(
            "every tokenizer worker's queue is full; retry later", record.request_id
        )

    def _offer(self, record: RequestRecord, frame: bytes) -> bool:
        """Round-robin over the tokenizer workers, live ones first (a dead one's pipe queues
        for its replacement, the last resort); False when none took it."""
        assert self.pipes is not None
        n = len(self.pipes)
        first = self._next_tokenizer
        order = [(first + k) % n for k in range(n)]
        if self.down:
            order.sort(key=lambda i: i in self.down)  # stable: round-robin among the live ones
        for i in order:
            if not self.pipes.offer(i, frame):
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
        with self.lock:
            self._check_open(None)
            record = self.new_record(None, deadline_s)
            record.query = True
            frame = codec.encode(build(record.wire_id, time.monotonic()))
            handle = make_handle(record)
            self.register(record, handle)
        return handle, frame

    def register(self, record: RequestRecord, handle: HandleBase) -> None:
        """Opens a request: its events reach ``handle`` from now on (``forget`` closes it)."""
        self.records[record.wire_id] = handle
        self.open_ids.add(record.request_id)

    def forget(self, record: RequestRecord) -> None:
        """Unregisters a request that ended or was never sent."""
        self.records.pop(record.wire_id, None)
        self.open_ids.discard(record.request_id)

    def _check_open(self, request_id: str | None) -> None:
        if self.closed or self.welcome is None:
            raise UnavailableError("the client is not connected or is closed", request_id)
        if self.reconnecting:
            raise UnavailableError(
                "the detokenizer connection was lost; reconnecting, retry shortly", request_id
            )

    def resubmit(self, lost: list[tuple[str, StreamEvent]]) -> list[tuple[str, StreamEvent]]:
        """Sends the requests a dead worker held to live workers, each under a fresh wire id
        (its t_submit kept: its latency counts from the first send); returns the ones that are
        not sent again (out of retries, no worker with room, the client closed), which end as
        ``lost`` says, and those the caller had aborted, which end with reason "abort". Under
        ``lock``: an abort either sees the new wire id or stops the resend."""
        with self.lock:
            if self.closed or self.pipes is None:
                return lost
            return self._resubmit(lost)

    def _resubmit(self, lost: list[tuple[str, StreamEvent]]) -> list[tuple[str, StreamEvent]]:
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
            if len(frame) > codec.MAX_FRAME_BYTES or not self._offer(record, frame):
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

    def expired(self, now: float) -> list[str]:
        """Wire ids whose deadline passed and that are still open."""
        # The same wire id may be open again (a user request_id reused after the first one
        # ended or was refused): only the record an entry was pushed for expires.
        return [
            wire_id
            for deadline, wire_id in self.deadlines.due(now)
            if (handle := self.records.get(wire_id)) is not None
            and handle.record.deadline == deadline
        ]

    def next_deadline_ms(self, cap_ms: int) -> int:
        return self.deadlines.next_ms(cap_ms)
