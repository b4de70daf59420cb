"""OpenAI's Responses API and Anthropic's Messages API through the real server (a tiny-model
cluster, one frontend process), with the official SDKs as clients: each answer is the one the
chat path gives the same conversation, streamed and not, with tools, structured output, stop
sequences, token counts, errors in each API's own shape, and aborts on disconnect."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import openai
import pytest

from http_worker.messages_api import CountTokensRequest
from tests import test_http_tiny
from tests.other_api_edge_cases import MESSAGES, PREFILL, RESPONSES
from tests.test_http_edge import KeepAlive
from tests.test_http_tiny import IDLE_WITHIN_S, LONG, _running_in_engine, _wait_for, metrics

# This module's own cluster and frontend process, made as test_http_tiny makes its own.
cluster, base_url = test_http_tiny.cluster, test_http_tiny.base_url
WEATHER = {
    "type": "object",
    # Bounded, so that the tiny random model's forced answer ends within a few dozen tokens.
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "days": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
ASK = "What is the weather in Paris?"
# One call: offered more, the tiny random model repeats its call until max_tokens.
ANY_ONE = {"type": "any", "disable_parallel_tool_use": True}


@pytest.fixture(scope="module")
def oai(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def claude(base_url):
    return anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0, timeout=60)


def chat(oai, messages, **kwargs):
    return oai.chat.completions.create(model="tiny", messages=messages, temperature=0, **kwargs)


# --- Responses ----------------------------------------------------------------------------------


def test_responses_text_is_chats_answer_and_its_stream_accumulates_to_it(oai):
    whole = oai.responses.create(
        model="tiny", input=ASK, instructions="Be brief.", max_output_tokens=12, temperature=0
    )
    same = chat(
        oai,
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": ASK}],
        max_tokens=12,
    )
    assert whole.object == "response" and whole.id.startswith("resp_") and not whole.store
    assert whole.output_text == same.choices[0].message.content
    assert whole.usage.input_tokens == same.usage.prompt_tokens
    assert whole.usage.output_tokens == same.usage.completion_tokens
    expected_status = "incomplete" if same.choices[0].finish_reason == "length" else "completed"
    assert whole.status == expected_status
    with oai.responses.stream(
        model="tiny", input=ASK, instructions="Be brief.", max_output_tokens=12, temperature=0
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response() if expected_status == "completed" else None
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert "response.output_text.delta" in kinds
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        f"response.{expected_status}",
    ]
    if final is not None:
        assert final.output_text == whole.output_text


def test_responses_function_call_round_trip(oai):
    tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER, "strict": True}]
    asked = [{"role": "user", "content": ASK}]
    first = oai.responses.create(
        model="tiny",
        input=asked,
        tools=tools,
        tool_choice="required",
        max_output_tokens=60,
        temperature=0,
    )
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    replay = [
        *asked,
        {
            "type": "function_call",
            "call_id": call.call_id,
            "name": call.name,
            "arguments": call.arguments,
        },
        {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 25 C"},
    ]
    answer = oai.responses.create(
        model="tiny", input=replay, tools=tools, max_output_tokens=8, temperature=0
    )
    assert answer.output[0].type == "message" and answer.status in ("completed", "incomplete")
    # The same conversation in chat's words: the same prompt, token for token.
    history = [
        *asked,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.call_id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 25 C"},
    ]
    chat_tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
    same = chat(oai, history, tools=chat_tools, max_tokens=8)
    assert answer.usage.input_tokens == same.usage.prompt_tokens
    assert answer.output_text == (same.choices[0].message.content or "")


def test_responses_json_schema_output_validates_and_logprobs_come_with_the_text(oai):
    text_format = {"format": {"type": "json_schema", "name": "weather", "schema": WEATHER}}
    r = oai.responses.create(
        model="tiny",
        input=ASK,
        text=text_format,
        max_output_tokens=60,
        temperature=0,
        include=["message.output_text.logprobs"],
        top_logprobs=2,
    )
    jsonschema.validate(json.loads(r.output_text), WEATHER)
    (part,) = r.output[0].content
    assert len(part.logprobs) == r.usage.output_tokens
    assert all(len(entry.top_logprobs) == 2 for entry in part.logprobs)
    assert "".join(entry.token for entry in part.logprobs).startswith("{")


@pytest.mark.parametrize("fields, param", RESPONSES, ids=[str(p) for _, p in RESPONSES])
def test_responses_refusals_name_their_field_and_keep_the_connection(base_url, fields, param):
    conn = KeepAlive(base_url)
    try:
        for stream in (False, True):
            body = {"model": "tiny", "input": "hi", "max_output_tokens": 4, "stream": stream}
            status, answer = conn.post("/v1/responses", json.dumps({**body, **fields}))
            error = answer["error"]
            assert status == 400 and error["type"] == "invalid_request_error", answer
            assert error["param"] == param and "Traceback" not in error["message"], error
        status, answer = conn.post(
            "/v1/responses", json.dumps({"input": "hi", "max_output_tokens": 2})
        )
        assert status == 200 and answer["status"] in ("completed", "incomplete")
    finally:
        conn.close()


def test_responses_store_is_accepted_nothing_is_kept_and_unknown_fields_are_refused(oai):
    r = oai.responses.create(
        model="tiny", input="hi", store=True, max_output_tokens=2, metadata={"a": "b"}
    )
    assert r.store is False and r.metadata == {"a": "b"}
    with pytest.raises(openai.BadRequestError) as caught:
        oai.responses.create(
            model="tiny", input="again", previous_response_id=r.id, max_output_tokens=2
        )
    assert caught.value.body["param"] == "previous_response_id"
    assert "keeps no responses" in caught.value.body["message"]
    with pytest.raises(openai.BadRequestError) as caught:  # an unknown field, as the SDK sees it
        oai.responses.create(model="tiny", input="hi", extra_body={"colour": "red"})
    assert caught.value.body["param"] == "colour"


# --- Messages -----------------------------------------------------------------------------------


def test_messages_text_is_chats_answer_and_the_stream_helper_accumulates_to_it(oai, claude):
    kwargs = dict(
        model="tiny", max_tokens=12, system="Be brief.", messages=[{"role": "user", "content": ASK}]
    )
    whole = claude.messages.create(**kwargs, extra_body={"temperature": 0})
    same = chat(
        oai,
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": ASK}],
        max_tokens=12,
    )
    assert whole.type == "message" and whole.role == "assistant" and whole.id.startswith("msg_")
    assert "".join(b.text for b in whole.content) == same.choices[0].message.content
    assert (
        whole.stop_reason
        == {"length": "max_tokens", "stop": "end_turn"}[same.choices[0].finish_reason]
    )
    usage = whole.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == same.usage.prompt_tokens
    assert usage.output_tokens == same.usage.completion_tokens
    with claude.messages.stream(**kwargs, extra_body={"temperature": 0}) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert final.model_dump(exclude={"id"}) == whole.model_dump(exclude={"id"})


def test_messages_tool_use_round_trip_with_tool_choice_any(claude):
    tools = [{"name": "get_weather", "description": "The forecast", "input_schema": WEATHER}]
    asked = [{"role": "user", "content": ASK}]
    kwargs = dict(model="tiny", max_tokens=60, messages=asked, tools=tools, tool_choice=ANY_ONE)
    first = claude.messages.create(**kwargs, extra_body={"temperature": 0})
    assert first.stop_reason == "tool_use"
    uses = [b for b in first.content if b.type == "tool_use"]
    assert uses and all(u.name == "get_weather" for u in uses)
    for use in uses:
        jsonschema.validate(use.input, WEATHER)
    with claude.messages.stream(**kwargs, extra_body={"temperature": 0}) as stream:
        streamed = stream.get_final_message()
    assert [b.input for b in streamed.content if b.type == "tool_use"] == [u.input for u in uses]
    results = [{"type": "tool_result", "tool_use_id": u.id, "content": "Sunny"} for u in uses]
    replay = [
        *asked,
        {"role": "assistant", "content": first.content},
        {"role": "user", "content": results},
    ]
    answer = claude.messages.create(model="tiny", max_tokens=6, messages=replay, tools=tools)
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use")
    counted = claude.messages.count_tokens(model="tiny", messages=replay, tools=tools)
    assert counted.input_tokens == answer.usage.input_tokens + answer.usage.cache_read_input_tokens


def test_count_tokens_is_the_prompt_the_engine_saw(claude):
    kwargs = dict(
        model="tiny",
        system=[{"type": "text", "text": "Be brief."}],
        messages=[
            {
                "role": "user",
                "content": [{"type": "text", "text": ASK, "cache_control": {"type": "ephemeral"}}],
            }
        ],
        tools=[{"name": "get_weather", "input_schema": WEATHER}],
    )
    counted = claude.messages.count_tokens(**kwargs)
    answer = claude.messages.create(max_tokens=2, **kwargs)
    assert counted.input_tokens == answer.usage.input_tokens + answer.usage.cache_read_input_tokens
    without_tools = claude.messages.count_tokens(**{**kwargs, "tools": []})
    assert without_tools.input_tokens < counted.input_tokens


def test_stop_sequences_end_with_stop_reason_stop_sequence(claude):
    kwargs = dict(
        model="tiny",
        max_tokens=24,
        messages=[{"role": "user", "content": ASK}],
        extra_body={"temperature": 0},
    )
    free = "".join(b.text for b in claude.messages.create(**kwargs).content)
    stop = free[len(free) // 2 : len(free) // 2 + 3]
    assert len(stop) == 3, free
    cut = claude.messages.create(**kwargs, stop_sequences=["never-seen", stop])
    assert (cut.stop_reason, cut.stop_sequence) == ("stop_sequence", stop)
    assert "".join(b.text for b in cut.content) == free[: free.index(stop)]
    with claude.messages.stream(**kwargs, stop_sequences=["never-seen", stop]) as stream:
        assert stream.get_final_message().model_dump(exclude={"id"}) == cut.model_dump(
            exclude={"id"}
        )


@pytest.mark.parametrize("fields, words", MESSAGES, ids=[w for _, w in MESSAGES])
def test_messages_refusals_are_anthropics_shape_naming_the_field(base_url, fields, words):
    conn = KeepAlive(base_url)
    try:
        for path in ("/v1/messages", "/v1/messages/count_tokens"):
            for stream in (False, True):
                body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
                if path == "/v1/messages":
                    body.update(max_tokens=4, stream=stream)
                elif (
                    stream
                    or not set(fields) <= set(CountTokensRequest.model_fields)
                    or fields is PREFILL
                ):
                    continue  # count_tokens has no stream and only some fields
                status, answer = conn.post(path, json.dumps({**body, **fields}))
                assert status == 400 and answer["type"] == "error", answer
                error = answer["error"]
                assert error["type"] == "invalid_request_error" and words in error["message"]
        ok = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        assert conn.post("/v1/messages", json.dumps(ok))[0] == 200
    finally:
        conn.close()


@pytest.mark.parametrize(
    "fields, error_class",
    [
        ({"unknown_field": 1}, anthropic.BadRequestError),
        ({"top_k": -1}, anthropic.BadRequestError),
        ({"model": "claude-x"}, anthropic.NotFoundError),
    ],
)
def test_the_sdk_raises_its_own_error_types(claude, fields, error_class):
    known = {"model": fields.pop("model", "tiny"), "max_tokens": 4}
    with pytest.raises(error_class) as caught:
        claude.messages.create(
            **known, messages=[{"role": "user", "content": "hi"}], extra_body=fields
        )
    assert caught.value.body["type"] == "error"


def test_unknown_paths_and_methods_answer_in_anthropics_shape(base_url):
    r = httpx.get(f"{base_url}/v1/messages", timeout=10)
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"
    assert (
        httpx.post(f"{base_url}/v1/messages/batches", json={}, timeout=10).json()["error"]["type"]
        == "not_found_error"
    )


def test_a_frontend_with_an_api_key_and_lenient_fields(cluster):
    """The key as x-api-key or Bearer; --lenient-fields ignores unknown fields of both APIs and
    still refuses the known ones it does not implement."""
    port = test_http_tiny.free_port()
    args = ("--api-key", "sekret", "--lenient-fields")
    popen = test_http_tiny.start_frontend(cluster, port, extra_args=args)
    url, hi = f"http://127.0.0.1:{port}", [{"role": "user", "content": "hi"}]
    try:
        ok = anthropic.Anthropic(base_url=url, api_key="sekret", max_retries=0)
        assert ok.messages.count_tokens(model="tiny", messages=hi).input_tokens > 0
        with pytest.raises(anthropic.AuthenticationError) as caught:
            anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0).messages.create(
                model="tiny", max_tokens=2, messages=hi
            )
        assert caught.value.body["error"]["type"] == "authentication_error"
        bogus = {"colour": "red"}
        answer = ok.messages.create(model="tiny", max_tokens=2, messages=hi, extra_body=bogus)
        assert answer.stop_reason in ("end_turn", "max_tokens")
        with pytest.raises(anthropic.BadRequestError, match="thinking"):
            ok.messages.create(
                model="tiny",
                max_tokens=2,
                messages=hi,
                extra_body={"thinking": {"type": "enabled", "budget_tokens": 1024}},
            )
        oai = openai.OpenAI(base_url=f"{url}/v1", api_key="sekret", max_retries=0)
        r = oai.responses.create(model="tiny", input="hi", max_output_tokens=2, extra_body=bogus)
        assert r.status in ("completed", "incomplete")
        with pytest.raises(openai.BadRequestError) as refused:
            oai.responses.create(model="tiny", input="hi", previous_response_id=r.id)
        assert refused.value.body["param"] == "previous_response_id"
        no = httpx.post(f"{url}/v1/responses", json={"input": "hi"}, headers={"x-api-key": "no"})
        assert no.status_code == 401
    finally:
        test_http_tiny.stop_frontend(popen)


# Output that cannot end early: a string of at least 20,000 characters, which the grammar holds
# the model to (the tiny random model, free, may sample its end of turn at any token).
ENDLESS = {"type": "object", "properties": {"a": {"type": "string", "minLength": 20000}}}
ENDLESS["required"] = ["a"]


@pytest.mark.parametrize(
    "path, body",
    [
        (
            "/v1/responses",
            {
                "input": "go on",
                "max_output_tokens": LONG,
                "text": {"format": {"type": "json_schema", "name": "endless", "schema": ENDLESS}},
            },
        ),
        (
            "/v1/messages",
            {
                "max_tokens": LONG - 1000,  # the tool's prompt takes room too
                "messages": [{"role": "user", "content": "go on"}],
                "tools": [{"name": "endless", "input_schema": ENDLESS}],
                "tool_choice": {"type": "any"},
            },
        ),
    ],
)
def test_disconnect_mid_stream_aborts_the_request_in_the_engine(cluster, base_url, path, body):
    key = ("splitserve_generations_total", (("outcome", "disconnected"),))
    before = metrics(base_url).get(key, 0.0)
    with httpx.Client(timeout=60) as http:
        with http.stream(
            "POST", f"{base_url}{path}", json={**body, "stream": True, "temperature": 0}
        ) as r:
            assert r.status_code == 200
            lines = r.iter_lines()  # kept: a dropped iterator would close the connection now
            assert next(lines).startswith("event: ")
            _wait_for(lambda: _running_in_engine(cluster) >= 1)
    _wait_for(lambda: metrics(base_url)[("splitserve_http_requests_in_flight", ())] == 0)
    assert metrics(base_url)[key] == before + 1
    _wait_for(lambda: _running_in_engine(cluster) == 0, IDLE_WITHIN_S)
