"""A stream's text-only chunks come from a template per choice (ChoicesFormat._text_template):
every byte must be what chunk() + sse() write for the same delta, whatever the text and the
request's options."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from http_worker.answer_format import ChoiceOutput, sse, usage_body
from http_worker.completions_bodies import ChatFormat, CompletionFormat
from ipc.structured import ToolCallDelta

_OPTIONS = [
    {},
    {"include_usage": True},
    {"include_usage": True, "continuous_usage": True},
    {"prompt_logprobs": True},
    {"echo": True},
    {"logprobs": 2},
]


def _texts():
    # Valid Unicode (what the detokenizer sends): quotes, escapes, controls, non-ASCII, the mark.
    return st.text(
        st.characters(exclude_categories=["Cs"]), min_size=1, max_size=12
    ) | st.sampled_from(['"', "\\", "\n", "\x00splitserve text\x00", "é", "🙂", "</s>"])


@settings(max_examples=200, deadline=None)
@given(
    st.sampled_from([ChatFormat, CompletionFormat]),
    st.sampled_from(_OPTIONS),
    st.sampled_from(["m", 'a "model"', "\x00splitserve text\x00"]),
    st.lists(st.tuples(st.integers(0, 2), _texts()), min_size=1, max_size=4),
    st.booleans(),
)
def test_text_chunks_are_the_bytes_chunk_writes(cls, options, model, pieces, with_usage):
    fmt = cls(model, **options)
    usage = usage_body(3, 1, 0) if with_usage else None
    for index, text in pieces:
        out = ChoiceOutput(text=text)
        assert b"".join(fmt.stream_delta(index, out, usage)) == sse(fmt.chunk(index, out, usage))


@pytest.mark.parametrize("cls", [ChatFormat, CompletionFormat])
def test_other_chunks_are_written_in_full(cls):
    fmt = cls("m", include_usage=True)
    call = ToolCallDelta(index=0, id="call_1", name="f", arguments="")
    for out in (
        ChoiceOutput(text="a", finish_reason="stop"),
        ChoiceOutput(text="", finish_reason="length"),
        ChoiceOutput(text="a", tool_calls=[call]),
        ChoiceOutput(text="b", echo_text="prompt "),
    ):
        assert b"".join(fmt.stream_delta(0, out, None)) == sse(fmt.chunk(0, out, None))
    assert b"".join(fmt.stream_delta(0, ChoiceOutput(), None)) == b""
