"""Tool calls end to end on the tiny random model (real processes, the HTTP frontend, the SDKs).

Calls cut by max_tokens (issue 38): forced calls repeat until max_tokens cuts one; at every cut
the answer holds calls only, never the start of one as text, on chat (streamed and not),
Responses and Messages alike: a call cut inside its arguments is reported with them as far as
they went, one cut before is dropped.

A model family's own format (issue 37): a tiny model whose template is in Llama 3.1's style
gets its forced call in that format ({"name": ..., "parameters": ...}), read back into
tool_calls, and the call goes back into the template's history."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import anthropic
import openai
import pytest
from pydantic_core import from_json

from procs.launch_cluster import launch_cluster
from tests.chat_templates import LLAMA3_TOOLS_TEMPLATE, with_template
from tests.test_http_tiny import free_port, start_frontend, stop_frontend

LIGHT = {
    "type": "object",
    "properties": {"on": {"type": "boolean"}, "room": {"enum": ["hall", "kitchen"]}},
    "required": ["on", "room"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "function": {"name": "set_light", "parameters": LIGHT}}]
ASK = [{"role": "user", "content": "Lights on in the hall."}]


def serve(model_dir, **knobs):
    with launch_cluster(
        str(model_dir),
        tokenizer_workers=1,
        kv_cache_tokens=8192,
        max_model_len=1024,
        heartbeat_interval_s=0.1,
        engine_threads=1,
        **knobs,
    ) as cluster:
        port = free_port()
        popen = start_frontend(cluster, port)
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            stop_frontend(popen)


@pytest.fixture(scope="module")
def base_url(tiny_model_dir):
    yield from serve(tiny_model_dir)


@pytest.fixture(scope="module")
def oai(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=60)


def forced(oai, max_tokens: int, stream: bool = False):
    return chat(oai, TOOLS, "required", stream, max_tokens)


def chat(client, tools, tool_choice, stream: bool, max_tokens: int = 80):
    """(content, [(name, arguments)], finish_reason), from the answer or its stream."""
    kwargs = dict(model="tiny", messages=ASK, temperature=0, max_tokens=max_tokens)
    kwargs.update(tools=tools, tool_choice=tool_choice)
    if not stream:
        r = client.chat.completions.create(**kwargs)
        message = r.choices[0].message
        calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
        return message.content or None, calls, r.choices[0].finish_reason
    content, pieces, reason = "", [], None
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for piece in delta.tool_calls or []:
            if piece.id:
                pieces.append([piece.function.name, piece.function.arguments or ""])
            else:
                pieces[piece.index][1] += piece.function.arguments
        reason = chunk.choices[0].finish_reason or reason
    return content or None, [tuple(c) for c in pieces], reason


def check_calls(calls, reason):
    """Every call but a cut last one is whole and valid; the last one, when cut, is the start
    of one (its arguments a prefix of an object)."""
    for i, (name, arguments) in enumerate(calls):
        assert name == "set_light"
        try:
            value = json.loads(arguments)
        except json.JSONDecodeError:
            assert i == len(calls) - 1 and reason == "length" and arguments.startswith("{")
            continue
        assert value["room"] in ("hall", "kitchen") and isinstance(value["on"], bool)


@pytest.fixture(scope="module")
def cuts(oai):
    """The non-streamed chat answer at every other max_tokens up to two calls and a half (the
    tiny model spells a call in ~50 tokens: "<", "too", "l", ...), 8 requests at a time."""
    limits = range(1, 130, 2)
    with ThreadPoolExecutor(8) as pool:
        return dict(zip(limits, pool.map(lambda k: forced(oai, k), limits)))


def test_chat_a_cut_call_never_surfaces_as_text(cuts):
    partial = 0
    for k, (content, calls, reason) in cuts.items():
        assert not content, (k, content)  # the forced output is calls only
        check_calls(calls, reason)
        partial += reason == "length" and bool(calls) and not _valid(calls[-1][1])
    counts = [len(calls) for _, calls, _ in cuts.values()]
    assert max(counts) >= 2 and partial >= 3  # cuts inside arguments were seen, and reported
    # Before a call's arguments begin (tag, name: several tokens) it is not reported at all.
    assert sum(b == a for a, b in zip(counts, counts[1:])) > 0


def test_chat_streamed_cuts_match_the_whole_answers(oai, cuts):
    for k in range(1, 130, 8):
        assert forced(oai, k, stream=True) == cuts[k], k


def test_responses_and_messages_cut_calls_are_call_items_only(base_url, oai, cuts):
    claude = anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0, timeout=60)
    tools = [{"name": "set_light", "input_schema": LIGHT}]
    for k in range(3, 130, 12):
        _, calls, reason = cuts[k]
        r = oai.responses.create(
            model="tiny",
            input=ASK,
            tools=[{"type": "function", "name": "set_light", "parameters": LIGHT}],
            tool_choice="required",
            max_output_tokens=k,
            temperature=0,
        )
        items = [(i.name, i.arguments) for i in r.output if i.type == "function_call"]
        assert items == calls and r.output_text == "", k  # (an empty message when no call)
        assert r.status == ("incomplete" if reason == "length" else "completed")
        kwargs = dict(model="tiny", max_tokens=k, messages=ASK, tools=tools)
        m = claude.messages.create(
            **kwargs, tool_choice={"type": "any"}, extra_body={"temperature": 0}
        )
        assert [b.type for b in m.content] == ["tool_use"] * len(calls), (k, m.content)
        assert m.stop_reason == ("max_tokens" if reason == "length" else "tool_use")
        for block, (_, arguments) in zip(m.content, calls):
            assert block.input == from_json(arguments, allow_partial=True)  # as far as it went
        with claude.messages.stream(
            **kwargs, tool_choice={"type": "any"}, extra_body={"temperature": 0}
        ) as stream:
            opened = [e.content_block.type for e in stream if e.type == "content_block_start"]
            final = stream.get_final_message()
        assert opened == ["tool_use"] * len(calls), (k, opened)
        assert [(b.name, b.input) for b in final.content] == [(b.name, b.input) for b in m.content]
        assert final.stop_reason == m.stop_reason


def _valid(arguments: str) -> bool:
    try:
        json.loads(arguments)
    except json.JSONDecodeError:
        return False
    return True


# --- a Llama-3-style template -------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama_url(tiny_model_dir, tmp_path_factory):
    model_dir = with_template(
        tiny_model_dir, tmp_path_factory.mktemp("tiny-llama3"), LLAMA3_TOOLS_TEMPLATE
    )
    yield from serve(model_dir)


@pytest.mark.parametrize("stream", [False, True])
def test_a_llama3_template_gets_its_forced_call_in_its_own_format(llama_url, stream):
    client = openai.OpenAI(base_url=f"{llama_url}/v1", api_key="unused", max_retries=0, timeout=60)
    named = {"type": "function", "function": {"name": "set_light"}}
    content, calls, reason = chat(client, TOOLS, named, stream)
    assert content is None and reason == "tool_calls"
    ((name, arguments),) = calls
    value = json.loads(arguments)
    assert name == "set_light" and value["room"] in ("hall", "kitchen")
    # The call back in the history, rendered by the template (its "parameters" form), then
    # the result as an "ipython" turn: the conversation goes on.
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": name, "arguments": arguments}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "done"},
    ]
    r = client.chat.completions.create(
        model="tiny", messages=history, tools=TOOLS, max_tokens=4, temperature=0
    )
    assert r.choices[0].finish_reason in ("length", "stop", "tool_calls")
