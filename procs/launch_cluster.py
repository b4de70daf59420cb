"""The supervisor: starts every process of a cluster, watches them, stops them in order.

Library use (tests, benchmarks):

    with launch_cluster(model="default", tokenizer_workers=2) as cluster:
        client = Client(cluster.client_addr)

Start-up: the engine first (it resolves the model's context length and vocabulary, which the
tokenizers check against and the detokenizer hands to clients), then the detokenizer and the
tokenizers; each reports WorkerReady. Shutdown is ordered so every request in flight gets its
terminal event: tokenizers stop accepting (they answer "unavailable"), the engine aborts what it
runs, tokenizers exit, and the detokenizer, last, forwards everything and ends what is left.

Policy on a child's unexpected exit (``restart_policy``): "restart" (the default) starts it again
under the same role, index and addresses, at most ``max_restarts`` times per slot; before that the
supervisor sends a ClusterNotice to the detokenizer, which ends every request that died with the
worker (all of the engine's; a tokenizer's are ended by each client, which knows what it sent
where) and forwards the notice to every client; a second notice says the replacement is ready. A
dead detokenizer is noticed by clients themselves (their connection drops). "shutdown", or a slot
out of restarts, stops the whole cluster in the same order as a shutdown; ``Cluster.failure`` says
why. With ``hang_timeout_s`` set, a ready child silent that long is killed and handled as dead.

Children are started from the thread that called ``start`` and, for restarts, from the watcher
thread: PR_SET_PDEATHSIG fires when the *thread* that forked a child exits, and both live until
``shutdown`` has stopped every child.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import zmq

from ipc import codec
from ipc.config import ClusterConfig
from ipc.messages import NOTICE_DIED, NOTICE_READY, ClusterNotice, Heartbeat, WorkerReady
from ipc.sockets import PullQueue, PushQueue
from procs.children import Child, spawn, stop_in_order
from procs.cluster_setup import make_config
from procs.thread_budget import describe_budget

logger = logging.getLogger("splitserve.supervisor")

CURVE_PUBLIC_KEY_FILE = "curve_public.key"


def _log_malformed(frame: bytes, exc: codec.DecodeError) -> None:
    logger.warning("malformed frame on the supervisor socket: %s", exc)


class ClusterStartError(RuntimeError):
    pass


class Cluster:
    def __init__(self, config: ClusterConfig, *, owns_run_dir: bool) -> None:
        self.config = config
        self.owns_run_dir = owns_run_dir
        self.ctx = zmq.Context()
        self.inbox: PullQueue[WorkerReady | Heartbeat] = PullQueue(
            self.ctx, config.supervisor_addr, WorkerReady, Heartbeat, curve=config.curve
        )
        # ClusterNotices go to the detokenizer's inbox (it forwards them to clients).
        self.notices = PushQueue(self.ctx, config.detokenizer_addr, hwm=1000, curve=config.curve)
        self.children: list[Child] = []
        self.restarts: dict[str, int] = {}  # child name -> restarts so far
        self.failure: str | None = None
        self._lock = threading.Lock()
        self._stopping = False
        self._stopped = threading.Event()  # the children are stopped (whoever stopped them)
        self._closed = False
        self._stop_watch = threading.Event()
        self._watcher: threading.Thread | None = None

    # --- start-up -----------------------------------------------------------------------------
    @classmethod
    def start(
        cls, config: ClusterConfig, *, owns_run_dir: bool = True, start_timeout_s: float = 180.0
    ) -> Cluster:
        config.write()
        if config.curve_public_key:  # for users: the key clients pass as server_public_key=
            key_path = Path(config.run_dir) / CURVE_PUBLIC_KEY_FILE
            fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(config.curve_public_key + "\n")
        cluster = cls(config, owns_run_dir=owns_run_dir)
        try:
            cluster._start_all(start_timeout_s)
        except BaseException:
            cluster.shutdown()
            raise
        cluster._watcher = threading.Thread(
            target=cluster._watch, name="splitserve-watch", daemon=True
        )
        cluster._watcher.start()
        return cluster

    def _start_all(self, timeout_s: float) -> None:
        print(
            f"splitserve supervisor pid={os.getpid()}: {describe_budget(self.config)}",
            file=sys.stderr,
            flush=True,
        )
        engine = self._spawn("engine", 0)
        ready = self._wait_ready([engine], timeout_s)[0]
        # Hand the engine's resolved limits to everyone started after it.
        self.config = dataclasses.replace(
            self.config.with_engine(max_model_len=ready.max_model_len),
            vocab_size=ready.vocab_size,
            model_name=ready.model_name,
        )
        self.config.write()
        rest = [self._spawn("detokenizer", 0)]
        rest += [self._spawn("tokenizer", i) for i in range(self.config.tokenizer_workers)]
        self._wait_ready(rest, timeout_s)
        if self.config.http_port is not None:
            # Last: a frontend's readiness is a handshake with the detokenizer.
            frontends = [self._spawn("http", i) for i in range(self.config.http_workers)]
            self._wait_ready(frontends, timeout_s)
        logger.info("cluster ready: %s", self.describe())

    def _spawn(self, role: str, index: int) -> Child:
        child = spawn(role, index, self.config)
        self.children.append(child)
        return child

    def _wait_ready(self, waiting: list[Child], timeout_s: float) -> list[WorkerReady]:
        deadline = time.monotonic() + timeout_s
        while any(c.ready is None for c in waiting):
            for c in waiting:
                if c.popen.poll() is not None:
                    raise ClusterStartError(
                        f"{c.name} exited with code {c.popen.returncode} during start-up "
                        "(its log above says why)"
                    )
            if time.monotonic() > deadline:
                late = [c.name for c in waiting if c.ready is None]
                raise ClusterStartError(f"not ready after {timeout_s:.0f} s: {', '.join(late)}")
            self._receive(200)
        return [c.ready for c in waiting]  # type: ignore[misc]

    def _receive(self, timeout_ms: int) -> None:
        if not self.inbox.wait(timeout_ms):
            return
        for msg in self.inbox.drain(1000, _log_malformed):
            child = self._child(msg.role, msg.index)
            if child is None or msg.pid != child.popen.pid:
                continue  # unknown, or the last words of a process already replaced
            child.last_seen = time.monotonic()
            if isinstance(msg, WorkerReady):
                child.ready = msg
            else:
                child.last_heartbeat = msg

    # --- watching -----------------------------------------------------------------------------
    def _watch(self) -> None:
        try:
            self._watch_loop()
        except Exception as exc:  # noqa: BLE001 - nobody would supervise the cluster any more
            logger.exception("the supervisor's watch loop failed; stopping the cluster")
            self.failure = f"supervisor watch loop failed: {exc!r}"
            self._stop_children()

    def _watch_loop(self) -> None:
        while not self._stop_watch.is_set():
            self._receive(100)
            if self._stopping:
                continue
            self._warn_silent_children()
            self._kill_hung_children()
            for c in self.children:
                if c.restarted and c.ready is not None:
                    c.restarted = False
                    logger.warning("%s restarted: pid %d ready", c.name, c.popen.pid)
                    self._notify(
                        ClusterNotice(
                            event=NOTICE_READY, role=c.role, index=c.index, pid=c.popen.pid
                        )
                    )
            dead = [c for c in self.children if c.popen.poll() is not None]
            if dead:
                self._handle_dead(dead)

    def _handle_dead(self, dead: list[Child]) -> None:
        """The restart policy: tell the detokenizer (it ends the requests that died), restart."""
        for c in dead:
            detail = c.killed_for or f"exited with code {c.popen.returncode}"
            if c.role != "detokenizer":  # a detokenizer's clients see their connection drop
                self._notify(
                    ClusterNotice(
                        event=NOTICE_DIED,
                        role=c.role,
                        index=c.index,
                        pid=c.popen.pid,
                        detail=detail,
                    )
                )
            used = self.restarts.get(c.name, 0)
            if self.config.restart_policy != "restart" or used >= self.config.max_restarts:
                why = (
                    "restart_policy is shutdown"
                    if self.config.restart_policy != "restart"
                    else f"it was restarted {used} times already (max_restarts)"
                )
                self.failure = f"{c.name} {detail}"
                logger.error(
                    "%s (pid %d) %s; stopping the cluster: %s", c.name, c.popen.pid, detail, why
                )
                self._stop_children()
                return
            with self._lock:
                if self._stopping:
                    return
                self.restarts[c.name] = used + 1
                self.children.remove(c)
                new = self._spawn(c.role, c.index)
                new.restarted = True
            logger.warning(
                "%s (pid %d) %s; restarting it as pid %d (restart %d of %d)",
                c.name,
                c.popen.pid,
                detail,
                new.popen.pid,
                used + 1,
                self.config.max_restarts,
            )

    def _kill_hung_children(self) -> None:
        limit = self.config.hang_timeout_s
        if not limit:
            return
        now = time.monotonic()
        for c in self.children:
            # Only once ready: loading a model is slow and says nothing until it is done.
            if c.ready is not None and not c.killed_for and now - c.last_seen > limit:
                c.killed_for = f"sent no heartbeat for {now - c.last_seen:.1f} s (hang_timeout_s)"
                logger.error("%s (pid %d) %s; killing it", c.name, c.popen.pid, c.killed_for)
                with contextlib.suppress(ProcessLookupError):
                    c.popen.kill()

    def _notify(self, notice: ClusterNotice) -> None:
        try:
            self.notices.put(notice, block=False)
        except zmq.Again:
            logger.error("the detokenizer is not reading; dropped notice %s", notice)

    def _warn_silent_children(self) -> None:
        # Only a warning: the engine heartbeats between steps, and one long prefill on a slow
        # CPU can legitimately outlast the timeout. A later policy may act on it.
        now = time.monotonic()
        for c in self.children:
            last = c.last_heartbeat.t if c.last_heartbeat else now
            if now - last > self.config.heartbeat_timeout_s and not c.silent_warned:
                c.silent_warned = True
                logger.warning("%s sent no heartbeat for %.1f s", c.name, now - last)
            elif now - last <= self.config.heartbeat_timeout_s:
                c.silent_warned = False

    def worker_stats(self, role: str, index: int = 0) -> dict[str, float]:
        """The latest heartbeat stats of one worker ({} before its first heartbeat)."""
        child = self._child(role, index)
        hb = child.last_heartbeat if child else None
        return dict(hb.stats) if hb else {}

    def _child(self, role: str, index: int) -> Child | None:
        return next((c for c in self.children if c.role == role and c.index == index), None)

    @property
    def client_addr(self) -> str:
        return self.config.client_addr

    @property
    def http_url(self) -> str | None:
        """The first HTTP frontend's base URL (all of them share it), None without one."""
        child = self._child("http", 0)
        return child.ready.addresses[0] if child and child.ready else None

    @property
    def curve_public_key(self) -> str | None:
        """The CURVE server public key clients need (Client(..., server_public_key=)), or None
        when the cluster runs without CURVE."""
        return self.config.curve_public_key or None

    @property
    def pids(self) -> dict[str, int]:
        return {c.name: c.popen.pid for c in self.children}

    def describe(self) -> str:
        http = f"HTTP {self.http_url}; " if self.http_url else ""
        return (
            f"client address {self.client_addr}; {http}"
            f"{self.config.tokenizer_workers} tokenizer worker(s); model "
            f"{self.config.model_name or self.config.model_path} (max_model_len "
            f"{self.config.engine.max_model_len}); pids {self.pids}"
        )

    # --- shutdown -----------------------------------------------------------------------------
    def _stop_children(self) -> None:
        with self._lock:
            stopping_elsewhere = self._stopping
            self._stopping = True  # no restart starts a child after this
            children = list(self.children)
        if stopping_elsewhere:
            # Another thread (the watcher, on a failure) is stopping them: shutdown() must not
            # close the sockets and remove the run directory under children still running.
            self._stopped.wait()
            return
        try:
            stop_in_order(children)
        finally:
            self._stopped.set()

    def shutdown(self) -> None:
        """Stops every child in order, reaps them, removes the run directory. Idempotent."""
        self._stop_children()
        self._stop_watch.set()
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join(timeout=5)
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.inbox.close()
        self.notices.socket.close(linger=0)
        self.ctx.term()
        self._remove_run_dir()

    def _remove_run_dir(self) -> None:
        run_dir = Path(self.config.run_dir)
        if self.owns_run_dir:
            shutil.rmtree(run_dir, ignore_errors=True)
            return
        for path in run_dir.glob("*.sock"):
            path.unlink(missing_ok=True)
        self.config.config_path.unlink(missing_ok=True)

    def wait(self, timeout_s: float | None = None) -> bool:
        """Blocks until a child fails (True) or the timeout passes (False)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while self.failure is None and (deadline is None or time.monotonic() < deadline):
            time.sleep(0.1)
        return self.failure is not None

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


@contextlib.contextmanager
def launch_cluster(
    model: str | os.PathLike | None = None,
    *,
    run_dir: str | None = None,
    start_timeout_s: float = 180.0,
    **overrides: object,
) -> Iterator[Cluster]:
    config, owns = make_config(model, run_dir, **overrides)
    try:
        cluster = Cluster.start(config, owns_run_dir=owns, start_timeout_s=start_timeout_s)
    except BaseException:
        if owns:
            shutil.rmtree(config.run_dir, ignore_errors=True)
        raise
    with cluster:
        yield cluster
