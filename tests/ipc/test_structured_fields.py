"""OpenAI's response_format and vLLM's structured_outputs map to one spec; bad shapes name the
field they are in."""

from __future__ import annotations

import json
import re

import pytest

from ipc.structured import StructuredOutputError, StructuredOutputSpec, spec_from_request

SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}


@pytest.mark.parametrize(
    "kwargs, expected",
    [
        ({}, None),
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, StructuredOutputSpec("json_object")),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "person", "schema": SCHEMA, "strict": True},
                }
            },
            StructuredOutputSpec("json_schema", json.dumps(SCHEMA, separators=(",", ":"))),
        ),
        ({"structured_outputs": {"json": SCHEMA}}, StructuredOutputSpec.json_schema(SCHEMA)),
        (
            {"structured_outputs": {"json": '{"type": "string"}'}},
            StructuredOutputSpec("json_schema", '{"type": "string"}'),
        ),
        (
            {"structured_outputs": {"regex": r"\d+", "choice": None}},
            StructuredOutputSpec("regex", r"\d+"),
        ),
        (
            {"structured_outputs": {"choice": ["yes", "no"]}},
            StructuredOutputSpec("choice", choices=["yes", "no"]),
        ),
        (
            {"structured_outputs": {"grammar": 'root ::= "a"'}},
            StructuredOutputSpec("grammar", 'root ::= "a"'),
        ),
        ({"structured_outputs": {"json_object": True}}, StructuredOutputSpec("json_object")),
    ],
)
def test_mapping(kwargs, expected):
    assert spec_from_request(**kwargs) == expected


@pytest.mark.parametrize(
    "kwargs, param, fragment",
    [
        ({"response_format": "json"}, "response_format", 'must be an object with a "type"'),
        ({"response_format": {"type": "xml"}}, "response_format", "got 'xml'"),
        ({"response_format": {"type": "json_schema"}}, "response_format", 'needs a "json_schema"'),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
            "response_format",
            "name must be a string",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": [1]},
                }
            },
            "response_format.json_schema.schema",
            "must be a JSON schema object",
        ),
        ({"structured_outputs": {}}, "structured_outputs", "exactly one of"),
        (
            {"structured_outputs": {"regex": "a", "choice": ["a"]}},
            "structured_outputs",
            "got regex, choice",
        ),
        (
            {"structured_outputs": {"choice": []}},
            "structured_outputs.choice",
            "at least one choice",
        ),
        ({"structured_outputs": {"choice": [1]}}, "structured_outputs.choice", "list of strings"),
        ({"structured_outputs": {"regex": ""}}, "structured_outputs.regex", "non-empty regex"),
        ({"structured_outputs": {"grammar": 5}}, "structured_outputs.grammar", "must be a string"),
        (
            {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
            "structured_outputs",
            "not both",
        ),
    ],
)
def test_bad_shapes_name_the_field(kwargs, param, fragment):
    with pytest.raises(StructuredOutputError, match=fragment) as caught:
        spec_from_request(**kwargs)
    assert caught.value.param == param


def submit(**kwargs):
    from ipc.client.requests import build_submit

    return build_submit(
        b"c",
        "r",
        prompt=None,
        prompt_token_ids=None,
        sampling=None,
        messages=kwargs.pop("messages", [{"role": "user", "content": "hi"}]),
        sampling_kwargs=kwargs,
        add_generation_prompt=True,
        t_submit=0.0,
    )


def test_the_sdk_takes_the_same_fields_beside_sampling_keywords():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    request = submit(
        max_tokens=5,
        response_format={"type": "json_object"},
        tools=tools,
        tool_choice={"type": "function", "function": {"name": "f"}},
        parallel_tool_calls=False,
    )
    assert request.sampling.max_tokens == 5 and request.structured == StructuredOutputSpec(
        "json_object"
    )
    assert json.loads(request.tools) == tools and json.loads(request.tool_choice)["function"]
    assert request.parallel_tool_calls is False
    spec = StructuredOutputSpec("regex", "a+")
    assert submit(response_format=spec).structured is spec
    assert submit(structured_outputs={"choice": ["a"]}).structured.choices == ["a"]


def test_the_sdk_takes_openai_history_messages():
    request = submit(
        messages=[
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "f", "arguments": '{"x":1}'},
                    },
                    {
                        "id": "c2",
                        "type": "function",
                        "function": {"name": "g", "arguments": {"y": 2}},
                    },
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "42"},
        ]
    )
    calls = request.messages[0].tool_calls
    assert [(c.id, c.name, json.loads(c.arguments)) for c in calls] == [
        ("c1", "f", {"x": 1}),
        ("c2", "g", {"y": 2}),
    ]
    assert request.messages[0].content == "" and request.messages[1].tool_call_id == "c1"


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"response_format": {"type": "xml"}}, "got 'xml'"),
        ({"tools": [object()]}, "not JSON serializable"),
        ({"parallel_tool_calls": "yes"}, "parallel_tool_calls must be"),
        ({"messages": [{"role": "assistant", "content": None}]}, "need content or tool_calls"),
        ({"messages": [{"role": "user", "content": 3}]}, "a chat message is"),
        (
            {"messages": [{"role": "assistant", "content": "", "tool_calls": [{"id": "x"}]}]},
            "a tool call is",
        ),
    ],
)
def test_the_sdk_refuses_bad_fields(kwargs, fragment):
    from ipc.client import BadRequestError

    with pytest.raises(BadRequestError, match=re.escape(fragment)):
        submit(**kwargs)
