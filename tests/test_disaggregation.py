"""Prefill/decode disaggregation on the tiny model (issue 40): one prefill and one decode engine,
real processes, real sockets, real shared memory. A request's prompt is computed on the prefill
engine, its KV blocks move to the decode engine, and its tokens are the colocated engine's
(greedy, and seeded with penalties: the sampler's state moves too). Killed and hung engines end
each request once, and no KV block or transfer buffer stays held at idle. No timed assertion."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from ipc.client import Client
from ipc.config import ClusterConfig
from ipc.replica_router import choose_decode, skip_prefill
from procs.cluster_setup import make_config
from procs.launch_cluster import launch_cluster
from procs.thread_budget import engine_cores
from tests.test_cluster_faults import account, pid_of, poll, restarted, terminal_counts
from tests.test_http_tiny import metrics

KNOBS = dict(
    max_model_len=1024,
    kv_cache_tokens=8192,
    prefill_chunk_tokens=64,  # long prompts take several chunks
    dtype="float32",  # both clusters alike: the tiny random model has near-ties
    heartbeat_interval_s=0.1,
    tokenizer_workers=2,
)
PD = dict(
    prefill_engines=1, decode_engines=1, max_restarts=3, pin_engine_cores=True, engine_threads=2
)
PREFILL, DECODE = 0, 1


def ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 40_000) for _ in range(n)]


PROMPTS = [ids(s, n) for s, n in ((1, 5), (2, 16), (3, 47), (4, 130), (5, 600), (6, 33))]
SAMPLED = dict(temperature=0.9, top_k=40, repetition_penalty=1.3, frequency_penalty=0.4)


@pytest.fixture(scope="module")
def cluster(tiny_model_dir):
    with launch_cluster(str(tiny_model_dir), **PD, **KNOBS, http_port=0) as c:
        yield c


def generate(client: Client) -> list[tuple[list[int], list[int]]]:
    """Each prompt greedy, then seeded with penalties: (tokens, engine indices)."""
    handles = [
        client.submit(prompt_token_ids=p, max_tokens=24, temperature=0, ignore_eos=True)
        for p in PROMPTS
    ]
    handles += [
        client.submit(prompt_token_ids=p, max_tokens=24, ignore_eos=True, seed=i, **SAMPLED)
        for i, p in enumerate(PROMPTS)
    ]
    return [h.result(timeout=60).raise_for_error() for h in handles]


def idle_and_clean(cluster) -> None:
    """Every engine back to no KV block held, the prefill engine's buffer empty."""

    def clean() -> bool:
        prefill, decode = (
            cluster.worker_stats("engine", PREFILL),
            cluster.worker_stats("engine", DECODE),
        )
        return (
            prefill.get("kv_blocks_used") == 0
            and prefill.get("kv_transfer_blocks_held") == 0
            and prefill.get("kv_transfers_in_flight") == 0
            and prefill.get("kv_handoffs_queued") == 0
            and decode.get("kv_blocks_used") == 0
            and decode.get("kv_imports_waiting") == 0
        )

    poll(clean, timeout_s=30, what="no KV block held on either engine")


def test_tokens_equal_the_colocated_engines_and_the_kv_moves(cluster, tiny_model_dir):
    with Client(cluster.client_addr) as client:
        split = generate(client)
    with launch_cluster(str(tiny_model_dir), **KNOBS) as colocated:
        with Client(colocated.client_addr) as client:
            together = generate(client)
    assert [r.token_ids for r in split] == [r.token_ids for r in together]
    for result in split:
        assert result.engine_index == DECODE  # its last tokens came from the decode engine
        assert result.timings.kv_transfer_s > 0 and result.timings.kv_transfer_bytes > 0
        assert result.timings.t_scheduled > 0  # the prefill engine's start reached the client
        assert len(result.t_received) >= 2
    assert all(r.timings.kv_transfer_s == 0 for r in together)
    prefill = cluster.worker_stats("engine", PREFILL)
    assert prefill["kv_transfers"] >= len(split) and prefill["kv_transfers_aborted"] == 0
    idle_and_clean(cluster)


