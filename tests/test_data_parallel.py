"""Two engine replicas on the tiny model (issue 25): the tokenizer workers route each request by
its token-id blocks and the replicas' loads, a replica's death loses no request, and /metrics
speaks vLLM's names per replica. Real processes, real sockets; no timed assertion.

The module's cluster has a low ``routing_balance_abs_threshold`` (6 requests) and small decode
batches (4), so a flood spreads and a replica holds waiting requests that never started.
"""

from __future__ import annotations

import os
import random
import signal

import httpx
import pytest

from ipc.client import Client
from procs.launch_cluster import launch_cluster
from tests.test_cluster_faults import account, pid_of, poll, restarted
from tests.test_http_tiny import metrics

TINY_KNOBS = dict(
    engines=2,
    tokenizer_workers=2,
    kv_cache_tokens=16384,
    max_model_len=2048,
    heartbeat_interval_s=0.1,
)
BLOCK = 16  # the engine's default block_size


@pytest.fixture(scope="module")
def cluster(tiny_model_dir):
    with launch_cluster(
        str(tiny_model_dir),
        routing_balance_abs_threshold=6,
        max_batch_size=4,
        max_restarts=2,
        http_port=0,
        **TINY_KNOBS,
    ) as c:
        yield c


def ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 40_000) for _ in range(n)]


def index_blocks(cluster) -> list[float]:
    """What each tokenizer worker's prefix index holds (its heartbeat says)."""
    return [cluster.worker_stats("tokenizer", i).get("index_blocks", 0) for i in range(2)]


def converse(cluster, client: Client, conversations: int = 6, turns: int = 3, seed: int = 0):
    """Multi-turn chats as token ids: each turn resends the conversation's whole history plus 4
    new blocks. A turn's requests go out together; the next turn waits for them, and until both
    tokenizer workers have heard of the blocks they stored (the prefix index follows the KV
    events asynchronously: a turn sent within a millisecond of the previous one's end can be
    routed before they arrive). Returns {conversation: [replica of each turn]} and the prompt
    tokens served from the prefix caches."""
    history: dict[int, list[int]] = {c: [] for c in range(conversations)}
    placed: dict[int, list[int]] = {c: [] for c in range(conversations)}
    cached = 0
    for turn in range(turns):
        known = index_blocks(cluster)
        handles = {}
        for c in range(conversations):
            history[c] = history[c] + ids(seed + 1000 * c + turn, 4 * BLOCK)
            handles[c] = client.submit(prompt_token_ids=history[c], max_tokens=2, ignore_eos=True)
        for c, handle in handles.items():
            result = handle.result(timeout=60)
            placed[c].append(result.engine_index)
            cached += result.usage.cached_tokens
        if cluster.config.routing_policy == "cache_aware":  # the others keep no index
            stored = conversations * 4  # at least: new blocks on the replica that had the rest
            poll(
                lambda known=known, stored=stored: all(
                    now >= then + stored for now, then in zip(index_blocks(cluster), known)
                ),
                what="the tokenizer workers knowing this turn's blocks",
            )
    return placed, cached


def test_a_conversation_sticks_to_one_replica_and_hits_more_cache_than_round_robin(
    cluster, tiny_model_dir
):
    with Client(cluster.client_addr) as client:
        placed, cached = converse(cluster, client, seed=1)
        report = client.engine_stats()
    assert all(len(set(turns)) == 1 for turns in placed.values()), placed
    assert {turns[0] for turns in placed.values()} == {0, 1}  # the first turns spread
    assert cached == 6 * (4 + 8) * BLOCK  # every later turn found its whole history
    assert report.routing_policy == "cache_aware"
    assert report.routing_decisions.get("cache_hit", 0) >= 12
    assert [r.stats.prefix_hit_tokens_total > 0 for r in report.replicas] == [True, True]
    with launch_cluster(str(tiny_model_dir), routing_policy="round_robin", **TINY_KNOBS) as rr:
        with Client(rr.client_addr) as client:
            rr_placed, rr_cached = converse(rr, client, seed=1)
            assert client.engine_stats().routing_decisions == {"round_robin": 18}
    print(f"\nprefix-cache hit tokens: cache_aware {cached}, round_robin {rr_cached}")
    assert any(len(set(turns)) == 2 for turns in rr_placed.values())
    assert cached > rr_cached


def test_unrelated_prefixes_one_after_another_land_on_two_replicas(tiny_model_dir):
    """Issue 38: two unrelated ~600-token prefixes, six requests each, one after another (so
    the loads tie at 0): each prefix stays on one replica, and the second prefix starts on the
    replica whose cache is empty instead of the lowest index. A fresh cluster, so the caches
    start empty."""
    placed: dict[str, list[int]] = {"a": [], "b": []}
    with launch_cluster(str(tiny_model_dir), **TINY_KNOBS) as fresh:
        with Client(fresh.client_addr) as client:
            for name, seed in (("a", 11), ("b", 12)):
                prefix = ids(seed, 37 * BLOCK)
                for i in range(6):
                    known = index_blocks(fresh)
                    tail = ids(seed * 100 + i, 8)
                    result = client.submit(prompt_token_ids=prefix + tail, max_tokens=1).result(
                        timeout=60
                    )
                    placed[name].append(result.engine_index)
                    if i == 0:  # the index follows the KV events asynchronously
                        poll(
                            lambda known=known: all(
                                now >= then + 37 for now, then in zip(index_blocks(fresh), known)
                            ),
                            what="the tokenizer workers knowing the prefix's blocks",
                        )
            decisions = client.engine_stats().routing_decisions
    print(f"\nreplicas of prefix a {placed['a']}, of prefix b {placed['b']}; {decisions}")
    assert len(set(placed["a"])) == 1 and len(set(placed["b"])) == 1, placed
    assert {placed["a"][0], placed["b"][0]} == {0, 1}, placed
    assert decisions == {"balanced": 2, "cache_hit": 10}


