"""A worker's channel to the supervisor: one WorkerReady when it serves, then heartbeats that
carry its stats, and a WorkerFailed as its last words when it cannot go on. Best effort: a
supervisor that is not reading never blocks a worker."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

import zmq

from ipc.config import ClusterConfig
from ipc.messages import Heartbeat, WorkerFailed, WorkerReady
from ipc.sockets import CurveKeys, PushQueue

logger = logging.getLogger("splitserve.worker")
QUEUE_LIMIT = 100  # messages; past it they are dropped with a warning
LAST_WORDS_LINGER_MS = 1000  # how long a failing worker waits for the supervisor to take them


class SupervisorLink:
    def __init__(
        self,
        ctx: zmq.Context,
        address: str,
        role: str,
        index: int,
        interval_s: float,
        curve: CurveKeys | None = None,
    ) -> None:
        self.role, self.index, self.interval_s = role, index, interval_s
        self.pid = os.getpid()
        self._queue = PushQueue(ctx, address, hwm=QUEUE_LIMIT, curve=curve)
        self._next_heartbeat = 0.0
        self._doing = ""  # the start-up work last reported (``starting``)

    def ready(self, addresses: list[str], **model_info: Any) -> None:
        self._send(
            WorkerReady(
                role=self.role, index=self.index, pid=self.pid, addresses=addresses, **model_info
            )
        )

    def heartbeat_due_in_ms(self) -> int:
        return max(0, int((self._next_heartbeat - time.monotonic()) * 1000))

    def maybe_heartbeat(self, stats: Callable[[], dict[str, float]]) -> None:
        """Sends one if ``interval_s`` has passed since the last; ``stats`` is called only then
        (a role calls this every pass of its loop: the engine's between two steps)."""
        now = time.monotonic()
        if now < self._next_heartbeat:
            return
        self._next_heartbeat = now + self.interval_s
        self._send(
            Heartbeat(
                role=self.role,
                index=self.index,
                pid=self.pid,
                t=now,
                stats={k: float(v) for k, v in stats().items()},
            )
        )

    def starting(self, doing: str) -> None:
        """Before ready: a Heartbeat naming the long start-up work (``start_progress``), at once
        where the work changed, else once each ``interval_s``."""
        now = time.monotonic()
        if doing == self._doing and now < self._next_heartbeat:
            return
        self._doing, self._next_heartbeat = doing, now + self.interval_s
        self._send(Heartbeat(role=self.role, index=self.index, pid=self.pid, t=now, doing=doing))

    def _send(self, msg: object) -> None:
        try:
            self._queue.put(msg, block=False)
        except zmq.Again:
            logger.warning("supervisor channel full; dropped a %s", type(msg).__name__)

    def close(self) -> None:
        self._queue.close()


def send_last_words(
    config: ClusterConfig, role: str, index: int, reason: str, *, refused: bool
) -> None:
    """Tells the supervisor why this worker is about to exit, on a context of its own (the
    worker's may be gone with whatever failed), waiting at most LAST_WORDS_LINGER_MS."""
    ctx = zmq.Context()
    try:
        queue = PushQueue(ctx, config.supervisor_addr, hwm=1, curve=config.curve)
        msg = WorkerFailed(role=role, index=index, pid=os.getpid(), reason=reason, refused=refused)
        try:
            queue.put(msg, block=True, timeout_ms=LAST_WORDS_LINGER_MS)
        except zmq.Again:
            logger.warning("the supervisor did not take this worker's last words")
        queue.socket.close(linger=LAST_WORDS_LINGER_MS)
    finally:
        ctx.destroy(linger=0)
