"""Incremental decoding and stop strings, without sockets."""

from __future__ import annotations

import pytest

from detok_worker.request_state import RequestState
from detok_worker.stop_strings import StopStringMatcher
from ipc.codec import unpack_id_list
from ipc.messages import RequestMeta
from runtime.model_files import load_tokenizer

TEXTS = [
    "Héllo wörld! 日本語のテキスト 🙂🚀 naïve café",
    "ascii only, plain text.\nline two",
    "emoji split 👨‍👩‍👧‍👦 and ∑∫√ math",
]


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    return load_tokenizer(default_model_dir)


def _stream(tokenizer, ids, stop=(), interval=1):
    state = RequestState(RequestMeta("r", b"c", prompt_tokens=1, stop=list(stop)))
    deltas = []
    for i, tok in enumerate(ids):
        if state.on_token(tokenizer, tok, float(i)):
            deltas.append(state.final("stop", 0.0, stopped_by_string=True))
            return deltas
        if state.should_stream(interval):
            deltas.append(state.delta())
    deltas.append(state.final("length", 0.0))
    return deltas


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_decode_equals_full_decode(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    deltas = _stream(tokenizer, ids)
    assert "".join(d.text for d in deltas) == tokenizer.decode(ids) == text
    assert all("\ufffd" not in d.text for d in deltas)  # no broken multi-byte characters
    assert sum(len(unpack_id_list(d.token_ids)) for d in deltas) == len(ids)
    assert deltas[-1].usage.completion_tokens == len(ids)


def test_stream_interval_batches_tokens(tokenizer):
    ids = tokenizer.encode("one two three four five six seven", add_special_tokens=False).ids
    deltas = _stream(tokenizer, ids, interval=3)
    sizes = [len(unpack_id_list(d.token_ids)) for d in deltas]
    assert sizes[0] == 1 and all(s == 3 for s in sizes[1:-1]) and sum(sizes) == len(ids)


def test_special_tokens_are_skipped(tokenizer):
    ids = tokenizer.encode("Hi", add_special_tokens=False).ids + [2]  # <|im_end|>
    assert "".join(d.text for d in _stream(tokenizer, ids)) == "Hi"


def test_stop_string_split_across_tokens(tokenizer):
    ids = tokenizer.encode("The answer is Paris. STOP here", add_special_tokens=False).ids
    deltas = _stream(tokenizer, ids, stop=["S.TOP", ". ST"])
    assert "".join(d.text for d in deltas) == "The answer is Paris"
    assert deltas[-1].finish_reason == "stop"


def test_matcher_holds_back_a_prefix_then_releases_it():
    m = StopStringMatcher(["</end>"])
    assert m.feed("abc</e") == ("abc", False)
    assert m.feed("n") == ("", False)
    assert m.feed("x more") == ("</enx more", False)  # the prefix never completed
    assert m.feed("</") == ("", False)
    assert m.flush() == "</"  # generation ended: a held tail is released


def test_matcher_earliest_stop_wins_and_text_never_contains_it():
    m = StopStringMatcher(["bb", "abc"])
    assert m.feed("xxa") == ("xx", False)
    assert m.feed("bcbb") == ("", True)  # "abc" starts before "bb": the held "a" is dropped
    m = StopStringMatcher(["bb", "abc"])
    out, stopped = m.feed("zabcbb")
    assert (out, stopped) == ("z", True)


def test_matcher_without_stops_is_a_pass_through():
    m = StopStringMatcher([])
    assert m.feed("anything") == ("anything", False) and m.flush() == ""
