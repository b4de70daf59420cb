"""The tokenizer worker's answers to /tokenize, /detokenize and /tokenizer_info, checked against
the tokenizer's own encode/decode and transformers' chat template."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from ipc.codec import pack_ids, unpack_id_list
from ipc.messages import ChatMessage, RequestError, SamplingParams, SubmitRequest
from ipc.messages.queries import TokenizeRequest, TokenizeResult
from ipc.structured import ToolCall
from runtime.model_files import load_tokenizer
from tests.chat_templates import THINKING_TEMPLATE, with_thinking_template
from tokenizer_worker.chat_template import ChatTemplate
from tokenizer_worker.prepare import Limits, RequestPreparer
from tokenizer_worker.query_answers import TokenizerQueries

LIMITS = Limits(max_model_len=512, vocab_size=49152)
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi ✓ 日本"}]


@pytest.fixture(scope="module")
def thinking_dir(default_model_dir, tmp_path_factory):
    return with_thinking_template(default_model_dir, tmp_path_factory.mktemp("thinking"))


@pytest.fixture(scope="module")
def queries(thinking_dir):
    return TokenizerQueries(
        load_tokenizer(thinking_dir),
        ChatTemplate.from_model_dir(thinking_dir),
        LIMITS,
        thinking_dir,
    )


@pytest.fixture(scope="module")
def hf(thinking_dir):
    return AutoTokenizer.from_pretrained(str(thinking_dir))


def ask(queries, **kwargs) -> TokenizeResult:
    answer = queries.answer(TokenizeRequest("q", b"c", **kwargs))
    assert isinstance(answer, TokenizeResult), answer
    return answer


@pytest.mark.parametrize("special", [True, False])
@pytest.mark.parametrize("text", ["Hello world", "  spaces\tand\nlines ✓ 日本", "<|im_start|>x"])
def test_tokenize_and_detokenize_match_the_tokenizer(queries, hf, text, special):
    answer = ask(queries, prompt=text, add_special_tokens=special, return_token_strs=True)
    ids = unpack_id_list(answer.token_ids)
    assert ids == hf(text, add_special_tokens=special)["input_ids"]
    assert answer.token_strs == hf.convert_ids_to_tokens(ids)
    assert answer.max_model_len == LIMITS.max_model_len
    assert ask(queries, detokenize_ids=pack_ids(ids)).text == hf.decode(ids)


@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}, {"enable_thinking": True}])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_tokens_match_transformers_with_template_kwargs(
    queries, hf, kwargs, add_generation_prompt
):
    messages = CHAT + [{"role": "user", "content": "and you?", "name": "Ann"}]
    answer = ask(
        queries,
        messages=[ChatMessage(**m) for m in messages],
        add_special_tokens=False,
        add_generation_prompt=add_generation_prompt,
        chat_template_kwargs=kwargs,
    )
    expected = hf.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
    )
    assert ("<think>" in expected) == (
        kwargs == {"enable_thinking": False} and add_generation_prompt
    )
    assert "(Ann)" in expected
    assert unpack_id_list(answer.token_ids) == hf(expected, add_special_tokens=False)["input_ids"]


def test_tokenizer_info_says_what_lm_eval_reads(queries):
    info = ask(queries, info=True).info
    assert (info["eos_token"], info["bos_token"], info["pad_token"]) == (
        "<|im_end|>",
        "<|im_start|>",
        "<|im_end|>",
    )
    assert info["chat_template"] == THINKING_TEMPLATE
    assert info["model_max_length"] == info["max_model_len"] == LIMITS.max_model_len
    assert info["tokenizer_class"] and info["vocab_size"] == LIMITS.vocab_size
    assert "sep_token" in info and info["sep_token"] is None


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"detokenize_ids": pack_ids([5, 49152])}, "must be in [0, 49152)"),
        ({"detokenize_ids": pack_ids([-1])}, "must be in [0, 49152)"),
        ({"messages": [ChatMessage("", "x")]}, "non-empty role"),
    ],
)
def test_bad_input_gets_an_error_naming_it(queries, kwargs, fragment):
    answer = queries.answer(TokenizeRequest("q", b"c", t_submit=3.0, **kwargs))
    assert isinstance(answer, RequestError) and fragment in answer.message
    assert (answer.request_id, answer.client_id, answer.code) == ("q", b"c", "bad_request")


@pytest.mark.parametrize("tool_choice", [None, "auto", "required", "none"])
def test_chat_with_tools_counts_what_a_request_with_them_is_computed_on(queries, tool_choice):
    """What count_tokens (POST /v1/messages/count_tokens) reads: the same rendering a chat
    request with these tools and this tool history gets, tools in the prompt or not."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    call = ToolCall("call_1", "f", '{"a": 1}')
    messages = [
        ChatMessage("user", "Use f."),
        ChatMessage("assistant", "", tool_calls=[call]),
        ChatMessage("tool", "42", tool_call_id="call_1"),
    ]
    choice = "" if tool_choice is None else json.dumps(tool_choice)
    counted = ask(queries, messages=messages, tools=json.dumps(tools), tool_choice=choice)
    preparer = RequestPreparer(queries.tokenizer, queries.chat_template, LIMITS)
    submit = SubmitRequest(
        "r", b"c", SamplingParams(), messages=messages, tools=json.dumps(tools), tool_choice=choice
    )
    (prepared,) = preparer.prepare_batch([submit])
    assert counted.token_ids == prepared.token_ids
    # The tools' prompt is there unless tool_choice is "none"; the history's call either way.
    without = unpack_id_list(ask(queries, messages=messages).token_ids)
    grown = len(unpack_id_list(counted.token_ids)) - len(without)
    assert grown > 50 if tool_choice != "none" else grown == 0
    # A tool history is written as requests get it (it was left out of /tokenize before).
    history = queries.tokenizer.decode(without)
    assert '<tool_call>\n{"name": "f", "arguments": {"a": 1}}' in history
    assert "<tool_response>\n42\n</tool_response>" in history


