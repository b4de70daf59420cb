"""Hermes tool calls read back from text: whole and streamed in any pieces, the same result; the
name goes out before the arguments are complete; text that is not a call stays content."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from detok_worker.tool_parsers import TOOL_PARSERS, HermesToolParser, ParsedDelta
from ipc.structured import ToolCallDelta
from tests.detok_worker.whole_text import parse_complete

WEATHER = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
)
TRICKY = (
    '<tool_call>\n{"name": "say", "arguments": {"text": "a \\"}\\" </tool_call> {[", '
    '"n": [1, {"x": "]"}]}}\n</tool_call>'
)


def parser() -> HermesToolParser:
    ids = (f"call_{i}" for i in itertools.count())
    return HermesToolParser(new_id=lambda: next(ids))


def calls_of(text):
    content, calls = parse_complete(parser(), text)
    return content, [(c.id, c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize(
    "text, content, calls",
    [
        ("The capital is Paris.", "The capital is Paris.", []),
        ("ends with a space ", "ends with a space ", []),
        (WEATHER, "", [("call_0", "get_weather", {"city": "Paris", "days": 3})]),
        (
            "Let me check.\n" + WEATHER + "\n" + WEATHER.replace("Paris", "Oslo"),
            "Let me check.",
            [
                ("call_0", "get_weather", {"city": "Paris", "days": 3}),
                ("call_1", "get_weather", {"city": "Oslo", "days": 3}),
            ],
        ),
        (TRICKY, "", [("call_0", "say", {"text": 'a "}" </tool_call> {[', "n": [1, {"x": "]"}]})]),
        # Arguments before the name: parsed when the call closes.
        (
            '<tool_call>{"arguments": {"a": 1}, "name": "f"}</tool_call>',
            "",
            [("call_0", "f", {"a": 1})],
        ),
        # Not a call: kept as text, tags and all.
        ("<tool_call>not json</tool_call> ok", "<tool_call>not json</tool_call> ok", []),
        # Cut off after a complete object (eos or max tokens before the closing tag).
        ('<tool_call>\n{"name": "f", "arguments": {}}', "", [("call_0", "f", {})]),
        # Cut before its arguments began: dropped, never text (issue 38).
        ('<tool_call>\n{"name": "f", "argu', "", []),
        ('ok\n<tool_call>\n{"name": "get_weather",', "ok", []),
        ("ok <tool_call>\n", "ok", []),
        # An unclosed tag followed by prose is text.
        ("<tool_call> maybe later", "<tool_call> maybe later", []),
        ("a <tool_ b", "a <tool_ b", []),
    ],
)
def test_whole_outputs(text, content, calls):
    assert calls_of(text) == (content, calls)


def stream(text: str, cuts: list[int]) -> list[ParsedDelta]:
    p = parser()
    pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    return [p.feed(piece) for piece in pieces] + [p.finish()]


def merged(deltas: list[ParsedDelta]):
    content, calls = "", []
    for delta in deltas:
        content += delta.content
        for d in delta.tool_calls:
            if d.id is not None:
                assert d.index == len(calls) and d.name
                calls.append([d.id, d.name, d.arguments])
            else:
                calls[d.index][2] += d.arguments
    return content, [(i, n, json.loads(a)) for i, n, a in calls]


SAMPLES = [
    "Let me check.\n" + WEATHER + "\n" + WEATHER.replace("Paris", "Oslo"),
    TRICKY,
    "plain <tool text",
    '<tool_call>{"arguments": {"a": 1}, "name": "f"}</tool_call>',
]


@settings(max_examples=150, deadline=None)
@given(sample=st.sampled_from(SAMPLES), data=st.data())
def test_streamed_in_any_pieces_equals_whole(sample, data):
    cuts = sorted(set(data.draw(st.lists(st.integers(1, len(sample) - 1), max_size=12))))
    assert merged(stream(sample, cuts)) == calls_of(sample)


def test_char_by_char_name_first_then_argument_fragments():
    deltas = stream(WEATHER, list(range(1, len(WEATHER))))
    first = next(i for i, d in enumerate(deltas) if d.tool_calls)
    start = deltas[first].tool_calls[0]
    assert start.as_openai() == {
        "index": 0,
        "id": "call_0",
        "type": "function",
        "function": {"name": "get_weather", "arguments": "{"},
    }
    # The name went out as soon as the arguments began, long before they were complete.
    assert WEATHER[: first + 1].endswith('"arguments": {')
    fragments = [d.tool_calls[0] for d in deltas[first + 1 :] if d.tool_calls]
    assert len(fragments) > 10 and all(f.id is None for f in fragments)
    assert fragments[0].as_openai() == {"index": 0, "function": {"arguments": '"'}}
    assert all(len(d.tool_calls) <= 1 for d in deltas)
    assert all(not d.content for d in deltas)


def test_text_that_may_open_a_call_is_held_back_then_released():
    p = parser()
    assert p.feed("Hello <tool").content == "Hello"  # the space waits for what follows
    assert p.feed("box> there").content == " <toolbox> there"
    assert p.finish().content == ""


def test_registry_names_the_default_format():
    assert TOOL_PARSERS["hermes"] is HermesToolParser
    assert ToolCallDelta(2, arguments="x").as_openai() == {
        "index": 2,
        "function": {"arguments": "x"},
    }
