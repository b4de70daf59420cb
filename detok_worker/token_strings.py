"""A token's own text and bytes, as OpenAI shows them in logprobs: " the" for the byte-level
token "Ġthe", its UTF-8 bytes; a token that holds part of a character keeps its own bytes (the
client can join them) and shows the replacement character as text.

The bytes come from the vocabulary itself, not from decoding the id: a decoder turns partial
characters into U+FFFD and strips a SentencePiece word's leading space, so ``decode([id])`` would
lose what the logprobs must show. Added tokens (special or not) are their content. Lookups are
cached: a stream asks for the same few thousand ids again and again.
"""

from __future__ import annotations

import re

import numpy as np

from ipc.messages import LogprobEntry, PromptLogprobs, TokenLogprobs, TopLogprob

_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
MAX_CACHED = 1 << 18


def byte_level_alphabet() -> dict[str, int]:
    """The byte-level BPE alphabet (GPT-2's): the printable character that stands for each
    byte. Printable Latin-1 bytes stand for themselves; the others are mapped past 255."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


class TokenStrings:
    """``tokenizer``: a ``tokenizers.Tokenizer``."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        # The decoder's own JSON only (the whole tokenizer's is megabytes, slow to parse).
        decoder = tokenizer.decoder.__getstate__().decode() if tokenizer.decoder else ""
        self.byte_level = '"ByteLevel"' in decoder
        self.byte_fallback = '"ByteFallback"' in decoder
        self.alphabet = byte_level_alphabet() if self.byte_level else {}
        self.added = {i: t.content for i, t in tokenizer.get_added_tokens_decoder().items()}
        self._cache: dict[int, tuple[str, bytes]] = {}

    def get(self, token_id: int) -> tuple[str, bytes]:
        """(text, bytes) of one token; an id the tokenizer does not know is ("", b"")."""
        found = self._cache.get(token_id)
        if found is None:
            data = self._bytes(token_id)
            found = (data.decode("utf-8", errors="replace"), data)
            if len(self._cache) < MAX_CACHED:
                self._cache[token_id] = found
        return found

    def _bytes(self, token_id: int) -> bytes:
        if token_id in self.added:
            return self.added[token_id].encode()
        piece = self.tokenizer.id_to_token(token_id)
        if piece is None:
            return b""
        if self.byte_level:
            try:
                return bytes(self.alphabet[c] for c in piece)
            except KeyError:  # not from the byte-level alphabet: take it as text
                return piece.encode()
        if self.byte_fallback and (match := _BYTE_FALLBACK.match(piece)):
            return bytes([int(match.group(1), 16)])
        return piece.replace("\u2581", " ").encode()  # SentencePiece's word boundary

    def entry(
        self, token_id: int, logprob: float | None, top_ids: bytes = b"", top_logprobs: bytes = b""
    ) -> LogprobEntry:
        text, data = self.get(token_id)
        return LogprobEntry(token_id, text, logprob, data, self._top(top_ids, top_logprobs))

    def sampled_entry(self, token_id: int, logprobs: TokenLogprobs) -> LogprobEntry:
        return self.entry(token_id, logprobs.logprob, logprobs.top_ids, logprobs.top_logprobs)

    def prompt_entries(self, chunk: PromptLogprobs, prompt_ids: list[int]) -> list[LogprobEntry]:
        """One entry per position of the chunk (positions index ``prompt_ids``)."""
        values = np.frombuffer(chunk.logprobs, "<f4").tolist()
        size = 4 * chunk.top_k  # bytes of one position's top ids (int32) or logprobs (float32)
        return [
            self.entry(
                prompt_ids[chunk.start + i],
                value,
                chunk.top_ids[i * size : (i + 1) * size],
                chunk.top_logprobs[i * size : (i + 1) * size],
            )
            for i, value in enumerate(values)
        ]

    def _top(self, top_ids: bytes, top_logprobs: bytes) -> list[TopLogprob]:
        top = []
        for token_id, logprob in zip(
            np.frombuffer(top_ids, "<i4").tolist(), np.frombuffer(top_logprobs, "<f4").tolist()
        ):
            text, data = self.get(token_id)
            top.append(TopLogprob(token_id, text, logprob, data))
        return top
