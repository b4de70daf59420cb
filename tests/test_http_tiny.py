"""The HTTP frontend end to end on real processes: a cluster on the tiny random model, the
frontend started as its own process (python -m http_worker.worker), the real `openai` client and
raw HTTP over real sockets."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import threading
import time

import httpx
import openai
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ipc.client import Client
from procs.children import REPO_ROOT
from procs.launch_cluster import launch_cluster
from runtime.model_files import load_tokenizer
from tests.frontend_process import frontend_command, wait_until_serving

MAX_MODEL_LEN = 4096
# Tokens of a request the tests abandon: the tiny model needs ~10 s on 2 busy CPU cores to
# generate them, so an engine idle within IDLE_WITHIN_S of a disconnect proves the abort.
LONG = 4000
IDLE_WITHIN_S = 5.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster(tiny_model_dir):
    with launch_cluster(
        str(tiny_model_dir),
        tokenizer_workers=1,
        kv_cache_tokens=16384,
        max_model_len=MAX_MODEL_LEN,
        heartbeat_interval_s=0.1,
    ) as c:
        yield c


def start_frontend(
    cluster, port: int, model_name: str = "tiny", env: dict | None = None, **kwargs
) -> subprocess.Popen:
    popen = subprocess.Popen(
        frontend_command(cluster.client_addr, port=port, model_name=model_name, **kwargs),
        cwd=str(REPO_ROOT),
        env=None if env is None else {**os.environ, **env},
    )
    try:
        wait_until_serving(f"http://127.0.0.1:{port}", popen, timeout_s=60)
    except BaseException:
        popen.kill()
        raise
    return popen


def stop_frontend(popen: subprocess.Popen) -> None:
    popen.terminate()
    # uvicorn re-raises the signal it handled once it has shut down cleanly.
    assert popen.wait(timeout=30) in (0, -signal.SIGTERM)


@contextlib.contextmanager
def openai_client(cluster, model_name: str = "tiny", timeout_s: float = 120):
    """An `openai` client of a frontend started for ``cluster`` (stopped on exit)."""
    port = free_port()
    popen = start_frontend(cluster, port, model_name=model_name)
    try:
        yield openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1",
            api_key="unused",
            max_retries=0,
            timeout=timeout_s,
        )
    finally:
        stop_frontend(popen)


@pytest.fixture(scope="module")
def base_url(cluster):
    port = free_port()
    popen = start_frontend(cluster, port)
    yield f"http://127.0.0.1:{port}"
    stop_frontend(popen)


@pytest.fixture(scope="module")
def oai(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


def metrics(base_url: str) -> dict[tuple[str, tuple], float]:
    text = httpx.get(f"{base_url}/metrics").text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def answering_pid(url: str, pids: set[int]) -> int:
    """Which of the frontend processes ``pids`` took a fresh connection to ``url`` (the kernel
    picks among SO_REUSEPORT listeners): the one that holds its other end. /health does not
    say (issue 38 item 9: nothing an unauthenticated caller does not need)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")  # accepted and answered
        ours = sock.getsockname()
        for pid in pids:
            for conn in psutil.Process(pid).net_connections(kind="tcp"):
                if conn.raddr and (conn.raddr.ip, conn.raddr.port) == ours:
                    return pid
    raise AssertionError(f"none of {pids} holds the connection from {ours}")


def test_models_and_health(base_url, oai):
    """/health says whether the cluster answers, and nothing about the host (issue 38 item 9:
    it showed the frontend's pid and index to any caller)."""
    assert [m.id for m in oai.models.list().data] == ["tiny"]
    assert httpx.get(f"{base_url}/health").json() == {"status": "ok"}


