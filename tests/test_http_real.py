"""The HTTP frontend on the real default model (SmolLM2-135M-Instruct) with the openai client."""

from __future__ import annotations

import anthropic
import openai
import pytest

from procs.launch_cluster import launch_cluster
from tests.test_http_tiny import free_port, start_frontend, stop_frontend

pytestmark = pytest.mark.slow
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def oai(default_model_dir):
    # Dense fp32 weights and activations: the logprob test compares with transformers' fp32.
    with launch_cluster(
        str(default_model_dir),
        tokenizer_workers=1,
        max_model_len=2048,
        weights="fp32",
        dtype="float32",
    ) as c:
        port = free_port()
        popen = start_frontend(c, port, model_name="smollm2")
        try:
            yield openai.OpenAI(
                base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120
            )
        finally:
            stop_frontend(popen)


def test_chat_answers_paris(oai):
    r = oai.chat.completions.create(
        model="smollm2", messages=QUESTION, temperature=0, max_tokens=24
    )
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"  # the model ends its turn by itself
    assert r.usage.completion_tokens < 24


def test_streamed_chat_answers_paris(oai):
    chunks = list(
        oai.chat.completions.create(
            model="smollm2", messages=QUESTION, temperature=0, max_completion_tokens=24, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert "Paris" in text and chunks[-1].choices[0].finish_reason == "stop"


def test_stop_string_on_the_answer(oai):
    r = oai.chat.completions.create(
        model="smollm2", messages=QUESTION, temperature=0, max_tokens=24, stop=["Paris"]
    )
    assert r.choices[0].finish_reason == "stop" and "Paris" not in r.choices[0].message.content


@pytest.fixture(scope="module")
def hf(default_model_dir):
    from tests.reference_model import load_reference_model

    return load_reference_model(default_model_dir)


def test_echo_logprobs_score_a_continuation_as_transformers_does(oai, hf, default_model_dir):
    """lm-evaluation-harness's loglikelihood request; the raw logprobs equal transformers'
    log-softmax on the same ids (fp32) within 1e-3, and "Paris" is the greedy continuation."""
    import torch

    from runtime.model_files import load_tokenizer

    text = "The capital of France is Paris"
    ids = load_tokenizer(default_model_dir).encode(text).ids
    r = oai.completions.create(
        model="smollm2", prompt=text, max_tokens=1, temperature=0, logprobs=1, echo=True
    )
    lp = r.choices[0].logprobs
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].log_softmax(-1)
    expected = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    assert lp.token_logprobs[0] is None and len(lp.tokens) == len(ids) + 1
    assert max(abs(a - float(b)) for a, b in zip(lp.token_logprobs[1 : len(ids)], expected)) < 1e-3
    # " Paris" was the model's own choice after "The capital of France is".
    assert max(lp.top_logprobs[len(ids) - 1], key=lp.top_logprobs[len(ids) - 1].get) == " Paris"


def test_chat_logprobs_streamed_and_not_agree(oai):
    kwargs = dict(
        model="smollm2",
        messages=QUESTION,
        temperature=0,
        max_tokens=8,
        logprobs=True,
        top_logprobs=5,
    )
    full = oai.chat.completions.create(**kwargs).choices[0]
    streamed = [
        e
        for chunk in oai.chat.completions.create(stream=True, **kwargs)
        for choice in chunk.choices
        if choice.logprobs
        for e in choice.logprobs.content
    ]
    assert [e.token for e in streamed] == [e.token for e in full.logprobs.content]
    # Every token has its entry, the end-of-turn token too (its text is not in the content).
    assert "".join(e.token for e in full.logprobs.content) == full.message.content + "<|im_end|>"
    for a, b in zip(streamed, full.logprobs.content):
        assert abs(a.logprob - b.logprob) < 1e-4 and len(a.top_logprobs) == 5
        assert a.top_logprobs[0].token == a.token  # greedy: the most likely token was chosen


def test_responses_api_answers_paris(oai):
    """OpenAI's Responses API, end to end on the real model (tests/test_http_other_apis.py has
    the breadth on the tiny one)."""
    r = oai.responses.create(
        model="smollm2", input=QUESTION[0]["content"], max_output_tokens=24, temperature=0
    )
    assert r.status == "completed" and "Paris" in r.output_text


def test_messages_api_streams_paris(oai):
    """Anthropic's Messages API through the anthropic SDK's stream helper."""
    claude = anthropic.Anthropic(
        base_url=str(oai.base_url).removesuffix("/").removesuffix("/v1"),
        api_key="unused",
        max_retries=0,
    )
    with claude.messages.stream(
        model="smollm2", max_tokens=24, messages=QUESTION, extra_body={"temperature": 0}
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert "Paris" in text and final.stop_reason == "end_turn"
    assert final.content[0].text == text
