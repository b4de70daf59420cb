"""The tokenizer worker's pure part: chat templates, encoding, validation."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from ipc.codec import pack_ids, unpack_id_list
from ipc.messages import ChatMessage, RequestError, SamplingParams, SubmitRequest, TokenizedRequest
from runtime.model_files import load_tokenizer
from tokenizer_worker.chat_template import ChatTemplate
from tokenizer_worker.prepare import Limits, RequestPreparer

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi ✓ 日本"}],
    [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c\n\nd"},
    ],
]


@pytest.fixture(scope="module")
def hf_tokenizer(default_model_dir):
    return AutoTokenizer.from_pretrained(str(default_model_dir))


@pytest.fixture(scope="module")
def preparer(default_model_dir):
    return RequestPreparer(
        load_tokenizer(default_model_dir),
        ChatTemplate.from_model_dir(default_model_dir),
        Limits(max_model_len=64, vocab_size=49152),
    )


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(
    default_model_dir, hf_tokenizer, conversation, add_generation_prompt
):
    ours = ChatTemplate.from_model_dir(default_model_dir).render(
        conversation, add_generation_prompt
    )
    theirs = hf_tokenizer.apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert ours == theirs


def test_chat_ids_match_transformers(preparer, hf_tokenizer):
    conversation = CONVERSATIONS[0]
    req = SubmitRequest(
        "r", b"c", SamplingParams(), messages=[ChatMessage(**m) for m in conversation]
    )
    (out,) = preparer.prepare_batch([req])
    expected = hf_tokenizer.apply_chat_template(
        conversation, tokenize=True, add_generation_prompt=True
    )
    expected = (
        expected["input_ids"]
        if isinstance(expected, dict) or hasattr(expected, "keys")
        else expected
    )
    assert unpack_id_list(out.token_ids) == list(expected)


def test_plain_prompt_matches_transformers_encode(preparer, hf_tokenizer):
    (out,) = preparer.prepare_batch([SubmitRequest("r", b"c", SamplingParams(), prompt="Hello")])
    assert unpack_id_list(out.token_ids) == hf_tokenizer("Hello")["input_ids"]
    assert out.meta.prompt_tokens == len(unpack_id_list(out.token_ids))


def _one(preparer, **kwargs):
    sampling = kwargs.pop("sampling", SamplingParams())
    return preparer.prepare_batch([SubmitRequest("r", b"c", sampling, **kwargs)])[0]


def test_too_long_prompt_is_rejected(preparer):
    out = _one(preparer, prompt="word " * 200)
    assert isinstance(out, RequestError) and "context length of 64" in out.message


def test_a_max_tokens_past_the_context_is_refused_and_one_that_fits_is_kept(preparer):
    """Issue 23: as OpenAI and vLLM, a limit the caller gave is not silently lowered."""
    out = _one(preparer, prompt="Hello", sampling=SamplingParams(max_tokens=1000))
    assert isinstance(out, RequestError) and out.param == "max_tokens"
    assert "max_tokens is 1000, but the prompt has 1 tokens" in out.message
    assert "at most 63 tokens" in out.message
    for too_many in (64, 2**31 - 1):
        out = _one(preparer, prompt="Hello", sampling=SamplingParams(max_tokens=too_many))
        assert isinstance(out, RequestError) and out.param == "max_tokens"
    out = _one(preparer, prompt="Hello", sampling=SamplingParams(max_tokens=63))
    assert isinstance(out, TokenizedRequest) and out.sampling.max_tokens == 63


def test_a_default_max_tokens_is_cut_to_the_room_left(preparer):
    out = _one(preparer, prompt="Hello", sampling=SamplingParams(default_max_tokens=1000))
    assert isinstance(out, TokenizedRequest)
    assert out.meta.prompt_tokens + out.sampling.max_tokens == 64
    out = _one(preparer, prompt="Hello", sampling=SamplingParams())
    assert out.sampling.max_tokens == 16  # the SDK's (and completions') default


def test_out_of_vocab_ids_and_stop_ids_are_rejected(preparer):
    out = _one(preparer, prompt_token_ids=pack_ids([1, 49152]))
    assert isinstance(out, RequestError) and "prompt_token_ids" in out.message
    out = _one(preparer, prompt_token_ids=pack_ids([-1]))
    assert isinstance(out, RequestError)
    out = _one(preparer, prompt="x", sampling=SamplingParams(stop_token_ids=[10**6]))
    assert isinstance(out, RequestError) and "stop_token_ids" in out.message


def test_one_bad_request_does_not_spoil_the_batch(preparer):
    reqs = [
        SubmitRequest("a", b"c", SamplingParams(), prompt="Hi"),
        SubmitRequest("b", b"c", SamplingParams(), prompt="word " * 200),
        SubmitRequest("c", b"c", SamplingParams(), prompt_token_ids=pack_ids([5, 6])),
    ]
    out = preparer.prepare_batch(reqs)
    assert [type(o).__name__ for o in out] == [
        "TokenizedRequest",
        "RequestError",
        "TokenizedRequest",
    ]
    assert unpack_id_list(out[2].token_ids) == [5, 6]


def test_logit_bias_ids_outside_the_vocabulary_are_rejected(preparer):
    out = _one(preparer, prompt="x", sampling=SamplingParams(logit_bias={5: 1.0, 49152: -1.0}))
    assert isinstance(out, RequestError)
    assert "logit_bias [49152] are outside the vocabulary (size 49152)" in out.message
    assert isinstance(
        _one(preparer, prompt="x", sampling=SamplingParams(logit_bias={49151: 100.0})),
        TokenizedRequest,
    )


def test_prompt_ids_reach_the_detokenizer_only_when_echo_or_prompt_logprobs_ask(preparer):
    plain = _one(preparer, prompt="Hello there", sampling=SamplingParams(logprobs=3))
    assert plain.meta.prompt_token_ids == b"" and not plain.meta.echo
    for sampling in (SamplingParams(echo=True), SamplingParams(max_tokens=0, prompt_logprobs=2)):
        out = _one(preparer, prompt="Hello there", sampling=sampling)
        assert out.meta.prompt_token_ids == out.token_ids and out.meta.echo == sampling.echo
        assert out.meta.prompt_logprobs == (sampling.prompt_logprobs is not None)
    stops = _one(preparer, prompt="x", sampling=SamplingParams(include_stop_str_in_output=True))
    assert stops.meta.include_stop_str_in_output


def test_min_tokens_follows_a_clamped_max_tokens(preparer):
    sampling = SamplingParams(default_max_tokens=500, min_tokens=400)
    out = _one(preparer, prompt="Hello", sampling=sampling)
    assert isinstance(out, TokenizedRequest)
    assert out.sampling.min_tokens == out.sampling.max_tokens == 64 - out.meta.prompt_tokens


def test_a_default_max_tokens_is_also_cut_to_max_default_tokens(default_model_dir):
    """Issue 38 item 7: a request without max_tokens (chat's default is the whole context) ran
    for minutes. Its default is cut to --max-default-tokens as well as to the room; a limit the
    request gives is not, and 0 leaves only the room (vLLM's default)."""

    def preparer(cap: int) -> RequestPreparer:
        return RequestPreparer(
            load_tokenizer(default_model_dir),
            ChatTemplate.from_model_dir(default_model_dir),
            Limits(max_model_len=64, vocab_size=49152, max_default_tokens=cap),
        )

    capped, uncapped = preparer(10), preparer(0)
    chat = [ChatMessage(role="user", content="Hi")]
    for kwargs in ({"prompt": "Hello"}, {"messages": chat}, {"prompt_token_ids": pack_ids([5])}):
        out = _one(capped, **kwargs, sampling=SamplingParams(default_max_tokens=64))
        assert out.sampling.max_tokens == 10, kwargs
        whole = _one(uncapped, **kwargs, sampling=SamplingParams(default_max_tokens=64))
        assert whole.sampling.max_tokens == 64 - whole.meta.prompt_tokens, kwargs
    assert _one(capped, prompt="Hello", sampling=SamplingParams()).sampling.max_tokens == 10
    small = SamplingParams(default_max_tokens=4)
    assert _one(capped, prompt="Hello", sampling=small).sampling.max_tokens == 4
    given = _one(capped, prompt="Hello", sampling=SamplingParams(max_tokens=40))
    assert given.sampling.max_tokens == 40  # asked for: not cut
    follows = SamplingParams(default_max_tokens=64, min_tokens=30)
    out = _one(capped, prompt="Hello", sampling=follows)
    assert (out.sampling.max_tokens, out.sampling.min_tokens) == (10, 10)
    near_the_end = _one(capped, prompt_token_ids=pack_ids([5] * 60), sampling=follows)
    assert near_the_end.sampling.max_tokens == 4  # the room is less than the cap
    with pytest.raises(ValueError, match="max_default_tokens"):
        Limits(max_model_len=64, vocab_size=49152, max_default_tokens=-1)
