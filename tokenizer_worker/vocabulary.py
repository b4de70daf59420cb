"""The vocabulary as data for the engine's grammar matchers (see ipc.structured.GrammarVocabulary).

The bytes of each token come from llguidance's own reading of the tokenizer (byte-level BPE,
SentencePiece byte fallback, added tokens): the grammar backend that consumes them is the one
that decides what a token's bytes are, so the two can never disagree.
"""

from __future__ import annotations

import llguidance
import numpy as np

from ipc.codec import pack_ids
from ipc.structured import GrammarVocabulary


def grammar_backend(
    tokenizer, vocab_size: int, eos_ids: list[int] | None = None
) -> tuple[llguidance.LLTokenizer, GrammarVocabulary]:
    """llguidance's tokenizer (the compiler checks grammars with it) and the vocabulary as data
    for the engine, from one reading of ``tokenizer`` (a ``tokenizers.Tokenizer``; ~0.3 s for
    49k tokens). ``vocab_size``: the model's logits width (ids the tokenizer has beyond it can
    never be sampled and are left out; ids it lacks below it get no bytes); ``eos_ids``: the ids
    that end a sequence (the model's; llguidance's guess when None)."""
    backend = llguidance.LLTokenizer(tokenizer.to_str())
    size = min(backend.vocab_size, vocab_size)
    pieces = [backend.decode_bytes([i]) for i in range(size)]
    special = [i for i in range(size) if backend.is_special_token(i)]
    ends = np.cumsum([len(p) for p in pieces], dtype=np.int64)
    if size and ends[-1] >= 2**31:
        raise ValueError("the vocabulary's bytes do not fit int32 offsets")
    eos = [t for t in (eos_ids or backend.eos_tokens) if 0 <= t < vocab_size]
    vocabulary = GrammarVocabulary(
        vocab_size=vocab_size,
        token_bytes=b"".join(pieces),
        token_ends=pack_ids(ends),
        special_ids=pack_ids(special),
        eos_ids=sorted(set(eos)),
    )
    vocabulary.fingerprint = vocabulary.digest()
    return backend, vocabulary


def grammar_vocabulary(
    tokenizer, vocab_size: int, eos_ids: list[int] | None = None
) -> GrammarVocabulary:
    return grammar_backend(tokenizer, vocab_size, eos_ids)[1]