def test_a_low_balance_threshold_spreads_a_flood_on_a_cached_prefix(cluster):
    prefix = ids(7, 8 * BLOCK)
    with Client(cluster.client_addr) as client:
        holder = client.submit(prompt_token_ids=prefix, max_tokens=1).result(timeout=60)
        before = client.engine_stats().routing_decisions
        handles = [
            client.submit(prompt_token_ids=prefix + ids(100 + i, 8), max_tokens=30, ignore_eos=True)
            for i in range(24)
        ]
        results = [h.result(timeout=120) for h in handles]
        after = client.engine_stats().routing_decisions
    replicas = [r.engine_index for r in results]
    print(f"\nflood on replica {holder.engine_index}'s prefix: {replicas}")
    assert set(replicas) == {0, 1}
    assert after.get("imbalanced", 0) > before.get("imbalanced", 0)
    assert after.get("cache_hit", 0) > before.get("cache_hit", 0)  # the holder first


def test_metrics_have_vllm_names_per_replica_and_move_with_load(cluster):
    url, model = cluster.http_url, cluster.config.model_name
    series = ("vllm:time_to_first_token_seconds_count", "vllm:generation_tokens_total")

    def per_engine(samples: dict, name: str) -> dict[str, float]:
        return {
            dict(labels)["engine"]: value
            for (sample, labels), value in samples.items()
            if sample == name and dict(labels).get("model_name") == model
        }

    before = metrics(url)
    for engine in ("0", "1"):
        for name in ("vllm:num_requests_running", "vllm:kv_cache_usage_perc"):
            assert engine in per_engine(before, name), (name, engine)
    for i in range(6):
        reply = httpx.post(
            f"{url}/v1/completions",
            json={"prompt": ids(300 + i, 40), "max_tokens": 5, "ignore_eos": True},
            timeout=60,
        )
        assert reply.status_code == 200, reply.text
    after = metrics(url)
    moved = {
        name: sum(per_engine(after, name).values()) - sum(per_engine(before, name).values())
        for name in (*series, "vllm:prefix_cache_queries_total", "vllm:prompt_tokens_total")
    }
    assert moved["vllm:time_to_first_token_seconds_count"] == 6
    assert moved["vllm:generation_tokens_total"] == 30
    assert moved["vllm:prompt_tokens_total"] == 240
    assert moved["vllm:prefix_cache_queries_total"] >= 240
    assert set(per_engine(after, "vllm:e2e_request_latency_seconds_count")) <= {"0", "1"}
    decisions = {
        dict(labels)["outcome"]: value
        for (name, labels), value in after.items()
        if name == "splitserve_routing_decisions_total" and dict(labels)["policy"] == "cache_aware"
    }
    assert sum(decisions.values()) >= 6 and set(decisions) <= {
        "cache_hit",
        "balanced",
        "imbalanced",
    }
    assert after[("splitserve_routing_seconds_total", (("policy", "cache_aware"),))] > 0


def test_a_killed_replica_loses_nothing_and_rejoins_after_its_restart(cluster):
    """SIGKILL of replica 1 with 16 requests spread over both, 4 running on each: replica 1's
    running ones end 'unavailable'; its waiting ones, which produced nothing, are sent again
    and served; replica 0's finish. Then replica 1 is back in the tokenizers' rotation."""
    with Client(cluster.client_addr, deadline_s=120) as client:
        handles = [
            client.submit(prompt_token_ids=ids(500 + i, 24), max_tokens=400, ignore_eos=True)
            for i in range(16)
        ]
        poll(
            lambda: (
                any(h.record.engine_index == 1 and h.record.token_ids for h in handles)
                and cluster.worker_stats("engine", 1).get("waiting", 0) > 0
            ),
            what="replica 1 generating with more requests waiting",
        )
        victim = pid_of(cluster, "engine", 1)
        os.kill(victim, signal.SIGKILL)
        results = account("engine[1] SIGKILL of 2, 4 running and more waiting on it", handles)
        lost = [r for r in results if r.error_code == "unavailable"]
        resent = [h for h in handles if h.resubmits]
        assert lost and all("engine replica 1 died" in r.error for r in lost)
        assert all(r.engine_index == 1 and r.token_ids for r in lost)
        assert resent and all(h.result().finish_reason == "length" for h in resent)
        assert len(lost) + sum(r.finish_reason == "length" for r in results) == 16
        poll(lambda: restarted(cluster, "engine", 1, victim), what="replica 1 restart")
        for i in range(2):
            # Replica 0's load as each tokenizer sees it must be its idle one too: a stale
            # report of its last requests sends every new request to the empty replica 1.
            poll(
                lambda i=i: (
                    (stats := cluster.worker_stats("tokenizer", i)).get("replicas_live") == 2
                    and stats.get("replica_load_0") == stats.get("replica_load_1") == 0
                ),
                what=f"tokenizer[{i}] routing to replica 1 again, both idle",
            )
        again = [
            client.submit(prompt_token_ids=ids(900 + i, 24), max_tokens=20, ignore_eos=True)
            for i in range(8)
        ]
        assert {h.result(timeout=60).engine_index for h in again} == {0, 1}
