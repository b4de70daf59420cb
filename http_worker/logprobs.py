"""OpenAI's logprobs bodies from the SDK's LogprobEntry lists (plain dicts, as the other bodies).

Completions (the legacy shape): ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``,
where each top_logprobs item maps token text to logprob for the ``n`` most likely tokens plus the
chosen one (so up to n + 1 keys), and null for a prompt's first token. Chat: ``{"content": [{
"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}``. vLLM's
``prompt_logprobs``: per prompt position null (the first) or ``{token id: {"logprob", "rank",
"decoded_token"}}``.
"""

from __future__ import annotations

import codecs
from typing import Any

from ipc.messages import LogprobEntry


class TextOffsets:
    """Character offsets of tokens in the text they make: a token that ends inside a character
    (byte-level vocabularies split some) adds nothing until the character is complete, so every
    offset points at the character the token belongs to."""

    __slots__ = ("chars", "_decoder")

    def __init__(self) -> None:
        self.chars = 0
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def next(self, data: bytes) -> int:
        offset = self.chars
        self.chars += len(self._decoder.decode(data))
        return offset

    def jump(self, chars: int) -> None:
        """The next token starts at ``chars`` (the output after an echoed prompt)."""
        self.chars = chars
        self._decoder.reset()


def completion_logprobs(
    entries: list[LogprobEntry], top_n: int, text_offset: list[int]
) -> dict[str, Any]:
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [_top_map(e, top_n) for e in entries],
        "text_offset": text_offset,
    }


def _top_map(entry: LogprobEntry, top_n: int) -> dict[str, float] | None:
    if entry.logprob is None:
        return None  # the prompt's first token: nothing to predict it from
    top = {t.token: t.logprob for t in entry.top[:top_n]}
    top.setdefault(entry.token, entry.logprob)  # the chosen token is always there
    return top


def chat_logprobs(entries: list[LogprobEntry], top_n: int) -> dict[str, Any]:
    return {
        "content": [
            {
                "token": e.token,
                "logprob": e.logprob,
                "bytes": list(e.bytes),
                "top_logprobs": [
                    {"token": t.token, "logprob": t.logprob, "bytes": list(t.bytes)}
                    for t in e.top[:top_n]
                ],
            }
            for e in entries
        ]
    }


def prompt_logprobs_body(entries: list[LogprobEntry]) -> list[dict[str, Any] | None]:
    """vLLM's shape. "rank" is known for the top tokens (their place) and for the prompt's own
    token when it is among them; otherwise null."""
    body: list[dict[str, Any] | None] = []
    for entry in entries:
        if entry.logprob is None:
            body.append(None)
            continue
        ranks = {t.token_id: rank for rank, t in enumerate(entry.top, 1)}
        values = {
            str(entry.token_id): {
                "logprob": entry.logprob,
                "rank": ranks.get(entry.token_id),
                "decoded_token": entry.token,
            }
        }
        for rank, t in enumerate(entry.top, 1):
            values.setdefault(
                str(t.token_id), {"logprob": t.logprob, "rank": rank, "decoded_token": t.token}
            )
        body.append(values)
    return body
