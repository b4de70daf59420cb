"""Logprobs, echo and the sampling extras end to end on real processes (a cluster on the tiny
random model, the HTTP frontend as its own process, the real `openai` client and the SDK),
checked against transformers' forward on the same ids (fp32)."""

from __future__ import annotations

import numpy as np
import openai
import pytest
import torch
import transformers

from detok_worker.token_strings import TokenStrings
from ipc.client import Client
from procs.launch_cluster import launch_cluster
from runtime.model_files import load_tokenizer
from tests.test_http_tiny import free_port, start_frontend, stop_frontend
from tokenizer_worker.chat_template import ChatTemplate

TOLERANCE = 1e-3
CHUNK = 16  # prefill chunk: prompts longer than this are computed over several steps


@pytest.fixture(scope="module")
def cluster(tiny_model_dir):
    with launch_cluster(
        str(tiny_model_dir),
        tokenizer_workers=1,
        kv_cache_tokens=8192,
        max_model_len=2048,
        prefill_chunk_tokens=CHUNK,
        stream_interval_tokens=2,
        dtype="float32",  # compared with transformers' float32 forward within 1e-3
    ) as c:
        yield c


@pytest.fixture(scope="module")
def oai(cluster):
    port = free_port()
    popen = start_frontend(cluster, port)
    yield openai.OpenAI(
        base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60
    )
    stop_frontend(popen)


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(tiny_model_dir), dtype=torch.float32
    ).eval()


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


@pytest.fixture(scope="module")
def text_of(tokenizer):
    strings = TokenStrings(tokenizer)
    return lambda token_id: strings.get(token_id)[0]


