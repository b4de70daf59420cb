"""Structured outputs and tool calling on the real default model (SmolLM2-135M-Instruct), through
the HTTP frontend with the `openai` client: every constrained output parses and validates, tool
calls carry valid arguments streamed and not, a conversation with a tool result is answered,
and unconstrained requests batched with constrained ones give the tokens they give alone."""

from __future__ import annotations

import json
import re
import threading
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest

from ipc.client import Client
from procs.launch_cluster import launch_cluster
from tests.test_http_tiny import openai_client

pytestmark = pytest.mark.slow

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "minLength": 1, "maxLength": 16},
                "country": {"enum": ["France", "Japan", "Peru", "Norway", "Other"]},
            },
            "required": ["city", "country"],
            "additionalProperties": False,
        },
        "color": {"enum": ["red", "green", "blue"]},
        "hobbies": {
            "type": "array",
            "items": {"type": "string", "maxLength": 12},
            "minItems": 1,
            "maxItems": 3,
        },
    },
    "required": ["name", "age", "address", "color", "hobbies"],
    "additionalProperties": False,
}
NAMES = ["Ada", "Bruno", "Chen", "Dana", "Emil", "Fatima", "Goro", "Hana"]
CITIES = ["Paris", "Tokyo", "Lima", "Oslo"]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "minLength": 1, "maxLength": 20},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The local time in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
ASK_WEATHER = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def cluster(default_model_dir):
    with launch_cluster(str(default_model_dir), tokenizer_workers=1, max_model_len=2048) as c:
        yield c


@pytest.fixture(scope="module")
def oai(cluster):
    with openai_client(cluster, "smollm2", timeout_s=600) as client:
        yield client


def chat(oai, messages, **kwargs):
    return oai.chat.completions.create(
        model="smollm2", messages=messages, temperature=0, **{"max_tokens": 160, **kwargs}
    )


def test_16_prompts_with_a_nested_schema_all_validate(oai):
    prompts = [
        [
            {
                "role": "user",
                "content": f"Describe {NAMES[i % 8]}, who lives in "
                f"{CITIES[i // 8]}, as a JSON object with name, age, address, favourite "
                f"color and hobbies.",
            }
        ]
        for i in range(16)
    ]
    fmt = {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": PERSON, "strict": True},
    }
    with ThreadPoolExecutor(16) as pool:  # all at once: one batch in the engine
        answers = list(pool.map(lambda m: chat(oai, m, response_format=fmt), prompts))
    for r in answers:
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)


def test_json_object_choice_and_regex(oai):
    r = chat(
        oai,
        [{"role": "user", "content": "Give a JSON object with the name and age of a cat."}],
        response_format={"type": "json_object"},
        max_tokens=200,
    )
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    r = chat(
        oai,
        [{"role": "user", "content": "Is Paris in France? Answer yes or no."}],
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    )
    assert r.choices[0].message.content in ("yes", "no")
    pattern = r"[A-Z][a-z]{2,12}, [A-Z][a-z]{2,12}"
    r = chat(
        oai,
        [{"role": "user", "content": "Name a city and its country."}],
        extra_body={"structured_outputs": {"regex": pattern}},
    )
    assert re.fullmatch(pattern, r.choices[0].message.content), r.choices[0].message.content


@pytest.mark.parametrize("choice", ["required", "named"])
@pytest.mark.parametrize("stream", [False, True])
def test_forced_tool_calls_have_valid_arguments(oai, choice, stream):
    tool_choice = (
        "required"
        if choice == "required"
        else {"type": "function", "function": {"name": "get_weather"}}
    )
    kwargs = dict(tools=[WEATHER, TIME], tool_choice=tool_choice, parallel_tool_calls=False)
    if stream:
        chunks = list(chat(oai, ASK_WEATHER, stream=True, **kwargs))
        calls: dict[int, dict] = {}
        for piece in (p for ch in chunks for p in (ch.choices[0].delta.tool_calls or [])):
            call = calls.setdefault(piece.index, {"name": None, "arguments": ""})
            call["name"] = call["name"] or piece.function.name
            call["arguments"] += piece.function.arguments or ""
        found = [(c["name"], c["arguments"]) for c in calls.values()]
        reason = chunks[-1].choices[0].finish_reason
    else:
        r = chat(oai, ASK_WEATHER, **kwargs)
        found = [(c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls]
        reason = r.choices[0].finish_reason
    assert reason == "tool_calls" and len(found) == 1
    name, arguments = found[0]
    if choice == "named":
        assert name == "get_weather"
    schema = {"get_weather": WEATHER, "get_time": TIME}[name]["function"]["parameters"]
    jsonschema.validate(json.loads(arguments), schema)


def test_a_conversation_with_a_tool_result_is_answered(oai):
    first = chat(
        oai, ASK_WEATHER, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False
    )
    call = first.choices[0].message.tool_calls[0]
    history = ASK_WEATHER + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {
            "role": "tool",
            "tool_call_id": call.id,
            "content": json.dumps({"temperature": 21, "sky": "sunny"}),
        },
    ]
    second = chat(oai, history, tools=[WEATHER], max_tokens=60)
    answer = second.choices[0].message
    assert second.choices[0].finish_reason == "stop" and not answer.tool_calls
    assert "21" in answer.content or "sunny" in answer.content.lower(), answer.content


def test_unconstrained_requests_are_untouched_by_constrained_ones_in_their_batch(cluster):
    plain = [
        [{"role": "user", "content": q}]
        for q in ("What is the capital of France?", "Name three colors.")
    ]
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    with Client(cluster.client_addr, deadline_s=600) as client:
        alone = [
            client.submit(messages=m, max_tokens=24, temperature=0).result().token_ids
            for m in plain
        ]
        handles = [client.submit(messages=m, max_tokens=24, temperature=0) for m in plain]
        handles += [
            client.submit(
                messages=[{"role": "user", "content": f"Describe {n} as a JSON object."}],
                max_tokens=160,
                temperature=0,
                response_format=fmt,
            )
            for n in NAMES[:4]
        ]
        results = [h.result() for h in handles]
    assert [r.token_ids for r in results[:2]] == alone
    for r in results[2:]:
        jsonschema.validate(json.loads(r.text), PERSON)


def test_the_paris_question_answers_alike_five_times_under_load(oai):
    # Issue 23: the second ask took its first 32 prompt tokens from the prefix cache and
    # answered "L'Étoile, la Marseillaise,". Two other streams keep the engine busy meanwhile
    # (their prompts and tokens share the question's steps).
    stop = threading.Event()

    def other_load(i: int) -> int:
        count = 0
        while not stop.is_set():
            ask = [
                {"role": "user", "content": f"Tell me about {NAMES[i]}, who lives in {CITIES[i]}."}
            ]
            chat(oai, ask, max_tokens=32)
            count += 1
        return count

    with ThreadPoolExecutor(2) as pool:
        others = [pool.submit(other_load, i) for i in range(2)]
        try:
            answers = [
                chat(oai, [{"role": "user", "content": "What is the capital of France?"}],
                     max_tokens=16).choices[0].message.content
                for _ in range(5)
            ]  # fmt: skip
        finally:
            stop.set()
        assert all(f.result() >= 1 for f in others)
    assert answers == ["The capital of France is Paris."] * 5
