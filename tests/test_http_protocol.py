"""The HTTP frontend's request parsing and error shape, without a cluster: the app answers
validation errors before it needs one (and 503 for valid requests while it has none)."""

from __future__ import annotations

import json

import jsonschema
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from http_worker.answer_format import ChoiceOutput
from http_worker.app import build_app
from http_worker.chat_protocol import ChatCompletionRequest
from http_worker.completions_bodies import ChatFormat, CompletionFormat
from http_worker.frontend import FrontendSettings
from http_worker.protocol import APIError, CompletionRequest


@pytest.fixture(scope="module")
def http():
    # Not entered as a context manager: the lifespan (the cluster handshake) does not run.
    app = build_app(FrontendSettings(client_addr="ipc:///nonexistent", model_name="m"))
    return TestClient(app, raise_server_exceptions=False)


def _error(response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


@pytest.mark.parametrize(
    "body, param, words",
    [
        ({"prompt": "hi", "max_tokens": -1}, "max_tokens", "greater than or equal to 0"),
        ({"prompt": "hi", "temperature": -0.5}, "temperature", "temperature"),
        ({"prompt": "hi", "temperature": "hot"}, "temperature", "number"),
        ({"prompt": "hi", "top_p": 0}, "top_p", "top_p"),
        ({"prompt": "hi", "top_k": -2}, "top_k", "greater than or equal to -1"),
        ({"prompt": "hi", "seed": -1}, "seed", "greater than or equal to 0"),
        ({"prompt": "hi", "stop": ["x"] * 17}, "stop", "stop"),
        ({"prompt": "hi", "stop": [""]}, "stop[0]", "stop"),
        ({"prompt": "hi", "n": 0}, "n", "greater"),
        ({"prompt": "hi", "n": 17}, "n", "less"),
        ({"prompt": ["a"] * 20, "n": 16}, "n", "choices"),
        ({"prompt": ""}, "prompt", "empty"),
        ({"prompt": []}, "prompt", "empty"),
        ({"prompt": ["a", ""]}, "prompt", "empty"),
        ({"prompt": [[1, 2], []]}, "prompt", "empty"),
        ({"prompt": ["a", 1]}, "prompt", ""),
        ({}, "prompt", "required"),
        ({"prompt": "hi", "logprobs": 21}, "logprobs", "less than or equal to 20"),
        ({"prompt": "hi", "logprobs": -1}, "logprobs", "greater than or equal to 0"),
        ({"prompt": "hi", "prompt_logprobs": 30}, "prompt_logprobs", "less than or equal to 20"),
        ({"prompt": "hi", "max_tokens": 0}, "max_tokens", "0 only with echo or prompt_logprobs"),
        ({"prompt": "hi", "min_tokens": -1}, "min_tokens", "min_tokens"),
        ({"prompt": "hi", "max_tokens": 2, "min_tokens": 3}, "min_tokens", "must not exceed"),
        ({"prompt": "hi", "min_p": 1.5}, "min_p", "min_p"),
        ({"prompt": "hi", "best_of": 3}, None, "best_of is not supported"),
        ({"prompt": "hi", "presence_penalty": 2.5}, "presence_penalty", "presence_penalty"),
        ({"prompt": "hi", "frequency_penalty": -3}, "frequency_penalty", "frequency_penalty"),
        ({"prompt": "hi", "repetition_penalty": 0}, "repetition_penalty", "repetition_penalty"),
        ({"prompt": "hi", "logit_bias": {"five": 1.0}}, "logit_bias", "keys must be token ids"),
        ({"prompt": "hi", "logit_bias": {"5": 101}}, "logit_bias", "logit_bias values must be"),
        (
            {"prompt": "hi", "logit_bias": {str(i): 1 for i in range(301)}},
            "logit_bias",
            "at most 300",
        ),
        ({"prompt": "hi", "stream_options": {"include_usage": True}}, None, "only allowed"),
    ],
)
def test_bad_completion_params_are_400_in_openai_shape(http, body, param, words):
    error = _error(http.post("/v1/completions", json={"model": "m", **body}), 400)
    assert error["type"] == "invalid_request_error"
    assert words.lower() in error["message"].lower()
    if param is not None:
        assert error["param"] == param


@pytest.mark.parametrize(
    "body, words",
    [
        ({"messages": []}, "at least 1"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "role"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "text content"),
        (
            {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
            "top_logprobs is only allowed when logprobs is true",
        ),
        (
            {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21},
            "top_logprobs: Input should be less than or equal to 20",
        ),
        (
            {"messages": [{"role": "user", "content": "hi"}], "tools": {"type": "function"}},
            "tools: Input should be a valid list",
        ),
        (
            {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "xml"}},
            "response_format type must be",
        ),
        (
            {
                "messages": [{"role": "user", "content": "hi"}],
                "structured_outputs": {"regex": "a", "choice": ["a"]},
            },
            "exactly one of",
        ),
        (
            {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0},
            "max_completion_tokens must be at least 1",
        ),
        # Bounded before any message is validated (thousands of parts take seconds).
        ({"messages": [{"role": "user", "content": "hi"}] * 4097}, "at most 4096 messages"),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}] * 4097}]},
            "messages: at most 4096 content parts in all",
        ),
    ],
)
def test_bad_chat_params_are_400(http, body, words):
    error = _error(http.post("/v1/chat/completions", json={"model": "m", **body}), 400)
    assert words in error["message"]