def reference(hf, ids: list[int], new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy continuation of ``ids`` and the log-softmax at every position of
    prompt + continuation."""
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([ids]),
            max_new_tokens=new_tokens,
            do_sample=False,
            min_new_tokens=new_tokens,
            pad_token_id=2,
        )[0].tolist()
        return out[len(ids) :], hf(torch.tensor([out])).logits[0].log_softmax(-1)


def random_prompt(length: int, seed: int) -> list[int]:
    return [1] + np.random.default_rng(seed).integers(100, 40000, size=length - 1).tolist()


def completion_logprobs(oai, stream: bool, **kwargs) -> tuple[str, dict]:
    """Text and logprobs of choice 0, joined over a stream's chunks."""
    if not stream:
        choice = oai.completions.create(model="tiny", **kwargs).choices[0]
        return choice.text, choice.logprobs.model_dump()
    text, joined = "", {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for chunk in oai.completions.create(model="tiny", stream=True, **kwargs):
        (choice,) = chunk.choices
        text += choice.text
        for key, values in choice.logprobs.model_dump().items():
            joined[key] += values
    return text, joined


@pytest.mark.parametrize("stream", [False, True])
def test_completion_logprobs_match_transformers(oai, hf, text_of, stream):
    prompt = random_prompt(40, seed=stream)  # three prefill chunks
    tokens, ref = reference(hf, prompt, 6)
    text, lp = completion_logprobs(
        oai,
        stream,
        prompt=prompt,
        max_tokens=6,
        temperature=0,
        logprobs=3,
        extra_body={"ignore_eos": True},
    )
    assert lp["tokens"] == [text_of(t) for t in tokens]
    for i, (token, value, top) in enumerate(zip(tokens, lp["token_logprobs"], lp["top_logprobs"])):
        row = ref[len(prompt) - 1 + i]
        assert abs(value - float(row[token])) < TOLERANCE
        best = row.topk(3)
        expected = {text_of(t): float(v) for t, v in zip(best.indices.tolist(), best.values)}
        assert set(top) == set(expected) | {text_of(token)}
        assert all(abs(top[k] - v) < TOLERANCE for k, v in expected.items())
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    plain = oai.completions.create(
        model="tiny", prompt=prompt, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    ).choices[0]
    assert plain.text == text and plain.logprobs is None  # asking changes nothing else


def chat_prompt_ids(tiny_model_dir, tokenizer, messages) -> list[int]:
    text = ChatTemplate.from_model_dir(tiny_model_dir).render(messages, True)
    return tokenizer.encode(text, add_special_tokens=False).ids


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_match_transformers(oai, hf, tiny_model_dir, tokenizer, text_of, stream):
    messages = [{"role": "user", "content": f"Name a colour{'!' * stream}"}]
    tokens, ref = reference(hf, chat_prompt_ids(tiny_model_dir, tokenizer, messages), 5)
    kwargs = dict(
        model="tiny",
        messages=messages,
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=4,
        extra_body={"ignore_eos": True},
    )
    if stream:
        content = [
            e
            for chunk in oai.chat.completions.create(stream=True, **kwargs)
            for choice in chunk.choices
            if choice.logprobs
            for e in choice.logprobs.content
        ]
    else:
        content = oai.chat.completions.create(**kwargs).choices[0].logprobs.content
    rows = ref[len(ref) - len(tokens) - 1 : -1]
    assert [e.token for e in content] == [text_of(t) for t in tokens]
    for entry, token, row in zip(content, tokens, rows):
        assert abs(entry.logprob - float(row[token])) < TOLERANCE
        assert bytes(entry.bytes).decode(errors="replace") == entry.token
        best = row.topk(4)
        assert [t.token for t in entry.top_logprobs] == [text_of(i) for i in best.indices]
        np.testing.assert_allclose(
            [t.logprob for t in entry.top_logprobs], best.values, atol=TOLERANCE
        )


def test_echo_returns_the_prompt_and_its_logprobs(oai, hf, tokenizer):
    prompt = "The capital of France is"
    ids = tokenizer.encode(prompt).ids
    n = len(ids)
    _, ref = reference(hf, ids, 1)
    # What lm-evaluation-harness sends for a loglikelihood request.
    r = oai.completions.create(
        model="tiny", prompt=prompt, max_tokens=1, temperature=0, logprobs=1, echo=True
    )
    (choice,) = r.choices
    lp = choice.logprobs
    assert choice.text.startswith(prompt) and len(lp.tokens) == n + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    expected = ref[torch.arange(n - 1), torch.tensor(ids[1:])].tolist()
    np.testing.assert_allclose(lp.token_logprobs[1:n], expected, atol=TOLERANCE)
    assert "".join(lp.tokens[:n]) == prompt and lp.text_offset[n] == len(prompt)
    assert all(len(top) in (1, 2) for top in lp.top_logprobs[1:])
    scored = oai.completions.create(
        model="tiny", prompt=prompt, max_tokens=0, logprobs=0, echo=True
    ).choices[0]
    assert scored.text == prompt and scored.finish_reason == "length"
    assert scored.logprobs.token_logprobs == lp.token_logprobs[:n]


def test_prompt_logprobs_with_a_warm_prefix_cache_equal_the_uncached_ones(oai, hf):
    prompt = random_prompt(70, seed=7)  # five chunks, four cacheable blocks
    kwargs = dict(model="tiny", prompt=prompt, max_tokens=1, temperature=0)

    def prompt_logprobs():
        r = oai.completions.create(**kwargs, extra_body={"prompt_logprobs": 2})
        assert r.usage.prompt_tokens_details.cached_tokens == 0
        return [
            None if p is None else p[str(t)]["logprob"]
            for p, t in zip(r.choices[0].prompt_logprobs, prompt)
        ]

    cold = prompt_logprobs()
    assert cold[0] is None
    _, ref = reference(hf, prompt, 1)
    expected = ref[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])].tolist()
    np.testing.assert_allclose(cold[1:], expected, atol=TOLERANCE)
    warm = oai.completions.create(**kwargs)  # the cache now holds the prompt's blocks
    # and its tail, with its prompt end's final hidden state: all of it
    assert oai.completions.create(**kwargs).usage.prompt_tokens_details.cached_tokens == 70
    again = prompt_logprobs()
    assert again[0] is None and "prompt_logprobs" not in warm.choices[0].model_extra
    np.testing.assert_allclose(again[1:], cold[1:], atol=1e-5)


