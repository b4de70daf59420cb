"""The vocabulary as data: each token's bytes are exactly what it stands for in text, special ids
are marked, sizes follow the model, and it survives the wire."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from ipc.codec import decode, encode
from tokenizer_worker.vocabulary import grammar_vocabulary

TEXTS = [
    '{"name": "Zoë", "tags": ["a", "b"]}',
    "héllo wörld ✓ 日本語 🙂",
    "x = [1, 2, 3]\n\ttab",
    "The quick brown fox jumps over the lazy dog. " * 3,
]


def byte_level_tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|end|>", "<|pad|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(TEXTS * 4, trainer)
    return tokenizer


def byte_fallback_tokenizer() -> Tokenizer:
    """SentencePiece-style (Llama, Mistral): '▁' for spaces, characters outside the vocabulary
    as <0xNN> byte tokens of the model's own vocabulary."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for piece in ["▁"] + [chr(c) for c in range(33, 127)] + ["▁t", "he", "▁the", "é"]:
        vocab.setdefault(piece, len(vocab))
    merges = [("▁", "t"), ("h", "e"), ("▁t", "he")]
    tokenizer = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>")
    )
    tokenizer.normalizer = normalizers.Replace(" ", "▁")
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    tokenizer.add_special_tokens(["<unk>", "<s>", "</s>"])
    return tokenizer


@pytest.mark.parametrize("make", [byte_level_tokenizer, byte_fallback_tokenizer])
def test_token_bytes_spell_the_text(make):
    tokenizer = make()
    size = tokenizer.get_vocab_size()
    vocabulary = grammar_vocabulary(tokenizer, size, [0])
    table = vocabulary.token_table()
    assert len(table) == size
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        assert b"".join(table[i] for i in ids) == text.encode(), text


def test_special_ids_sizes_and_wire_round_trip():
    tokenizer = byte_level_tokenizer()
    size = tokenizer.get_vocab_size()
    vocabulary = grammar_vocabulary(tokenizer, size + 7, [1, 0, 0])
    # The byte 0xFF (never in UTF-8 text) is llguidance's marker for special tokens, so the
    # token for that lone byte is kept out of grammars like a special token.
    assert vocabulary.special_id_list() == [0, 1, tokenizer.token_to_id("ÿ")]
    assert vocabulary.eos_ids == [0, 1]
    table = vocabulary.token_table()
    assert len(table) == size + 7 and table[size:] == [b""] * 7  # the model's padding rows
    assert decode(encode(vocabulary)) == vocabulary
    assert vocabulary.fingerprint == vocabulary.digest()
    smaller = grammar_vocabulary(tokenizer, size - 3, [0])  # ids past the model's are dropped
    assert smaller.token_table() == table[: size - 3]
    assert smaller.digest() != vocabulary.digest()


def test_malformed_vocabulary_is_refused():
    from ipc.codec import pack_ids
    from ipc.structured import GrammarVocabulary

    with pytest.raises(ValueError, match="do not fit"):
        GrammarVocabulary(2, b"abc", pack_ids([1, 2, 3]), b"", [0])
    with pytest.raises(ValueError, match="eos_ids"):
        GrammarVocabulary(4, b"abc", pack_ids([1, 2, 3]), b"", [4])
    bad = GrammarVocabulary(4, b"abc", pack_ids([2, 1, 3]), b"", [0])
    with pytest.raises(ValueError, match="do not describe"):
        bad.token_table()


def test_default_model_vocabulary(default_model_dir):
    tokenizer = Tokenizer.from_file(str(default_model_dir / "tokenizer.json"))
    vocabulary = grammar_vocabulary(tokenizer, 49152, [2])
    table = vocabulary.token_table()
    assert len(table) == 49152 and table[2] == b"<|im_end|>"
    assert vocabulary.special_id_list() == list(range(17))
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        assert b"".join(table[i] for i in ids) == text.encode()
    assert len(encode(vocabulary)) < 1_000_000  # one frame, well under the codec's limits