def test_malformed_bodies_are_400_not_422_or_500(http):
    for content in (b"{not json", b"[1, 2]", b"", b"\xff\xfe"):
        r = http.post(
            "/v1/completions", content=content, headers={"content-type": "application/json"}
        )
        _error(r, 400)


def test_wrong_model_is_404_and_unknown_route_is_404(http):
    error = _error(http.post("/v1/completions", json={"model": "gpt-4", "prompt": "hi"}), 404)
    assert error["code"] == "model_not_found" and error["param"] == "model"
    _error(http.get("/v1/nothing-here"), 404)
    _error(http.get("/v1/completions"), 405)


def test_valid_request_without_a_cluster_is_503_and_health_says_so(http):
    error = _error(http.post("/v1/completions", json={"model": "m", "prompt": "hi"}), 503)
    assert error["code"] == "unavailable"
    r = http.get("/health")
    assert r.status_code == 503 and "not connected" in r.json()["reason"]


def test_health_says_nothing_about_the_host(http):
    """Issue 38 item 9: /health (no API key needed) showed the frontend's pid and index."""
    r = http.get("/health")
    assert r.status_code == 503 and set(r.json()) == {"status", "reason"}


# Fields with numeric bounds that SamplingParams (or the wire) checks; the document states them.
BOUNDED = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
    "n",
    "logprobs",
    "prompt_logprobs",
)


def _numeric(schema: dict) -> dict:
    return next(s for s in schema.get("anyOf", [schema]) if s.get("type") in ("number", "integer"))


def test_the_documents_bounds_are_what_validation_does(http):
    """Issue 38 item 9: /openapi.json admitted top_p 0, which the server then refused. For each
    bounded number of a completion, a value at each bound the document states is taken (only
    the missing cluster answers: 503), and one just past it is a 400 naming the field."""
    fields = http.get("/openapi.json").json()["components"]["schemas"]["CompletionRequest"]
    checked = []
    for name in BOUNDED:
        schema = _numeric(fields["properties"][name])
        step = 1 if schema["type"] == "integer" else 1e-6
        inside, outside = [], []
        if "minimum" in schema:
            inside.append(schema["minimum"])
            outside.append(schema["minimum"] - step)
        if "exclusiveMinimum" in schema:
            inside.append(schema["exclusiveMinimum"] + step)
            outside.append(schema["exclusiveMinimum"])
        if "maximum" in schema:
            inside.append(schema["maximum"])
            outside.append(schema["maximum"] + step)
        assert outside, f"{name}: the document states no bound"
        for value in inside:
            r = http.post("/v1/completions", json={"prompt": "hi", name: value})
            assert r.status_code == 503, (name, value, r.text)
        for value in outside:
            error = _error(http.post("/v1/completions", json={"prompt": "hi", name: value}), 400)
            assert error["param"] == name, (name, value, error)
        checked.append((name, inside, outside))
    assert ("top_p", [1e-6, 1], [0, 1 + 1e-6]) in checked


def _agrees(doc: dict, model: str, body: dict) -> bool:
    """Whether the document's schema of ``model`` admits ``body``."""
    schema = {"$ref": f"#/components/schemas/{model}", "components": doc["components"]}
    return jsonschema.Draft202012Validator(schema).is_valid(body)


