"""Which reasoning parser a model gets, read from its chat template or named, and what it means
for one request: only chat requests, none with enable_thinking false, the output starting in
the thinking when the prompt opened it (deepseek_r1: always)."""

from __future__ import annotations

import pytest

from ipc.client.requests import build_submit
from ipc.messages import ChatMessage, RequestError, SamplingParams, SubmitRequest, TokenizedRequest
from ipc.structured import StructuredOutputSpec
from runtime.model_files import load_tokenizer
from tests.chat_templates import LLAMA3_TOOLS_TEMPLATE, THINKING_TEMPLATE
from tests.test_reasoning_tiny import THINK_TEMPLATE
from tokenizer_worker.chat_template import ChatTemplate
from tokenizer_worker.prepare import Limits, RequestPreparer
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


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    return load_tokenizer(default_model_dir)


def prepared(tokenizer, source: str, **sampling_kwargs):
    preparer = RequestPreparer(
        tokenizer,
        template(source),
        Limits(max_model_len=2048, vocab_size=49152),
        reasoning_parser="qwen3",
    )
    request = build_submit(
        b"c",
        "r",
        prompt=None,
        messages=[{"role": "user", "content": "Name a city."}],
        prompt_token_ids=None,
        sampling=SamplingParams(max_tokens=8),
        sampling_kwargs=sampling_kwargs,
        add_generation_prompt=True,
        t_submit=0.0,
    )
    return preparer.prepare_batch([request])[0]


def test_a_grammar_binds_the_whole_output_or_is_refused(tokenizer):
    plain = prepared(tokenizer, THINK_TEMPLATE)
    assert isinstance(plain, TokenizedRequest)
    assert (plain.meta.reasoning_parser, plain.meta.reasoning_open) == ("qwen3", True)
    regex = {"response_format": StructuredOutputSpec("regex", "<think>[a-z]+")}
    # The prompt opened the thinking: a grammar would bind it, so the request is refused.
    refused = prepared(tokenizer, THINK_TEMPLATE, **regex)
    assert isinstance(refused, RequestError) and "enable_thinking" in refused.message
    assert refused.param == "response_format"
    # Not opened: the grammar holds from the first token, the output is all answer (its
    # "<think>" is the grammar's text), nothing is split.
    bound = prepared(tokenizer, THINKING_TEMPLATE, **regex)
    assert isinstance(bound, TokenizedRequest) and bound.grammar
    assert (bound.meta.reasoning_parser, bound.meta.reasoning_open) == ("", False)
    unbound = prepared(tokenizer, THINKING_TEMPLATE)
    assert isinstance(unbound, TokenizedRequest)
    assert (unbound.meta.reasoning_parser, unbound.meta.reasoning_open) == ("qwen3", False)
