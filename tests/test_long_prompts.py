"""Issue 38: a long prompt's encoding never holds up the other requests of its tokenizer worker,
and background work of the tokenizer workers and HTTP frontends runs at a lower OS priority than
the engine's. Real processes (a stand-in engine), the real tokenizer behind a gate the test
opens; no timed assertion."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest

from ipc.client import Client
from procs.launch_cluster import launch_cluster
from tests.procs.slow_preparer import GATE_FILE
from tests.test_cluster_faults import pid_of, poll

FAKE_ENGINE = "tests.procs.fake_engine:make"
LONG_CHARS = 1000
NICENESS = 7


@pytest.fixture(scope="module")
def cluster():
    with launch_cluster(
        None,
        tokenizer_workers=1,
        engine_factory=FAKE_ENGINE,
        preparer_factory="tests.procs.slow_preparer:make_gated",
        tokenizer_long_prompt_chars=LONG_CHARS,
        background_niceness=NICENESS,
        http_port=0,
    ) as c:
        yield c


def niceness(pid: int) -> dict[int, int]:
    """Thread id -> its nice value, for every thread of ``pid``."""
    return {
        int(tid): os.getpriority(os.PRIO_PROCESS, int(tid))
        for tid in os.listdir(f"/proc/{pid}/task")
    }


def test_a_short_request_is_answered_while_a_long_prompt_is_being_tokenized(cluster):
    gate = Path(cluster.config.run_dir) / GATE_FILE
    with Client(cluster.client_addr) as client:
        # 2,400 characters in a few dozen tokens (runs of "#"): it fits the stand-in's 256-token
        # context, and the gate keeps it in tokenization until the test opens it.
        long = client.submit("#" * 80 * 30, max_tokens=1)
        short = client.submit("Hello", max_tokens=1).result(timeout=30)
        assert short.finish_reason == "length"
        assert not long.done  # still being tokenized
        gate.touch()
        result = long.result(timeout=30)
    assert result.finish_reason == "length" and 0 < result.usage.prompt_tokens < 256
    poll(
        lambda: cluster.worker_stats("tokenizer", 0).get("long_prompts", 0) >= 1,
        what="the worker's heartbeat counting the long prompt",
    )


def test_background_threads_run_nicer_and_the_engine_does_not(cluster):
    tokenizer, http, engine = (pid_of(cluster, role) for role in ("tokenizer", "http", "engine"))
    with Client(cluster.client_addr) as client:
        schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
        client.submit(
            "Hi",
            max_tokens=1,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
        ).result(timeout=60)
    big = {
        "model": cluster.config.model_name,
        "prompt": "Hello",
        "max_tokens": 1,
        "user": "u" * 100_000,
    }  # over 64 KiB: parsed on the frontend's body thread
    reply = httpx.post(f"{cluster.http_url}/v1/completions", json=big, timeout=60)
    assert reply.status_code == 200, reply.text
    # The tokenizer worker: its loop as nice as the cluster (this process's value, which it
    # inherited); the long-prompt lane and the grammar check NICENESS nicer.
    base = os.getpriority(os.PRIO_PROCESS, 0)
    nicer = min(19, base + NICENESS)
    threads = niceness(tokenizer)
    assert threads[tokenizer] == base
    assert sum(n == nicer for n in threads.values()) >= 2, threads
    assert set(threads.values()) <= {base, nicer}
    frontend = poll(
        lambda: next((t for t in [niceness(http)] if nicer in t.values()), None),
        what="the HTTP frontend's body thread",
    )
    assert frontend[http] == base
    assert set(niceness(engine).values()) == {base}
