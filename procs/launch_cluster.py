"""The supervisor: starts every process of a cluster, watches them, stops them in order.

Library use (tests, benchmarks):

    with launch_cluster(model="default", tokenizer_workers=2) as cluster:
        client = Client(cluster.client_addr)

Start-up: the engines first (each replica resolves the model's context length and vocabulary,
which the tokenizers check against and the detokenizer hands to clients; the replicas must agree
on the model and vocabulary, and the cluster offers the shortest context any of them resolved),
then the detokenizer and the tokenizers; each reports WorkerReady. Shutdown is ordered so every
request in flight gets its terminal event: tokenizers stop accepting (they answer
"unavailable"), the engines abort what they run, tokenizers exit, and the detokenizer, last,
forwards everything and ends what is left.
While it runs, a ``Watcher`` (supervision.py) applies the restart policy to children that die or
hang; ``Cluster.failure`` says why a cluster stopped on its own.
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

from ipc.config import ClusterConfig
from ipc.messages import ClusterNotice, WorkerReady
from ipc.sockets import PushQueue
from procs.children import Child, stop_in_order
from procs.cluster_setup import make_config
from procs.supervision import ClusterStartError, Roster, SupervisionPolicy, Watcher
from procs.thread_budget import describe_budget

logger = logging.getLogger("splitserve.supervisor")

CURVE_PUBLIC_KEY_FILE = "curve_public.key"
__all__ = ["CURVE_PUBLIC_KEY_FILE", "Child", "Cluster", "ClusterStartError", "launch_cluster"]


def with_engine_limits(config: ClusterConfig, readies: list[WorkerReady]) -> ClusterConfig:
    """The config the processes started after the engines get: the replicas' model name and
    vocabulary size (ClusterStartError unless they agree) and the shortest context any of them
    resolved (each caps it to its own KV cache)."""
    first = readies[0]
    for ready in readies[1:]:
        if (ready.model_name, ready.vocab_size) != (first.model_name, first.vocab_size):
            raise ClusterStartError(
                f"engine replicas disagree: engine[{first.index}] serves {first.model_name!r} "
                f"with {first.vocab_size} tokens, engine[{ready.index}] {ready.model_name!r} "
                f"with {ready.vocab_size}"
            )
    return dataclasses.replace(
        config.with_engine(max_model_len=min(r.max_model_len for r in readies)),
        vocab_size=first.vocab_size,
        model_name=first.model_name,
        engines_ready=True,
    )


class Cluster:
    def __init__(self, config: ClusterConfig, *, owns_run_dir: bool) -> None:
        self.config = config
        self.owns_run_dir = owns_run_dir
        self.ctx = zmq.Context()
        self.roster = Roster(self.ctx, config)
        # ClusterNotices go to the detokenizer's inbox (it forwards them to clients); with
        # several engines, those about engines go to the tokenizer workers too (routing).
        self.notices = PushQueue(self.ctx, config.detokenizer_addr, hwm=1000, curve=config.curve)
        self.router_notices = [
            PushQueue(self.ctx, address, hwm=1000, curve=config.curve)
            for address in (config.tokenizer_addrs if config.routes else [])
        ]
        # Disaggregated: prefill engines hear of decode engines' deaths (their KV in flight).
        self.router_notices += [
            PushQueue(self.ctx, config.engine_addr(p), hwm=1000, curve=config.curve)
            for p in (config.prefill_indices if config.disaggregated else [])
        ]
        self.policy = SupervisionPolicy(config)
        self.watcher = Watcher(
            self.roster, self.policy, self._notify, self._respawn, self._stop_children
        )
        self._lock = threading.Lock()
        self._stopping = False
        self._stopped = threading.Event()  # the children are stopped (whoever stopped them)
        self._closed = False

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
        cluster.watcher.start()
        return cluster

    def _start_all(self, timeout_s: float) -> None:
        """Children are started from this thread (restarts from the watcher's): see Watcher."""
        print(
            f"splitserve supervisor pid={os.getpid()}: {describe_budget(self.config)}",
            file=sys.stderr,
            flush=True,
        )
        engines = [self._spawn("engine", r) for r in range(self.config.engines)]
        # The other processes start beside the engines: their interpreters and imports (~0.5 s
        # each) overlap the engines' start, then each waits for the config the engines' limits
        # complete (run_worker.await_engines), and its start-up time counts from that write.
        rest = [self._spawn("detokenizer", 0)]
        rest += [self._spawn("tokenizer", i) for i in range(self.config.tokenizer_workers)]
        frontends = []
        if self.config.http_port is not None:
            frontends = [self._spawn("http", i) for i in range(self.config.http_workers)]
        self.config = with_engine_limits(self.config, self.roster.wait_ready(engines, timeout_s))
        self.config.write()
        written = time.monotonic()
        for child in rest + frontends:
            child.last_seen = written
        self.roster.wait_ready(rest, timeout_s)
        # Last: a frontend's readiness is a handshake with the detokenizer.
        self.roster.wait_ready(frontends, timeout_s)
        logger.info("cluster ready: %s", self.describe())

    def _spawn(self, role: str, index: int) -> Child:
        return self.roster.spawn(role, index, self.config)

    def _respawn(self, dead: Child) -> Child | None:
        """The watcher's restart: a replacement under the same role and index (None once the
        cluster is stopping, so no child starts after the stop began)."""
        with self._lock:
            if self._stopping:
                return None
            self.roster.children.remove(dead)
            new = self._spawn(dead.role, dead.index)
            new.restarted = True
            return new

    def _notify(self, notice: ClusterNotice) -> None:
        try:
            self.notices.put(notice, block=False)
        except zmq.Again:
            logger.error("the detokenizer is not reading; dropped notice %s", notice)
        if notice.role != "engine":
            return
        for index, queue in enumerate(self.router_notices):
            try:
                queue.put(notice, block=False)
            except zmq.Again:
                logger.error("tokenizer[%d] is not reading; dropped notice %s", index, notice)

    # --- what the cluster is ------------------------------------------------------------------
    @property
    def children(self) -> list[Child]:
        return self.roster.children

    @property
    def restarts(self) -> dict[str, int]:
        """Child name -> restarts so far."""
        return self.policy.restarts

    @property
    def failure(self) -> str | None:
        """Why the cluster stopped on its own (a child out of restarts, ...), else None."""
        return self.watcher.failure

    def child(self, role: str, index: int = 0) -> Child | None:
        return self.roster.find(role, index)

    def worker_stats(self, role: str, index: int = 0) -> dict[str, float]:
        """The latest heartbeat stats of one worker ({} before its first heartbeat)."""
        child = self.child(role, index)
        hb = child.last_heartbeat if child else None
        return dict(hb.stats) if hb else {}

    @property
    def client_addr(self) -> str:
        return self.config.client_addr

    @property
    def http_url(self) -> str | None:
        """The first HTTP frontend's base URL (all of them share it), None without one."""
        child = self.child("http", 0)
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
        engines = (
            f"{self.config.engines} engine replicas routed {self.config.routing_policy}; "
            if self.config.routes
            else ""
        )
        if self.config.disaggregated:
            engines = (
                f"{self.config.prefill_engines} prefill + {self.config.decode_engines} decode "
                f"engines (prefill routed {self.config.routing_policy}); "
            )
        return (
            f"client address {self.client_addr}; {http}{engines}"
            f"{self.config.tokenizer_workers} tokenizer worker(s); model "
            f"{self.config.model_name or self.config.model_path} (max_model_len "
            f"{self.config.engine.max_model_len}); pids {self.pids}"
        )

    # --- shutdown -----------------------------------------------------------------------------
    def _stop_children(self) -> None:
        with self._lock:
            stopping_elsewhere = self._stopping
            self._stopping = True  # no restart starts a child after this
            self.watcher.stopping = True
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
        self.watcher.join(timeout_s=5)
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.roster.close()
        for queue in (self.notices, *self.router_notices):
            queue.socket.close(linger=0)
        self.ctx.term()
        self._remove_run_dir()

    def _remove_run_dir(self) -> None:
        run_dir = Path(self.config.run_dir)
        prefix = Path(self.config.kv_segment_prefix)  # KV transfer segments a killed engine left
        for segment in prefix.parent.glob(prefix.name + "*"):
            segment.unlink(missing_ok=True)
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