HI = [{"role": "user", "content": "hi"}]
CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.mark.parametrize(
    "path, model, body, taken",
    [
        ("/v1/completions", "CompletionRequest", {"prompt": "hi"}, True),
        ("/v1/completions", "CompletionRequest", {"prompt": [[1], [2]]}, True),
        ("/v1/completions", "CompletionRequest", {"prompt": ""}, False),
        ("/v1/completions", "CompletionRequest", {"prompt": []}, False),
        ("/v1/completions", "CompletionRequest", {"prompt": ["a", ""]}, False),
        ("/v1/completions", "CompletionRequest", {"prompt": [[1], []]}, False),
        ("/v1/completions", "CompletionRequest", {"prompt": "hi", "top_p": 0}, False),
        ("/v1/completions", "CompletionRequest", {"prompt": "hi", "stop": ""}, False),
        ("/v1/completions", "CompletionRequest", {"prompt": "hi", "stop": ["x"] * 17}, False),
        ("/v1/completions", "CompletionRequest", {"prompt": "hi", "stop": ["x" * 257]}, False),
        ("/v1/completions", "CompletionRequest", {"prompt": "hi", "logit_bias": {"a": 1}}, False),
        ("/v1/completions", "CompletionRequest", {"prompt": "hi", "logit_bias": {"5": 101}}, False),
        ("/v1/chat/completions", "ChatCompletionRequest", {"messages": HI}, True),
        (
            "/v1/chat/completions",
            "ChatCompletionRequest",
            {"messages": [*HI, {"role": "assistant", "tool_calls": [CALL]}]},
            True,
        ),
        (
            "/v1/chat/completions",
            "ChatCompletionRequest",
            {"messages": [*HI, {"role": "tool", "content": "r", "tool_call_id": "c1"}]},
            True,
        ),
        (
            "/v1/chat/completions",
            "ChatCompletionRequest",
            {"messages": [*HI, {"role": "tool", "content": "r"}]},
            False,
        ),
        (
            "/v1/chat/completions",
            "ChatCompletionRequest",
            {"messages": [*HI, {"role": "tool", "content": "r", "tool_call_id": ""}]},
            False,
        ),
        ("/v1/chat/completions", "ChatCompletionRequest", {"messages": [{"role": "user"}]}, False),
        (
            "/v1/chat/completions",
            "ChatCompletionRequest",
            {"messages": [{"role": "assistant", "tool_calls": []}]},
            False,
        ),
        (
            "/v1/chat/completions",
            "ChatCompletionRequest",
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            False,
        ),
    ],
)
def test_the_document_admits_what_the_server_takes(http, path, model, body, taken):
    """Issue 38 item 9: the document admitted an empty prompt, top_p 0 and tool messages
    without their tool_call_id, which the server then refused. Each body: taken by the server
    (only the missing cluster answers: 503) exactly when the document admits it."""
    doc = http.get("/openapi.json").json()
    assert _agrees(doc, model, body) == taken
    assert http.post(path, json=body).status_code == (503 if taken else 400)


@pytest.mark.parametrize(
    "model, body",
    [
        ("ChatCompletionRequest", {"messages": HI, "tool_choice": "required"}),
        (
            "ChatCompletionRequest",
            {"messages": HI, "tool_choice": {"type": "function", "function": {"name": "f"}}},
        ),
        ("ChatCompletionRequest", {"messages": HI, "tools": [], "tool_choice": "required"}),
        ("ResponsesRequest", {"input": "hi", "tool_choice": "required"}),
        ("MessagesRequest", {"messages": HI, "max_tokens": 4, "tool_choice": {"type": "any"}}),
    ],
)
def test_the_document_says_a_forced_tool_choice_needs_tools(http, model, body):
    """Issue 38 item 9: tool_choice "required" (any) without tools is refused by the tokenizer
    worker (tests/test_http_other_apis.py shows it); the document now says so, and admits the
    same choice with a tool."""
    doc = http.get("/openapi.json").json()
    assert not _agrees(doc, model, body)
    tools = (
        [TOOL]
        if model != "MessagesRequest"
        else [{"name": "f", "input_schema": {"type": "object"}}]
    )
    if model == "ResponsesRequest":
        tools = [{"type": "function", "name": "f"}]
    assert _agrees(doc, model, {**body, "tools": tools})


def test_token_ids_in_the_document_without_a_cluster(http):
    """Token ids are bounded by the served model's vocabulary, which a frontend learns from its
    cluster (tests/test_http_edge.py); without one the document says where to look."""
    schemas = http.get("/openapi.json").json()["components"]["schemas"]
    item = schemas["DetokenizeBody"]["properties"]["tokens"]["items"]
    assert item["maximum"] == 2**31 - 1 and "/tokenizer_info" in item["description"]
    assert "x-token-id" not in json.dumps(schemas)


def test_metrics_parse_and_count_answers_by_status(http):
    http.post("/v1/completions", json={"model": "m", "prompt": "hi", "n": 0})
    families = {f.name: f for f in text_string_to_metric_families(http.get("/metrics").text)}
    counted = {
        (s.labels["endpoint"], s.labels["status"]): s.value
        for s in families["splitserve_http_requests"].samples
        if s.name.endswith("_total")
    }
    assert counted[("/v1/completions", "400")] >= 1
    assert "splitserve_http_time_to_first_token_seconds" in families


