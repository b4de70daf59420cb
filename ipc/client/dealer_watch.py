"""The asyncio client's DEALER: a plain socket whose descriptor the event loop watches.

zmq.asyncio's ``await sock.poll()`` / ``await sock.recv()`` build a poller, futures and callbacks
for every frame; at one stream that was most of the HTTP worker's CPU per token. Here the loop
watches the socket's descriptor once (``add_reader``) and a wake-up reads with non-blocking calls.

ZeroMQ's descriptor is edge-triggered and is also consumed by sends on the same socket, so the
socket's EVENTS, not the descriptor, says whether a frame is waiting: ``wait`` checks them before
it sleeps, unless ``frames`` just found none and nothing was sent since. Sends never block: a
frame the socket will not take now (its queue to the detokenizer is full) waits in a backlog, in
order, and goes out on a later pass.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Iterator
from typing import cast

import zmq

from ipc.client.transport import monitor_events

BACKLOG_RETRY_MS = 10  # how soon a pass retries frames the socket would not take


def _settle(waiter: asyncio.Future, woke: bool) -> None:
    if not waiter.done():
        waiter.set_result(woke)


class DealerWatch:
    """One DEALER (and its disconnect monitor) on one event loop; every method runs on that
    loop's thread."""

    def __init__(self, sock: zmq.Socket, loop: asyncio.AbstractEventLoop) -> None:
        self.sock = sock
        self._loop = loop
        self._monitor: zmq.Socket | None = None
        self._monitor_signalled = False
        self._waiter: asyncio.Future | None = None
        self._backlog: deque[bytes] = deque()
        self._unsure = True  # whether a frame may wait that the descriptor will not signal
        loop.add_reader(sock.FD, self._wake)

    def watch_disconnect(self, monitor: zmq.Socket) -> None:
        """Reports the connection dropping (transport.disconnect_monitor's socket)."""
        self._monitor = monitor
        self._monitor_signalled = True  # an event queued before the watch began is read too
        self._loop.add_reader(monitor.FD, self._wake_monitor)

    def _wake(self) -> None:
        if self._waiter is not None:
            _settle(self._waiter, True)

    def _wake_monitor(self) -> None:
        self._monitor_signalled = True
        self._wake()

    def has_frame(self) -> bool:
        return bool(cast(int, self.sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN)

    async def wait(self, timeout_ms: int) -> None:
        """Until a frame or a monitor event may be waiting, or ``timeout_ms`` passed (then the
        monitor is read as well: its descriptor may have fired before it was watched)."""
        if self._backlog:
            timeout_ms = min(timeout_ms, BACKLOG_RETRY_MS)
        if self._monitor_signalled or (self._unsure and self.has_frame()):
            return
        self._waiter = waiter = self._loop.create_future()
        timer = self._loop.call_later(timeout_ms / 1e3, _settle, waiter, False)
        try:
            woke = await waiter
        finally:
            timer.cancel()
            self._waiter = None
        self._monitor_signalled |= not woke

    async def readable(self, timeout_s: float) -> bool:
        """Whether a frame arrived within ``timeout_s`` (the handshake's wait)."""
        deadline = time.monotonic() + timeout_s
        while not self.has_frame():
            left_ms = int((deadline - time.monotonic()) * 1e3)
            if left_ms <= 0:
                return False
            await self.wait(left_ms)
        return True

    def frames(self) -> Iterator[bytes]:
        """The frames waiting now, without blocking."""
        while self.has_frame():
            yield self.sock.recv(zmq.NOBLOCK)
        self._unsure = False

    def disconnected(self) -> bool:
        """Whether the monitor reported the connection dropping since the last look (read only
        when its descriptor signalled or a wait timed out: reading it costs calls)."""
        if self._monitor is None or not self._monitor_signalled:
            return False
        self._monitor_signalled = False
        return monitor_events(self._monitor) > 0

    def send(self, frames: list[bytes]) -> None:
        """In order, now where the socket takes them; the rest on a later ``send``/``wait``. A
        send may consume the descriptor's signal of a frame: a pending ``wait`` looks again."""
        self._backlog.extend(frames)
        if self._backlog:
            self._unsure = True
            self._wake()
        while self._backlog:
            try:
                self.sock.send(self._backlog[0], zmq.NOBLOCK)
            except zmq.Again:
                return
            self._backlog.popleft()

    async def flush(self, timeout_s: float) -> None:
        """Sends the backlog, giving up after ``timeout_s`` (the detokenizer is not reading)."""
        deadline = time.monotonic() + timeout_s
        self.send([])
        while self._backlog and time.monotonic() < deadline:
            await asyncio.sleep(BACKLOG_RETRY_MS / 1e3)
            self.send([])

    def close(self, linger: int) -> None:
        if self._waiter is not None:
            _settle(self._waiter, False)
        self._loop.remove_reader(self.sock.FD)
        if self._monitor is not None:
            self._loop.remove_reader(self._monitor.FD)
            self.sock.disable_monitor()
            self._monitor.close(linger=0)
            self._monitor = None
        self.sock.close(linger=linger)
