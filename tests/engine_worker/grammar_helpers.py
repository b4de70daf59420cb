"""A tiny vocabulary for grammar tests, and a driver that samples under a grammar."""

from __future__ import annotations

import time

import numpy as np
import torch

from engine_worker.grammar_builder import RequestGrammar, advance_matcher
from engine_worker.grammar_mask import GrammarMasker
from ipc.codec import pack_ids
from ipc.messages import FINISH_STOP
from ipc.structured import GrammarVocabulary

EOS = 0
SPECIAL = [EOS, 1]  # 1 is a special token that is not eos: never text
MERGES = [
    b'{"',
    b'": ',
    b'", "',
    b'"}',
    b", ",
    b"true",
    b"false",
    b"null",
    b"red",
    b"green",
    b"name",
    b"age",
    b"tags",
    b"ab",
    b"12",
    b"\n",
    b"\xc3",
    b"\xa9",
]  # last two: half of é


def tiny_vocabulary(padding: int = 40) -> GrammarVocabulary:
    """Two special tokens, the printable ASCII bytes, a few merges (two of them half a UTF-8
    character), then ``padding`` ids the model has but the tokenizer does not."""
    tokens = [b"<|end|>", b"<|other|>"] + [bytes([c]) for c in range(32, 127)] + MERGES
    ends = np.cumsum([len(t) for t in tokens])
    vocabulary = GrammarVocabulary(
        vocab_size=len(tokens) + padding,
        token_bytes=b"".join(tokens),
        token_ends=pack_ids(ends),
        special_ids=pack_ids(SPECIAL),
        eos_ids=[EOS],
    )
    vocabulary.fingerprint = vocabulary.digest()
    return vocabulary


def wait_ready(grammar: RequestGrammar, timeout_s: float = 10.0) -> RequestGrammar:
    deadline = time.monotonic() + timeout_s
    while not grammar.ready():
        assert time.monotonic() < deadline, "the grammar was not built in time"
        time.sleep(0.001)
    return grammar


def sample_constrained(
    grammars: list[RequestGrammar | None], vocab_size: int, steps: int, seed: int = 0
) -> tuple[list[list[int]], list[str | None]]:
    """Greedy over random logits, every row masked by its grammar each step (each sampled token
    consumed here, as the engine's mask thread would). Returns each row's tokens and how it
    ended (a finish reason, or None if still going after ``steps``)."""
    generator = torch.Generator().manual_seed(seed)
    masker = GrammarMasker(vocab_size)
    tokens: list[list[int]] = [[] for _ in grammars]
    ended: list[str | None] = [None] * len(grammars)
    for _ in range(steps):
        live = [i for i in range(len(grammars)) if ended[i] is None]
        if not live:
            break
        logits = torch.randn(len(live), vocab_size, generator=generator)
        masker.apply(logits, [grammars[i] for i in live])
        for row, token in zip(live, logits.argmax(dim=-1).tolist()):
            tokens[row].append(token)
            grammar = grammars[row]
            if grammar is not None:
                advance_matcher(grammar, token)
                assert not grammar.error, grammar.error
                if grammar.stopped:
                    ended[row] = FINISH_STOP
                elif token == EOS:
                    ended[row] = "eos"
    return tokens, ended


def text_of(vocabulary: GrammarVocabulary, tokens: list[int]) -> bytes:
    table = vocabulary.token_table()
    return b"".join(table[t] for t in tokens if t not in vocabulary.eos_ids)