def test_sampling_mapping():
    req = CompletionRequest(
        prompt="x",
        temperature=0,
        top_p=0.5,
        top_k=4,
        seed=7,
        stop="END",
        stop_token_ids=[3],
        ignore_eos=True,
        n=2,
        max_tokens=5,
    )
    a, b = req.sampling(16, 0), req.sampling(16, 1)
    assert (
        a.max_tokens,
        a.temperature,
        a.top_p,
        a.top_k,
        a.stop,
        a.stop_token_ids,
        a.ignore_eos,
    ) == (5, 0.0, 0.5, 4, ["END"], [3], True)
    assert (a.seed, b.seed) == (7, 8)  # n choices with one seed differ, reproducibly
    top = CompletionRequest(prompt="x", seed=2**63 - 1, n=2)
    assert [top.sampling(16, i).seed for i in range(2)] == [2**63 - 1, 0]  # wraps in range
    defaults = CompletionRequest(prompt="x").sampling(16, 0)
    assert (defaults.temperature, defaults.top_p, defaults.top_k, defaults.seed) == (
        1.0,
        1.0,
        0,
        None,
    )
    # No max_tokens: the endpoint's default, which the tokenizer worker cuts to the room left.
    assert (defaults.max_tokens, defaults.default_max_tokens) == (None, 16)
    assert not defaults.penalized
    p = CompletionRequest(
        prompt="x", presence_penalty=0.5, frequency_penalty=-0.25, repetition_penalty=1.3
    ).sampling(16, 0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -0.25, 1.3)
    with pytest.raises(APIError) as info:
        CompletionRequest(prompt="x", temperature=-1).sampling(16, 0)
    assert info.value.status == 400


def test_logprob_fields_map_to_sampling_params():
    plain = CompletionRequest(prompt="x").sampling(16, 0)
    assert (plain.logprobs, plain.prompt_logprobs, plain.echo) == (None, None, False)
    echoed = CompletionRequest(prompt="x", echo=True, logprobs=2, max_tokens=0).sampling(1, 0)
    assert (echoed.logprobs, echoed.prompt_logprobs, echoed.echo) == (2, 2, True)
    both = CompletionRequest(prompt="x", echo=True, logprobs=1, prompt_logprobs=4).sampling(1, 0)
    assert both.prompt_logprobs == 4  # the prompt's entries serve both
    assert CompletionRequest(prompt="x", echo=True).sampling(1, 0).prompt_logprobs is None
    extras = CompletionRequest(
        prompt="x", min_tokens=2, min_p=0.1, logit_bias={"7": -100}, include_stop_str_in_output=True
    ).sampling(4, 0)
    assert (
        extras.min_tokens,
        extras.min_p,
        extras.logit_bias,
        extras.include_stop_str_in_output,
    ) == (2, 0.1, {7: -100.0}, True)
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert ChatCompletionRequest(**chat).sampling(4, 0).logprobs is None
    assert ChatCompletionRequest(**chat, logprobs=True).sampling(4, 0).logprobs == 0
    assert ChatCompletionRequest(**chat, logprobs=True, top_logprobs=5).sampling(4, 0).logprobs == 5
    assert ChatCompletionRequest(**chat, prompt_logprobs=1).sampling(4, 0).prompt_logprobs == 1


def test_a_prompt_of_token_ids_may_hold_token_zero(http):
    # Valid: past validation, the frontend without a cluster answers 503, not "prompt is empty".
    for prompt in ([0], [5, 0], [[0], [5, 0]]):
        response = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
        assert response.status_code == 503, response.text


def test_prompt_shapes():
    assert CompletionRequest(prompt="a").prompts() == [{"prompt": "a"}]
    assert CompletionRequest(prompt=["a", "b"]).prompts() == [{"prompt": "a"}, {"prompt": "b"}]
    assert CompletionRequest(prompt=[1, 2]).prompts() == [{"prompt_token_ids": [1, 2]}]
    # Token id 0 is a token like any other (not an empty prompt).
    assert CompletionRequest(prompt=[0]).prompts() == [{"prompt_token_ids": [0]}]
    assert CompletionRequest(prompt=[5, 0]).prompts() == [{"prompt_token_ids": [5, 0]}]
    assert CompletionRequest(prompt=[[1], [2, 3]]).prompts() == [
        {"prompt_token_ids": [1]},
        {"prompt_token_ids": [2, 3]},
    ]
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    chat = ChatCompletionRequest(
        messages=[{"role": "developer", "content": "be brief"}, {"role": "user", "content": parts}],
        max_tokens=3,
        max_completion_tokens=9,
    )
    assert chat.prompts()[0]["messages"] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "ab"},
    ]
    assert chat.sampling(100, 0).max_tokens == 9  # the newer name wins
    assert chat.max_tokens_name == "max_completion_tokens"


