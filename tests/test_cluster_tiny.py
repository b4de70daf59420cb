"""A cluster with the real engine on the tiny random model (fast): end-to-end streaming, 64
concurrent requests from two clients against the engine run in-process, and proof that the engine
process never loads a tokenizer."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import msgpack
import pytest
import zmq

from engine_worker.engine import Engine
from ipc.block_hash import block_hashes
from ipc.client import Client
from ipc.codec import unpack_id_list
from ipc.engine_config import EngineConfig
from ipc.messages import SamplingParams
from procs.launch_cluster import launch_cluster
from runtime.model_files import load_tokenizer

ENGINE_KNOBS = dict(
    max_batch_size=32,
    prefill_max_batch_size=32,
    prefill_max_tokens=4096,
    prefill_chunk_tokens=2048,
    block_size=16,
    kv_cache_tokens=16384,
    max_model_len=1024,
    # The cluster and the in-process reference alike: the tiny random model has near-ties that
    # bf16 and float32 break differently.
    dtype="float32",
)


@pytest.fixture(scope="module")
def kv_events_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("kv-events")


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, kv_events_dir):
    kv_events = {
        "enable_kv_cache_events": True,
        "endpoint": f"ipc://{kv_events_dir}/kv.sock",
        "replay_endpoint": f"ipc://{kv_events_dir}/kv-replay.sock",
    }
    with launch_cluster(
        str(tiny_model_dir),
        tokenizer_workers=2,
        kv_events_config=json.dumps(kv_events),
        **ENGINE_KNOBS,
    ) as c:
        yield c


def test_streamed_chat_request(cluster):
    with Client(cluster.client_addr, deadline_s=120) as client:
        assert client.max_model_len == 1024 and client.welcome.vocab_size == 49152
        handle = client.submit(
            messages=[{"role": "user", "content": "Hi there"}],
            max_tokens=12,
            temperature=0,
            ignore_eos=True,
        )
        deltas = list(handle.stream(timeout=60))
        assert sum(d.finished for d in deltas) == 1
        result = handle.result()
        assert result.finish_reason == "length" and len(result.token_ids) == 12
        assert result.text == "".join(d.text for d in deltas)
        assert result.usage.completion_tokens == 12 and result.timings.t_first_token > 0


def _prompts(n: int) -> list[str]:
    rng = random.Random(7)
    words = "the quick brown fox jumps over lazy dog paris london tokyo river mountain".split()
    return [
        " ".join(rng.choice(words) for _ in range(rng.choice([1, 5, 30, 120]))) for _ in range(n)
    ]


def _in_process_greedy(
    model_dir: Path, id_lists: list[list[int]], max_tokens: list[int]
) -> list[list[int]]:
    engine = Engine(
        EngineConfig(
            model_path=str(model_dir),
            device="cpu",
            enable_prefix_cache=True,
            max_waiting_requests=4096,
            **ENGINE_KNOBS,
        )
    )
    for i, (ids, n) in enumerate(zip(id_lists, max_tokens)):
        engine.add(f"r{i}", ids, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(id_lists))}
    while engine.has_work():
        step = engine.step()
        for rid, tok in zip(step.request_ids, unpack_id_list(step.token_ids)):
            out[rid].append(tok)
    return [out[f"r{i}"] for i in range(len(id_lists))]


def test_64_concurrent_requests_from_two_clients_match_the_engine_in_process(
    cluster, tiny_model_dir
):
    prompts = _prompts(64)
    max_tokens = [4 + (i % 5) * 3 for i in range(64)]
    tokenizer = load_tokenizer(tiny_model_dir)
    id_lists = [tokenizer.encode(p).ids for p in prompts]
    with (
        Client(cluster.client_addr, deadline_s=120) as a,
        Client(cluster.client_addr, deadline_s=120) as b,
    ):
        handles = [
            (a if i % 2 else b).submit(p, max_tokens=n, temperature=0, ignore_eos=True)
            for i, (p, n) in enumerate(zip(prompts, max_tokens))
        ]
        results = [h.result(timeout=120) for h in handles]
    expected = _in_process_greedy(tiny_model_dir, id_lists, max_tokens)
    for r, ids, want in zip(results, id_lists, expected):
        assert r.finish_reason == "length" and r.usage.prompt_tokens == len(ids)
        assert r.token_ids == want
        assert r.text == tokenizer.decode(want, skip_special_tokens=True)


def test_abort_and_stop_token_with_the_real_engine(cluster):
    with Client(cluster.client_addr, deadline_s=120) as client:
        handle = client.submit("count with me", max_tokens=500, temperature=0, ignore_eos=True)
        stream = handle.stream(timeout=60)
        next(stream)
        handle.abort()
        assert list(stream)[-1].finish_reason == "abort"
        first = client.submit("abc", max_tokens=5, temperature=0, ignore_eos=True).result(60)
        stop_id = first.token_ids[2]
        r = client.submit(
            "abc", max_tokens=5, temperature=0, ignore_eos=True, stop_token_ids=[stop_id]
        ).result(60)
        assert r.finish_reason == "stop" and r.token_ids[-1] == stop_id
        assert len(r.token_ids) == first.token_ids.index(stop_id) + 1


def test_engine_process_never_loads_a_tokenizer(cluster):
    with Client(cluster.client_addr, deadline_s=120) as client:
        client.submit("make the engine step", max_tokens=3).result(timeout=60)
        steps_before = cluster.worker_stats("engine").get("steps", 0)
        client.submit(messages=[{"role": "user", "content": "and again"}], max_tokens=3).result(
            timeout=60
        )
    deadline = time.monotonic() + 10  # wait for a heartbeat sent after those steps
    while cluster.worker_stats("engine").get("steps", 0) <= steps_before:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert cluster.worker_stats("engine")["imported_tokenizers"] == 0.0
    # An outside check on the real process: no tokenizers extension is mapped into it.
    engine_pid = cluster.pids["engine[0]"]
    maps = Path(f"/proc/{engine_pid}/maps").read_text()
    assert "tokenizers" not in maps
    tokenizer_pid = cluster.pids["tokenizer[0]"]
    assert "tokenizers" in Path(f"/proc/{tokenizer_pid}/maps").read_text()  # the check works


def test_a_burst_of_a_thousand_submits_from_a_default_client_is_accepted(cluster):
    """The seeds' workload from the SDK as shipped: submit() in a loop, no tuning. The pipes
    are sized from the cluster's admission bound, so nothing is refused as overloaded while the
    engine's waiting queue (4096 by default) has room."""
    with Client(cluster.client_addr) as client:
        handles = [
            client.submit(prompt_token_ids=[1, 2 + i % 1000, 3], max_tokens=1, temperature=0)
            for i in range(1000)
        ]
        results = [h.result(timeout=240) for h in handles]
    assert [r.finish_reason for r in results] == ["length"] * 1000


