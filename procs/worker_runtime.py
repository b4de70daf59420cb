"""What every worker process shares: logging with its role, the supervisor channel (ready +
heartbeats), and the shutdown signals.

Signals (sent by the supervisor only; workers ignore SIGINT so a terminal's Ctrl-C reaches the
supervisor alone and shutdown stays ordered):
    SIGUSR1  drain: stop accepting new work (tokenizers answer "unavailable: shutting down")
    SIGTERM  finish: end what is in flight with terminal events, then exit
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time

import zmq

from ipc.config import ClusterConfig
from ipc.messages import Heartbeat, WorkerReady
from ipc.sockets import PushQueue

logger = logging.getLogger("splitserve.worker")


def setup_logging(role: str, index: int | None = None) -> None:
    name = role if index is None else f"{role}-{index}"
    logging.basicConfig(
        level=os.environ.get("SPLITSERVE_LOG_LEVEL", "INFO").upper(),
        format=f"%(asctime)s {name} pid=%(process)d %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr, force=True)


class WorkerRuntime:
    def __init__(self, role: str, index: int, config: ClusterConfig, ctx: zmq.Context) -> None:
        self.role, self.index, self.config = role, index, config
        self.pid = os.getpid()
        self.draining = False
        self.stopping = False
        self._supervisor = PushQueue(ctx, config.supervisor_addr, hwm=100,
                                     curve=config.curve)
        self._next_heartbeat = 0.0
        signal.signal(signal.SIGUSR1, self._on_drain)
        signal.signal(signal.SIGTERM, self._on_stop)
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    def _on_drain(self, *_: object) -> None:
        self.draining = True

    def _on_stop(self, *_: object) -> None:
        self.draining = True
        self.stopping = True

    def announce(self, addresses: list[str], **model_info: object) -> None:
        """One start-up line (stderr: stdout belongs to the CLI's answers), then WorkerReady."""
        print(f"splitserve {self.role}[{self.index}] pid={self.pid} ready: "
              + " ".join(addresses), file=sys.stderr, flush=True)
        self._send(WorkerReady(role=self.role, index=self.index, pid=self.pid,
                               addresses=addresses, **model_info))  # type: ignore[arg-type]

    def heartbeat_due_in_ms(self) -> int:
        return max(0, int((self._next_heartbeat - time.monotonic()) * 1000))

    def maybe_heartbeat(self, stats: dict[str, float]) -> None:
        now = time.monotonic()
        if now < self._next_heartbeat:
            return
        self._next_heartbeat = now + self.config.heartbeat_interval_s
        self._send(Heartbeat(role=self.role, index=self.index, pid=self.pid, t=now,
                             stats={k: float(v) for k, v in stats.items()}))

    def _send(self, msg: object) -> None:
        try:
            self._supervisor.put(msg, block=False)
        except zmq.Again:  # the supervisor is not reading; heartbeats are best-effort
            logger.warning("supervisor channel full; dropped a %s", type(msg).__name__)

    def close(self) -> None:
        self._supervisor.close()
