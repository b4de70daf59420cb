"""What the tokenizer worker makes of a request's response format and tools (the default model's
tokenizer and chat template, which knows no tools): the prompt the model sees, the grammar and
the tool parser that travel with the request, and the named errors."""

from __future__ import annotations

import json

import pytest

from ipc.client.requests import build_submit
from ipc.codec import unpack_id_list
from ipc.messages import RequestError, SamplingParams, TokenizedRequest
from ipc.structured import StructuredOutputSpec
from runtime.model_files import load_tokenizer
from tokenizer_worker.chat_template import ChatTemplate
from tokenizer_worker.prepare import Limits, RequestPreparer

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def preparer(default_model_dir):
    tokenizer = load_tokenizer(default_model_dir)
    return RequestPreparer(
        tokenizer,
        ChatTemplate.from_model_dir(default_model_dir),
        Limits(max_model_len=2048, vocab_size=49152),
    )


def prepare(preparer, messages=None, prompt=None, **options):
    request = build_submit(
        b"c",
        "r",
        prompt=prompt,
        messages=messages,
        prompt_token_ids=None,
        sampling=SamplingParams(max_tokens=8),
        sampling_kwargs=options,
        add_generation_prompt=True,
        t_submit=0.0,
    )
    result = preparer.prepare_batch([request])[0]
    if isinstance(result, TokenizedRequest):  # with the prompt the model sees
        return result, preparer.tokenizer.decode(
            unpack_id_list(result.token_ids), skip_special_tokens=False
        )
    return result, ""


def test_auto_tools_are_offered_in_the_generic_prompt_and_parsed(preparer):
    result, text = prepare(preparer, ASK, tools=[WEATHER])
    assert result.meta.tool_parser == "hermes" and result.grammar == ""
    assert "<tools>" in text and json.dumps(WEATHER) in text and "<tool_call>" in text
    none, text = prepare(preparer, ASK, tools=[WEATHER], tool_choice="none")
    assert none.meta.tool_parser == "" and "<tools>" not in text


def test_forced_calls_carry_a_grammar(preparer):
    named, text = prepare(
        preparer,
        ASK,
        tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    assert named.meta.tool_parser == "hermes" and "get_weather" in named.grammar
    assert "You must call the function get_weather." in text
    schema, _ = prepare(
        preparer, prompt="Name:", response_format=StructuredOutputSpec("regex", "[A-Z][a-z]+")
    )
    assert schema.grammar and schema.meta.tool_parser == ""


def test_token_ids_of_a_chat_rendered_with_tools_keep_the_parser_and_the_forced_grammar(preparer):
    """What an engine replica under Ray Serve receives: the ingress rendered the chat with the
    tools and sends their token ids, the tools beside them."""
    forced = {"type": "function", "function": {"name": "get_weather"}}
    rendered, _ = prepare(preparer, ASK, tools=[WEATHER], tool_choice=forced)
    request = build_submit(
        b"c",
        "r",
        prompt=None,
        messages=None,
        prompt_token_ids=unpack_id_list(rendered.token_ids),
        sampling=SamplingParams(max_tokens=8),
        sampling_kwargs={"tools": [WEATHER], "tool_choice": forced},
        add_generation_prompt=True,
        t_submit=0.0,
    )
    from_ids = preparer.prepare_batch([request])[0]
    assert isinstance(from_ids, TokenizedRequest) and from_ids.token_ids == rendered.token_ids
    assert from_ids.meta.tool_parser == "hermes" and from_ids.grammar == rendered.grammar


def test_a_history_with_calls_and_results_is_written_in_the_call_format(preparer):
    history = ASK + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "clear"}'},
    ]
    result, text = prepare(preparer, history, tools=[WEATHER])
    assert isinstance(result, TokenizedRequest)
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    )
    assert '<tool_response>\n{"sky": "clear"}\n</tool_response>' in text


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"prompt": "x", "tools": [WEATHER]}, "tools and tool_choice need chat messages"),
        (
            {
                "messages": ASK,
                "tools": [WEATHER],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "cannot be combined",
        ),
        (
            {"messages": ASK, "tools": [WEATHER], "tool_choice": {"type": "function"}},
            "tool_choice must be",
        ),
        (
            {"messages": ASK, "structured_outputs": {"json": {"type": "objekt"}}},
            "invalid JSON schema",
        ),
    ],
)
def test_bad_requests_are_named(preparer, kwargs, fragment):
    result, _ = prepare(preparer, **kwargs)
    assert isinstance(result, RequestError) and fragment in result.message
