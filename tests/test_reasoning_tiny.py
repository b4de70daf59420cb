"""Reasoning models end to end (issue 42 part 3): a tiny random Qwen3-shaped model whose chat
template opens ``<think>`` in the prompt (and writes an empty thinking block with
``enable_thinking: false``), served with --reasoning-parser qwen3, read with the official
``openai`` and ``anthropic`` SDKs (real processes, the HTTP frontend).

The random model never writes ``</think>``: its whole output is thinking, which is what each
API must carry apart from the answer (chat ``reasoning_content``, a Responses ``reasoning``
item, a Messages ``thinking`` block), streamed and not, and equal to what the same prompt
generates as raw text. Where ``</think>`` splits text and calls: tests/detok_worker."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

from tests.chat_templates import with_template
from tests.test_tool_calls_tiny import serve

THINK_TEMPLATE = """{%- for message in messages -%}
<|im_start|>{{ message['role'] }}
{% if message['reasoning_content'] is defined %}<think>{{ message['reasoning_content'] }}</think>
{% endif %}{{ message['content'] }}<|im_end|>
{% endfor -%}
{%- if add_generation_prompt -%}
<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% else %}<think>
{% endif -%}
{%- endif -%}
"""
ASK = [{"role": "user", "content": "Which is larger, 9.11 or 9.8?"}]
# Greedy, the random model writes blank lines; seeded sampling (chat and completions take a
# seed) gives words, the same from both.
GREEDY = {"temperature": 0, "max_tokens": 12}
SEEDED = {"temperature": 1.0, "seed": 7, "max_tokens": 12}
OFF = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def base_url(tiny_model_dir, tmp_path_factory):
    model_dir = with_template(tiny_model_dir, tmp_path_factory.mktemp("tiny-think"), THINK_TEMPLATE)
    yield from serve(model_dir, reasoning_parser="qwen3")


@pytest.fixture(scope="module")
def oai(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def claude(base_url):
    return anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0, timeout=60)


def raw_text(base_url, oai, sampling=GREEDY, **extra) -> str:
    """What the chat's prompt generates as plain text (its ids through completions)."""
    body = {"model": "tiny", "messages": ASK, **extra}
    ids = httpx.post(f"{base_url}/tokenize", json=body, timeout=60).json()["tokens"]
    return oai.completions.create(model="tiny", prompt=ids, **sampling).choices[0].text


@pytest.fixture(scope="module")
def thinking(base_url, oai):
    text = raw_text(base_url, oai)
    assert text and "</think>" not in text
    return text


def test_chat_thinking_is_reasoning_content(base_url, oai):
    thinking = raw_text(base_url, oai, SEEDED)
    assert thinking.strip() and "</think>" not in thinking
    r = oai.chat.completions.create(model="tiny", messages=ASK, **SEEDED)
    message = r.choices[0].message
    assert message.reasoning_content == thinking  # type: ignore[attr-defined]
    assert not message.content and r.choices[0].finish_reason == "length"
    reasoning, content, chunks = "", "", 0
    for chunk in oai.chat.completions.create(model="tiny", messages=ASK, stream=True, **SEEDED):
        for choice in chunk.choices:
            delta = choice.delta
            reasoning += getattr(delta, "reasoning_content", None) or ""
            content += delta.content or ""
            chunks += bool(getattr(delta, "reasoning_content", None))
    assert reasoning == thinking and content == "" and chunks > 1


def test_thinking_off_splits_nothing(base_url, oai, thinking):
    answer = raw_text(base_url, oai, **OFF)
    r = oai.chat.completions.create(model="tiny", messages=ASK, extra_body=OFF, **GREEDY)
    message = r.choices[0].message
    assert message.content == answer
    assert getattr(message, "reasoning_content", None) is None


def test_responses_reasoning_item(oai, thinking):
    r = oai.responses.create(model="tiny", input=ASK, temperature=0, max_output_tokens=12)
    assert [item.type for item in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == thinking and r.output_text == ""
    events = list(
        oai.responses.create(
            model="tiny", input=ASK, temperature=0, max_output_tokens=12, stream=True
        )
    )
    kinds = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    assert "".join(deltas) == thinking and len(deltas) > 1
    done = [e for e in events if e.type == "response.reasoning_text.done"]
    assert [e.text for e in done] == [thinking]
    assert kinds.count("response.output_item.added") == 2 and kinds[-1] == "response.incomplete"
    assert events[-1].response.output[0].content[0].text == thinking


def test_messages_thinking_block(claude, base_url, oai, thinking):
    m = claude.messages.create(
        model="tiny", messages=ASK, max_tokens=12, extra_body={"temperature": 0}
    )
    assert [b.type for b in m.content] == ["thinking"] and m.content[0].thinking == thinking
    assert m.stop_reason == "max_tokens"
    with claude.messages.stream(
        model="tiny", messages=ASK, max_tokens=12, extra_body={"temperature": 0}
    ) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert final.content[0].thinking == thinking and "thinking" in kinds
    # Anthropic's thinking switch is the template's enable_thinking.
    off = claude.messages.create(
        model="tiny",
        messages=ASK,
        max_tokens=12,
        extra_body={"temperature": 0},
        thinking={"type": "disabled"},
    )
    assert [b.type for b in off.content] == ["text"]
    assert off.content[0].text == raw_text(base_url, oai, **OFF)
    tokens = {
        kind: claude.messages.count_tokens(
            model="tiny",
            messages=ASK,
            thinking={"type": kind, "budget_tokens": 1024} if kind == "enabled" else {"type": kind},
        ).input_tokens
        for kind in ("enabled", "disabled")
    }
    assert tokens["disabled"] > tokens["enabled"]  # the template wrote the empty block


def test_grammar_with_thinking_is_refused_clearly(oai):
    schema = {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "integer"}}}
    with pytest.raises(openai.BadRequestError, match="enable_thinking"):
        oai.chat.completions.create(model="tiny", messages=ASK, response_format=schema, **GREEDY)
    r = oai.chat.completions.create(
        model="tiny", messages=ASK, response_format=schema, extra_body=OFF, **GREEDY
    )
    assert r.choices[0].message.content.strip().lstrip("-").isdigit()


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"enable_thinking": "false"}, "enable_thinking must be true or false"),
        ({"enable_thinking": 0}, "enable_thinking must be true or false"),
        ({"enable_thinking": None}, "enable_thinking must be true or false"),
        ([["enable_thinking", False]], "chat_template_kwargs"),
        ("enable_thinking=false", "chat_template_kwargs"),
        ({"messages": []}, "may not set 'messages'"),
    ],
)
def test_hostile_chat_template_kwargs(base_url, kwargs, words):
    body = {"model": "tiny", "messages": ASK, "max_tokens": 2, "chat_template_kwargs": kwargs}
    r = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and words in r.text, r.text


