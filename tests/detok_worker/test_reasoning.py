"""The detokenizer splits a reasoning model's thinking out of the text: the splitter alone (fed
whole and piece by piece, the same answer), and the real DetokenizerCore with a real tokenizer,
where the thinking streams as StreamEvent.reasoning and tool calls are read after it."""

from __future__ import annotations

import pytest

from detok_worker.reasoning import ReasoningSplitter
from ipc.messages import RequestMeta
from ipc.structured import ToolCall, add_tool_call_deltas
from runtime.model_files import load_tokenizer
from tests.detok_worker.test_core import CLIENT, core_with_clients, feed_one_per_step


def split(text: str, starts_open: bool, piece: int = 0) -> tuple[str, str]:
    splitter = ReasoningSplitter(starts_open)
    pieces = [text[i : i + piece] for i in range(0, len(text), piece)] if piece else [text]
    parts = [splitter.feed(p) for p in pieces] + [splitter.finish()]
    return "".join(r for r, _ in parts), "".join(c for _, c in parts)


CASES = [
    # (output, the prompt opened <think>, reasoning, content)
    ("<think>\nweigh it\n</think>\n\nThe answer.", False, "\nweigh it\n", "The answer."),
    ("  <think>a</think>b", False, "a", "b"),
    ("The answer, no thinking.", False, "", "The answer, no thinking."),
    ("2 < 3 and <think> later", False, "", "2 < 3 and <think> later"),  # not first: text
    ("weigh it\n</think>\n\nThe answer.", True, "weigh it\n", "The answer."),
    ("<think>again</think>done", True, "again", "done"),
    ("cut off mid-thought", True, "cut off mid-thought", ""),  # no </think>: all thinking
    ("<think>cut off", False, "cut off", ""),
    ("<thi", False, "", "<thi"),
    ("a</think>", True, "a", ""),
    ("x</think>\n\n\n", True, "x", ""),
]


@pytest.mark.parametrize(("text", "opened", "reasoning", "content"), CASES)
@pytest.mark.parametrize("piece", [0, 1, 2, 5])
def test_split_is_the_same_whole_or_in_pieces(text, opened, reasoning, content, piece):
    assert split(text, opened, piece) == (reasoning, content)


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    return load_tokenizer(default_model_dir)


def run(tokenizer, text: str, *, parser="qwen3", opened=False, tools="", reason="stop"):
    core = core_with_clients(tokenizer, CLIENT)
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    meta = RequestMeta(
        "r",
        CLIENT,
        prompt_tokens=3,
        tool_parser=tools,
        reasoning_parser=parser,
        reasoning_open=opened,
    )
    return feed_one_per_step(core, meta, ids, reason)


def test_the_thinking_streams_apart_from_the_answer(tokenizer):
    events = run(tokenizer, "<think>\nLet me weigh 9.11 and 9.8.\n</think>\n\n9.8 is larger.")
    assert "".join(e.reasoning for e in events) == "\nLet me weigh 9.11 and 9.8.\n"
    assert "".join(e.text for e in events) == "9.8 is larger."
    assert sum(bool(e.reasoning) for e in events) > 3  # streamed, not held to the end
    first_text = next(i for i, e in enumerate(events) if e.text)
    assert not any(e.reasoning for e in events[first_text:])
    assert [e.finished for e in events].count(True) == 1


def test_deepseek_r1_output_cut_before_its_end_tag_is_all_thinking(tokenizer):
    events = run(tokenizer, "Hmm, 9.11 or 9.8", parser="deepseek_r1", opened=True, reason="length")
    assert "".join(e.reasoning for e in events) == "Hmm, 9.11 or 9.8"
    assert "".join(e.text for e in events) == "" and events[-1].finish_reason == "length"


def test_no_parser_leaves_the_tags_in_the_text(tokenizer):
    text = "<think>a</think>b"
    events = run(tokenizer, text, parser="")
    assert "".join(e.text for e in events) == text and not any(e.reasoning for e in events)


def test_tool_calls_are_read_after_the_thinking(tokenizer):
    call = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
    # A call written inside the thinking is thinking, not a call.
    events = run(tokenizer, f"<think>maybe {call}</think>\n\n{call}", tools="hermes")
    calls: list[ToolCall] = []
    for event in events:
        add_tool_call_deltas(calls, event.tool_calls)
    assert "".join(e.reasoning for e in events) == f"maybe {call}"
    assert [c.name for c in calls] == ["f"] and events[-1].finish_reason == "tool_calls"
