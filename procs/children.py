"""The supervisor's children: one record per worker process, how one is started, and the
order in which they are stopped."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from ipc.config import ClusterConfig
from ipc.messages import Heartbeat, WorkerFailed, WorkerReady
from procs.thread_budget import child_env
from runtime.process import PARENT_PID_ENV

logger = logging.getLogger("splitserve.supervisor")
REPO_ROOT = Path(__file__).resolve().parents[1]


@dataclasses.dataclass(slots=True)
class Child:
    role: str
    index: int
    popen: subprocess.Popen
    ready: WorkerReady | None = None
    last_heartbeat: Heartbeat | None = None
    silent_warned: bool = False
    last_seen: float = 0.0  # supervisor's monotonic clock: spawn, ready or latest heartbeat
    restarted: bool = False  # a replacement whose readiness the detokenizer is still to hear of
    killed_for: str = ""  # why the supervisor killed it (hang), for the log and the notice
    failed: WorkerFailed | None = None  # its last words: why it could not start or crashed
    doing: str = ""  # before ready: the long start-up work its heartbeats name

    @property
    def name(self) -> str:
        return f"{self.role}[{self.index}]"


def spawn(role: str, index: int, config: ClusterConfig) -> Child:
    """Starts one worker process (python -m procs.run_worker ROLE INDEX CONFIG)."""
    env = child_env(role, config, dict(os.environ), index)
    env[PARENT_PID_ENV] = str(os.getpid())
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    popen = subprocess.Popen(
        [sys.executable, "-m", "procs.run_worker", role, str(index), str(config.config_path)],
        env=env,
        cwd=str(REPO_ROOT),
    )
    return Child(role, index, popen, last_seen=time.monotonic())


def stop_in_order(children: list[Child]) -> None:
    """The ordered shutdown: every request in flight still gets its terminal event."""
    tokenizers = [c for c in children if c.role == "tokenizer"]
    engines = [c for c in children if c.role == "engine"]
    detoks = [c for c in children if c.role == "detokenizer"]
    frontends = [c for c in children if c.role == "http"]
    # Frontends stop accepting connections first; their open responses get the terminal
    # events the rest of the shutdown produces, then they exit.
    _signal(frontends, signal.SIGTERM)
    _signal(tokenizers, signal.SIGUSR1)  # stop accepting; new submits get "unavailable"
    time.sleep(0.1 if tokenizers else 0)  # let a batch being encoded reach the engine
    _signal(engines, signal.SIGTERM)
    _wait(engines, 30.0)
    _signal(tokenizers, signal.SIGTERM)
    _wait(tokenizers, 10.0)
    _signal(detoks, signal.SIGTERM)
    _wait(detoks, 10.0)
    _wait(frontends, 15.0)


def _signal(children: list[Child], sig: int) -> None:
    for c in children:
        if c.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                c.popen.send_signal(sig)


def _wait(children: list[Child], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for c in children:
        try:
            c.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            logger.error("%s did not exit in %.0f s; killing it", c.name, timeout_s)
            c.popen.kill()
            c.popen.wait()
