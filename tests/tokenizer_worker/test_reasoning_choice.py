"""Which reasoning parser a model gets, read from its chat template or named, and what it means
for one request: only chat requests, none with enable_thinking false, the output starting in
the thinking when the prompt opened it (deepseek_r1: always)."""

from __future__ import annotations

import pytest

from ipc.messages import ChatMessage, SamplingParams, SubmitRequest
from tests.chat_templates import LLAMA3_TOOLS_TEMPLATE, THINKING_TEMPLATE
from tests.test_reasoning_tiny import THINK_TEMPLATE
from tokenizer_worker.chat_template import ChatTemplate
from tokenizer_worker.reasoning import choose_reasoning_parser, request_reasoning


def template(source: str) -> ChatTemplate:
    return ChatTemplate(source, {"bos_token": "<s>"})


@pytest.mark.parametrize(
    ("source", "knob", "parser"),
    [
        (THINK_TEMPLATE, "auto", "deepseek_r1"),  # its prompt ends inside <think>
        (THINKING_TEMPLATE, "auto", "qwen3"),  # writes both tags, opens none by default
        (LLAMA3_TOOLS_TEMPLATE, "auto", ""),
        ("{{ raise_exception('no') }}<think></think>", "auto", "qwen3"),  # probe fails: tags
        (THINK_TEMPLATE, "none", ""),
        (LLAMA3_TOOLS_TEMPLATE, "qwen3", "qwen3"),  # named: taken as named
        (THINKING_TEMPLATE, "deepseek_r1", "deepseek_r1"),
    ],
)
def test_the_parser_is_read_from_the_template_or_named(source, knob, parser):
    assert choose_reasoning_parser(template(source), knob) == parser


def test_no_template_and_a_bad_name():
    assert choose_reasoning_parser(None) == ""
    with pytest.raises(ValueError, match="reasoning_parser must be one of"):
        choose_reasoning_parser(None, "qwen")


def chat(**kwargs) -> SubmitRequest:
    return SubmitRequest(
        "r", b"c", SamplingParams(), messages=[ChatMessage("user", "hi")], **kwargs
    )


def test_what_a_request_gets():
    opened, closed = "<|im_start|>assistant\n<think>\n", "<think>\n\n</think>\n\n"
    assert request_reasoning("qwen3", chat(), opened) == ("qwen3", True)
    assert request_reasoning("qwen3", chat(), closed) == ("qwen3", False)
    assert request_reasoning("deepseek_r1", chat(), "no tag") == ("deepseek_r1", True)
    off = chat(chat_template_kwargs={"enable_thinking": False})
    assert request_reasoning("qwen3", off, opened) == ("", False)
    assert request_reasoning("", chat(), opened) == ("", False)
    prompt = SubmitRequest("r", b"c", SamplingParams(), prompt=opened)
    assert request_reasoning("deepseek_r1", prompt, opened) == ("", False)


@pytest.mark.parametrize("bad", ["false", 0, None, [False]])
def test_enable_thinking_must_be_a_boolean(bad):
    with pytest.raises(ValueError, match="enable_thinking must be true or false"):
        chat(chat_template_kwargs={"enable_thinking": bad})
