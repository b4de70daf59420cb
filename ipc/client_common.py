"""What the sync and asyncio clients share: errors, results, request building, event routing.

Request ids on the wire are the user's ids prefixed with the client's id, so two clients using
the same ids never collide in the engine; users only ever see their own ids.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import zmq

from ipc import codec
from ipc.codec import pack_ids, unpack_id_list
from ipc.messages import (
    ERR_BAD_REQUEST, ERR_INTERNAL, ERR_OVERLOADED, ERR_UNAVAILABLE, FINISH_ABORT, FINISH_ERROR,
    NOTICE_DIED,
    NOTICE_READY, ChatMessage, ClientEvents, ClientWelcome, ClusterNotice, RequestTimings,
    SamplingParams, StreamEvent, SubmitRequest, Usage,
)
from ipc.sockets import LINGER_MS, CurveKeys, configure, connect

ERR_TIMEOUT = "timeout"


class SplitserveError(Exception):
    code = ERR_INTERNAL

    def __init__(self, message: str, request_id: str | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id


class BadRequestError(SplitserveError, ValueError):
    code = ERR_BAD_REQUEST


class OverloadedError(SplitserveError):
    code = ERR_OVERLOADED


class UnavailableError(SplitserveError):
    code = ERR_UNAVAILABLE


class RequestTimeoutError(SplitserveError, TimeoutError):
    """The client-side deadline passed with no terminal event (a last resort against hangs)."""
    code = ERR_TIMEOUT


_ERRORS = {cls.code: cls for cls in (BadRequestError, OverloadedError, UnavailableError,
                                     RequestTimeoutError)}


def error_for(code: str | None, message: str, request_id: str | None = None) -> SplitserveError:
    return _ERRORS.get(code or "", SplitserveError)(message, request_id)


@dataclass(slots=True)
class Delta:
    """One piece of a request's stream, as the client received it."""

    request_id: str
    text: str
    token_ids: list[int]
    t_received: float  # time.monotonic() in the client when the event arrived
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    error_code: str | None = None
    usage: Usage | None = None
    timings: RequestTimings | None = None


@dataclass(slots=True)
class GenerationResult:
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None
    usage: Usage | None
    timings: RequestTimings | None
    error: str | None = None
    error_code: str | None = None
    t_submit: float = 0.0  # time.monotonic() right before the submit's send
    t_received: list[float] = field(default_factory=list)  # one per delta that carried tokens

    @property
    def ok(self) -> bool:
        return self.finish_reason != FINISH_ERROR

    @property
    def ttft_s(self) -> float | None:
        return self.t_received[0] - self.t_submit if self.t_received else None

    @property
    def inter_token_s(self) -> list[float]:
        return [b - a for a, b in zip(self.t_received, self.t_received[1:])]

    def raise_for_error(self) -> "GenerationResult":
        if not self.ok:
            raise error_for(self.error_code, self.error or "request failed", self.request_id)
        return self


def build_submit(client_id: bytes, wire_id: str, *, prompt: str | None,
                 messages: list[Any] | None, prompt_token_ids: Any, sampling: SamplingParams | None,
                 sampling_kwargs: dict[str, Any], add_generation_prompt: bool,
                 t_submit: float) -> SubmitRequest:
    """The SubmitRequest for one submit() call; anything invalid raises BadRequestError."""
    try:
        if sampling is None:
            sampling = SamplingParams(**sampling_kwargs)
        elif sampling_kwargs:
            raise ValueError("give either sampling= or sampling keyword arguments, not both")
        chat = None
        if messages is not None:
            chat = [_chat_message(m) for m in messages]
        packed = None
        if prompt_token_ids is not None:
            packed = pack_ids(prompt_token_ids)
        if prompt is not None and not isinstance(prompt, str):
            raise ValueError(f"prompt must be a string, got {type(prompt).__name__}")
        return SubmitRequest(request_id=wire_id, client_id=client_id, sampling=sampling,
                             prompt=prompt, messages=chat, prompt_token_ids=packed,
                             add_generation_prompt=add_generation_prompt, t_submit=t_submit)
    except (ValueError, TypeError, OverflowError) as exc:
        raise BadRequestError(str(exc)) from None


def _chat_message(m: Any) -> ChatMessage:
    if isinstance(m, ChatMessage):
        return m
    if isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str):
        return ChatMessage(role=m["role"], content=m["content"])
    raise ValueError(f"a chat message is a {{'role': str, 'content': str}} map, got {m!r}")


