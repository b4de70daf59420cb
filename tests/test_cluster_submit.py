"""submit() hands the request to ZeroMQ and returns: it never waits for a tokenizer. With every
tokenize batch slowed on purpose, every submit call returns before the first tokenization ends,
and full queues are an explicit OverloadedError, never a silent drop."""

from __future__ import annotations

import time

import pytest

from ipc.client import Client, OverloadedError
from procs.launch_cluster import launch_cluster
from tests.procs.slow_preparer import DELAY_S

FAKE_ENGINE = "tests.procs.fake_engine:make"  # a stand-in engine: no model, echoes
SLOW_PREPARER = "tests.procs.slow_preparer:make"  # DELAY_S per tokenize batch


@pytest.fixture(scope="module")
def slow_cluster():
    with launch_cluster(
        None,
        tokenizer_workers=1,
        tokenizer_queue_max=4,
        engine_factory=FAKE_ENGINE,
        preparer_factory=SLOW_PREPARER,
    ) as c:
        yield c


def test_submit_returns_before_tokenization(slow_cluster):
    with Client(slow_cluster.client_addr) as client:
        prompts = ["short", "a much longer prompt " * 50]
        handles = [client.submit(prompts[i % 2], max_tokens=1) for i in range(16)]
        t_all_submitted = time.monotonic()
        results = [h.result(timeout=60) for h in handles]
        for r in results:
            assert r.finish_reason == "length"
            # the tokenizer really was slow: the wait is on the server side, after submit
            assert r.timings.t_tokenized - r.t_submit >= DELAY_S * 0.9
        # Causality rather than a stopwatch: all 16 submit() calls had returned before the
        # tokenizer finished encoding even the first of them (each batch takes >= DELAY_S).
        assert t_all_submitted < min(r.timings.t_tokenized for r in results)


def test_full_queues_raise_overloaded_and_accepted_requests_still_finish(slow_cluster):
    # Big frames fill the pipes and kernel buffers quickly; each is too long for the context,
    # so the accepted ones end fast with a bad_request error once tokenized.
    with Client(slow_cluster.client_addr, submit_hwm=2) as client:
        accepted, overloaded = [], 0
        big = "x " * 200_000
        for _ in range(200):
            try:
                accepted.append(client.submit(big, max_tokens=1))
            except OverloadedError:
                overloaded += 1
        assert overloaded > 0 and accepted
        for h in accepted:
            r = h.result(timeout=120, check=False)
            assert r.finish_reason == "error" and r.error_code == "bad_request"
