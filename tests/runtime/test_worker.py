"""A role's entry point (runtime.worker.run_on_context) when its loop dies."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

CRASHING_WORKER = textwrap.dedent(
    """
    import zmq
    from runtime.worker import run_on_context

    class Crashing:
        def __init__(self, ctx):
            self.inbox = ctx.socket(zmq.PULL)  # open, as a worker's sockets are mid-loop
            self.inbox.bind("tcp://127.0.0.1:*")
            self.out = ctx.socket(zmq.PUSH)
            self.out.connect("tcp://127.0.0.1:9")  # nobody there: a message stays queued
            self.out.send(b"unsent", zmq.NOBLOCK)

        def run(self):
            raise RuntimeError("the loop died")

    run_on_context(Crashing)
    """
)


def test_a_worker_whose_loop_raises_exits_with_the_error():
    """The loop raised with its sockets open: ctx.term() waited for them forever, so the
    process lived on without heartbeats and the supervisor never restarted it (a tokenizer
    worker hung so, every request sent to it lost). It must exit, the error said."""
    done = subprocess.run(
        [sys.executable, "-c", CRASHING_WORKER],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode != 0
    assert "RuntimeError: the loop died" in done.stderr
