"""What every worker's main loop shares: the supervisor link and the shutdown signals.

Signals (sent by the supervisor only; workers ignore SIGINT so a terminal's Ctrl-C reaches the
supervisor alone and shutdown stays ordered):
    SIGUSR1  drain: stop accepting new work (tokenizers answer "unavailable: shutting down")
    SIGTERM  finish: end what is in flight with terminal events, then exit
"""

from __future__ import annotations

import contextlib
import signal
import sys
from collections.abc import Callable
from typing import Protocol

import zmq

from ipc.config import ClusterConfig
from runtime import start_progress
from runtime.supervisor_link import SupervisorLink


class StartupError(Exception):
    """A worker cannot start for a reason the user can act on (a model it cannot serve, a file
    that is not a model): its message is the one line the launch ends with, and the worker
    exits with EXIT_STARTUP_REFUSED, logging no traceback."""


def write_line(text: str) -> None:
    """``text`` and its newline to stderr in one write(). Every child runs with PYTHONUNBUFFERED=1,
    where print() writes the text and the newline separately: two children announcing at once
    on the supervisor's stderr could interleave them and glue one's line onto the other's (one
    write of a line shorter than PIPE_BUF reaches a pipe whole)."""
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


class WorkerRuntime:
    def __init__(self, role: str, index: int, config: ClusterConfig, ctx: zmq.Context) -> None:
        self.role, self.index, self.config = role, index, config
        self.draining = False
        self.stopping = False
        self.link = SupervisorLink(
            ctx, config.supervisor_addr, role, index, config.heartbeat_interval_s, config.curve
        )
        self.pid = self.link.pid
        signal.signal(signal.SIGUSR1, self._on_drain)
        signal.signal(signal.SIGTERM, self._on_stop)
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    def _on_drain(self, *_: object) -> None:
        self.draining = True

    def _on_stop(self, *_: object) -> None:
        self.draining = True
        self.stopping = True

    def starting(self) -> contextlib.AbstractContextManager[None]:
        """Wraps the worker's start: long work in it (``start_progress.alive``) heartbeats, and
        a SIGTERM meanwhile ends it there (SystemExit: the work's own cleanup runs, e.g. a
        kernel build kills its g++) instead of after the work."""

        def send(doing: str) -> None:
            if self.stopping:
                raise SystemExit(0)
            self.link.starting(doing)

        return start_progress.reporting(send)

    def announce(self, addresses: list[str], **model_info: object) -> None:
        """One start-up line (stderr: stdout belongs to the CLI's answers), then WorkerReady."""
        write_line(
            f"splitserve {self.role}[{self.index}] pid={self.pid} ready: " + " ".join(addresses)
        )
        self.link.ready(addresses, **model_info)

    def heartbeat_due_in_ms(self) -> int:
        return self.link.heartbeat_due_in_ms()

    def maybe_heartbeat(self, stats: Callable[[], dict[str, float]]) -> None:
        self.link.maybe_heartbeat(stats)

    def close(self) -> None:
        self.link.close()


class _Runs(Protocol):
    def run(self) -> None: ...


def run_on_context(make: Callable[[zmq.Context], _Runs]) -> None:
    """A role's entry point: its worker on a fresh ZeroMQ context, terminated however it ends.
    A worker that raised (at start-up, or out of its loop) leaves sockets open, and ``term()``
    would wait for them forever, a live process that never beats again: those are closed at
    once (linger 0) and the error raised, so the process exits and the supervisor handles it as
    dead (its requests ended, the worker restarted)."""
    ctx = zmq.Context()
    try:
        make(ctx).run()
    except BaseException:
        ctx.destroy(linger=0)
        raise
    ctx.term()
