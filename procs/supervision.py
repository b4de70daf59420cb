"""Watching a cluster's children: who is there and what each last said (``Roster``), what to do
when one dies, hangs or falls silent (``SupervisionPolicy``, decisions only), and the thread that
applies those decisions while the cluster runs (``Watcher``).

The policy (``restart_policy``): "restart" (the default) starts a dead child again under the same
role, index and addresses, at most ``max_restarts`` times per slot; before that a ClusterNotice
goes to the detokenizer, which ends every request that died with the worker and forwards the
notice to every client; a second notice says the replacement is ready. A dead detokenizer is
noticed by clients themselves (their connection drops). "shutdown", or a slot out of restarts,
stops the whole cluster. With ``hang_timeout_s`` set, a ready child silent that long is killed
and handled as dead; a child silent past ``heartbeat_timeout_s`` is only logged (one long prefill
on a slow CPU can legitimately outlast it).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable

import zmq

from ipc import codec
from ipc.config import ClusterConfig
from ipc.messages import (
    EXIT_STARTUP_REFUSED,
    NOTICE_DIED,
    NOTICE_READY,
    ClusterNotice,
    Heartbeat,
    WorkerFailed,
    WorkerReady,
)
from ipc.sockets import PullQueue
from procs.children import Child, spawn
from runtime.worker import write_line

logger = logging.getLogger("splitserve.supervisor")


class ClusterStartError(RuntimeError):
    pass


def _log_malformed(frame: bytes, exc: codec.DecodeError) -> None:
    logger.warning("malformed frame on the supervisor socket: %s", exc)


# After a child's exit, how long the supervisor waits for its last words (WorkerFailed: sent
# before it exits, but on a socket of its own that may deliver a little after).
LAST_WORDS_WAIT_S = 1.0


class Roster:
    """The children and the supervisor's inbox (WorkerReady, Heartbeat and WorkerFailed)."""

    def __init__(self, ctx: zmq.Context, config: ClusterConfig) -> None:
        self.inbox: PullQueue[WorkerReady | Heartbeat | WorkerFailed] = PullQueue(
            ctx, config.supervisor_addr, WorkerReady, Heartbeat, WorkerFailed, curve=config.curve
        )
        self.children: list[Child] = []

    def spawn(self, role: str, index: int, config: ClusterConfig) -> Child:
        child = spawn(role, index, config)
        self.children.append(child)
        return child

    def find(self, role: str, index: int) -> Child | None:
        return next((c for c in self.children if c.role == role and c.index == index), None)

    def receive(self, timeout_ms: int) -> None:
        """Reads what arrived (waiting up to ``timeout_ms`` for the first) into the records."""
        if not self.inbox.wait(timeout_ms):
            return
        for msg in self.inbox.drain(1000, _log_malformed):
            child = self.find(msg.role, msg.index)
            if child is None or msg.pid != child.popen.pid:
                continue  # unknown, or the last words of a process already replaced
            child.last_seen = time.monotonic()
            if isinstance(msg, WorkerReady):
                child.ready = msg
            elif isinstance(msg, WorkerFailed):
                child.failed = msg
            else:
                child.last_heartbeat = msg
                if child.ready is None and msg.doing and msg.doing != child.doing:
                    # once per kind of work: the user sees why this start takes long
                    write_line(f"splitserve {child.name} pid={msg.pid}: {msg.doing}")
                child.doing = msg.doing

    def why_exited(self, child: Child) -> str:
        """A child that exited: its last words if it sent them (waiting a little for them),
        else its exit code."""
        deadline = time.monotonic() + LAST_WORDS_WAIT_S
        while child.failed is None and time.monotonic() < deadline:
            self.receive(50)
        if child.failed is not None:
            return child.failed.reason
        return f"exited with code {child.popen.returncode} (its log above says why)"

    def wait_ready(self, waiting: list[Child], timeout_s: float) -> list[WorkerReady]:
        """Each child's WorkerReady; raises ClusterStartError, with the child's own reason, at
        the first that fails or exits, or at the first silent for ``timeout_s``: a child's
        time counts from its start or its latest message (a Heartbeat before ready says it is
        alive in long start-up work, e.g. building our int4 kernel)."""
        while any(c.ready is None for c in waiting):
            for c in waiting:
                if c.failed is not None or c.popen.poll() is not None:
                    raise ClusterStartError(f"{c.name}: {self.why_exited(c)}")
            now = time.monotonic()
            late = [c.name for c in waiting if c.ready is None and now - c.last_seen > timeout_s]
            if late:
                raise ClusterStartError(f"not ready after {timeout_s:.0f} s: {', '.join(late)}")
            self.receive(200)
        return [c.ready for c in waiting if c.ready is not None]

    def close(self) -> None:
        self.inbox.close()


