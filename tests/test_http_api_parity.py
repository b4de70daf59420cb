"""Issue 15's API parity on real processes: a tiny-model cluster (its chat template reads
``enable_thinking`` and message names), frontends started as their own processes (one strict,
one with --lenient-fields), the real `openai` client and raw HTTP.

No silent drops; max_completion_tokens; continuous usage; chat_template_kwargs; /tokenize,
/detokenize, /tokenizer_info, /version; the SDK's queries; the engine's series in /metrics."""

from __future__ import annotations

import asyncio
import subprocess
import time

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from http_worker.fields import NO_OP_FIELDS, NOT_IMPLEMENTED_FIELDS
from ipc.client import AsyncClient, BadRequestError, Client
from procs.children import REPO_ROOT
from procs.launch_cluster import launch_cluster
from runtime.model_files import load_tokenizer
from tests.chat_templates import THINKING_TEMPLATE, with_thinking_template
from tests.frontend_process import frontend_command, wait_until_serving
from tests.test_http_tiny import free_port, metrics, start_frontend, stop_frontend

MAX_MODEL_LEN = 2048
CHAT = [{"role": "user", "content": "Tell me a story"}]
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir, tmp_path_factory):
    return with_thinking_template(tiny_model_dir, tmp_path_factory.mktemp("tiny-thinking"))


@pytest.fixture(scope="module")
def cluster(model_dir):
    # max_batch_size 2: a third request waits, so the waiting gauge has something to show.
    with launch_cluster(
        str(model_dir),
        tokenizer_workers=1,
        kv_cache_tokens=16384,
        max_model_len=MAX_MODEL_LEN,
        max_batch_size=2,
        heartbeat_interval_s=0.1,
    ) as c:
        yield c


@pytest.fixture(scope="module")
def base_url(cluster):
    port = free_port()
    popen = start_frontend(cluster, port)
    yield f"http://127.0.0.1:{port}"
    stop_frontend(popen)


@pytest.fixture(scope="module")
def lenient(cluster, tmp_path_factory):
    """(base URL, log file) of a frontend started with --lenient-fields."""
    port = free_port()
    log = tmp_path_factory.mktemp("lenient") / "frontend.log"
    with open(log, "w") as sink:
        popen = subprocess.Popen(
            frontend_command(
                cluster.client_addr, port=port, model_name="tiny", extra_args=("--lenient-fields",)
            ),
            cwd=str(REPO_ROOT),
            stderr=sink,
        )
    try:
        wait_until_serving(f"http://127.0.0.1:{port}", popen, timeout_s=60)
        yield f"http://127.0.0.1:{port}", log
    finally:
        stop_frontend(popen)


@pytest.fixture(scope="module")
def oai(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def hf(model_dir):
    return AutoTokenizer.from_pretrained(str(model_dir))


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=60)


def refusal(response: httpx.Response, code: str) -> dict:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == code and error["type"] == "invalid_request_error"
    return error


def generation_body(path: str, **extra) -> dict:
    if path == "/v1/completions":
        return {"model": "tiny", "prompt": "hi", "max_tokens": 2, **extra}
    return {"model": "tiny", "messages": CHAT, "max_tokens": 2, **extra}


ENDPOINTS = ("/v1/completions", "/v1/chat/completions")


# --- no silent drops ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(NOT_IMPLEMENTED_FIELDS))
def test_every_known_unimplemented_field_is_refused_by_name_lenient_or_not(base_url, lenient, name):
    for url in (base_url, lenient[0]):
        for path in ENDPOINTS:
            response = post(url, path, generation_body(path, **{name: {"asks": "something"}}))
            assert response.status_code == 400, (url, path, response.text)
            error = response.json()["error"]
            assert name in (error["param"] or "") or name in error["message"], error


@pytest.mark.parametrize(
    "path, extra, param",
    [
        ("/v1/completions", {"bogus_field": 3}, "bogus_field"),
        ("/v1/chat/completions", {"bogus_chat_field": None}, "bogus_chat_field"),
        (
            "/v1/chat/completions",
            {"stream": True, "stream_options": {"include_usage": True, "vendor_flag": 1}},
            "stream_options.vendor_flag",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi", "vendor": 1}]},
            "messages[0].vendor",
        ),
        (
            "/v1/chat/completions",
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}
                        ],
                    }
                ]
            },
            "messages[0].content[0].cache_control",
        ),
    ],
)
def test_unknown_fields_are_refused_by_name_and_logged_and_ignored_when_lenient(
    base_url, lenient, path, extra, param
):
    error = refusal(post(base_url, path, generation_body(path, **extra)), "unknown_field")
    assert error["param"] == param and repr(param) in error["message"]
    assert "--lenient-fields" in error["message"]
    url, log = lenient
    for _ in range(2):
        response = post(url, path, generation_body(path, **extra))
        assert response.status_code == 200, response.text
    logged = [
        line for line in log.read_text().splitlines() if f"ignored unknown field {param!r}" in line
    ]
    assert len(logged) == 1, logged  # once per name, not once per request