def test_response_shapes():
    chat = ChatFormat("m", include_usage=True)
    assert chat.id.startswith("chatcmpl-")
    assert chat.first_chunk(0)["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    end = chat.chunk(0, ChoiceOutput(finish_reason="stop"))["choices"][0]
    assert end["delta"] == {} and end["finish_reason"] == "stop"
    full = CompletionFormat("m").full([ChoiceOutput("hi", "length")], {"prompt_tokens": 1})
    assert full["id"].startswith("cmpl-") and full["object"] == "text_completion"
    assert full["choices"] == [
        {"index": 0, "text": "hi", "logprobs": None, "finish_reason": "length"}
    ]


def test_sdk_errors_map_to_statuses_clients_can_act_on():
    from http_worker.generation import api_error_from
    from ipc.client import (
        BadRequestError,
        OverloadedError,
        RequestTimeoutError,
        SplitserveError,
        UnavailableError,
    )

    statuses = {
        cls: api_error_from(cls("why")).status
        for cls in (
            BadRequestError,
            OverloadedError,
            UnavailableError,
            RequestTimeoutError,
            SplitserveError,
        )
    }
    assert statuses == {
        BadRequestError: 400,
        OverloadedError: 429,
        UnavailableError: 503,
        RequestTimeoutError: 504,
        SplitserveError: 500,
    }
    assert api_error_from(OverloadedError("queue full")).body()["error"]["message"] == "queue full"


def test_the_api_key_guards_v1_and_the_tokenizer_endpoints_not_version_or_metrics():
    app = build_app(
        FrontendSettings(client_addr="ipc:///nonexistent", model_name="m", api_key="sesame")
    )
    http = TestClient(app, raise_server_exceptions=False)
    for method, path in (
        ("post", "/tokenize"),
        ("post", "/detokenize"),
        ("get", "/tokenizer_info"),
        ("get", "/v1/models"),
    ):
        assert (
            _error(http.request(method.upper(), path, json={"prompt": "x"}), 401)["code"]
            == "invalid_api_key"
        )
    key = {"Authorization": "Bearer sesame"}
    # With the key: past the guard (503: this app has no cluster behind it).
    assert http.post("/tokenize", json={"prompt": "x"}, headers=key).status_code == 503
    assert http.get("/version").json()["version"]
    assert http.get("/metrics").status_code == 200


def test_tokenizer_endpoints_check_the_body_before_needing_a_cluster(http):
    assert _error(http.post("/tokenize", content=b"{oops"), 400)["message"]
    assert _error(http.post("/tokenize", json=[1]), 400)["message"]
    assert _error(http.post("/tokenize", json={"prompt": "x", "extra": 1}), 400)["param"] == "extra"
    assert _error(http.post("/detokenize", json={"tokens": ["a"]}), 400)["param"].startswith(
        "tokens"
    )
    assert _error(http.post("/tokenize", json={"prompt": "x", "model": "gpt"}), 404)
    assert _error(http.post("/tokenize", json={"prompt": "x"}), 503)["code"] == "unavailable"


def test_an_unexpected_error_is_a_whole_500_and_the_connection_stays_usable():
    """Issue 23 item 3's second half: Starlette's ``exception_handler(Exception)`` answered and
    then raised again, and uvicorn dropped the keep-alive connection without Connection: close,
    so the client's next request on it failed. A real uvicorn on a real socket here."""
    import http.client
    import threading

    import uvicorn

    app = build_app(FrontendSettings(client_addr="ipc:///nonexistent", model_name="m"))

    @app.get("/fault")
    async def fault() -> None:
        raise RuntimeError("a bug")

    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=0, lifespan="off", log_config=None)
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            thread.join(0.05)
        port = server.servers[0].sockets[0].getsockname()[1]
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.connect()
        sock = conn.sock
        for path, status in (
            ("/fault", 500),
            ("/version", 200),
            ("/fault", 500),
            ("/version", 200),
        ):
            conn.request("GET", path)
            reply = conn.getresponse()
            body = reply.read()
            assert reply.status == status and conn.sock is sock, (path, reply.status, body)
            assert reply.getheader("connection", "") != "close"
        assert b'"code":"internal"' in body or status == 200
        conn.close()
    finally:
        server.should_exit = True
        thread.join(10)
