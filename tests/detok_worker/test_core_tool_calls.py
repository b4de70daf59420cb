"""The detokenizer reads tool calls out of a request's text when its meta names a parser: the
calls leave the text and stream as deltas, a stop after a call is finish_reason "tool_calls",
stop strings still apply first; without a parser the same text is plain content."""

from __future__ import annotations

import json

import pytest

from ipc.messages import RequestMeta
from ipc.structured import ToolCall, add_tool_call_deltas
from runtime.model_files import load_tokenizer
from tests.detok_worker.test_core import CLIENT, core_with_clients, step

CALL = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
)


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    return load_tokenizer(default_model_dir)


def run(tokenizer, text: str, parser: str, reason: str = "stop", stop=()):
    core = core_with_clients(tokenizer, CLIENT)
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    meta = RequestMeta("r", CLIENT, prompt_tokens=3, stop=list(stop), tool_parser=parser)
    for i, token in enumerate(ids):
        core.on_step_output(
            step(
                i + 1,
                metas=[meta] if i == 0 else (),
                tokens=[("r", token)],
                finished=[("r", reason)] if i == len(ids) - 1 else (),
            )
        )
    events = core.take_output().events.get(CLIENT, [])
    calls: list[ToolCall] = []
    for event in events:
        add_tool_call_deltas(calls, event.tool_calls)
    return events, "".join(e.text for e in events), calls


def test_calls_stream_out_of_the_text(tokenizer):
    events, text, calls = run(tokenizer, f"Let me check.\n{CALL}\n{CALL}", "hermes")
    assert text == "Let me check."
    assert [c.name for c in calls] == ["get_weather"] * 2 and calls[0].id != calls[1].id
    assert json.loads(calls[0].arguments) == {"city": "Paris", "days": 2}
    pieces = [d for e in events for d in e.tool_calls]
    assert len(pieces) > 4  # the arguments streamed in fragments, not at the end
    assert events[-1].finished and events[-1].finish_reason == "tool_calls"
    assert [e.finished for e in events].count(True) == 1


def test_length_keeps_its_reason_and_no_parser_means_plain_text(tokenizer):
    events, _, calls = run(tokenizer, CALL, "hermes", reason="length")
    assert len(calls) == 1 and events[-1].finish_reason == "length"
    events, text, calls = run(tokenizer, CALL, "")
    assert text == CALL and not calls and events[-1].finish_reason == "stop"


def test_stop_strings_apply_before_the_parser(tokenizer):
    _, text, calls = run(tokenizer, f"Sure.\n{CALL}", "hermes", stop=["<tool_call>"])
    assert text.strip() == "Sure." and not calls
