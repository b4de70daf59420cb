"""Following one KV-event publisher (``runtime.kv_publisher``): a tokenizer worker follows every
engine replica with one ``KVEventSubscriber`` each; tests and tools use ``receive_until``.

The subscriber hands its owner every batch once, in sequence order, asking the replay socket for
what the live stream skipped (a slow joiner's start, a message the PUB dropped at its high-water
mark, a publisher restart). Side topics (``ipc.messages.ReplicaLoad`` under ``b"load"``) come
through ``take_side`` as they arrive, unnumbered gaps and all: only the latest counts.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from ipc.codec import DecodeError
from ipc.kv_events import EventBatch, decode_batch, decode_seq, encode_seq
from ipc.sockets import CurveKeys, open_socket

logger = logging.getLogger("splitserve.kv_events")


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
        side_topics: tuple[bytes, ...] = (),
    ) -> None:
        self.ctx, self.topic, self.curve = ctx, topic, curve
        self.side_topics = side_topics
        self.side: list[tuple[bytes, int, bytes]] = []  # (topic, seq, payload), see take_side
        self.replay_address = replay_address
        self.replay_timeout_s = replay_timeout_s
        self.max_waiting = max_waiting
        self.sub = open_socket(ctx, zmq.SUB, address, bind_it=False, rcvhwm=rcvhwm, curve=curve)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        for side_topic in side_topics if topic else ():  # b"" lets every topic through
            self.sub.setsockopt(zmq.SUBSCRIBE, side_topic)
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
            if len(frames) != 3 or len(frames[1]) != 8:
                continue
            if frames[0] == self.topic:
                self._on_live(decode_seq(frames[1]), frames[2])
            elif frames[0] in self.side_topics:
                self.side.append((frames[0], decode_seq(frames[1]), frames[2]))
        if self.replay_deadline and time.monotonic() > self.replay_deadline:
            logger.warning("no end of replay from %s; going on without it", self.replay_address)
            self._end_replay(give_up=True)
        out, self._out = self._out, []
        return out

    def take_side(self) -> list[tuple[bytes, int, bytes]]:
        """The side topics' messages received so far, oldest first (``receive`` reads them)."""
        side, self.side = self.side, []
        return side

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