def test_known_refusals_through_the_openai_client(oai):
    with pytest.raises(openai.BadRequestError) as caught:
        oai.completions.create(
            model="tiny", prompt="hi", max_tokens=2, extra_body={"use_beam_search": True}
        )
    assert caught.value.body["param"] == "use_beam_search"
    with pytest.raises(openai.BadRequestError) as caught:
        oai.chat.completions.create(
            model="tiny",
            messages=CHAT,
            max_tokens=2,
            extra_body={"guided_json": {"type": "object"}},
        )
    assert caught.value.body["param"] == "guided_json"
    with pytest.raises(openai.BadRequestError, match="reasoning_effort"):
        oai.chat.completions.create(
            model="tiny", messages=CHAT, max_tokens=2, reasoning_effort="high"
        )


def test_the_openai_clients_ordinary_calls_and_harmless_fields_work(oai):
    """What real clients send besides sampling: harmless fields are accepted and change
    nothing; a previous answer replayed as a message object (with its null extras) works."""
    plain = oai.chat.completions.create(model="tiny", messages=CHAT, max_tokens=6, **GREEDY)
    harmless = oai.chat.completions.create(
        model="tiny",
        messages=CHAT,
        max_tokens=6,
        user="u-1",
        metadata={"run": "a"},
        store=False,
        service_tier="auto",
        parallel_tool_calls=False,
        tools=[],
        n=1,
        temperature=0,
        extra_body={
            "ignore_eos": True,
            "prompt_cache_key": "k",
            "safety_identifier": "s",
            "top_k": 0,
            "spaces_between_special_tokens": True,
            "priority": 0,
        },
    )
    assert harmless.choices[0].message.content == plain.choices[0].message.content
    replay = CHAT + [plain.choices[0].message, {"role": "user", "content": "go on"}]
    again = oai.chat.completions.create(model="tiny", messages=replay, max_tokens=3, **GREEDY)
    assert again.usage.prompt_tokens > plain.usage.prompt_tokens
    chunks = list(
        oai.completions.create(
            model="tiny",
            prompt="hi",
            max_tokens=3,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    assert chunks[-1].usage.completion_tokens == 3
    assert set(NO_OP_FIELDS) >= {"metadata", "store", "service_tier"}


# --- max_completion_tokens, continuous usage, chat_template_kwargs -----------------------------


def test_max_completion_tokens_on_both_endpoints_and_in_the_sdk(cluster, oai):
    r = oai.completions.create(
        model="tiny",
        prompt="hi",
        max_tokens=9,
        temperature=0,
        extra_body={"ignore_eos": True, "max_completion_tokens": 4},
    )
    assert r.usage.completion_tokens == 4  # the newer name wins
    r = oai.chat.completions.create(model="tiny", messages=CHAT, max_completion_tokens=5, **GREEDY)
    assert r.usage.completion_tokens == 5
    with Client(cluster.client_addr) as client:
        result = client.submit("hi", max_completion_tokens=3, ignore_eos=True).result(60)
        assert result.usage.completion_tokens == 3


@pytest.mark.parametrize("include_usage", [True, False])
@pytest.mark.parametrize("chat", [True, False])
def test_continuous_usage_puts_each_choices_usage_on_every_chunk(oai, chat, include_usage):
    options = {"include_usage": include_usage, "continuous_usage_stats": True}
    kw = dict(model="tiny", max_tokens=4, n=2, stream=True, stream_options=options, **GREEDY)
    stream = (
        oai.chat.completions.create(messages=CHAT, **kw)
        if chat
        else oai.completions.create(prompt="once upon", **kw)
    )
    chunks = list(stream)
    per_choice: dict[int, list[int]] = {0: [], 1: []}
    prompt_tokens = set()
    for c in chunks[:-1] if include_usage else chunks:
        (choice,) = c.choices
        assert c.usage is not None, c
        per_choice[choice.index].append(c.usage.completion_tokens)
        prompt_tokens.add(c.usage.prompt_tokens)
        assert c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens
    assert len(prompt_tokens) == 1
    for counts in per_choice.values():
        assert counts == sorted(counts) and counts[-1] == 4
    if include_usage:  # the last chunk: no choice, the whole request's usage
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
        assert chunks[-1].usage.prompt_tokens == prompt_tokens.pop()


def test_chat_template_kwargs_reach_the_template(cluster, base_url, oai, hf):
    def prompt_tokens(**extra_body) -> int:
        r = oai.chat.completions.create(
            model="tiny", messages=CHAT, max_tokens=1, temperature=0, extra_body=extra_body
        )
        return r.usage.prompt_tokens

    thinking_off = {"enable_thinking": False}
    off = prompt_tokens(chat_template_kwargs=thinking_off)
    assert off > prompt_tokens()  # the template wrote the empty <think> block
    tokenized = post(
        base_url, "/tokenize", {"messages": CHAT, "chat_template_kwargs": thinking_off}
    ).json()
    text = hf.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True, **thinking_off)
    assert tokenized["tokens"] == hf(text, add_special_tokens=False)["input_ids"]
    assert tokenized["count"] == off
    with Client(cluster.client_addr) as client:
        sdk = client.submit(messages=CHAT, max_tokens=1, chat_template_kwargs=thinking_off)
        assert sdk.result(60).usage.prompt_tokens == off
    for bad, words in (
        ({"messages": []}, "may not set 'messages'"),
        ({"a": [[[[[[[[[1]]]]]]]]]}, "deeper"),
    ):
        response = post(
            base_url,
            "/v1/chat/completions",
            generation_body("/v1/chat/completions", chat_template_kwargs=bad),
        )
        assert response.status_code == 400 and words in response.json()["error"]["message"]
    response = post(
        base_url,
        "/v1/completions",
        generation_body("/v1/completions", chat_template_kwargs=thinking_off),
    )
    assert refusal(response, "unknown_field")["param"] == "chat_template_kwargs"


# --- tokenizer endpoints ------------------------------------------------------------------------


@pytest.mark.parametrize("special", [True, False])
def test_tokenize_and_detokenize_round_trip_like_the_tokenizer(base_url, model_dir, special):
    tokenizer = load_tokenizer(model_dir)
    for text in ("The quick brown fox", "  ✓ 日本\n\ttabs", "<|im_start|>user\nhi<|im_end|>"):
        body = post(
            base_url,
            "/tokenize",
            {"prompt": text, "add_special_tokens": special, "return_token_strs": True},
        ).json()
        ids = tokenizer.encode(text, add_special_tokens=special).ids
        assert body == {
            "count": len(ids),
            "max_model_len": MAX_MODEL_LEN,
            "tokens": ids,
            "token_strs": [tokenizer.id_to_token(i) for i in ids],
        }
        back = post(base_url, "/detokenize", {"tokens": ids}).json()
        assert back == {"prompt": tokenizer.decode(ids, skip_special_tokens=False)}


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_tokenize_chat_messages_like_transformers(base_url, hf, add_generation_prompt):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi", "name": "Ann"},
    ]
    body = post(
        base_url,
        "/tokenize",
        {"model": "tiny", "messages": messages, "add_generation_prompt": add_generation_prompt},
    ).json()
    expected = hf.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert "(Ann)" in expected
    assert body["tokens"] == hf(expected, add_special_tokens=False)["input_ids"]
    assert body["token_strs"] is None and body["count"] == len(body["tokens"])


