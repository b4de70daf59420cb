"""Process faults on a real cluster: every accepted request ends with exactly one terminal event,
the supervisor restarts the dead worker, and a fresh request succeeds afterwards.

The stand-in engine (tests/procs/fake_engine.py, 20 ms a step) keeps
requests in flight long enough to kill a process under them; tokenizers and the detokenizer are
the real ones. The client-disconnect test runs the real engine on the tiny model, to see its KV
blocks come back. Each fault test prints one row of the issue's table (-s shows them).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from ipc.client import Client
from procs.launch_cluster import launch_cluster

SLOW_FAKE_ENGINE = "tests.procs.fake_engine:make_slow"  # 20 ms a step
REPO = Path(__file__).resolve().parents[1]
N = 12


def poll(predicate, timeout_s: float = 20.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.02)
    raise AssertionError(f"{what} not reached within {timeout_s} s")


@pytest.fixture(scope="module")
def cluster():
    # 240 tokens: ~5 s in flight
    with launch_cluster(
        None,
        tokenizer_workers=2,
        heartbeat_interval_s=0.1,
        max_restarts=3,
        engine_factory=SLOW_FAKE_ENGINE,
    ) as c:
        yield c


def pid_of(cluster, role: str, index: int = 0) -> int:
    return cluster.child(role, index).popen.pid


def restarted(cluster, role: str, index: int, old_pid: int) -> bool:
    child = cluster.child(role, index)
    return (
        child is not None
        and child.popen.pid != old_pid
        and child.ready is not None
        and child.popen.poll() is None
    )


def terminal_counts(handles) -> list[int]:
    return [sum(d.finished for d in h._deltas) for h in handles]


def account(fault: str, handles, timeout_s: float = 20.0) -> list:
    """Waits for every handle's terminal event (the deadline is the test's, not the client's),
    checks there is exactly one each, prints the table row, returns the results."""
    results = [h.result(timeout=timeout_s, check=False) for h in handles]
    counts = terminal_counts(handles)
    ended = sum(c == 1 for c in counts)
    lost = sum(c == 0 for c in counts)
    print(f"\nFAULT | {fault} | requests {len(handles)} | ended correctly {ended} | lost {lost}")
    assert counts == [1] * len(handles), counts
    for r in results:  # finished normally, or a clear error; never a client-side timeout
        assert r.finish_reason in ("length", "stop", "abort") or (
            r.error_code == "unavailable" and r.error.startswith("unavailable: ")
        ), r
    return results


def assert_serves(client) -> None:
    result = client.submit("after the fault", max_tokens=3).result(timeout=30)
    assert result.finish_reason == "length" and result.text.startswith("after")


def kill_tokenizer_with_half_queued(cluster, client, index: int, fault: str):
    """Stops worker ``index`` (it reads nothing more, so its share stays queued in it), submits
    N requests, kills it; returns the handles, those it held, and the results."""
    victim = pid_of(cluster, "tokenizer", index)
    os.kill(victim, signal.SIGSTOP)
    try:
        handles = [client.submit(f"queued {i}", max_tokens=60) for i in range(N)]
        held = [h for h in handles if h.tokenizer_index == index]
        assert len(held) == N // 2
        other = next(h for h in handles if h not in held)
        next(other.stream(timeout=30))  # the other worker's share is generating
    finally:
        os.kill(victim, signal.SIGKILL)
    results = account(fault, handles)
    poll(lambda: restarted(cluster, "tokenizer", index, victim), what="tokenizer restart")
    poll(lambda: index not in client._core.down, what="the client hearing it is back")
    return handles, held, results


def test_tokenizer_killed_with_requests_queued_in_it(cluster):
    """The requests still queued in the dead worker are sent again to the live one (under fresh
    wire ids) and finish there, with their latency counted from the first submit."""
    with Client(cluster.client_addr, deadline_s=60) as client:
        handles, held, results = kill_tokenizer_with_half_queued(
            cluster, client, 1, "tokenizer[1] SIGKILL, half the requests queued in it"
        )
        assert [r.finish_reason for r in results] == ["length"] * N
        for h, r in zip(handles, results):
            assert h.resubmits == (1 if h in held else 0)
            assert r.request_id == h.request_id and r.t_submit == h.t_submit
        assert all(h.tokenizer_index == 0 for h in held)
        # Both workers serve again: round-robin puts the next two on different workers.
        fresh = [client.submit("after the fault", max_tokens=3) for _ in range(2)]
        assert {h.tokenizer_index for h in fresh} == {0, 1}
        assert all(h.result(timeout=30).text.startswith("after") for h in fresh)
    assert cluster.restarts["tokenizer[1]"] == 1


def test_tokenizer_killed_without_retries_ends_its_requests_with_an_error(cluster):
    before = cluster.restarts.get("tokenizer[0]", 0)
    with Client(cluster.client_addr, deadline_s=60, tokenizer_retries=0) as client:
        handles, held, results = kill_tokenizer_with_half_queued(
            cluster, client, 0, "tokenizer[0] SIGKILL, no retries"
        )
        for h, r in zip(handles, results):
            if h in held:
                assert r.error_code == "unavailable" and "tokenizer worker 0 died" in r.error
            else:
                assert r.finish_reason == "length"
        assert_serves(client)
    assert cluster.restarts["tokenizer[0]"] == before + 1


def test_async_client_sends_a_dead_tokenizers_requests_again(cluster):
    """The asyncio client (the HTTP frontend's) takes the same path on its event loop."""
    from ipc.client import AsyncClient

    async def run():
        async with AsyncClient(cluster.client_addr, deadline_s=60) as client:
            victim = pid_of(cluster, "tokenizer", 1)
            os.kill(victim, signal.SIGSTOP)
            try:
                handles = [client.submit(f"async {i}", max_tokens=20) for i in range(N)]
                held = [h for h in handles if h.tokenizer_index == 1]
                await asyncio.sleep(0.2)
            finally:
                os.kill(victim, signal.SIGKILL)
            results = [await h.result(timeout=30, check=False) for h in handles]
            counts = terminal_counts(handles)
            print(
                f"\nFAULT | tokenizer[1] SIGKILL, asyncio client | requests {N} | ended "
                f"correctly {counts.count(1)} | lost {counts.count(0)}"
            )
            assert counts == [1] * N
            assert [r.finish_reason for r in results] == ["length"] * N
            assert len(held) == N // 2 and all(h.resubmits == 1 for h in held)
            poll(lambda: restarted(cluster, "tokenizer", 1, victim), what="tokenizer restart")

    asyncio.run(run())


def test_tokenizer_queries_in_a_killed_tokenizer_get_exactly_one_answer(cluster):
    """tokenize / detokenize queued in a worker that dies: sent again to the live one (one
    answer each, the right one), or without retries a clear 'unavailable' error for those it
    held; none is lost, none answered twice. (One kill per worker: the module's cluster allows
    each worker a few restarts.)"""
    from ipc.client import AsyncClient, UnavailableError

    async def run(retries: int, index: int) -> tuple[list, list]:
        async with AsyncClient(
            cluster.client_addr, deadline_s=60, tokenizer_retries=retries
        ) as client:
            victim = pid_of(cluster, "tokenizer", index)
            os.kill(victim, signal.SIGSTOP)
            try:
                queries = [client.tokenize(f"word{i}") for i in range(N // 2)]
                queries += [client.detokenize([100 + i]) for i in range(N // 2)]
                await asyncio.sleep(0.2)
            finally:
                os.kill(victim, signal.SIGKILL)
            answers = await asyncio.gather(*queries, return_exceptions=True)
            assert client._core.records == {}  # every query ended
            expected = [(await client.tokenize(f"word{i}")).token_ids for i in range(N // 2)]
            expected += [await client.detokenize([100 + i]) for i in range(N // 2)]
            poll(lambda: restarted(cluster, "tokenizer", index, victim), what="tokenizer restart")
        return [getattr(a, "token_ids", a) for a in answers], expected

    answers, expected = asyncio.run(run(1, 0))
    assert answers == expected
    answers, expected = asyncio.run(run(0, 1))
    errors = [a for a in answers if isinstance(a, Exception)]
    assert len(errors) == N // 2  # round-robin: half were in the dead worker
    assert all(
        isinstance(a, UnavailableError) and "tokenizer worker 1 died" in str(a) for a in errors
    )
    assert [(a, e) for a, e in zip(answers, expected) if a not in errors] == [
        (e, e) for a, e in zip(answers, expected) if a not in errors
    ]


def test_engine_killed_with_requests_in_flight(cluster):
    with Client(cluster.client_addr, deadline_s=60) as client:
        handles = [client.submit(f"in flight {i}", max_tokens=240) for i in range(N)]
        for h in handles:
            next(h.stream(timeout=30))  # every one is generating
        victim = pid_of(cluster, "engine")
        os.kill(victim, signal.SIGKILL)
        results = account("engine SIGKILL, all requests generating", handles)
        assert all("the engine died" in r.error for r in results)
        poll(lambda: restarted(cluster, "engine", 0, victim), what="engine restart")
        assert_serves(client)


def test_engine_killed_with_requests_still_in_a_tokenizer(cluster):
    """Requests that had not reached the engine yet end too (the client ends all it has open)."""
    with Client(cluster.client_addr, deadline_s=60) as client:
        tok = pid_of(cluster, "tokenizer", 0)
        os.kill(tok, signal.SIGSTOP)
        try:
            handles = [client.submit(f"mixed {i}", max_tokens=240) for i in range(N)]
            generating = [h for h in handles if h.tokenizer_index == 1]
            next(generating[0].stream(timeout=30))
            victim = pid_of(cluster, "engine")
            os.kill(victim, signal.SIGKILL)
            account("engine SIGKILL, half generating, half stuck in a tokenizer", handles)
        finally:
            os.kill(tok, signal.SIGCONT)
        poll(lambda: restarted(cluster, "engine", 0, victim), what="engine restart")
        assert_serves(client)
        # The stuck half reached the new engine after the fact; the client's aborts free them.
        poll(lambda: cluster.worker_stats("engine").get("live", 1) == 0, what="engine empty")


def test_detokenizer_killed_with_requests_in_flight(cluster):
    with Client(cluster.client_addr, deadline_s=60) as client:
        handles = [client.submit(f"streaming {i}", max_tokens=240) for i in range(N)]
        for h in handles:
            next(h.stream(timeout=30))
        victim = pid_of(cluster, "detokenizer")
        os.kill(victim, signal.SIGKILL)
        results = account("detokenizer SIGKILL, all requests streaming", handles)
        assert all("detokenizer" in r.error for r in results)
        poll(lambda: restarted(cluster, "detokenizer", 0, victim), what="detokenizer restart")
        poll(lambda: not client._core.reconnecting, what="the client's new handshake")
        assert_serves(client)
        # The requests the dead detokenizer streamed were aborted in the engine by the client.
        poll(lambda: cluster.worker_stats("engine").get("live", 1) == 0, what="engine empty")
        with Client(cluster.client_addr) as newcomer:  # new clients get in as well
            assert_serves(newcomer)


def test_restart_hygiene_no_zombies_no_run_dir(cluster):
    """After the restarts above, a shutdown still stops every child (the replacements too) and
    removes the run directory."""
    pids = list(cluster.pids.values())
    assert len(pids) == 4 and sum(cluster.restarts.values()) >= 4
    run_dir = Path(cluster.config.run_dir)
    cluster.shutdown()
    for pid in pids:
        with pytest.raises(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)  # reaped already: not a zombie of ours
    assert not run_dir.exists()


def test_shutdown_policy_stops_the_cluster_and_ends_requests():
    with launch_cluster(
        None, restart_policy="shutdown", engine_factory=SLOW_FAKE_ENGINE
    ) as cluster:
        with Client(cluster.client_addr, deadline_s=60) as client:
            handles = [client.submit(f"doomed {i}", max_tokens=240) for i in range(4)]
            next(handles[0].stream(timeout=30))
            os.kill(pid_of(cluster, "engine"), signal.SIGKILL)
            assert cluster.wait(timeout_s=20)
            account("engine SIGKILL, restart_policy=shutdown", handles)
        assert "engine[0]" in cluster.failure
        poll(
            lambda: all(c.popen.poll() is not None for c in cluster.children),
            what="every child stopped",
        )


CLIENT_SCRIPT = textwrap.dedent("""
    import sys
    from ipc.client import Client
    client = Client(sys.argv[1])
    handles = [client.submit("a client that vanishes " * 4, max_tokens=1900, ignore_eos=True,
                             temperature=0) for _ in range(4)]
    for h in handles:
        next(h.stream(timeout=60))
    print("streaming", flush=True)
    sys.stdin.read()  # until killed
""")


def test_client_killed_mid_stream_frees_its_requests_and_kv(tiny_model_dir):
    """A client process killed with SIGKILL never says goodbye: the detokenizer notices when its
    next event cannot be delivered, and aborts its requests in the engine; their KV comes back."""
    with launch_cluster(
        tiny_model_dir, enable_prefix_cache=False, heartbeat_interval_s=0.1
    ) as cluster:
        proc = subprocess.Popen(
            [sys.executable, "-c", CLIENT_SCRIPT, cluster.client_addr],
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        try:
            assert proc.stdout.readline().strip() == "streaming"
            poll(
                lambda: cluster.worker_stats("engine").get("kv_blocks_used", 0) > 0,
                what="KV in use",
            )
            proc.kill()
            proc.wait()
        finally:
            if proc.poll() is None:
                proc.kill()
        stats = poll(
            lambda: (
                (s := cluster.worker_stats("engine")).get("live", 1) == 0
                and s.get("running", 1) == 0
                and s.get("kv_blocks_used", 1) == 0
                and s
            ),
            what="the engine freeing the vanished client's requests",
        )
        assert stats["kv_blocks_available"] == stats["kv_blocks_total"]
        print(
            "\nFAULT | client SIGKILL mid-stream (tiny model) | requests 4 | aborted in the "
            "engine, KV freed 4 | lost 0"
        )
        # Its heartbeat may predate the client's loss by one interval: poll, then require it.
        poll(
            lambda: cluster.worker_stats("detokenizer").get("open_requests") == 0,
            what="the detokenizer holding none of the vanished client's requests",
        )
        with Client(cluster.client_addr) as client:
            assert client.submit("still serving", max_tokens=2).result(timeout=30).ok