def test_min_tokens_and_logit_bias_change_the_output(oai, hf, text_of):
    prompt = random_prompt(12, seed=3)
    tokens, _ = reference(hf, prompt, 4)
    kwargs = dict(model="tiny", prompt=prompt, max_tokens=4, temperature=0, logprobs=0)
    forced = oai.completions.create(**kwargs, logit_bias={"4242": 100}).choices[0].logprobs
    assert forced.tokens == [text_of(4242)] * 4
    banned = oai.completions.create(**kwargs, logit_bias={str(tokens[0]): -100}).choices[0]
    assert banned.logprobs.tokens[0] != text_of(tokens[0])
    stopping = dict(kwargs, extra_body={"stop_token_ids": [tokens[0]]})
    assert oai.completions.create(**stopping).usage.completion_tokens == 1
    held = oai.completions.create(
        **{**stopping, "extra_body": {"stop_token_ids": [tokens[0]], "min_tokens": 3}}
    )
    assert held.usage.completion_tokens >= 3
    assert text_of(tokens[0]) not in held.choices[0].logprobs.tokens[:2]


def test_n_choices_each_get_their_own_logprobs(oai):
    kwargs = dict(
        model="tiny",
        prompt="Once upon",
        n=3,
        max_tokens=5,
        temperature=1.0,
        seed=3,
        logprobs=2,
        extra_body={"ignore_eos": True},
    )
    r = oai.completions.create(**kwargs)
    assert len({c.text for c in r.choices}) == 3
    streamed: dict[int, tuple[list, list]] = {i: ([], []) for i in range(3)}
    for chunk in oai.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            streamed[choice.index][0].extend(choice.logprobs.tokens)
            streamed[choice.index][1].extend(choice.logprobs.token_logprobs)
    for choice in r.choices:  # seeded: the same tokens (values up to a batch's float noise)
        tokens, values = streamed[choice.index]
        assert len(choice.logprobs.tokens) == 5 and tokens == choice.logprobs.tokens
        np.testing.assert_allclose(values, choice.logprobs.token_logprobs, atol=1e-4)


def test_include_stop_str_in_output(oai):
    kwargs = dict(
        model="tiny",
        prompt="one two three",
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    text = oai.completions.create(**kwargs).choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    cut = oai.completions.create(**kwargs, stop=[stop]).choices[0].text
    kept = (
        oai.completions.create(
            **{**kwargs, "extra_body": {"ignore_eos": True, "include_stop_str_in_output": True}},
            stop=[stop],
        )
        .choices[0]
        .text
    )
    assert kept == cut + stop and text.startswith(kept)


def test_the_sdk_exposes_logprobs_and_the_echoed_prompt(cluster, tokenizer):
    ids = tokenizer.encode("hello there world").ids
    with Client(cluster.client_addr) as client:
        handle = client.submit(
            prompt_token_ids=ids,
            max_tokens=3,
            temperature=0,
            logprobs=2,
            prompt_logprobs=1,
            echo=True,
            ignore_eos=True,
        )
        deltas = list(handle.stream(timeout=60))
        result = handle.result(60)
    assert deltas[0].echo_text == "hello there world" == result.echo_text
    assert [e.token_id for e in result.prompt_logprobs] == ids
    assert [e.token_id for e in result.logprobs] == result.token_ids and len(result.logprobs) == 3
    assert all(len(e.top) == 2 for e in result.logprobs)
    for delta in deltas:  # a token never travels without its logprobs
        assert [e.token_id for e in delta.logprobs] == delta.token_ids
