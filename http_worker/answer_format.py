"""What every API's answer format shares: a choice's output as the engine's deltas built it
(``ChoiceOutput``), the ``AnswerFormat`` that http_worker.answer writes a whole answer or a
stream through (one per API: completions_bodies.py for completions and chat,
responses_api_bodies.py, messages_api_bodies.py), server-sent events and OpenAI's usage body.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from http_worker.protocol import APIError
from ipc.client import Delta
from ipc.messages import LogprobEntry
from ipc.structured import ToolCallDelta


def sse(body: Any, event: str | None = None) -> bytes:
    """One server-sent event; ``event`` names its type (the Responses and Messages APIs do)."""
    data = b"data: " + json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
    return (b"event: " + event.encode() + b"\n" + data if event else data) + b"\n\n"


def usage_body(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


@dataclass(slots=True)
class Reasoning:
    """A piece of the thinking among a ChoiceOutput's parts."""

    text: str


@dataclass(slots=True)
class ChoiceOutput:
    """What one choice produced: all of it, or one delta's worth."""

    text: str = ""
    finish_reason: str | None = None
    logprobs: list[LogprobEntry] = field(default_factory=list)
    prompt_logprobs: list[LogprobEntry] = field(default_factory=list)
    echo_text: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)  # pieces, as they came
    reasoning: str = ""  # the thinking a reasoning parser split out of the text
    # Thinking, text and call pieces in the order they came (a delta's thinking, then its
    # text, then its calls), for the APIs whose output is a list of typed items or blocks.
    parts: list[str | ToolCallDelta | Reasoning] = field(default_factory=list)

    def add(self, delta: Delta) -> ChoiceOutput:
        self.reasoning += delta.reasoning
        if delta.reasoning:
            self.parts.append(Reasoning(delta.reasoning))
        self.text += delta.text
        self.tool_calls += delta.tool_calls
        if delta.text:
            self.parts.append(delta.text)
        self.parts += delta.tool_calls
        self.logprobs += delta.logprobs
        self.prompt_logprobs += delta.prompt_logprobs
        self.echo_text += delta.echo_text
        if delta.finished:
            self.finish_reason = delta.finish_reason
        return self

    @property
    def has_content(self) -> bool:
        """Worth a chunk: text, or tokens whose text is still held back (their logprobs)."""
        return bool(
            self.text
            or self.logprobs
            or self.prompt_logprobs
            or self.echo_text
            or self.finish_reason
            or self.tool_calls
            or self.reasoning
        )


class AnswerFormat(Protocol):
    """Writes one answer in its API's shape. ``id`` is fixed per answer (every chunk of a stream
    carries it, and the engine requests are named after it); the stream's bytes are whole
    server-sent events."""

    id: str

    def full(self, choices: list[ChoiceOutput], usage: dict[str, Any]) -> dict[str, Any]:
        """The non-streaming body; ``choices`` in index order."""
        ...

    def stream_start(self, choices: int, usage: dict[str, Any] | None) -> Iterable[bytes]:
        """Before the first delta; ``usage``: the prompt's, when continuous usage was asked."""
        ...

    def stream_delta(
        self, index: int, out: ChoiceOutput, usage: dict[str, Any] | None
    ) -> Iterable[bytes]: ...

    def stream_end(self, usage: dict[str, Any]) -> Iterable[bytes]: ...

    def stream_error(self, error: APIError) -> Iterable[bytes]:
        """A choice failed mid-stream (the others are aborted already)."""
        ...