def test_metrics_label_the_roles_and_count_the_transfers(cluster):
    body = {"model": cluster.config.model_name, "prompt": "Hello there", "max_tokens": 6}
    answer = httpx.post(f"{cluster.http_url}/v1/completions", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    series = metrics(cluster.http_url)
    name = cluster.config.model_name
    for engine, role in ((PREFILL, "prefill"), (DECODE, "decode")):
        labels = (("engine", str(engine)), ("model_name", name), ("role", role))
        assert ("vllm:num_requests_running", labels) in series
    assert series[("splitserve_kv_transfer_seconds_count", ())] >= 1
    assert series[("splitserve_kv_transfer_bytes_sum", ())] > 0


def test_a_request_that_ends_at_its_first_token_never_moves(cluster):
    with Client(cluster.client_addr) as client:
        # a prompt of its own: the decode engine caches PROMPTS[2] (it would skip the prefill)
        result = client.submit(prompt_token_ids=ids(41, 47), max_tokens=1).result(timeout=30)
    # Ended by the prefill engine, nothing moved (the engines' transfer counts travel in
    # heartbeats, a beat late: an earlier test's transfers could still be arriving there)
    assert result.finish_reason == "length" and len(result.token_ids) == 1
    assert result.engine_index == PREFILL and result.timings.kv_transfer_s == 0
    idle_and_clean(cluster)


def test_each_engine_runs_pinned_to_its_own_core(cluster):
    cpus = sorted(os.sched_getaffinity(0))
    pinned = [os.sched_getaffinity(pid_of(cluster, "engine", e)) for e in (PREFILL, DECODE)]
    assert pinned == [set(engine_cores(cluster.config, e) or ()) for e in (PREFILL, DECODE)]
    assert pinned == [{cpus[0]}, {cpus[1 % len(cpus)]}]  # one thread each, distinct where 2+
    for e in (PREFILL, DECODE):  # and torch runs one thread there
        environ = Path(f"/proc/{pid_of(cluster, 'engine', e)}/environ").read_bytes()
        assert b"OMP_NUM_THREADS=1\0" in environ


def test_a_prompt_the_decode_engine_caches_skips_the_prefill_engine(cluster):
    """Issue 40 part 2: the decode engine caches the prompt's blocks it imported (and the ones
    it decoded); the same prompt again goes straight to it (its 12-token tail computed there),
    with no prefill engine and no transfer, and gives the same tokens, one terminal event."""
    prompt = ids(40, 300)  # 18 full blocks of 16 and 12 tokens
    with Client(cluster.client_addr) as client:

        def ask():
            handle = client.submit(
                prompt_token_ids=prompt, max_tokens=12, temperature=0, ignore_eos=True
            )
            result = handle.result(timeout=60)
            assert terminal_counts([handle]) == [1] and result.finish_reason == "length"
            return result

        first = ask()
        assert first.timings.kv_transfer_s > 0  # through the prefill engine
        before = client.engine_stats().routing_decisions.get("skip_prefill", 0)

        def straight():  # the workers learn the decode engine's blocks from its events
            again = ask()
            assert again.token_ids == first.token_ids and again.engine_index == DECODE
            return again if again.timings.kv_transfer_s == 0 else None

        again = poll(straight, what="a repeat routed straight to the decode engine")
        assert again.timings.kv_transfer_bytes == 0
        assert client.engine_stats().routing_decisions["skip_prefill"] == before + 1
    series = metrics(cluster.http_url)
    labels = (("outcome", "skip_prefill"), ("policy", "cache_aware"))
    assert series[("splitserve_routing_decisions_total", labels)] >= 1
    idle_and_clean(cluster)


def test_a_grammar_is_refused_with_a_clear_error(cluster):
    with Client(cluster.client_addr) as client:
        result = client.submit(
            "Say hi", max_tokens=8, response_format={"type": "json_object"}
        ).result(timeout=60, check=False)
        assert result.error_code == "bad_request"
        assert "--prefill-engines" in result.error and "colocated" in result.error
        assert client.submit("after", max_tokens=3).result(timeout=30).finish_reason == "length"


def test_an_abort_reaches_the_request_wherever_it_runs(cluster):
    with Client(cluster.client_addr) as client:
        # prompts the decode engine does not cache yet: they move (a cached one skips over)
        handle = client.submit(prompt_token_ids=ids(42, 130), max_tokens=800, ignore_eos=True)
        poll(
            lambda: cluster.worker_stats("engine", DECODE).get("running", 0) > 0,
            what="the request decoding",
        )
        handle.abort()
        (result,) = account("abort while decoding", [handle])
    assert result.finish_reason == "abort" and len(result.token_ids) < 800
    idle_and_clean(cluster)


def test_decode_engine_killed_ends_its_requests_once_and_frees_the_buffer(cluster):
    with Client(cluster.client_addr) as client:
        handles = [
            client.submit(prompt_token_ids=ids(43 + i, 130), max_tokens=800, ignore_eos=True)
            for i in range(4)
        ]
        poll(
            lambda: cluster.worker_stats("engine", DECODE).get("running", 0) >= 2,
            what="requests decoding",
        )
        victim = pid_of(cluster, "engine", DECODE)
        os.kill(victim, signal.SIGKILL)
        results = account("decode engine killed", handles, timeout_s=60)
        assert any(r.error_code == "unavailable" for r in results)
        # A prompt computed while its decode engine restarts waits for it (within the transfer
        # bound) instead of failing: before, it ended "decode engine 1 is down".
        during = client.submit(prompt_token_ids=ids(71, 130), max_tokens=4, ignore_eos=True)
        poll(lambda: restarted(cluster, "engine", DECODE, victim), 60, "decode engine restart")
        assert during.result(timeout=60).finish_reason == "length"
        again = client.submit(prompt_token_ids=PROMPTS[1], max_tokens=8, ignore_eos=True)
        assert again.result(timeout=60).engine_index == DECODE
    idle_and_clean(cluster)


def test_prefill_engine_killed_mid_prompt_ends_each_request_once(cluster):
    with Client(cluster.client_addr) as client:
        victim = pid_of(cluster, "engine", PREFILL)
        os.kill(victim, signal.SIGSTOP)  # the prompts queue in it...
        handles = [
            client.submit(prompt_token_ids=ids(100 + i, 900), max_tokens=4, ignore_eos=True)
            for i in range(6)
        ]
        time.sleep(0.3)
        os.kill(victim, signal.SIGCONT)  # ...it starts on them...
        time.sleep(0.005)
        os.kill(victim, signal.SIGKILL)  # ...and dies queued or mid-prompt
        results = account("prefill engine killed mid-prompt", handles, timeout_s=90)
        assert all(r.ok or r.error_code == "unavailable" for r in results)
        poll(lambda: restarted(cluster, "engine", PREFILL, victim), 60, "prefill engine restart")
        assert client.submit("after", max_tokens=3).result(timeout=60).finish_reason == "length"
    idle_and_clean(cluster)


def test_a_hung_decode_engine_times_the_transfer_out(tiny_model_dir):
    with (
        launch_cluster(str(tiny_model_dir), **PD, **KNOBS, kv_transfer_timeout_s=1.0) as hung,
        Client(hung.client_addr) as client,
    ):
        victim = pid_of(hung, "engine", DECODE)
        os.kill(victim, signal.SIGSTOP)
        try:
            handles = [
                client.submit(prompt_token_ids=p, max_tokens=8, ignore_eos=True)
                for p in PROMPTS[:3]
            ]
            results = account("decode engine hung", handles, timeout_s=30)
        finally:
            os.kill(victim, signal.SIGCONT)
        assert [r.error_code for r in results] == ["unavailable"] * 3
        assert all("aborted (not taken within 1 s)" in r.error for r in results)
        assert all(len(r.token_ids) == 1 for r in results)  # the prefill engine's first token
        poll(
            lambda: hung.worker_stats("engine", DECODE).get("kv_imports_refused") == 3,
            what="the decode engine finding the given-back runs",
        )
        poll(  # stats travel in heartbeats: the prefill engine's may come a beat later
            lambda: hung.worker_stats("engine", PREFILL).get("kv_transfers_aborted") == 3,
            what="the prefill engine counting the aborted transfers",
        )
        idle_and_clean(hung)
        result = client.submit(prompt_token_ids=PROMPTS[0], max_tokens=5).result(timeout=30)
        assert result.ok and result.engine_index == DECODE
        prefix = Path(hung.config.kv_segment_prefix)
        assert len(list(prefix.parent.glob(prefix.name + "*"))) == 1  # the prefill engine's
    assert not list(prefix.parent.glob(prefix.name + "*"))  # removed with the cluster


def test_the_two_modes_are_exclusive_in_one_line(tmp_path):
    for flags, says in (
        (["--engines", "2", "--prefill-engines", "1", "--decode-engines", "1"], "exclusive"),
        (["--prefill-engines", "2"], "needs both"),
    ):
        done = subprocess.run(
            [sys.executable, "-m", "procs.cli", "launch", *flags],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 2
        assert done.stderr.count("\n") == 1 and says in done.stderr, done.stderr
    with pytest.raises(ValueError, match="exclusive"):
        make_config("default", str(tmp_path / "x"), engines=2, prefill_engines=1, decode_engines=1)
    config, _ = make_config(
        "default", str(tmp_path / "y"), prefill_engines=2, decode_engines=3, engine_factory="x:y"
    )
    assert config.engines == 5 and list(config.decode_indices) == [2, 3, 4]
    assert [config.engine_role(i) for i in range(5)] == ["prefill"] * 2 + ["decode"] * 3
    assert ClusterConfig.from_json(config.to_json()) == config


def test_decode_engines_are_chosen_by_load_then_free_blocks():
    assert choose_decode({2: 3, 3: 1}, {2: 100, 3: 5}, [2, 3]) == 3
    assert choose_decode({2: 1, 3: 1}, {2: 10, 3: 50}, [2, 3]) == 3
    assert {choose_decode({}, {}, [2, 3], turn) for turn in range(2)} == {2, 3}
    assert choose_decode({2: 0, 3: 9}, {}, [3]) == 3  # a dead one is never chosen


def test_a_prompt_skips_the_prefill_engines_only_when_a_decode_engine_caches_nearly_all():
    # decode engines 2 and 3 cache 10 and 12 leading blocks of a 200-token prompt (16 a block)
    matched, live = {0: 12, 2: 10, 3: 12}, [2, 3]
    assert skip_prefill(matched, 200, 16, live, {}, 8) == 3  # 8 tokens left to compute
    assert skip_prefill(matched, 200, 16, live, {}, 7) is None
    assert skip_prefill(matched, 200, 16, [2], {}, 64) == 2  # 40 left: a live one only
    assert skip_prefill({2: 12, 3: 12}, 200, 16, live, {3: 0, 2: 4}, 8) == 3  # then load
    assert skip_prefill(matched, 200, 16, live, {}, 0) is None  # 0: never
    assert skip_prefill({0: 13}, 200, 16, live, {}, 64) is None  # a prefill engine's cache
