"""The codec's two errors (ipc.codec raises them; ipc.token_ids too), apart so that modules the
codec builds on can raise them."""

from __future__ import annotations


class DecodeError(ValueError):
    """A frame that is not a well-formed message of a known kind."""


class EncodeError(ValueError):
    """A message the wire cannot carry: a string that is not valid Unicode (a lone UTF-16
    surrogate, which UTF-8 cannot encode) or an integer outside msgpack's 64 bits. ``path``
    names the value in the message (``messages[0].content``, ``sampling.logit_bias``)."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}" if path else message)
        self.path = path
