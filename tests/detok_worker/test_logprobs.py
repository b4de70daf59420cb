"""Logprobs, echo and include_stop_str_in_output in the detokenizer: token strings as OpenAI
shows them (byte-level and SentencePiece vocabularies), logprobs that travel with their tokens
whatever the stream interval, the prompt's text and logprobs on the first event."""

from __future__ import annotations

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models

from detok_worker.core import DetokenizerCore
from detok_worker.token_strings import TokenStrings
from ipc.codec import pack_ids, unpack_id_list
from ipc.messages import FinishRecord, PromptLogprobs, RequestMeta, StepOutput, TokenLogprobs
from runtime.model_files import load_tokenizer

CLIENT = b"client"


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    return load_tokenizer(default_model_dir)


def floats(values) -> bytes:
    return np.asarray(values, dtype="<f4").tobytes()


def test_byte_level_tokens_keep_their_own_bytes(tokenizer):
    strings = TokenStrings(tokenizer)
    text = "héllo ✓ 日本 the"
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    pieces = [strings.get(i) for i in ids]
    assert b"".join(data for _, data in pieces).decode() == text
    assert ("é", "é".encode()) in pieces and (" the", b" the") in pieces
    partial = [(t, d) for t, d in pieces if t.endswith("\ufffd")]  # "✓" is split in three
    assert partial and all(len(d) <= 2 for _, d in partial)
    assert strings.get(tokenizer.token_to_id("<|im_end|>")) == ("<|im_end|>", b"<|im_end|>")
    assert strings.get(10**7) == ("", b"")
    for token_id in range(0, 49152, 97):  # every token's text is what decoding it alone gives
        assert strings.get(token_id)[0] == tokenizer.decode([token_id], skip_special_tokens=False)


def test_sentencepiece_tokens_show_spaces_and_fallback_bytes():
    vocab = {"<unk>": 0, "\u2581the": 1, "<0xE2>": 2, "a": 3}
    sp = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    sp.decoder = decoders.Sequence(
        [
            decoders.Replace("\u2581", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    strings = TokenStrings(sp)
    assert strings.get(1) == (" the", b" the")
    assert strings.get(2) == ("\ufffd", b"\xe2")
    assert strings.get(3) == ("a", b"a")


def core_for(tokenizer, **kwargs) -> DetokenizerCore:
    core = DetokenizerCore(tokenizer, **kwargs)
    core.on_hello(CLIENT)
    core.take_output()
    return core


def meta(rid: str, prompt: list[int] | None = None, **kwargs) -> RequestMeta:
    return RequestMeta(
        rid,
        CLIENT,
        prompt_tokens=len(prompt or [1]),
        prompt_token_ids=pack_ids(prompt) if prompt else b"",
        **kwargs,
    )


def test_logprobs_travel_with_their_tokens_at_any_stream_interval(tokenizer):
    core = core_for(tokenizer, stream_interval_tokens=3)
    ids = tokenizer.encode("one two three four five six seven", add_special_tokens=False).ids
    for i, token in enumerate(ids):
        # Row 0 is a neighbour that did not ask; row 1 asked for its token and its top 2.
        core.on_step_output(
            StepOutput(
                step=i,
                t_step=float(i),
                new_requests=[meta("plain"), meta("asked")] if i == 0 else [],
                request_ids=["plain", "asked"],
                token_ids=pack_ids([token, token]),
                logprobs=[TokenLogprobs(1, -0.5 - i, pack_ids([token, 7]), floats([-0.5 - i, -9]))],
                finished=[FinishRecord(r, "length") for r in ("plain", "asked")]
                if i == len(ids) - 1
                else [],
            )
        )
    events = core.take_output().events[CLIENT]
    asked = [e for e in events if e.request_id == "asked"]
    assert len(asked) > 2 and not any(e.logprobs for e in events if e.request_id == "plain")
    for event in asked:
        assert [e.token_id for e in event.logprobs] == unpack_id_list(event.token_ids)
    entries = [e for event in asked for e in event.logprobs]
    assert [e.logprob for e in entries] == [-0.5 - i for i in range(len(ids))]
    assert "".join(e.token for e in entries) == "one two three four five six seven"
    assert all([t.token_id for t in e.top] == [e.token_id, 7] for e in entries)
    assert entries[1].top[0].bytes == entries[1].bytes == entries[1].token.encode()


def test_echo_and_prompt_logprobs_come_first_even_when_scoring_only(tokenizer):
    core = core_for(tokenizer)
    prompt = tokenizer.encode("The capital of France", add_special_tokens=False).ids
    n = len(prompt)
    # Two prefill chunks; scoring only (no token), so the engine's finish ends it.
    core.on_step_output(
        StepOutput(
            step=1,
            t_step=1.0,
            new_requests=[meta("r", prompt, echo=True, prompt_logprobs=True)],
            prompt_logprobs=[
                PromptLogprobs(
                    "r", 1, floats([-1.0, -2.0]), 1, pack_ids([5, 6]), floats([-0.1, -0.2])
                )
            ],
        )
    )
    core.on_step_output(
        StepOutput(
            step=2,
            t_step=2.0,
            prompt_logprobs=[
                PromptLogprobs(
                    "r",
                    3,
                    floats(range(-3, -n, -1)),
                    1,
                    pack_ids(range(3, n)),
                    floats([0] * (n - 3)),
                )
            ],
            finished=[FinishRecord("r", "length")],
        )
    )
    (event,) = core.take_output().events[CLIENT]
    assert event.finished and event.echo_text == "The capital of France" and not event.text
    entries = event.prompt_logprobs
    assert [e.token_id for e in entries] == prompt
    assert [e.logprob for e in entries] == [None, -1.0, -2.0, *range(-3, -n, -1)]
    assert entries[0].top == [] and [t.token_id for t in entries[1].top] == [5]
    assert "".join(e.token for e in entries) == "The capital of France"


def test_echo_without_prompt_logprobs_and_a_stop_string_kept(tokenizer):
    core = core_for(tokenizer)
    prompt = tokenizer.encode("Say it:", add_special_tokens=False).ids
    ids = tokenizer.encode(" yes. And more", add_special_tokens=False).ids
    core.on_step_output(
        StepOutput(
            step=1,
            t_step=1.0,
            new_requests=[
                meta("r", prompt, echo=True, stop=["."], include_stop_str_in_output=True)
            ],
        )
    )
    for i, token in enumerate(ids):
        core.on_step_output(
            StepOutput(step=2 + i, t_step=2.0, request_ids=["r"], token_ids=pack_ids([token]))
        )
    events = core.take_output().events[CLIENT]
    assert events[0].echo_text == "Say it:" and not any(e.echo_text for e in events[1:])
    assert not any(e.prompt_logprobs for e in events)
    assert "".join(e.text for e in events) == " yes." and events[-1].finish_reason == "stop"