def _replay_from_zero(ctx: zmq.Context, address: str) -> list[tuple[int, bytes]]:
    """A DEALER's replay from seq 0, read from the wire description alone."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(address)
    dealer.send_multipart([b"", (0).to_bytes(8, "big")])
    batches = []
    while dealer.poll(10_000):
        empty, seq, payload = dealer.recv_multipart()
        assert empty == b""
        if seq == (-1).to_bytes(8, "big", signed=True):
            break
        batches.append((int.from_bytes(seq, "big"), payload))
    dealer.close(linger=0)
    return batches


def test_engine_publishes_kv_events_internally_and_on_the_users_endpoint(cluster, kv_events_dir):
    ids = list(range(7000, 7000 + 3 * 16 + 4))  # three full blocks, tokens no other test sends
    with Client(cluster.client_addr, deadline_s=120) as client:
        client.submit(prompt_token_ids=ids, max_tokens=1, temperature=0).result(timeout=60)
    ctx = zmq.Context()
    try:
        internal = _replay_from_zero(ctx, cluster.config.engine_events_replay_addr(0))
        users = _replay_from_zero(ctx, f"ipc://{kv_events_dir}/kv-replay.sock")
    finally:
        ctx.term()
    assert users == internal  # one stream, two sinks
    assert [seq for seq, _ in internal] == list(range(len(internal)))
    batches = [msgpack.unpackb(payload) for _, payload in internal]
    assert batches[0][1] == [{"type": "AllBlocksCleared"}] and batches[0][2] == 0
    stored = [e for _, events, _ in batches for e in events if e["type"] == "BlockStored"]
    mine = [e for e in stored if e["token_ids"][:16] == ids[:16]]
    assert len(mine) == 1 and mine[0]["parent_block_hash"] is None
    assert mine[0]["block_hashes"] == block_hashes(ids, 16) and mine[0]["token_ids"] == ids[:48]
