"""Tools on the prompt side: checks with named errors, what the chat template renders (generic
format for SmolLM2, passthrough for templates that know tools), and the grammar that forces
valid calls (read back by the Hermes parser, arguments valid against the function's schema)."""

from __future__ import annotations

import json
from enum import Enum
from typing import Literal

import jsonschema
import pytest
from pydantic import BaseModel, ConfigDict, Field

from detok_worker.tool_parsers import HermesToolParser
from engine_worker.grammar_builder import GrammarBuilder, backend_tokenizer
from tests.detok_worker.whole_text import parse_complete
from tests.engine_worker.grammar_helpers import (
    sample_constrained,
    text_of,
    tiny_vocabulary,
    wait_ready,
)
from tokenizer_worker.chat_template import ChatTemplate
from tokenizer_worker.grammar_compiler import GrammarCompiler
from tokenizer_worker.tool_calls import (
    ToolChoice,
    ToolSpecError,
    check_tools,
    conversation_for_template,
    forced_tool_call_spec,
    resolve_tool_choice,
    template_supports_tools,
)
from tokenizer_worker.tool_formats import rebase_refs

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 8},
                "unit": {"enum": ["c", "f"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
COUNT = {
    "type": "function",
    "function": {
        "name": "count",
        "parameters": {
            "type": "object",
            "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
            "required": ["n"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, COUNT]


# A tool whose parameters pydantic writes: nested models and an enum under "$defs", referenced
# with "$ref" (a default beside one), optional fields as anyOf [..., null]. Extra keys are
# forbidden, as OpenAI's strict tools (and its pydantic helper) have them.
class Unit(str, Enum):
    celsius = "celsius"
    fahrenheit = "fahrenheit"


class Place(BaseModel):
    model_config = ConfigDict(extra="forbid")
    city: str = Field(min_length=1, max_length=12)
    country: Literal["FR", "JP", "PE"] | None = None


class Forecast(BaseModel):
    model_config = ConfigDict(extra="forbid")
    where: Place
    unit: Unit = Unit.celsius
    days: int = Field(ge=1, le=7)
    also: list[Place] = Field(default_factory=list, max_length=2)


class Alarm(BaseModel):
    model_config = ConfigDict(extra="forbid")
    at: Place
    minutes: int | None = Field(default=None, ge=0, le=59)


PYDANTIC_TOOLS = [
    {"type": "function", "function": {"name": name, "parameters": model.model_json_schema()}}
    for name, model in (("forecast", Forecast), ("alarm", Alarm))
]
PYDANTIC_MODELS = {"forecast": Forecast, "alarm": Alarm}


@pytest.mark.parametrize(
    "tools, fragment",
    [
        ({"a": 1}, "must be a list"),
        ([{"type": "code_interpreter"}], 'tools[0] must be {"type": "function"'),
        ([{"type": "function", "function": {"name": "bad name"}}], "tools[0].function.name"),
        ([WEATHER, WEATHER], "'get_weather' is defined twice"),
        (
            [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}],
            "tools[0].function.parameters: invalid JSON schema",
        ),
    ],
)
def test_bad_tools_are_named(tools, fragment):
    with pytest.raises(ToolSpecError, match=fragment.replace("[", r"\[").replace("{", r"\{")):
        check_tools(tools)


def test_tool_choice():
    assert resolve_tool_choice(TOOLS, None) == ToolChoice("auto")
    assert resolve_tool_choice([], None) == ToolChoice("none")
    assert resolve_tool_choice(TOOLS, "required") == ToolChoice("required")
    assert resolve_tool_choice(TOOLS, "none") == ToolChoice("none")
    named = {"type": "function", "function": {"name": "count"}}
    assert resolve_tool_choice(TOOLS, named) == ToolChoice("named", "count")
    with pytest.raises(
        ToolSpecError,
        match="'nope', which is not among the tools "
        r"\(get_weather, count\)",
    ):
        resolve_tool_choice(TOOLS, {"type": "function", "function": {"name": "nope"}})
    with pytest.raises(ToolSpecError, match="needs at least one tool"):
        resolve_tool_choice([], "required")
    with pytest.raises(ToolSpecError, match="tool_choice must be"):
        resolve_tool_choice(TOOLS, "always")


HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'},
            },
            {
                "id": "call_2",
                "type": "function",
                "function": {"name": "count", "arguments": '{"n": 2}'},
            },
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": "2"},
]


def test_generic_format_for_a_template_without_tools(default_model_dir):
    template = ChatTemplate.from_model_dir(default_model_dir)
    source = (default_model_dir / "chat_template.jinja").read_text()
    assert not template_supports_tools(source)
    messages, tools = conversation_for_template(
        HISTORY, TOOLS, ToolChoice("named", "count"), supports_tools=False
    )
    assert tools is None and [m["role"] for m in messages] == [
        "system",
        "user",
        "assistant",
        "user",
    ]
    text = template.render(messages)
    assert json.dumps(WEATHER) in text and "You must call the function count." in text
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}'
        '\n</tool_call>\n<tool_call>\n{"name": "count"'
    ) in text
    assert (
        "<tool_response>\n18 C, sunny\n</tool_response>\n<tool_response>\n2\n"
        "</tool_response><|im_end|>"
    ) in text
    assert text.endswith("<|im_start|>assistant\n")
    # An existing system message is kept, the tools appended to it.
    with_system = [{"role": "system", "content": "Be brief."}] + HISTORY[:1]
    messages, _ = conversation_for_template(with_system, TOOLS, ToolChoice("auto"), False)
    assert messages[0]["content"].startswith("Be brief.\n\nYou can call functions")
    # "none": no tools in the prompt.
    messages, _ = conversation_for_template(HISTORY[:1], TOOLS, ToolChoice("none"), False)
    assert messages == HISTORY[:1]


