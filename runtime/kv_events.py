"""Publishing KV-cache events (an engine) and following them (a tokenizer worker, a test).

The wire is ``ipc.kv_events``'s (vLLM's): PUB frames ``topic | seq | payload``, an optional
ROUTER answering replays. ``KVEventPublisher`` keeps the engine's step off the wire: ``publish``
numbers the batch and hands it to a bounded queue; a thread of its own encodes it once, sends it
to every sink (the cluster's internal stream, and the user's ``--kv-events-config`` endpoint)
and keeps the last ``buffer_steps`` payloads per sink for replay. ``KVEventSubscriber`` follows
one publisher and hands its owner every batch once, in sequence order, asking the replay socket
for what the live stream skipped (a slow joiner's start, a message the PUB dropped at its
high-water mark, a publisher restart).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from itertools import count

import zmq

from ipc.codec import DecodeError
from ipc.kv_events import (
    END_OF_REPLAY,
    EventBatch,
    KVCacheEvent,
    decode_batch,
    decode_seq,
    encode_batch,
    encode_seq,
)
from ipc.sockets import CurveKeys, open_socket

logger = logging.getLogger("splitserve.kv_events")

REPLAY_REQUEST_MAX_BYTES = 64  # [b"", 8-byte seq]: anything larger is not a replay request
CLOSE_TIMEOUT_S = 2.0
_bells = count()


@dataclass(frozen=True, slots=True)
class EventSink:
    """One destination: a PUB socket (bound, or connected to a collector) and, optionally, a
    ROUTER that answers replays from its last ``buffer_steps`` batches. ``curve``: the cluster's
    key pair, for the sockets this process binds."""

    address: str
    bind: bool = True
    replay_address: str | None = None
    topic: bytes = b""
    buffer_steps: int = 10_000
    hwm: int = 100_000
    curve: CurveKeys | None = None


class _OpenSink:
    """A sink's sockets and replay buffer; used by the publisher thread alone."""

    def __init__(self, ctx: zmq.Context, sink: EventSink) -> None:
        self.topic = sink.topic
        pub_curve = sink.curve if sink.bind else None  # a collector we connect to is no CURVE peer
        self.pub = open_socket(
            ctx, zmq.PUB, sink.address, bind_it=sink.bind, sndhwm=sink.hwm, curve=pub_curve
        )
        self.replay: zmq.Socket | None = None
        if sink.replay_address is not None:
            # A replay sends the whole buffer at once: a ROUTER drops what exceeds its HWM.
            self.replay = open_socket(
                ctx,
                zmq.ROUTER,
                sink.replay_address,
                bind_it=True,
                sndhwm=sink.buffer_steps + 2,
                curve=sink.curve,
            )
            self.replay.setsockopt(zmq.MAXMSGSIZE, REPLAY_REQUEST_MAX_BYTES)
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=sink.buffer_steps)

    def send(self, seq: int, payload: bytes) -> None:
        self.pub.send_multipart((self.topic, encode_seq(seq), payload), copy=False)
        self.buffer.append((seq, payload))

    def serve_replay(self) -> None:
        assert self.replay is not None
        frames = self.replay.recv_multipart()
        if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
            logger.warning("ignored a malformed replay request (%d frames)", len(frames))
            return
        client, start = frames[0], decode_seq(frames[2])
        for seq, payload in self.buffer:
            if seq >= start:
                self.replay.send_multipart((client, b"", encode_seq(seq), payload), copy=False)
        self.replay.send_multipart((client, b"", END_OF_REPLAY, b""))

    def close(self) -> None:
        self.pub.close(linger=0)
        if self.replay is not None:
            self.replay.close(linger=0)


