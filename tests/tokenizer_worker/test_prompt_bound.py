"""Issue 38: a prompt too long for any tokenization to fit is refused from its length alone,
before the tokenizer reads it; the bound (ceil(characters / the longest token's characters))
never exceeds what the real tokenizer produces, and tokenizers with no such bound get none."""

from __future__ import annotations

import random

import pytest
from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers

from ipc.messages import ChatMessage, RequestError, SamplingParams, SubmitRequest
from runtime.model_files import load_tokenizer
from tokenizer_worker.chat_template import ChatTemplate
from tokenizer_worker.prepare import Limits, RequestPreparer
from tokenizer_worker.prompt_bound import fewest_tokens, longest_token_chars

CONTEXT = 64


class RecordingTokenizer:
    """The real tokenizer, with a record of every text it was asked to encode."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self.texts: list[str] = []

    def encode_batch(self, texts, **kwargs):
        self.texts.extend(texts)
        return self._tokenizer.encode_batch(texts, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    return load_tokenizer(default_model_dir)


def test_the_bound_never_exceeds_the_real_count(tokenizer, default_model_dir):
    longest = longest_token_chars(tokenizer)
    assert longest is not None and longest >= 64  # e.g. a run of '#' or of spaces
    vocab = list(tokenizer.get_vocab(with_added_tokens=True))
    rng = random.Random(0)
    alphabets = ["abc xyz", "日本語の文", "✓🙂\u0301", "#", " ", "\n    ", "<|im_start|>", "-="]
    texts = [tok.replace("Ġ", " ").replace("Ċ", "\n") * 5 for tok in sorted(vocab, key=len)[-40:]]
    for _ in range(200):
        alphabet = "".join(rng.sample(alphabets, 3))
        texts.append("".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 3000))))
    template = ChatTemplate.from_model_dir(default_model_dir)
    texts += [template.render([{"role": "user", "content": t}], True) for t in texts[:20]]
    for text in texts:
        assert len(tokenizer.encode(text).ids) >= fewest_tokens(len(text), longest), text[:80]


def test_a_prompt_past_the_bound_is_refused_unread(tokenizer, default_model_dir):
    spy = RecordingTokenizer(tokenizer)
    preparer = RequestPreparer(
        spy, ChatTemplate.from_model_dir(default_model_dir), Limits(CONTEXT, 49152)
    )
    longest = preparer.longest_token
    assert longest == longest_token_chars(tokenizer)
    huge = "word " * (longest * CONTEXT // 5 + 1)  # at least CONTEXT tokens, whatever they are
    plain = SubmitRequest("p", b"c", SamplingParams(), prompt=huge)
    chat = SubmitRequest("m", b"c", SamplingParams(), messages=[ChatMessage("user", huge)])
    fits = SubmitRequest("f", b"c", SamplingParams(), prompt="Hello")
    results = preparer.prepare_batch([plain, chat, fits])
    for result in results[:2]:
        assert isinstance(result, RequestError) and result.code == "bad_request"
        assert f"more than {longest} characters" in result.message, result.message
        assert f"context length of {CONTEXT} tokens" in result.message
    assert not isinstance(results[2], RequestError)
    assert spy.texts == ["Hello"]  # the long texts never reached the tokenizer
    # Below the bound the tokenizer decides (and refuses by the real count).
    shorter = "word " * (longest * (CONTEXT - 1) // 5 - 1)
    (result,) = preparer.prepare_batch([SubmitRequest("s", b"c", SamplingParams(), prompt=shorter)])
    assert isinstance(result, RequestError) and "the prompt has" in result.message
    assert spy.texts[-1] == shorter


def _bpe(**kwargs) -> Tokenizer:
    return Tokenizer(models.BPE({"a": 0, "b": 1, "ab": 2, "<unk>": 3}, [("a", "b")], **kwargs))


def test_tokenizers_that_fold_or_drop_characters_get_no_bound():
    byte_level = _bpe()
    byte_level.pre_tokenizer = pre_tokenizers.ByteLevel()
    assert longest_token_chars(byte_level) == 5  # '<unk>'
    composed = _bpe()
    composed.pre_tokenizer = pre_tokenizers.ByteLevel()
    composed.normalizer = normalizers.NFC()
    assert longest_token_chars(composed) == 20  # NFC joins up to 4 characters into one
    whitespace = _bpe(unk_token="<unk>")
    whitespace.pre_tokenizer = pre_tokenizers.Whitespace()  # drops the spaces
    stripped = _bpe(byte_fallback=True)
    stripped.normalizer = normalizers.Strip()
    fused = _bpe(unk_token="<unk>", fuse_unk=True)  # a run of unknown characters is one token
    dropping = _bpe()  # no unknown token, no bytes: unknown characters vanish
    absorbing = _bpe(byte_fallback=True)
    absorbing.add_special_tokens([AddedToken("<mask>", lstrip=True)])  # takes the spaces before
    word_level = Tokenizer(models.WordLevel({"a": 0, "<unk>": 1}, unk_token="<unk>"))
    for tokenizer in (whitespace, stripped, fused, dropping, absorbing, word_level):
        assert longest_token_chars(tokenizer) is None
    assert len(fused.encode("zzzzzzzzzz").ids) == 1  # why: ten characters, one token