@pytest.mark.parametrize(
    "path, body, status, words",
    [
        ("/tokenize", {"prompt": ""}, 400, "empty"),
        ("/tokenize", {"messages": []}, 400, "messages"),
        ("/tokenize", {"prompt": "x", "model": "other"}, 404, "does not exist"),
        ("/tokenize", {"prompt": "x", "vendor": 1}, 400, "vendor"),
        ("/tokenize", {"messages": CHAT, "tools": [{"type": "function"}]}, 400, "tools"),
        ("/tokenize", {}, 400, "prompt"),
        ("/detokenize", {"tokens": []}, 400, "at least 1 item"),
        ("/detokenize", {"tokens": [1, 49152]}, 400, "[0, 49152)"),
        (
            "/detokenize",
            {"tokens": [-3]},
            400,
            "tokens[0]: Input should be greater than or equal to 0",
        ),
        ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
    ],
)
def test_tokenizer_endpoints_refuse_bad_input_clearly(base_url, path, body, status, words):
    response = post(base_url, path, body)
    assert response.status_code == status, response.text
    assert words in response.json()["error"]["message"] + str(response.json()["error"]["param"])


def test_tokenizer_info_and_version(base_url):
    info = httpx.get(f"{base_url}/tokenizer_info").json()
    assert (info["eos_token"], info["bos_token"], info["pad_token"]) == (
        "<|im_end|>",
        "<|im_start|>",
        "<|im_end|>",
    )
    assert info["chat_template"] == THINKING_TEMPLATE and info["tokenizer_class"]
    assert info["model_max_length"] == info["max_model_len"] == MAX_MODEL_LEN
    assert httpx.get(f"{base_url}/version").json()["version"]


