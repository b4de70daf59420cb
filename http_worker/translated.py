"""The chat request that a body of another API (OpenAI's Responses, Anthropic's Messages) is
translated into: every API reaches the cluster by the one chat path (the same submit, chat
template, grammars, tool-call parsing, logprobs and aborts). Only the names differ: an error
about the chat request names its field as the API's own body does (``max_output_tokens``, not
``max_tokens``), by the API's ``FIELD_NAMES``."""

from __future__ import annotations

import re
from typing import Any, ClassVar

from pydantic import ValidationError

from http_worker.body import validation_error
from http_worker.chat_protocol import ChatCompletionRequest
from http_worker.protocol import bad_request
from ipc.field_rules import FieldError

# A function's name, as the tokenizer worker checks it (there, a 400 without the field's name).
TOOL_NAME = r"^[A-Za-z0-9_-]{1,64}$"
# Tool definitions of every API become chat's {"type": "function", "function": {...}}.
CHAT_TOOL_FIELD = re.compile(r"\btools\[(\d+)\]\.function\.")


class TranslatedChatRequest(ChatCompletionRequest):
    """A subclass per API sets ``FIELD_NAMES``: (pattern over chat's field paths, the API's
    name), applied in order to an error's param and message."""

    FIELD_NAMES: ClassVar[tuple[tuple[re.Pattern[str], str], ...]] = ()

    @classmethod
    def in_api_words(cls, text: str) -> str:
        for pattern, name in cls.FIELD_NAMES:
            text = pattern.sub(name, text)
        return text

    @classmethod
    def from_chat(cls, chat: dict[str, Any]) -> TranslatedChatRequest:
        """The chat request; the API's own models have checked what it is made of, so a refusal
        here is rare (it is still a 400, in the API's words)."""
        try:
            return cls.model_validate(chat)
        except ValidationError as exc:
            error = validation_error(exc.errors())
            raise bad_request(
                cls.in_api_words(error.message), cls.in_api_words(error.param or "") or None
            ) from None

    def named(self, exc: FieldError) -> FieldError:
        exc = super().named(exc)
        return FieldError(self.in_api_words(exc.param), self.in_api_words(str(exc)))
