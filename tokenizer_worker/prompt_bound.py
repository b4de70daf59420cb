"""The fewest tokens a text can encode to, from its length alone: a prompt that cannot fit the
context is refused before the tokenizer reads it (a 7 MB prompt took ~10 s to encode before it
was refused, and every request queued behind it waited).

A token stands for at most ``L`` characters of the text it is matched in, ``L`` the longest
token's string in the vocabulary (added and special tokens included). A byte-level BPE writes a
token's bytes one character each, so its string is at least as long as the text it stands for
(a character is one byte or more); a byte-fallback token (``<0x41>``) is longer than its byte.
Either way ``L`` can only overstate, and a text of ``n`` characters encodes to at least
``ceil(n / L)`` tokens, before the special tokens a template or post-processor adds (more tokens,
never fewer). That holds only where nothing in the pipeline folds an unbounded run of characters
into one token or drops it: a whitespace-splitting pre-tokenizer, a stripping normalizer, an
unknown token that swallows a run of unknown characters, an added token that strips the spaces
beside it, or a word-level model. For those (and any step not known here) there is no bound and
the prompt is tokenized (off the worker's loop when it is long: tokenizer_worker.long_prompts).
Composing Unicode normalizers (NFC, NFKC) join at most 4 characters into one; the bound allows it.
"""

from __future__ import annotations

import json
import math
from typing import Any

_KEEPS_LENGTH = {"Prepend", "Lowercase", "NFD", "NFKD", "ByteLevel", "Replace"}
_COMPOSES = {"NFC", "NFKC"}  # at most 4 characters (a canonical decomposition's longest) -> 1
_SPLITS = {"ByteLevel", "Metaspace", "Digits", "Split", "Punctuation", "UnicodeScripts"}


def longest_token_chars(tokenizer: Any) -> int | None:
    """The most characters of input text one token can stand for (``L``, with the normalizer's
    shrinking folded in), or None where this tokenizer has no such bound."""
    spec = json.loads(tokenizer.to_str())
    if spec.get("truncation") is not None:
        return None
    shrink = _normalizer_shrink(spec.get("normalizer"))
    if shrink is None or not _splits_keep_text(spec.get("pre_tokenizer")):
        return None
    byte_level = '"ByteLevel"' in json.dumps([spec.get("normalizer"), spec.get("pre_tokenizer")])
    if not _model_bounded(spec.get("model") or {}, byte_level):
        return None
    added = spec.get("added_tokens") or []
    if any(token.get("lstrip") or token.get("rstrip") for token in added):
        return None
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    longest = max((len(token) for token in vocab), default=0)
    return longest * shrink if longest else None


def fewest_tokens(chars: int, longest: int) -> int:
    return math.ceil(chars / longest)


def _normalizer_shrink(step: dict | None) -> int | None:
    """By how much the normalizer can shorten a text at most (None: without bound)."""
    if step is None:
        return 1
    kind = step.get("type")
    if kind == "Sequence":
        total = 1
        for inner in step.get("normalizers") or []:
            shrink = _normalizer_shrink(inner)
            if shrink is None:
                return None
            total *= shrink
        return total
    if kind == "Replace":  # a plain string no longer than what replaces it
        pattern = step.get("pattern") or {}
        found = pattern.get("String")
        if found is None or len(step.get("content", "")) < len(found):
            return None
        return 1
    if kind in _KEEPS_LENGTH:
        return 1
    return 4 if kind in _COMPOSES else None


def _splits_keep_text(step: dict | None) -> bool:
    """Whether the pre-tokenizer keeps every character (whitespace splitting drops them)."""
    if step is None:
        return True
    kind = step.get("type")
    if kind == "Sequence":
        return all(_splits_keep_text(inner) for inner in step.get("pretokenizers") or [])
    return kind in _SPLITS and step.get("behavior") != "Removed"


def _model_bounded(model: dict, byte_level: bool) -> bool:
    """Whether each character the model reads ends up in a token of its own vocabulary: an
    unknown token fused over a run of unknown characters, an unknown character a BPE without
    an unknown token drops, or a word-level model's unknown word break the bound. A byte-level
    BPE has every byte in its vocabulary."""
    kind = model.get("type")
    if kind == "BPE":
        unk = model.get("unk_token")
        return bool(byte_level or model.get("byte_fallback") or (unk and not model.get("fuse_unk")))
    if kind == "Unigram":  # fuses unknown characters into one unknown token
        return bool(model.get("byte_fallback"))
    return False