class SupervisionPolicy:
    """Decisions only: nothing here starts, kills or sends anything."""

    def __init__(self, config: ClusterConfig) -> None:
        self.restart_policy = config.restart_policy
        self.max_restarts = config.max_restarts
        self.hang_timeout_s = config.hang_timeout_s
        self.heartbeat_timeout_s = config.heartbeat_timeout_s
        self.restarts: dict[str, int] = {}  # child name -> restarts so far

    def after_death(self, child: Child) -> str | None:
        """None: restart it (the restart is counted). Otherwise why the cluster stops instead."""
        used = self.restarts.get(child.name, 0)
        if self.restart_policy != "restart":
            return "restart_policy is shutdown"
        if child.popen.returncode == EXIT_STARTUP_REFUSED:
            return "it refused to start, and would again"
        if used >= self.max_restarts:
            return f"it was restarted {used} times already (max_restarts)"
        self.restarts[child.name] = used + 1
        return None

    def hung(self, children: list[Child], now: float) -> list[tuple[Child, str]]:
        """Ready children silent past ``hang_timeout_s`` (0: never), with why; only once ready:
        loading a model is slow and says nothing until it is done."""
        limit = self.hang_timeout_s
        if not limit:
            return []
        return [
            (c, f"sent no heartbeat for {now - c.last_seen:.1f} s (hang_timeout_s)")
            for c in children
            if c.ready is not None and not c.killed_for and now - c.last_seen > limit
        ]

    def newly_silent(self, children: list[Child], now: float) -> list[tuple[Child, float]]:
        """Children whose heartbeats stopped past ``heartbeat_timeout_s`` since the last call
        (each said once until it speaks again), with the seconds of silence."""
        found = []
        for c in children:
            silent_for = now - (c.last_heartbeat.t if c.last_heartbeat else now)
            if silent_for > self.heartbeat_timeout_s:
                if not c.silent_warned:
                    c.silent_warned = True
                    found.append((c, silent_for))
            else:
                c.silent_warned = False
        return found


class Watcher:
    """The thread that watches the roster while the cluster runs and applies the policy.

    ``notify`` sends a ClusterNotice to the detokenizer; ``respawn`` starts a child's
    replacement (None once the cluster is stopping); ``stop`` stops the whole cluster. Children
    are started from this thread for restarts: PR_SET_PDEATHSIG fires when the *thread* that
    forked a child exits, and this one lives until every child is stopped."""

    def __init__(
        self,
        roster: Roster,
        policy: SupervisionPolicy,
        notify: Callable[[ClusterNotice], None],
        respawn: Callable[[Child], Child | None],
        stop: Callable[[], None],
    ) -> None:
        self.roster, self.policy = roster, policy
        self.notify, self.respawn, self.stop = notify, respawn, stop
        self.failure: str | None = None
        self.stopping = False  # set by the cluster when it stops: no more restarts or notices
        self._quit = threading.Event()
        self._thread = threading.Thread(target=self._run, name="splitserve-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def join(self, timeout_s: float) -> None:
        self._quit.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=timeout_s)

    def _run(self) -> None:
        try:
            while not self._quit.is_set():
                self.roster.receive(100)
                if not self.stopping:
                    self.check(time.monotonic())
        except Exception as exc:  # noqa: BLE001 - nobody would supervise the cluster any more
            logger.exception("the supervisor's watch loop failed; stopping the cluster")
            self.failure = f"supervisor watch loop failed: {exc!r}"
            self.stop()

    def check(self, now: float) -> None:
        """One round: warn of silence, kill hung children, announce replacements that are
        ready, then handle the dead."""
        children = self.roster.children
        for c, silent_for in self.policy.newly_silent(children, now):
            logger.warning("%s sent no heartbeat for %.1f s", c.name, silent_for)
        for c, why in self.policy.hung(children, now):
            c.killed_for = why
            logger.error("%s (pid %d) %s; killing it", c.name, c.popen.pid, why)
            with contextlib.suppress(ProcessLookupError):
                c.popen.kill()
        for c in children:
            if c.restarted and c.ready is not None:
                c.restarted = False
                logger.warning("%s restarted: pid %d ready", c.name, c.popen.pid)
                self.notify(
                    ClusterNotice(event=NOTICE_READY, role=c.role, index=c.index, pid=c.popen.pid)
                )
        dead = [c for c in children if c.popen.poll() is not None]
        for c in dead:
            if not self._handle_dead(c):
                return

    def _handle_dead(self, c: Child) -> bool:
        """Tells the detokenizer (it ends the requests that died) and restarts the child, or
        stops the cluster. False once the cluster is stopping."""
        detail = c.killed_for or f"exited with code {c.popen.returncode}"
        if c.failed is not None:
            detail += f": {c.failed.reason}"
        if c.role != "detokenizer":  # a detokenizer's clients see their connection drop
            self.notify(
                ClusterNotice(
                    event=NOTICE_DIED, role=c.role, index=c.index, pid=c.popen.pid, detail=detail
                )
            )
        why = self.policy.after_death(c)
        if why is not None:
            self.failure = f"{c.name} {detail}"
            logger.error(
                "%s (pid %d) %s; stopping the cluster: %s", c.name, c.popen.pid, detail, why
            )
            self.stop()
            return False
        new = self.respawn(c)
        if new is None:
            return False
        logger.warning(
            "%s (pid %d) %s; restarting it as pid %d (restart %d of %d)",
            c.name,
            c.popen.pid,
            detail,
            new.popen.pid,
            self.policy.restarts[c.name],
            self.policy.max_restarts,
        )
        return True
