"""The Messages API's answer: the ``message`` object, its stream of typed events
(``message_start``, ``ping``, per content block ``content_block_start``,
``content_block_delta``... with ``thinking_delta``, ``text_delta`` or ``input_json_delta``,
``content_block_stop``; then ``message_delta`` with the stop reason and the usage,
``message_stop``), and errors in Anthropic's shape, ``{"type": "error", "error": {"type",
"message"}}``, with the status codes every route answers with.

``usage`` in Anthropic's terms: ``input_tokens`` are the prompt's tokens not read from the
prefix cache, ``cache_read_input_tokens`` those that were (their sum is the prompt).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

from pydantic_core import from_json

from http_worker.answer_format import ChoiceOutput, sse
from http_worker.messages_api import MessagesRequest
from http_worker.output_items import Change, OutputItem, OutputItems
from http_worker.protocol import APIError
from ipc.messages import FINISH_LENGTH, FINISH_STOP, FINISH_TOOL_CALLS

# Anthropic's error type per status; other 4xx are invalid_request_error, other 5xx api_error.
ERROR_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    504: "timeout_error",
    529: "overloaded_error",
}


def messages_error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """Anthropic's error has no param: the message names the field."""
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    if param and param not in message:
        message = f"{param}: {message}"
    return {"type": "error", "error": {"type": kind, "message": message}}


class MessagesFormat:
    """The Messages API's ``AnswerFormat``."""

    def __init__(self, model: str, request: MessagesRequest) -> None:
        self.id = f"msg_{uuid.uuid4().hex}"
        self.model = model
        self.stops = request.stop_sequences or []
        self.output = OutputItems()
        self._finish_reason: str | None = None
        self._stop_sequence: str | None = None

    def _feed(self, out: ChoiceOutput) -> list[Change]:
        if out.finish_reason is not None:
            self._finish_reason = out.finish_reason
            self._cut_stop(out)
        return self.output.feed(out)

    def _cut_stop(self, out: ChoiceOutput) -> None:
        """The stop sequence that ended the answer is at the end of its last delta's text (the
        detokenizer releases no part of a stop string before it matches): out it goes, named."""
        texts = [i for i, part in enumerate(out.parts) if isinstance(part, str)]
        if out.finish_reason != FINISH_STOP or not self.stops or not texts:
            return
        last: str = out.parts[texts[-1]]  # type: ignore[assignment]
        matched = max((s for s in self.stops if last.endswith(s)), key=len, default=None)
        if matched is not None:
            self._stop_sequence = matched
            out.parts[texts[-1]] = last[: len(last) - len(matched)]
            out.text = out.text[: len(out.text) - len(matched)]

    @property
    def _stop_reason(self) -> str:
        if self._finish_reason == FINISH_LENGTH:
            return "max_tokens"
        if self._finish_reason == FINISH_TOOL_CALLS:
            return "tool_use"
        return "stop_sequence" if self._stop_sequence is not None else "end_turn"

    def full(self, choices: list[ChoiceOutput], usage: dict[str, Any]) -> dict[str, Any]:
        (out,) = choices  # one choice: the API has no n
        self._feed(out)
        self.output.finish()
        return self._message(
            [_block(item) for item in self.output.items],
            self._stop_reason,
            self._stop_sequence,
            _usage(usage),
        )

    def _message(
        self, content: list, stop_reason: str | None, stop_sequence: str | None, usage: dict
    ) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": stop_sequence,
            "usage": usage,
        }

    # --- a stream ---------------------------------------------------------------------------

    def stream_start(self, choices: int, usage: dict[str, Any] | None) -> Iterator[bytes]:
        opening = _usage(usage) if usage is not None else _usage(None)
        yield _event("message_start", message=self._message([], None, None, opening))
        yield _event("ping")

    def stream_delta(
        self, index: int, out: ChoiceOutput, usage: dict[str, Any] | None
    ) -> Iterator[bytes]:
        for change in self._feed(out):
            yield self._change_event(change)

    def stream_end(self, usage: dict[str, Any]) -> Iterator[bytes]:
        for change in self.output.finish():
            yield self._change_event(change)
        stop = {"stop_reason": self._stop_reason, "stop_sequence": self._stop_sequence}
        yield _event("message_delta", delta=stop, usage=_usage(usage))
        yield _event("message_stop")

    def stream_error(self, error: APIError) -> Iterator[bytes]:
        yield sse(messages_error_body(error.status, error.message, error.param), "error")

    def _change_event(self, change: Change) -> bytes:
        item = self.output.items[change.index]
        if change.what == "open":
            opened = _block(OutputItem(item.kind, "", item.call_id, item.name))
            return _event("content_block_start", index=change.index, content_block=opened)
        if change.what == "close":
            return _event("content_block_stop", index=change.index)
        if item.kind == "text":
            delta = {"type": "text_delta", "text": change.text}
        elif item.kind == "thinking":
            delta = {"type": "thinking_delta", "thinking": change.text}
        else:
            delta = {"type": "input_json_delta", "partial_json": change.text}
        return _event("content_block_delta", index=change.index, delta=delta)


def _event(kind: str, **fields: Any) -> bytes:
    return sse({"type": kind, **fields}, kind)


def _block(item: OutputItem) -> dict[str, Any]:
    if item.kind == "text":
        return {"type": "text", "text": item.text}
    if item.kind == "thinking":  # no signature: the thinking is not signed here
        return {"type": "thinking", "thinking": item.text, "signature": ""}
    return {"type": "tool_use", "id": item.call_id, "name": item.name, "input": _input(item.text)}


def _input(arguments: str) -> Any:
    """A call's arguments as the object Anthropic's tool_use carries. Arguments cut short by
    max_tokens are read as far as they go (complete members only, as Anthropic's SDK reads a
    stream's ``input_json_delta``s); others the model wrote that are no JSON object (only a
    call the grammar did not force) are kept as text."""
    if not arguments:
        return {}
    try:
        value = from_json(arguments, allow_partial=True)
    except ValueError:
        value = None
    return value if isinstance(value, dict) else {"_unparsed_arguments": arguments}


def _usage(usage: dict[str, Any] | None) -> dict[str, Any]:
    """From chat's usage (None: not known yet)."""
    if usage is None:
        return {"input_tokens": 0, "output_tokens": 0}
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    return {
        "input_tokens": usage["prompt_tokens"] - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": usage["completion_tokens"],
    }