def test_a_template_that_knows_tools_gets_them():
    source = (
        "{% if tools %}TOOLS:{{ tools | length }}{% endif %}{% for m in messages %}"
        "{{ m.role }}{% if m.tool_calls %}{{ m.tool_calls[0].function.arguments.city }}"
        "{% endif %};{% endfor %}"
    )
    assert template_supports_tools(source)
    messages, tools = conversation_for_template(HISTORY, TOOLS, ToolChoice("auto"), True)
    assert tools == TOOLS and messages[1]["tool_calls"][0]["function"]["arguments"] == {
        "city": "Paris",
        "unit": "c",
    }
    assert (
        ChatTemplate(source, {})._template.render(messages=messages, tools=tools)
        == "TOOLS:2user;assistantParis;tool;tool;"
    )
    assert HISTORY[1]["tool_calls"][0]["function"]["arguments"].startswith("{")  # not mutated


@pytest.fixture(scope="module")
def grammar_parts():
    vocabulary = tiny_vocabulary()
    builder = GrammarBuilder(vocabulary)
    yield vocabulary, GrammarCompiler(backend_tokenizer(vocabulary)), builder
    builder.close()


@pytest.mark.parametrize(
    "choice, parallel",
    [
        (ToolChoice("named", "get_weather"), False),
        (ToolChoice("named", "get_weather"), True),
        (ToolChoice("required"), False),
        (ToolChoice("required"), True),
    ],
)
def test_forced_calls_parse_and_match_the_schema(grammar_parts, choice, parallel):
    vocabulary, compiler, builder = grammar_parts
    assert forced_tool_call_spec(TOOLS, ToolChoice("auto")) is None
    spec = forced_tool_call_spec(TOOLS, choice, parallel_tool_calls=parallel)
    text = compiler.compile(spec)
    grammars = [wait_ready(builder.request(text)) for _ in range(6)]
    outputs, ended = sample_constrained(grammars, vocabulary.vocab_size, steps=400, seed=3)
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    counts = set()
    for tokens, how in zip(outputs, ended):
        assert how in ("stop", "eos")
        content, calls = parse_complete(HermesToolParser(), text_of(vocabulary, tokens).decode())
        assert content == "" and calls
        counts.add(len(calls))
        for call in calls:
            if choice.mode == "named":
                assert call.name == choice.name
            jsonschema.validate(json.loads(call.arguments), by_name[call.name])
    several = parallel and choice.mode == "required"  # a named function is called once
    assert counts == ({1} if not several else counts | {2})


@pytest.mark.parametrize(
    "choice", [ToolChoice("named", "forecast"), ToolChoice("required")], ids=["named", "required"]
)
def test_pydantic_parameters_with_local_defs_are_followed(grammar_parts, choice):
    """Each function's "$ref"s resolve inside its own parameters, wherever the call format puts
    them (one function, or one branch of several)."""
    vocabulary, compiler, builder = grammar_parts
    check_tools(PYDANTIC_TOOLS)
    text = compiler.compile(
        forced_tool_call_spec(PYDANTIC_TOOLS, choice, parallel_tool_calls=False)
    )
    grammars = [wait_ready(builder.request(text)) for _ in range(6)]
    outputs, ended = sample_constrained(grammars, vocabulary.vocab_size, steps=600, seed=5)
    for tokens, how in zip(outputs, ended):
        assert how in ("stop", "eos")
        content, calls = parse_complete(HermesToolParser(), text_of(vocabulary, tokens).decode())
        assert content == "" and len(calls) == 1
        assert choice.mode == "required" or calls[0].name == "forecast"
        PYDANTIC_MODELS[calls[0].name].model_validate_json(calls[0].arguments)
        schema = PYDANTIC_TOOLS[0 if calls[0].name == "forecast" else 1]["function"]["parameters"]
        jsonschema.validate(json.loads(calls[0].arguments), schema)


def test_rebased_refs_keep_data_and_remote_references():
    schema = {
        "$defs": {"A": {"type": "string"}},
        "properties": {
            "a": {"$ref": "#/$defs/A"},
            "self": {"$ref": "#"},
            "remote": {"$ref": "https://example.com/s.json"},
            "c": {"const": {"$ref": "#/not/a/reference"}, "default": {"$ref": "#"}},
        },
    }
    out = rebase_refs(schema, "#/anyOf/1/properties/arguments")
    assert out["properties"]["a"] == {"$ref": "#/anyOf/1/properties/arguments/$defs/A"}
    assert out["properties"]["self"] == {"$ref": "#/anyOf/1/properties/arguments"}
    assert out["properties"]["remote"] == schema["properties"]["remote"]
    assert out["properties"]["c"] == schema["properties"]["c"]  # values, not schemas
    assert schema["properties"]["a"] == {"$ref": "#/$defs/A"}  # the tool's own is untouched
