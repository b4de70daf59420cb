"""Structured outputs and tool calls through the whole cluster on the tiny random model: real
processes, the HTTP frontend, the `openai` client. The model's tokens are noise, so whatever
the output is, it is the grammar's doing. Bad input is a 400 naming the problem, and after an
engine restart the tokenizer sends the vocabulary again."""

from __future__ import annotations

import json
import os
import re
import signal

import jsonschema
import openai
import pytest

from ipc.client import Client
from procs.launch_cluster import launch_cluster
from tests.test_cluster_faults import pid_of, poll, restarted
from tests.test_http_tiny import openai_client

SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 3},
    },
    "required": ["color", "ok", "tags"],
    "additionalProperties": False,
}
TOOL = {
    "type": "function",
    "function": {
        "name": "set_light",
        "parameters": {
            "type": "object",
            "properties": {"on": {"type": "boolean"}, "room": {"enum": ["hall", "kitchen"]}},
            "required": ["on", "room"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "Go."}]


@pytest.fixture(scope="module")
def cluster(tiny_model_dir):
    with launch_cluster(
        str(tiny_model_dir),
        tokenizer_workers=1,
        kv_cache_tokens=8192,
        max_model_len=2048,
        heartbeat_interval_s=0.1,
        max_restarts=2,
    ) as c:
        yield c


@pytest.fixture(scope="module")
def oai(cluster):
    with openai_client(cluster, "tiny", timeout_s=120) as client:
        yield client


def chat(oai, **kwargs):
    return oai.chat.completions.create(
        model="tiny", messages=ASK, temperature=0, max_tokens=80, **kwargs
    )


def test_schema_choice_and_regex_shape_the_output(oai):
    r = chat(
        oai, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}
    )
    assert r.choices[0].finish_reason == "stop"  # the grammar ended it
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    r = chat(oai, extra_body={"structured_outputs": {"choice": ["alpha", "beta gamma"]}})
    assert r.choices[0].message.content in ("alpha", "beta gamma")
    r = oai.completions.create(
        model="tiny",
        prompt="Code:",
        temperature=0,
        max_tokens=40,
        extra_body={"structured_outputs": {"regex": r"[A-Z]{2}-\d{3}"}},
    )
    assert re.fullmatch(r"[A-Z]{2}-\d{3}", r.choices[0].text), r.choices[0].text


@pytest.mark.parametrize("stream", [False, True])
def test_a_named_function_is_called_with_valid_arguments(oai, stream):
    kwargs = dict(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "set_light"}})
    if not stream:
        r = chat(oai, **kwargs)
        calls, reason = r.choices[0].message.tool_calls, r.choices[0].finish_reason
        assert len(calls) == 1 and r.choices[0].message.content is None
        name, arguments = calls[0].function.name, calls[0].function.arguments
    else:
        chunks = list(chat(oai, stream=True, **kwargs))
        pieces = [c for ch in chunks for c in (ch.choices[0].delta.tool_calls or [])]
        assert pieces[0].id and pieces[0].type == "function" and pieces[0].index == 0
        assert all(p.id is None and p.index == 0 for p in pieces[1:])
        name = pieces[0].function.name
        arguments = "".join(p.function.arguments or "" for p in pieces)
        reason = chunks[-1].choices[0].finish_reason
    assert name == "set_light" and reason == "tool_calls"
    jsonschema.validate(json.loads(arguments), TOOL["function"]["parameters"])


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "objekt"}},
                }
            },
            "invalid JSON schema",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "array", "uniqueItems": True}},
                }
            },
            "unsupported JSON schema keyword(s): uniqueItems",
        ),
        ({"extra_body": {"structured_outputs": {"regex": "(ab"}}}, "unclosed group"),
        ({"extra_body": {"structured_outputs": {"grammar": "root ::= undefined"}}}, "grammar"),
        (
            {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "fly"}}},
            "tool_choice names the function 'fly', which is not among the tools (set_light)",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
            "tools[0].function.name",
        ),
        (
            {
                "tools": [TOOL],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "cannot be combined",
        ),
        ({"response_format": {"type": "yaml"}}, "response_format type must be"),
    ],
)
def test_bad_input_is_a_400_naming_the_problem(oai, kwargs, fragment):
    with pytest.raises(openai.BadRequestError) as caught:
        chat(oai, **kwargs)
    assert fragment in str(caught.value)


def test_the_vocabulary_reaches_a_restarted_engine(cluster):
    with Client(cluster.client_addr, deadline_s=120) as client:
        victim = pid_of(cluster, "engine")
        os.kill(victim, signal.SIGKILL)
        poll(lambda: restarted(cluster, "engine", 0, victim), timeout_s=60, what="engine restart")
        result = client.submit(
            messages=ASK,
            max_tokens=60,
            temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}},
        ).result(timeout=120)
    assert result.finish_reason == "stop"
    jsonschema.validate(json.loads(result.text), SCHEMA)
