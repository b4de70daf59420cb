"""The cluster's plumbing on real processes and sockets, with a stand-in engine that echoes the
prompt's token ids (no model: fast and deterministic). The real engine is covered by
test_cluster_tiny.py and test_cluster_real.py."""

from __future__ import annotations

import asyncio
import time

import msgpack
import pytest
import zmq

from ipc.client import AsyncClient, BadRequestError, Client, RequestTimeoutError, UnavailableError
from procs.launch_cluster import launch_cluster

FAKE_ENGINE = "tests.procs.fake_engine:make"  # a stand-in engine: no model, echoes
TOKENIZE_DELAY_MS = 300


@pytest.fixture(scope="module")
def cluster():
    with launch_cluster(
        None, tokenizer_workers=2, stream_interval_tokens=1, engine_factory=FAKE_ENGINE
    ) as c:
        yield c


@pytest.fixture(scope="module")
def client(cluster):
    with Client(cluster.client_addr, deadline_s=60) as c:
        yield c


def _assert_still_serving(client):
    result = client.submit("still serving", max_tokens=2).result(timeout=30)
    assert (result.text, result.finish_reason) == ("still serving", "length")


def test_stream_end_to_end(client):
    handle = client.submit("Hello world, this is a test", max_tokens=9)
    deltas = list(handle.stream(timeout=30))
    assert "".join(d.text for d in deltas) == "Hello world, this is a testHello world"
    assert [d.finished for d in deltas].count(True) == 1 and deltas[-1].finish_reason == "length"
    result = handle.result()
    assert result.usage.completion_tokens == 9 and result.usage.prompt_tokens == 7
    t = result.timings
    assert (
        t.t_submit
        <= t.t_tokenize_start
        <= t.t_tokenized
        <= t.t_arrived
        <= t.t_first_token
        <= t.t_last_token
        <= t.t_finished
    )
    # It ended in the step that produced its last token: it finished at that step's time, not
    # whenever the detokenizer got round to it.
    assert t.t_finished == t.t_last_token
    assert len(result.t_received) == 9 and result.ttft_s > 0


def test_stop_string_ends_the_request_and_is_not_in_the_text(client):
    result = client.submit("alpha beta gamma delta", max_tokens=50, stop=[" gam"]).result(30)
    assert result.text == "alpha beta" and result.finish_reason == "stop"


def test_abort_mid_stream(client):
    handle = client.submit("one two three four", max_tokens=200)
    stream = handle.stream(timeout=30)
    next(stream)
    handle.abort()
    rest = list(stream)
    assert rest[-1].finish_reason == "abort"
    assert handle.result().usage.completion_tokens < 200
    _assert_still_serving(client)


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(prompt="word " * 300), "context length"),
        (dict(prompt_token_ids=[1, 2, 10**6]), "prompt_token_ids"),
        (dict(prompt="x", stop_token_ids=[10**7]), "stop_token_ids"),
        (dict(messages=[{"role": "", "content": "x"}]), "role"),
    ],
)
def test_bad_requests_get_a_clear_error_and_the_cluster_keeps_serving(client, kwargs, fragment):
    with pytest.raises(BadRequestError, match=fragment):
        client.submit(max_tokens=4, **kwargs).result(timeout=30)
    _assert_still_serving(client)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(prompt=""),
        dict(max_tokens=0, prompt="x"),
        dict(prompt="x", temperature=-1),
        dict(prompt="x", top_p=0),
        dict(prompt="x", messages=[]),
        dict(prompt="x", speculative="no"),
    ],
)
def test_invalid_arguments_fail_at_submit(client, kwargs):
    with pytest.raises(BadRequestError, match=next(iter(set(kwargs) - {"prompt"}), None)):
        client.submit(**kwargs)


def test_malformed_frames_sent_raw_to_a_tokenizer(cluster, client):
    handle = client.submit("warm", max_tokens=1)  # a real wire id to attribute the errors to
    handle.result(timeout=30)
    wire_prefix = handle.wire_id.rsplit(":", 1)[0]
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.connect(cluster.config.tokenizer_addr(0))
    handles = []
    for i, prompt in enumerate([b"\xff\xfe bad utf-8", "x"]):
        rec = client._core.new_record(f"raw{i}", None)
        from ipc.client import RequestHandle

        h = RequestHandle(client, rec)
        client._core.register(rec, h)
        handles.append(h)
        body = {
            "kind": "submit",
            "request_id": rec.wire_id,
            "client_id": client._core.client_id,
            "sampling": {"max_tokens": 2} if i == 0 else {"max_tokens": "two"},
            "prompt": "PLACEHOLDER",
        }
        frame = msgpack.packb(body, use_bin_type=True)
        if isinstance(prompt, bytes):
            frame = frame.replace(b"\xabPLACEHOLDER", bytes([0xA0 | len(prompt)]) + prompt)
        push.send(frame)
    push.send(b"\x00\x01 not msgpack at all")  # unattributable: logged, nothing else
    push.close(linger=1000)
    ctx.term()
    with pytest.raises(BadRequestError, match="UTF-8"):
        handles[0].result(timeout=30)
    with pytest.raises(BadRequestError, match="max_tokens"):
        handles[1].result(timeout=30)
    assert wire_prefix
    _assert_still_serving(client)


def test_two_clients_same_request_ids_do_not_collide(cluster, client):
    with Client(cluster.client_addr) as other:
        a = client.submit("first client", max_tokens=2, request_id="same")
        b = other.submit("second client", max_tokens=2, request_id="same")
        assert a.result(timeout=30).text == "first client"
        assert b.result(timeout=30).text == "second client"


def test_a_client_leaving_with_requests_in_flight_disturbs_no_one(cluster, client):
    leaving = Client(cluster.client_addr)
    gone = [leaving.submit("bye bye", max_tokens=200) for _ in range(4)]
    leaving.close()
    for h in gone:
        with pytest.raises(UnavailableError):
            h.result(timeout=5)
    _assert_still_serving(client)
    deadline = time.monotonic() + 10
    while cluster.worker_stats("engine").get("live", 1) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert cluster.worker_stats("engine")["live"] == 0  # the engine freed them


def test_client_deadline_is_a_last_resort(cluster):
    with Client(cluster.client_addr, deadline_s=0.3) as c:
        with pytest.raises(RequestTimeoutError):
            c.submit("slow " * 4, max_tokens=240).result(timeout=10)


def test_async_client(cluster):
    async def main():
        async with AsyncClient(cluster.client_addr) as c:
            handles = [c.submit(f"async prompt {i}", max_tokens=3) for i in range(8)]
            streamed = [d.text async for d in handles[0]]
            results = [await h.result(timeout=30) for h in handles]
            return streamed, results

    try:
        import uvloop

        run = uvloop.run
    except ImportError:  # pragma: no cover
        run = asyncio.run
    streamed, results = run(main())
    assert "".join(streamed) == results[0].text
    assert all(r.text.startswith("async prompt") for r in results)
    assert all(r.finish_reason == "length" for r in results)


def test_generate_batch(client):
    results = client.generate(["a b", [{"role": "user", "content": "hi"}], [5, 6, 7]], max_tokens=2)
    assert [r.finish_reason for r in results] == ["length"] * 3
    assert results[2].token_ids == [5, 6]


def test_unreachable_cluster_is_unavailable(tmp_path):
    with pytest.raises(UnavailableError):
        Client(f"ipc://{tmp_path}/nobody.sock", connect_timeout_s=0.3)