def test_completion_matches_the_sdk_and_counts_tokens_like_the_tokenizer(cluster, oai, tokenizer):
    prompt = "The quick brown fox jumps over"
    r = oai.completions.create(
        model="tiny", prompt=prompt, max_tokens=7, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.id.startswith("cmpl-") and r.object == "text_completion" and r.model == "tiny"
    (choice,) = r.choices
    assert choice.index == 0 and choice.finish_reason == "length" and choice.logprobs is None
    assert r.usage.prompt_tokens == len(tokenizer.encode(prompt).ids)
    assert r.usage.completion_tokens == 7
    assert r.usage.total_tokens == r.usage.prompt_tokens + 7
    with Client(cluster.client_addr) as client:
        sdk = client.submit(prompt, max_tokens=7, temperature=0, ignore_eos=True).result(60)
    assert choice.text == sdk.text


def test_penalties_reach_the_engine(cluster, oai):
    """OpenAI's presence/frequency penalties and the extra repetition_penalty give what the SDK
    gives with the same values, and change a greedy answer that repeats itself."""
    prompt = "the the the the"
    kw = dict(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
    plain = oai.completions.create(**kw, extra_body={"ignore_eos": True}).choices[0].text
    penalized = (
        oai.completions.create(
            **kw,
            frequency_penalty=2.0,
            presence_penalty=1.0,
            extra_body={"ignore_eos": True, "repetition_penalty": 3.0},
        )
        .choices[0]
        .text
    )
    with Client(cluster.client_addr) as client:
        sdk = client.submit(
            prompt,
            max_tokens=12,
            temperature=0,
            ignore_eos=True,
            frequency_penalty=2.0,
            presence_penalty=1.0,
            repetition_penalty=3.0,
        ).result(60)
    assert penalized == sdk.text and penalized != plain


def test_token_id_prompt_and_batch_with_n(oai, tokenizer):
    ids = tokenizer.encode("hello world").ids
    r = oai.completions.create(
        model="tiny", prompt=ids, max_tokens=3, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.usage.prompt_tokens == len(ids)
    by_text = oai.completions.create(
        model="tiny",
        prompt="hello world",
        max_tokens=3,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert r.choices[0].text == by_text.choices[0].text
    batch = oai.completions.create(
        model="tiny",
        prompt=["one", "two three"],
        n=2,
        max_tokens=4,
        temperature=1.0,
        seed=11,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert batch.usage.completion_tokens == 16
    # The prompt is counted once per prompt, not once per choice.
    assert batch.usage.prompt_tokens == len(tokenizer.encode("one").ids) + len(
        tokenizer.encode("two three").ids
    )
    again = oai.completions.create(
        model="tiny",
        prompt=["one", "two three"],
        n=2,
        max_tokens=4,
        temperature=1.0,
        seed=11,
        extra_body={"ignore_eos": True},
    )
    assert [c.text for c in again.choices] == [c.text for c in batch.choices]  # seeded


def test_chat_completion_and_its_stream_agree(cluster, oai):
    messages = [{"role": "user", "content": "Tell me a story"}]
    full = oai.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=9,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert full.id.startswith("chatcmpl-") and full.object == "chat.completion"
    message = full.choices[0].message
    assert message.role == "assistant" and message.content and full.usage.completion_tokens == 9
    with Client(cluster.client_addr) as client:
        sdk = client.submit(messages=messages, max_tokens=9, temperature=0, ignore_eos=True).result(
            60
        )
    assert message.content == sdk.text and full.usage.prompt_tokens == sdk.usage.prompt_tokens

    chunks = list(
        oai.chat.completions.create(
            model="tiny",
            messages=messages,
            max_tokens=9,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and finishes.count("length") == 1
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 9
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_path_times_on_request_follow_each_token_in_order(base_url, oai):
    """X-Splitserve-Path-Times: 1 puts each token's hops, and the request's stages, in SSE
    comments, in the order the text travelled; a plain stream has none, and the openai client
    reads the traced stream unchanged."""
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Tell me a story"}],
        "max_tokens": 5,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    url = f"{base_url}/v1/chat/completions"
    lines = httpx.post(url, json=body, headers={"X-Splitserve-Path-Times": "1"}, timeout=60)
    lines = lines.text.splitlines()
    hops = [json.loads(x[len(": path ") :]) for x in lines if x.startswith(": path ")]
    [stages] = [json.loads(x[len(": path-request ") :]) for x in lines if x.startswith(": path-")]
    order = ["t_step", "t_detok_woke", "t_detok_sent", "t_http_in", "t_sse"]
    assert len(hops) == 5  # one per token: the stream interval is 1
    for times in hops:
        assert times["threads"] >= 1  # the torch threads the step ran on
        assert 0 < times["step_ms"] and all(times[a] <= times[b] for a, b in zip(order, order[1:]))
    assert [h["t_step"] for h in hops] == sorted(h["t_step"] for h in hops)
    request_order = ["t_http_arrived", "t_submit", "t_tokenized", "t_arrived", "t_scheduled"]
    assert all(stages[a] <= stages[b] for a, b in zip(request_order, request_order[1:]))
    assert stages["t_first_token"] == hops[0]["t_step"] <= stages["t_finished"]
    plain = httpx.post(url, json=body, timeout=60).text
    plain_lines = plain.splitlines()
    assert not any(x.startswith(":") for x in plain_lines)
    assert sum(x.startswith("data: ") for x in plain_lines) == len(hops) + 2  # role, [DONE]
    traced = oai.chat.completions.create(
        **{k: v for k, v in body.items() if k != "ignore_eos"},
        extra_body={"ignore_eos": True},
        extra_headers={"X-Splitserve-Path-Times": "1"},
    )
    assert len([c for c in traced if c.choices and c.choices[0].delta.content]) == 5


def test_stop_strings_end_the_text_before_the_stop(oai):
    kw = dict(
        model="tiny", prompt="count", max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    text = oai.completions.create(**kw).choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), text
    r = oai.completions.create(**kw, stop=[stop, "never-appears"])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == text[: text.index(stop)]
    streamed = list(oai.completions.create(**kw, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == r.choices[0].text
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_bad_requests_get_400_with_the_servers_message(oai, tokenizer):
    with pytest.raises(openai.BadRequestError, match="temperature"):
        oai.completions.create(model="tiny", prompt="hi", temperature=-1)
    with pytest.raises(openai.BadRequestError, match="logprobs"):
        oai.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "x"}],
            logprobs=True,
            top_logprobs=21,
        )
    # A token id outside the vocabulary in logit_bias: the tokenizer worker's 400.
    with pytest.raises(openai.BadRequestError, match=r"logit_bias \[49152\] are outside"):
        oai.completions.create(model="tiny", prompt="hi", logit_bias={"49152": 1})
    # Caught by the tokenizer worker, after the submit: still a 400, streaming or not.
    too_long = "hello " * (MAX_MODEL_LEN + 10)
    with pytest.raises(openai.BadRequestError, match="context length"):
        oai.completions.create(model="tiny", prompt=too_long, max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="context length"):
        list(oai.completions.create(model="tiny", prompt=too_long, max_tokens=2, stream=True))
    with pytest.raises(openai.BadRequestError, match="49152"):
        oai.completions.create(model="tiny", prompt=[1, 10**6], max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        oai.completions.create(model="not-served", prompt="hi")


def _running_in_engine(cluster) -> float:
    return cluster.worker_stats("engine").get("running", -1)


def _wait_for(predicate, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def test_disconnect_mid_stream_aborts_the_request_in_the_engine(cluster, base_url):
    """Observables: the frontend's in-flight gauges back to 0, a 'disconnected' outcome
    counted, and the engine's own heartbeat stats showing no running request."""
    before = metrics(base_url).get(
        ("splitserve_generations_total", (("outcome", "disconnected"),)), 0.0
    )
    body = {
        "model": "tiny",
        "prompt": "go on forever",
        "max_tokens": LONG,
        "stream": True,
        "temperature": 0,
        "ignore_eos": True,
    }
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{base_url}/v1/completions", json=body) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert json.loads(first[6:])["choices"][0]["finish_reason"] is None
            _wait_for(lambda: _running_in_engine(cluster) >= 1)
        # Leaving the block closes the connection mid-stream.
    _wait_for(lambda: metrics(base_url)[("splitserve_http_requests_in_flight", ())] == 0)
    after = metrics(base_url)
    assert after[("splitserve_generations_in_flight", ())] == 0
    assert after[("splitserve_generations_total", (("outcome", "disconnected"),))] == before + 1
    _wait_for(lambda: _running_in_engine(cluster) == 0, IDLE_WITHIN_S)
    _wait_for(lambda: cluster.worker_stats("detokenizer")["open_requests"] == 0)


def test_disconnect_while_waiting_for_a_whole_answer_aborts_too(cluster, base_url):
    port = int(base_url.rsplit(":", 1)[1])
    body = json.dumps(
        {
            "model": "tiny",
            "prompt": "go on",
            "max_tokens": LONG,
            "temperature": 0,
            "ignore_eos": True,
        }
    ).encode()
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
            b"application/json\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
        )
        _wait_for(lambda: _running_in_engine(cluster) >= 1)
    _wait_for(lambda: metrics(base_url)[("splitserve_http_requests_in_flight", ())] == 0)
    _wait_for(lambda: _running_in_engine(cluster) == 0, IDLE_WITHIN_S)


def test_metrics_move_with_traffic(base_url, oai):
    before = metrics(base_url)
    oai.completions.create(
        model="tiny", prompt="abc", max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
    )
    after = metrics(base_url)

    def moved(name: str, labels: tuple = ()) -> float:
        return after.get((name, labels), 0.0) - before.get((name, labels), 0.0)

    ok = (("endpoint", "/v1/completions"), ("status", "200"))
    assert moved("splitserve_http_requests_total", ok) == 1
    assert moved("splitserve_generations_total", (("outcome", "length"),)) == 1
    assert moved("splitserve_generation_tokens_total") == 5
    assert moved("splitserve_prompt_tokens_total") >= 1
    assert moved("splitserve_http_time_to_first_token_seconds_count") == 1
    assert moved("splitserve_http_e2e_request_latency_seconds_count") == 1
    assert moved("splitserve_time_per_output_token_seconds_count") == 1
    assert moved("splitserve_tokenize_seconds_count") == 1
    assert after[("splitserve_http_requests_in_flight", ())] == 0


def test_two_frontends_share_one_port_and_their_metrics(cluster, tmp_path):
    """SO_REUSEPORT: both processes answer on one port; with prometheus_client's multiprocess
    mode either one's /metrics counts the requests both served."""
    port = free_port()
    env = {"PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    frontends = [start_frontend(cluster, port, index=i, reuse_port=True, env=env) for i in range(2)]
    url = f"http://127.0.0.1:{port}"
    try:
        pids, both = set(), {p.pid for p in frontends}
        for _ in range(200):  # a fresh connection each time: the kernel picks a frontend
            pids.add(answering_pid(url, both))
            if len(pids) == 2:
                break
        assert pids == both
        for _ in range(6):
            r = httpx.post(
                f"{url}/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2}
            )
            assert r.status_code == 200 and len(r.json()["choices"]) == 1
        ok = (
            "splitserve_http_requests_total",
            (("endpoint", "/v1/completions"), ("status", "200")),
        )
        assert metrics(url)[ok] == 6
    finally:
        for popen in frontends:
            stop_frontend(popen)


def test_supervised_frontend_reports_ready_and_heartbeats(cluster, tmp_path):
    """What the supervisor relies on: WorkerReady (role http, its URL) once it serves, then
    heartbeats with its in-flight counts, on the supervisor's own PULL socket."""
    import zmq

    from ipc.messages import Heartbeat, WorkerReady
    from ipc.sockets import PullQueue

    ctx = zmq.Context()
    inbox = PullQueue(ctx, f"ipc://{tmp_path}/supervisor.sock", WorkerReady, Heartbeat)
    popen = subprocess.Popen(
        frontend_command(
            cluster.client_addr,
            port=0,
            index=3,
            extra_args=("--supervisor-addr", inbox.address, "--heartbeat-interval-s", "0.1"),
        ),
        cwd=str(REPO_ROOT),
    )
    try:
        assert inbox.wait(60_000)
        ready = inbox.get()
        assert isinstance(ready, WorkerReady) and (ready.role, ready.index) == ("http", 3)
        assert ready.pid == popen.pid and ready.model_name == cluster.config.model_name
        (url,) = ready.addresses
        assert answering_pid(url, {popen.pid}) == popen.pid  # serving already
        assert inbox.wait(5_000)
        beat = inbox.get()
        assert isinstance(beat, Heartbeat) and beat.stats["in_flight"] == 0
    finally:
        stop_frontend(popen)
        inbox.close()
        ctx.term()


def test_supervisor_starts_frontends_and_stops_them_in_order(tiny_model_dir):
    """launch_cluster(http_port=0, http_workers=2): the supervisor picks one port, starts both
    frontends after the rest is ready, and on shutdown a stream still open ends (it is told the
    cluster stopped) before every frontend exits."""
    with launch_cluster(
        str(tiny_model_dir),
        tokenizer_workers=1,
        kv_cache_tokens=16384,
        max_model_len=MAX_MODEL_LEN,
        http_port=0,
        http_workers=2,
    ) as cluster:
        url = cluster.http_url
        assert url and url.startswith("http://127.0.0.1:")
        frontends = {c.popen.pid: c.popen for c in cluster.children if c.role == "http"}
        assert len(frontends) == 2
        seen = set()
        for _ in range(200):
            seen.add(answering_pid(url, set(frontends)))
            if seen == set(frontends):
                break
        assert seen == set(frontends)
        r = httpx.post(
            f"{url}/v1/completions",
            json={
                "model": cluster.config.model_name,
                "prompt": "hi",
                "max_tokens": 3,
                "ignore_eos": True,
            },
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3

        lines: list[str] = []
        stopper = threading.Thread(target=cluster.shutdown)
        with httpx.stream(
            "POST",
            f"{url}/v1/completions",
            timeout=60,
            json={
                "model": cluster.config.model_name,
                "prompt": "hi",
                "max_tokens": LONG,
                "ignore_eos": True,
                "stream": True,
            },
        ) as stream:
            for line in stream.iter_lines():
                if line.startswith("data: "):
                    lines.append(line[len("data: ") :])
                    if len(lines) == 2:
                        stopper.start()
        stopper.join(timeout=60)
        assert not stopper.is_alive()
        assert all(p.poll() is not None for p in frontends.values())
        # The stream ended properly: a last chunk saying why, then [DONE].
        assert lines[-1] == "[DONE]", lines[-3:]
        last = json.loads(lines[-2])
        assert last.get("error") or last["choices"][0]["finish_reason"], last
    assert not os.path.exists(cluster.config.run_dir)