class RequestRecord:
    """The client's view of one request; the handle classes wrap it."""

    __slots__ = ("request_id", "wire_id", "t_submit", "deadline", "text", "token_ids",
                 "t_received", "final", "tokenizer", "seen", "pending", "resubmits", "aborted")

    def __init__(self, request_id: str, wire_id: str, deadline: float | None) -> None:
        self.request_id, self.wire_id, self.deadline = request_id, wire_id, deadline
        self.t_submit = 0.0  # set from the SubmitRequest, right before the send
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.t_received: list[float] = []
        self.final: Delta | None = None
        self.tokenizer = -1  # the index of the tokenizer worker it was sent to
        self.seen = False  # an event arrived: it is past its tokenizer
        # The request as sent, kept until it is past its tokenizer: if that worker dies first it
        # is sent again (to another worker, under a fresh wire id).
        self.pending: SubmitRequest | None = None
        self.resubmits = 0
        self.aborted = False  # the caller asked to abort it

    def apply(self, event: StreamEvent, t: float) -> Delta:
        ids = unpack_id_list(event.token_ids) if event.token_ids else []
        delta = Delta(self.request_id, event.text, ids, t, event.finished, event.finish_reason,
                      event.error, event.error_code, event.usage, event.timings)
        self.text.append(event.text)
        self.token_ids.extend(ids)
        self.seen = True
        self.pending = None
        if ids or event.text:
            self.t_received.append(t)
        if event.finished:
            self.final = delta
        return delta

    def result(self) -> GenerationResult:
        f = self.final
        assert f is not None, "result() before the terminal event"
        return GenerationResult(self.request_id, "".join(self.text), list(self.token_ids),
                                f.finish_reason, f.usage, f.timings, f.error, f.error_code,
                                self.t_submit, list(self.t_received))


class HandleBase:
    """What sync and async handles share; each adds its own waiting (condition / event)."""

    def __init__(self, client: Any, record: RequestRecord) -> None:
        self._client = client
        self._record = record
        self._deltas: list[Delta] = []

    @property
    def request_id(self) -> str:
        return self._record.request_id

    @property
    def t_submit(self) -> float:
        return self._record.t_submit

    @property
    def done(self) -> bool:
        return self._record.final is not None

    def _next_delta(self, i: int) -> Delta:
        """The i-th delta, raising the request's error if that delta ends it with one."""
        delta = self._deltas[i]
        if delta.error_code:
            raise error_for(delta.error_code, delta.error or "request failed", self.request_id)
        return delta


@dataclass(slots=True)
class Routed:
    """What ClientCore.route found in one frame beyond events (see there)."""

    welcome: ClientWelcome | None = None
    lost: list[tuple[str, StreamEvent]] = field(default_factory=list)
    retry: bool = False  # lost with a tokenizer worker: ClientCore.resubmit may send them again