class KVEventPublisher:
    """``publish`` is called from one thread (the engine loop) and never blocks: the batch gets
    the next sequence number and goes to a queue of at most ``queue_max`` batches. Should the
    publisher thread fall that far behind, the batch is dropped and its number stays unused, so
    subscribers see the gap and know their view is incomplete (nothing is lost silently)."""

    def __init__(
        self,
        ctx: zmq.Context,
        sinks: list[EventSink],
        *,
        data_parallel_rank: int = 0,
        queue_max: int = 100_000,
    ) -> None:
        self.data_parallel_rank = data_parallel_rank
        self.dropped = 0
        self._seq = 0
        self._queue: queue.Queue[tuple[int, EventBatch] | None] = queue.Queue(queue_max)
        self._sinks = [_OpenSink(ctx, sink) for sink in sinks]  # bind errors surface here
        self.addresses = [a for sink in sinks for a in (sink.address, sink.replay_address) if a]
        bell = f"inproc://kv-events-bell-{next(_bells)}"
        # One ring per queued batch, so the bell's pipe never needs more room than the queue.
        # (A pipe of one message looked full to the sender for a while after the thread had
        # read it, and a ring went missing.)
        self._bell_in = open_socket(ctx, zmq.PAIR, bell, bind_it=True, rcvhwm=queue_max + 2)
        self._bell = open_socket(ctx, zmq.PAIR, bell, bind_it=False, sndhwm=queue_max + 2)
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: list[KVCacheEvent]) -> int:
        """Queues one batch; returns its sequence number."""
        seq = self._seq
        self._seq += 1
        try:
            self._queue.put_nowait((seq, EventBatch(events, time.time(), self.data_parallel_rank)))
        except queue.Full:
            self.dropped += 1
            if self.dropped % 1000 == 1:
                logger.warning(
                    "KV event queue full: batch %d dropped (%d so far)", seq, self.dropped
                )
            return seq
        self._ring()
        return seq

    def close(self) -> None:
        """Sends what is queued, then stops the thread and closes the sockets."""
        try:
            self._queue.put(None, timeout=CLOSE_TIMEOUT_S)
        except queue.Full:
            logger.warning("KV event publisher still busy at close; stopping it anyway")
        self._ring()
        self._thread.join(CLOSE_TIMEOUT_S)
        self._bell.close(linger=0)

    def _ring(self) -> None:
        try:
            self._bell.send(b"", zmq.NOBLOCK)
        except zmq.Again:
            pass  # rings are pending: the thread drains the whole queue when it wakes

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._bell_in, zmq.POLLIN)
        replays = {s.replay: s for s in self._sinks if s.replay is not None}
        for sock in replays:
            poller.register(sock, zmq.POLLIN)
        try:
            while self._pump():
                for sock, _ in poller.poll():
                    if sock is self._bell_in:
                        while self._bell_in.poll(0):
                            self._bell_in.recv()
                    else:
                        replays[sock].serve_replay()
        except Exception:  # the engine keeps serving; its events stop
            logger.exception("the KV event publisher thread failed")
        finally:
            for sink in self._sinks:
                sink.close()
            self._bell_in.close(linger=0)

    def _pump(self) -> bool:
        """Sends every queued batch; False once the close marker is reached."""
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return True
            if item is None:
                return False
            seq, batch = item
            payload = encode_batch(batch)
            for sink in self._sinks:
                sink.send(seq, payload)


@dataclass(frozen=True, slots=True)
class ReceivedBatch:
    seq: int
    batch: EventBatch
    lost_before: int  # batches just before this one that could not be recovered (0: none)