def test_sdk_queries_sync_and_async_each_end_once(cluster, model_dir):
    tokenizer = load_tokenizer(model_dir)
    ids = tokenizer.encode("hello world").ids
    with Client(cluster.client_addr) as client:
        client.submit("one step, so the engine has reported", max_tokens=1).result(60)
        assert client.tokenize("hello world").token_ids == ids
        assert client.detokenize(ids) == "hello world"
        assert client.tokenizer_info()["eos_token"] == "<|im_end|>"
        assert client.engine_stats().stats.kv_blocks_total > 0
        for bad in (
            lambda: client.tokenize(""),
            lambda: client.detokenize([]),
            lambda: client.detokenize([10**9]),
            lambda: client.tokenize(messages=[]),
            lambda: client.tokenize(messages=CHAT, chat_template_kwargs={"tools": 1}),
        ):
            with pytest.raises(BadRequestError):
                bad()
        assert client._core.records == {}  # nothing left open

    async def run() -> None:
        async with AsyncClient(cluster.client_addr) as client:
            tokenized, text, info = await asyncio.gather(
                client.tokenize("hello world"), client.detokenize(ids), client.tokenizer_info()
            )
            assert (tokenized.token_ids, text, info["bos_token"]) == (
                ids,
                "hello world",
                "<|im_start|>",
            )
            with pytest.raises(BadRequestError, match="49152"):
                await client.detokenize([49152])
            assert (await client.engine_stats()).stats.kv_blocks_total > 0
            assert client._core.records == {}

    asyncio.run(run())


# --- the engine's series in /metrics ------------------------------------------------------------

ENGINE = "splitserve_engine_"


def engine_series(url: str) -> dict[str, float]:
    return {
        name[len(ENGINE) :]: value
        for (name, labels), value in metrics(url).items()
        if name.startswith(ENGINE) and labels == (("model_name", "tiny"),)
    }


def wait_for(predicate, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)
    return value


def test_engine_gauges_move_with_traffic_and_every_frontend_reports_them(
    cluster, base_url, lenient
):
    before = engine_series(base_url)
    assert set(before) == {
        "requests_running",
        "requests_waiting",
        "kv_cache_usage_ratio",
        "prefix_cache_queried_tokens_total",
        "prefix_cache_hit_tokens_total",
        "preemptions_total",
        "spec_decode_drafts_total",  # zero without --speculative: every launch reports them
        "spec_decode_draft_tokens_total",
        "spec_decode_accepted_tokens_total",
    }
    shared = "a prompt long enough to fill two whole KV blocks of sixteen tokens " * 3
    with Client(cluster.client_addr) as client:
        handles = [
            client.submit(shared + str(i), max_tokens=1900, ignore_eos=True) for i in range(3)
        ]  # max_batch_size 2: the third waits
        busy = wait_for(
            lambda: (
                (s := engine_series(base_url))["requests_running"] == 2
                and s["requests_waiting"] == 1
                and s
            )
        )
        assert 0 < busy["kv_cache_usage_ratio"] < 1
        assert busy["prefix_cache_hit_tokens_total"] >= before["prefix_cache_hit_tokens_total"]
        for h in handles:
            h.abort()
            h.result(60, check=False)
    idle = wait_for(lambda: (s := engine_series(base_url))["requests_running"] == 0 and s)
    assert idle["requests_waiting"] == 0 and idle["kv_cache_usage_ratio"] == 0

    def moved(series: dict[str, float], name: str) -> float:
        return series[name] - before[name]

    assert moved(idle, "prefix_cache_queried_tokens_total") >= 3 * 30  # every prompt looked up
    assert moved(idle, "prefix_cache_hit_tokens_total") >= 32
    # One source, whichever frontend answers: the lenient one, and one started just now (its
    # start-up health probe may add a 1-token request to the counters, never start them over).
    port = free_port()
    fresh = start_frontend(cluster, port)
    try:
        for other in (engine_series(lenient[0]), engine_series(f"http://127.0.0.1:{port}")):
            for name, value in other.items():
                if name.endswith("_total"):
                    assert idle[name] <= value <= idle[name] + 1, name
                else:
                    assert value == idle[name], name
    finally:
        stop_frontend(fresh)
