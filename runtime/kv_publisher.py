"""Publishing KV-cache events (an engine) and following them (a tokenizer worker, a test).

The wire is ``ipc.kv_events``'s (vLLM's): PUB frames ``topic | seq | payload``, an optional
ROUTER answering replays. ``KVEventPublisher`` keeps the engine's step off the wire: ``publish``
numbers the batch and hands it to a bounded queue; a thread of its own encodes it once, sends it
to every sink (the cluster's internal stream, and the user's ``--kv-events-config`` endpoint)
and keeps the last ``buffer_steps`` payloads per sink for replay. ``KVEventSubscriber``
(runtime/kv_subscriber.py) follows one publisher.

A sink marked ``side`` (the internal stream) also carries ``publish_side``'s messages: other
topics (an engine replica's load, ``ipc.messages.ReplicaLoad``) with sequence numbers of their
own, never buffered for replay (the latest is what counts), so the KV topic's numbers keep no
gaps. A subscriber given ``side_topics`` hands them over through ``take_side``.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from itertools import count

import zmq

from ipc import codec
from ipc.kv_events import (
    END_OF_REPLAY,
    EventBatch,
    KVCacheEvent,
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
    side: bool = False  # also carries publish_side's topics


@dataclass(frozen=True, slots=True)
class _SideMessage:
    topic: bytes
    seq: int
    message: object  # an ipc.codec message, encoded on the publisher thread


class _OpenSink:
    """A sink's sockets and replay buffer; used by the publisher thread alone."""

    def __init__(self, ctx: zmq.Context, sink: EventSink) -> None:
        self.topic = sink.topic
        self.side = sink.side
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

    def send_side(self, topic: bytes, seq: int, payload: bytes) -> None:
        self.pub.send_multipart((topic, encode_seq(seq), payload), copy=False)

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
        self._side_seq: dict[bytes, int] = {}
        self._queue: queue.Queue[tuple[int, EventBatch] | _SideMessage | None] = queue.Queue(
            queue_max
        )
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

    def publish_side(self, topic: bytes, message: object) -> None:
        """Queues an ipc.codec message for the side sinks under ``topic`` (its own sequence);
        dropped when the queue is full (the next one supersedes it)."""
        seq = self._side_seq.get(topic, 0)
        self._side_seq[topic] = seq + 1
        try:
            self._queue.put_nowait(_SideMessage(topic, seq, message))
        except queue.Full:
            return
        self._ring()

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
            if isinstance(item, _SideMessage):
                side_payload = codec.encode(item.message)
                for sink in self._sinks:
                    if sink.side:
                        sink.send_side(item.topic, item.seq, side_payload)
                continue
            seq, batch = item
            payload = encode_batch(batch)
            for sink in self._sinks:
                sink.send(seq, payload)