class ClientCore:
    """Ids, records and deadlines; no sockets, no threads (the clients bring those).

    Faults: each request is sent on the socket of one tokenizer worker and remembers which, so a
    ClusterNotice "tokenizer i died" finds exactly the requests that were still in it (those the
    detokenizer does not list alive): each is sent again to a live worker under a fresh wire id,
    up to ``tokenizer_retries`` times, and otherwise ends with an "unavailable" error. "engine
    died" ends everything open; a lost detokenizer connection ends everything open too, and
    submits are refused until the restarted detokenizer welcomed us again. The caller sends a
    ClientAbort for the old wire ids of all of them (a copy the dead worker had already passed on
    is then freed, and its events, under a wire id no longer open, are dropped here)."""

    def __init__(self, deadline_s: float | None, tokenizer_retries: int = 1) -> None:
        if tokenizer_retries < 0:
            raise BadRequestError("tokenizer_retries must be >= 0")
        self.client_id = f"c{secrets.token_hex(8)}".encode()
        self.deadline_s = deadline_s
        self.tokenizer_retries = tokenizer_retries
        self.records: dict[str, Any] = {}  # wire id -> handle
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

    def submit(self, socks: list[zmq.Socket], make_handle: Any, request_id: str | None,
               deadline_s: float | None, **request: Any) -> Any:
        """Builds, registers and sends one request without blocking; returns its handle.

        ``socks``: one PUSH per tokenizer worker (see _send). Raises BadRequestError for
        invalid arguments, OverloadedError when every tokenizer's pipe is full, UnavailableError
        while the detokenizer reconnects (the request was not accepted and is forgotten)."""
        if self.reconnecting:
            raise UnavailableError("the detokenizer connection was lost; reconnecting, retry "
                                   "shortly", request_id)
        record = self.new_record(request_id, deadline_s)
        msg = build_submit(self.client_id, record.wire_id, t_submit=time.monotonic(), **request)
        record.t_submit = msg.t_submit
        record.pending = msg
        frame = codec.encode(msg)
        if len(frame) > codec.MAX_FRAME_BYTES:  # the tokenizer's socket would drop it unseen
            raise BadRequestError(f"the request is {len(frame)} bytes encoded; the limit is "
                                  f"{codec.MAX_FRAME_BYTES}", record.request_id)
        handle = make_handle(record)
        self.records[record.wire_id] = handle
        self.open_ids.add(record.request_id)
        if self.reconnecting:
            # The receiver thread saw the detokenizer connection drop after the check above: it
            # may have listed the open requests before this one was registered, and the restarted
            # detokenizer would drop this one's events until our new hello. Not sent: refuse it.
            self.forget(record)
            raise UnavailableError("the detokenizer connection was lost; reconnecting, retry "
                                   "shortly", record.request_id)
        if self._send(socks, record, frame):
            return handle
        self.forget(record)
        raise OverloadedError("every tokenizer worker's queue is full; retry later",
                              record.request_id)

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

    def resubmit(self, socks: list[zmq.Socket],
                 lost: list[tuple[str, StreamEvent]]) -> list[tuple[str, StreamEvent]]:
        """Sends the requests a dead tokenizer held to live workers, each under a fresh wire id
        (its t_submit kept: its latency counts from the first send); returns the ones that are
        not sent again (out of retries, no worker with room), which end as ``lost`` says,
        and those the caller had aborted, which end with reason "abort".

        The caller serializes this with submit() and with reading a wire id for an abort (the
        sync client's lock), so an abort either sees the new wire id or stops the resend."""
        still_lost = []
        for wire_id, event in lost:
            handle = self.records.get(wire_id)
            record = handle._record if handle is not None else None
            if record is not None and record.aborted:
                still_lost.append((wire_id, StreamEvent(request_id=wire_id, finished=True,
                                                        finish_reason=FINISH_ABORT)))
                continue
            if (record is None or record.pending is None
                    or record.resubmits >= self.tokenizer_retries):
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
        if notice.role == "engine":
            message = f"unavailable: the engine died{detail}; the request was lost with it"
            lost = list(self.records)  # list(): atomic against a submitting thread
        elif notice.role == "tokenizer":
            self.down.add(notice.index)
            message = (f"unavailable: tokenizer worker {notice.index} died{detail} before the "
                       "request reached the engine, and it could not be sent again; retry it")
            alive = set(notice.alive_ids)
            lost = [wid for wid, h in list(self.records.items())
                    if h._record.tokenizer == notice.index and not h._record.seen
                    and wid not in alive]
        else:
            return []
        return [(wid, unavailable_event(wid, message)) for wid in lost]

    def on_disconnected(self) -> list[tuple[str, StreamEvent]]:
        """The detokenizer connection dropped: every open request's stream is gone with it."""
        self.reconnecting = True
        message = "unavailable: the connection to the detokenizer was lost (it died or stopped)"
        return [(wid, unavailable_event(wid, message)) for wid in list(self.records)]

    def on_welcome(self) -> None:
        self.reconnecting = False

    def route(self, frame: bytes) -> Routed:
        """One frame from the detokenizer: its events go to their handles. Returns the welcome of
        a restarted detokenizer and the open requests a notice says were lost, which the caller
        aborts in the cluster, sends again with ``resubmit`` where ``retry`` says so, and ends
        with ``end_lost``."""
        try:
            msg = codec.decode_as(frame, ClientEvents, ClusterNotice, ClientWelcome)
        except codec.DecodeError:
            return Routed()  # not from a splitserve detokenizer; nothing to attribute it to
        if isinstance(msg, ClusterNotice):
            return Routed(lost=self.on_notice(msg), retry=msg.role == "tokenizer")
        if isinstance(msg, ClientWelcome):  # a restarted detokenizer answered our hello
            self.on_welcome()
            return Routed(welcome=msg)
        now = time.monotonic()
        for event in msg.events:
            if (handle := self.records.get(event.request_id)) is not None:
                self.apply(handle, event, now)
        return Routed()

    def end_lost(self, lost: list[tuple[str, StreamEvent]]) -> None:
        now = time.monotonic()
        for wire_id, event in lost:
            if (handle := self.records.get(wire_id)) is not None:
                self.apply(handle, event, now)

    def apply(self, handle: Any, event: StreamEvent, now: float) -> None:
        """Routes one event to its handle; a terminal event forgets the request."""
        delta = handle._record.apply(event, now)
        if event.finished:
            self.forget(handle._record)
        handle._deliver(delta)

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
                if handle is not None and handle._record.deadline == deadline:
                    out.append(wire_id)
        return out

    def next_deadline_ms(self, cap_ms: int) -> int:
        with self._heap_lock:
            if not self._deadlines:
                return cap_ms
            first = self._deadlines[0][0]
        return max(0, min(cap_ms, int((first - time.monotonic()) * 1000) + 1))