def test_unknown_template_kwargs_reach_the_template_unread(oai, thinking):
    extra = {"chat_template_kwargs": {"reasoning_budget": {"nested": [1, {"a": None}]}}}
    r = oai.chat.completions.create(model="tiny", messages=ASK, extra_body=extra, **GREEDY)
    assert r.choices[0].message.reasoning_content == thinking  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("thinking", "max_tokens", "words"),
    [
        ({"type": "enabled"}, 2000, "budget_tokens"),
        ({"type": "disabled", "budget_tokens": 2048}, 4000, "budget_tokens"),
        ({"type": "enabled", "budget_tokens": 512}, 2000, "budget_tokens"),
        ({"type": "enabled", "budget_tokens": "2048"}, 4000, "budget_tokens"),
        ({"type": "enabled", "budget_tokens": 2048}, 2000, "less than max_tokens"),
        ({"type": "maybe"}, 20, "thinking"),
        ({"type": "enabled", "budget_tokens": 2048, "extra": 1}, 4000, "extra"),
        ("enabled", 20, "thinking"),
        ([{"type": "enabled"}], 20, "thinking"),
    ],
)
def test_hostile_messages_thinking(base_url, thinking, max_tokens, words):
    body = {"model": "tiny", "messages": ASK, "max_tokens": max_tokens, "thinking": thinking}
    r = httpx.post(f"{base_url}/v1/messages", json=body, timeout=60)
    assert r.status_code == 400 and words in r.text, r.text
    assert r.json()["type"] == "error"


def test_an_earlier_answers_thinking_reaches_the_template(base_url, oai):
    said = {"role": "assistant", "content": "9.8."}
    history = [*ASK, said, {"role": "user", "content": "Sure?"}]
    thought = [*ASK, {**said, "reasoning_content": "9.8 has more tenths."}, history[-1]]

    def prompt_tokens(messages) -> int:
        return oai.chat.completions.create(
            model="tiny", messages=messages, max_tokens=1
        ).usage.prompt_tokens

    assert prompt_tokens(thought) > prompt_tokens(history)
    for message, words in (
        ({**said, "reasoning_content": 5}, "reasoning_content"),
        ({**said, "reasoning_content": ["a"]}, "reasoning_content"),
        ({**ASK[0], "reasoning_content": "x"}, "only an assistant message has reasoning_content"),
    ):
        body = {"model": "tiny", "messages": [*ASK, message], "max_tokens": 1}
        r = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 400 and words in r.text, r.text


def test_responses_takes_its_reasoning_items_back(oai):
    """An earlier answer's output replayed as input: its reasoning item goes to the assistant
    turn after it (the template shows it), as chat's reasoning_content."""
    first = oai.responses.create(model="tiny", input=ASK, temperature=0, max_output_tokens=4)
    assert first.output[0].type == "reasoning"
    said = {"role": "assistant", "content": "9.8."}
    thought = {
        "type": "reasoning",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": "9.8 has more tenths."}],
    }
    then = {"role": "user", "content": "Sure?"}

    def input_tokens(items) -> int:
        r = oai.responses.create(model="tiny", input=items, temperature=0, max_output_tokens=1)
        return r.usage.input_tokens

    assert input_tokens([*ASK, thought, said, then]) > input_tokens([*ASK, said, then])
    replayed = [*ASK, *[item.model_dump(exclude_none=True) for item in first.output], then]
    assert input_tokens(replayed) > 0


@pytest.mark.parametrize(
    ("item", "words"),
    [
        ({"type": "reasoning"}, "needs summary"),
        ({"type": "reasoning", "summary": [], "content": "text"}, "reasoning_text"),
        ({"type": "reasoning", "summary": [{"type": "output_text", "text": "x"}]}, "parts only"),
        ({"type": "reasoning", "summary": [], "role": "assistant"}, "has no role"),
        ({"type": "reasoning", "summary": "x"}, "summary"),
        (
            {"role": "user", "content": [{"type": "reasoning_text", "text": "x"}]},
            "belong to a reasoning item",
        ),
    ],
)
def test_hostile_reasoning_items(base_url, item, words):
    body = {"model": "tiny", "input": [*ASK, item], "max_output_tokens": 1}
    r = httpx.post(f"{base_url}/v1/responses", json=body, timeout=60)
    assert r.status_code == 400 and words in r.text, r.text
