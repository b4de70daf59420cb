"""The detokenizer reads tool calls out of a request's text when its meta names a parser: the
calls leave the text and stream as deltas, a stop after a call is finish_reason "tool_calls",
stop strings still apply first; without a parser the same text is plain content."""

from __future__ import annotations

import json

import pytest

from ipc.messages import RequestMeta
from ipc.structured import ToolCall, add_tool_call_deltas
from runtime.model_files import load_tokenizer
from tests.detok_worker.test_core import CLIENT, core_with_clients, feed_one_per_step

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
    events = feed_one_per_step(core, meta, ids, reason)
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


def test_a_cut_call_is_dropped_and_a_partial_one_keeps_its_arguments(tokenizer):
    events, text, calls = run(
        tokenizer, 'Sure.\n<tool_call>\n{"name": "get_weather",', "hermes", "length"
    )
    assert text == "Sure." and not calls and events[-1].finish_reason == "length"
    events, text, calls = run(tokenizer, CALL[:60], "hermes", reason="length")
    assert text == "" and len(calls) == 1 and calls[0].arguments == CALL[CALL.index("{", 20) : 60]


@pytest.fixture(scope="module")
def mistral_tokenizer(default_model_dir):
    """The default tokenizer with Mistral's markers as special tokens (skipped when decoded)."""
    tokenizer = load_tokenizer(default_model_dir)
    tokenizer.add_special_tokens(["[TOOL_CALLS]", "[ARGS]"])
    return tokenizer


def test_marker_tokens_reach_the_parser_though_special_tokens_are_skipped(mistral_tokenizer):
    text = 'Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]f[ARGS]{}'
    ids = mistral_tokenizer.encode(text, add_special_tokens=False).ids
    assert mistral_tokenizer.token_to_id("[TOOL_CALLS]") in ids
    assert "[TOOL_CALLS]" not in mistral_tokenizer.decode(ids, skip_special_tokens=True)
    events, content, calls = run(mistral_tokenizer, text, "mistral")
    assert content == "Checking." and [c.name for c in calls] == ["get_weather", "f"]
    assert json.loads(calls[0].arguments) == {"city": "Oslo"} and len(calls[0].id) == 9
    assert events[-1].finish_reason == "tool_calls"
    _, content, calls = run(mistral_tokenizer, text, "")  # no parser: the markers stay skipped
    assert content == 'Checking.get_weather{"city": "Oslo"}f{}' and not calls