class KVEventSubscriber:
    """Follows one publisher. ``receive`` never blocks: it returns the batches that are ready,
    each exactly once and in sequence order. A gap in the live stream (or, with ``from_start``,
    joining) asks the replay socket for the missing batches; live batches wait meanwhile. What
    the replay buffer no longer holds is counted in ``lost_before``. A sequence number that goes
    back means the publisher restarted: the subscriber starts over from its seq 0.

    ``sockets`` are for the owner's poller; ``receive`` also gives up a replay that has not
    ended within ``replay_timeout_s``, so call it now and then even when nothing is readable."""

    def __init__(
        self,
        ctx: zmq.Context,
        address: str,
        replay_address: str | None = None,
        *,
        topic: bytes = b"",
        curve: CurveKeys | None = None,
        from_start: bool = True,
        replay_timeout_s: float = 2.0,
        max_waiting: int = 100_000,
        rcvhwm: int = 100_000,
    ) -> None:
        self.ctx, self.topic, self.curve = ctx, topic, curve
        self.replay_address = replay_address
        self.replay_timeout_s = replay_timeout_s
        self.max_waiting = max_waiting
        self.sub = open_socket(ctx, zmq.SUB, address, bind_it=False, rcvhwm=rcvhwm, curve=curve)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        self.dealer: zmq.Socket | None = None
        self.expected: int | None = None  # the next seq to deliver; None: take the first seen
        self.last_live = -1
        self.replay_deadline = 0.0  # > 0 while a replay is in flight
        self.waiting: list[tuple[int, bytes]] = []  # live batches held during a replay
        # Batches a replay delivered ahead of the live stream, to tell their late live copies
        # from a restarted publisher's batches.
        self.replayed: deque[tuple[int, bytes]] = deque(maxlen=max_waiting)
        self.lost = 0
        self._out: list[ReceivedBatch] = []
        if from_start and replay_address is not None:
            self._start_replay(0)

    @property
    def sockets(self) -> list[zmq.Socket]:
        return [s for s in (self.sub, self.dealer) if s is not None]

    def receive(self) -> list[ReceivedBatch]:
        while self.dealer is not None and self.dealer.poll(0):
            self._on_replay(self.dealer.recv_multipart())
        while self.sub.poll(0):
            frames = self.sub.recv_multipart()
            if len(frames) == 3 and frames[0] == self.topic and len(frames[1]) == 8:
                self._on_live(decode_seq(frames[1]), frames[2])
        if self.replay_deadline and time.monotonic() > self.replay_deadline:
            logger.warning("no end of replay from %s; going on without it", self.replay_address)
            self._end_replay(give_up=True)
        out, self._out = self._out, []
        return out

    def start_over(self) -> None:
        """Forgets where it was and replays from seq 0: for an owner told that the publisher
        restarted (a restart is also detected when sequence numbers go back, but not when the
        new publisher's numbers have already passed the old one's)."""
        self.expected, self.waiting, self.last_live = None, [], -1
        self.replayed.clear()
        if self.replay_address is not None:
            self._start_replay(0)

    def close(self) -> None:
        self.sub.close(linger=0)
        if self.dealer is not None:
            self.dealer.close(linger=0)

    def _on_live(self, seq: int, payload: bytes) -> None:
        if self._restarted(seq, payload):
            logger.info("KV event publisher restarted (seq %d after %d)", seq, self.last_live)
            self.start_over()
        self.last_live = seq
        if self.replay_deadline:
            self.waiting.append((seq, payload))
            if len(self.waiting) > self.max_waiting:
                self._end_replay(give_up=True)
        elif self.expected is None or seq == self.expected:
            self._deliver(seq, payload)
        elif seq < self.expected:
            pass  # a replay delivered it already
        elif self.replay_address is not None:
            self.waiting.append((seq, payload))
            self._start_replay(self.expected)
        else:
            self._deliver(seq, payload)  # no replay socket: the gap is counted, not filled

    def _restarted(self, seq: int, payload: bytes) -> bool:
        """Live numbers only go up. One behind what was delivered is either a batch a replay
        delivered first, now showing up on the live stream (the same payload), or a restarted
        publisher's (payloads carry a timestamp, so a new publisher's differ)."""
        replayed = self.replayed
        while replayed and replayed[0][0] < seq:
            replayed.popleft()
        if replayed and replayed[0][0] == seq:
            return replayed.popleft()[1] != payload
        return seq <= self.last_live or (self.expected is not None and seq < self.expected)

    def _on_replay(self, frames: list[bytes]) -> None:
        if len(frames) != 3 or frames[0] != b"" or len(frames[1]) != 8:
            return
        seq = decode_seq(frames[1])
        if seq == -1:
            self._end_replay()
        elif self.replay_deadline and (self.expected is None or seq >= self.expected):
            if seq > self.last_live:  # the live stream may still show it: remember it was sent
                self.replayed.append((seq, frames[2]))
            self._deliver(seq, frames[2])

    def _start_replay(self, start: int) -> None:
        if self.dealer is not None:  # a fresh socket, so that a late answer cannot mix in
            self.dealer.close(linger=0)
        assert self.replay_address is not None
        self.dealer = open_socket(
            self.ctx,
            zmq.DEALER,
            self.replay_address,
            bind_it=False,
            rcvhwm=self.max_waiting,
            curve=self.curve,
        )
        self.dealer.send_multipart((b"", encode_seq(start)))
        self.expected = start
        self.replay_deadline = time.monotonic() + self.replay_timeout_s

    def _end_replay(self, give_up: bool = False) -> None:
        """Delivers the live batches held during the replay. One after a hole the replay did
        not fill (it was dropped while the replay ran) starts another replay, unless giving
        up: the holes are then counted as lost."""
        self.replay_deadline = 0.0
        if give_up and self.dealer is not None:
            self.dealer.close(linger=0)
            self.dealer = None
        waiting, self.waiting = self.waiting, []
        for index, (seq, payload) in enumerate(waiting):
            if self.expected is not None and seq < self.expected:
                continue
            if not give_up and self.expected is not None and seq > self.expected:
                self.waiting = waiting[index:]
                self._start_replay(self.expected)
                return
            self._deliver(seq, payload)

    def _deliver(self, seq: int, payload: bytes) -> None:
        lost = 0 if self.expected is None else seq - self.expected
        self.expected = seq + 1
        try:
            batch = decode_batch(payload)
        except DecodeError as exc:
            logger.warning("undecodable KV event batch %d: %s", seq, exc)
            lost += 1
            self.lost += lost
            return
        self.lost += lost
        self._out.append(ReceivedBatch(seq, batch, lost))


def receive_until(
    subscriber: KVEventSubscriber, done: Callable[[list[ReceivedBatch]], bool], timeout_s: float
) -> list[ReceivedBatch]:
    """Receives until ``done(received so far)`` or the timeout (tests, tools; a worker's loop
    polls ``sockets`` with its own and calls ``receive``)."""
    got: list[ReceivedBatch] = []
    deadline = time.monotonic() + timeout_s
    while not done(got) and time.monotonic() < deadline:
        poller = zmq.Poller()
        for sock in subscriber.sockets:
            poller.register(sock, zmq.POLLIN)
        poller.poll(50)
        got.extend(subscriber.receive())
    return got