def timeout_event(wire_id: str, seconds: float | None) -> StreamEvent:
    return StreamEvent(request_id=wire_id, finished=True, finish_reason=FINISH_ERROR,
                       error=f"no terminal event within the client deadline of {seconds} s",
                       error_code=ERR_TIMEOUT)


def unavailable_event(wire_id: str, message: str) -> StreamEvent:
    return StreamEvent(request_id=wire_id, finished=True, finish_reason=FINISH_ERROR,
                       error=message, error_code=ERR_UNAVAILABLE)


def closed_event(wire_id: str) -> StreamEvent:
    return StreamEvent(request_id=wire_id, finished=True, finish_reason=FINISH_ERROR,
                       error="the client was closed before the request finished",
                       error_code=ERR_UNAVAILABLE)


def curve_keys(server_public_key: str | bytes | None) -> CurveKeys | None:
    """The cluster's CURVE public key (Z85, as the supervisor prints it), or None for a cluster
    without CURVE (ipc, or tcp on loopback)."""
    if not server_public_key:
        return None
    try:
        return CurveKeys(server_public_key.strip())
    except (ValueError, UnicodeEncodeError) as exc:
        raise BadRequestError(f"server_public_key: {exc}") from None


MIN_SUBMIT_HWM = 64


def submit_hwm_for(welcome: ClientWelcome, asked: int | None) -> int:
    """Frames each tokenizer pipe holds before submit() says overloaded: as asked, or by
    default the cluster's own admission bound spread over its tokenizer workers (a burst the
    engine would queue must not be refused by a pipe that filled in microseconds)."""
    if asked is not None:
        return asked
    workers = max(1, len(welcome.tokenizer_addrs))
    return max(MIN_SUBMIT_HWM, -(-welcome.max_waiting_requests // workers))


def make_submit_sockets(ctx: zmq.Context, addrs: list[str], hwm: int,
                        curve: CurveKeys | None = None) -> list[zmq.Socket]:
    """One plain (sync) PUSH per tokenizer worker (NOBLOCK sends never wait): the client knows
    which worker holds each request, so a worker's death ends exactly its requests."""
    socks = []
    for addr in addrs:
        sock = configure(zmq.Socket(ctx, zmq.PUSH), receives=False, sndhwm=hwm)
        sock.setsockopt(zmq.LINGER, LINGER_MS)
        if curve is not None:
            curve.make_client(sock)
        sock.connect(addr)
        socks.append(sock)
    return socks


def disconnect_monitor(dealer: zmq.Socket) -> zmq.Socket:
    """A plain (sync, also under asyncio) socket that reports the DEALER's connection to the
    detokenizer dropping; read it with monitor_events."""
    addr = f"inproc://splitserve-monitor-{secrets.token_hex(8)}"
    dealer.monitor(addr, zmq.EVENT_DISCONNECTED)
    monitor = zmq.Socket(dealer.context, zmq.PAIR)
    monitor.connect(addr)
    return monitor


def monitor_events(monitor: zmq.Socket) -> int:
    """How many DISCONNECTED events are queued on ``monitor`` (read without blocking)."""
    from zmq.utils.monitor import parse_monitor_message

    count = 0
    while True:
        try:
            parts = monitor.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return count
        if parse_monitor_message(parts)["event"] == zmq.EVENT_DISCONNECTED:
            count += 1


def make_dealer(sock: zmq.Socket, client_id: bytes, address: str,
                curve: CurveKeys | None = None) -> zmq.Socket:
    sock.setsockopt(zmq.IDENTITY, client_id)
    configure(sock, receives=True)
    connect(sock, address, curve)
    return sock


_WILDCARD_HOSTS = ("0.0.0.0", "*", "[::]", "::")


def tokenizer_addrs(client_addr: str, advertised: list[str]) -> list[str]:
    """The tokenizer addresses as this client must dial them: a cluster bound to a wildcard host
    (``--listen 0.0.0.0``) advertises that host, which only means "the host you reached me at"."""
    if not client_addr.startswith("tcp://"):
        return advertised
    reached = client_addr[len("tcp://"):].rsplit(":", 1)[0]
    out = []
    for addr in advertised:
        if addr.startswith("tcp://"):
            host, port = addr[len("tcp://"):].rsplit(":", 1)
            if host in _WILDCARD_HOSTS:
                addr = f"tcp://{reached}:{port}"
        out.append(addr)
    return out


def prompt_kwargs(p: Any) -> dict[str, Any]:
    """generate()'s prompts: a string, a list of chat messages, or a list of token ids."""
    if isinstance(p, str):
        return {"prompt": p}
    if isinstance(p, (list, tuple)) and p and all(isinstance(x, int) for x in p):
        return {"prompt_token_ids": p}
    return {"messages": p}