def test_tools_without_messages_or_malformed_are_refused(queries):
    with pytest.raises(ValueError, match="chat messages only"):
        TokenizeRequest("q", b"c", prompt="x", tools="[]")
    answer = queries.answer(
        TokenizeRequest("q", b"c", messages=[ChatMessage("user", "x")], tools='[{"type": "x"}]')
    )
    assert isinstance(answer, RequestError) and "tools[0]" in answer.message


@pytest.mark.parametrize("depth", [300, 980, 5000])
def test_a_history_call_with_arguments_nested_too_deep_is_a_bad_request(queries, depth):
    """A history call's arguments are a JSON string, so the body's depth bound never saw them:
    ~1000 levels made the tokenize query raise RecursionError out of the worker's loop (the
    worker hung) and a chat request a 500. Both are the caller's 400 now."""
    deep = ToolCall("call_1", "f", "[" * depth + "]" * depth)
    messages = [
        ChatMessage("user", "Use f."),
        ChatMessage("assistant", "", tool_calls=[deep]),
        ChatMessage("tool", "42", tool_call_id="call_1"),
    ]
    answer = queries.answer(TokenizeRequest("q", b"c", messages=messages))
    assert isinstance(answer, RequestError) and answer.code == "bad_request"
    assert "nest" in answer.message and "at most 200 levels" in answer.message
    preparer = RequestPreparer(queries.tokenizer, queries.chat_template, LIMITS)
    (prepared,) = preparer.prepare_batch(
        [SubmitRequest("r", b"c", SamplingParams(), messages=messages)]
    )
    assert isinstance(prepared, RequestError) and prepared.code == "bad_request"
    assert "at most 200 levels" in prepared.message
    # As deep as an HTTP body may nest is still rendered.
    ok = ToolCall("call_1", "f", "[" * 190 + "]" * 190)
    messages[1] = ChatMessage("assistant", "", tool_calls=[ok])
    assert ask(queries, messages=messages).token_ids
