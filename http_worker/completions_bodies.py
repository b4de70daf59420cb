"""The bodies of POST /v1/completions and POST /v1/chat/completions, whole and as stream chunks:
plain dicts, built by hand because they are on the per-token path and json.dumps of a dict is the
cheap way. A choice's output (``ChoiceOutput``, http_worker.answer_format) is all of it for a
full response, or one delta's worth for a stream chunk; a format renders it, with logprobs
(http_worker.logprobs) when they were asked.
"""

from __future__ import annotations

import json
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Any

from http_worker.answer_format import ChoiceOutput, sse
from http_worker.logprobs import (
    TextOffsets,
    chat_logprobs,
    completion_logprobs,
    prompt_logprobs_body,
)
from http_worker.protocol import APIError
from http_worker.tool_call_bodies import delta_with_calls, message_with_calls

SSE_DONE = b"data: [DONE]\n\n"
# Stands for a chunk's text in a template of it (ChoicesFormat._text_template); a chunk whose
# other fields hold it too gets no template.
_TEXT_MARK = "\x00splitserve text\x00"
_TEXT_MARK_JSON = json.dumps(_TEXT_MARK).encode()


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class ChoicesFormat(ABC):
    """Builds the bodies of one of the two endpoints that answer with ``choices``
    (an ``AnswerFormat``); a subclass per endpoint. ``created`` and ``id`` are fixed
    per response so every chunk of a stream carries the same ones (as OpenAI's do).

    ``logprobs``: top logprobs per token to show (None: no logprobs); ``echo``: the prompt's text
    (and, with logprobs, its entries) leads the choice; ``prompt_logprobs``: vLLM's per-position
    prompt logprobs are shown."""

    id_prefix = ""
    object_full = ""
    object_chunk = ""
    text_template = False  # chunk() puts a text-only delta's text in one JSON string

    def __init__(
        self,
        model: str,
        include_usage: bool = False,
        continuous_usage: bool = False,
        *,
        logprobs: int | None = None,
        echo: bool = False,
        prompt_logprobs: bool = False,
    ) -> None:
        self.id = new_id(self.id_prefix)
        self.created = int(time.time())
        self.model = model
        self.include_usage = include_usage
        self.continuous_usage = continuous_usage  # each chunk: its choice's usage so far
        self.logprobs, self.echo, self.prompt_logprobs = logprobs, echo, prompt_logprobs
        self._offsets: dict[int, TextOffsets] = {}  # per choice, across a stream's chunks
        self._templates: dict[int, tuple[bytes, bytes] | tuple[()]] = {}  # per choice

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def full(self, choices: list[ChoiceOutput], usage: dict[str, Any]) -> dict:
        """The non-streaming body; ``choices`` in index order."""
        body = self._envelope(
            self.object_full, [self._full_choice(i, out) for i, out in enumerate(choices)]
        )
        self._add_prompt_logprobs(body, choices[0] if choices else ChoiceOutput())
        body["usage"] = usage
        return body

    def chunk(
        self, index: int, out: ChoiceOutput, usage: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        body = self._envelope(self.object_chunk, [self._chunk_choice(index, out)])
        self._add_prompt_logprobs(body, out)
        self._chunk_usage(body, usage)
        return body

    def _chunk_usage(self, body: dict[str, Any], usage: dict[str, Any] | None) -> None:
        if self.continuous_usage and usage is not None:
            body["usage"] = usage
        elif self.include_usage:
            body["usage"] = None  # OpenAI: null on every chunk but the last when usage is asked

    def first_chunk(self, index: int, usage: dict[str, Any] | None = None) -> dict[str, Any] | None:
        return None

    # The stream (http_worker.answer): OpenAI's chunks as data-only events ending with [DONE].

    def stream_start(self, choices: int, usage: dict[str, Any] | None) -> Iterator[bytes]:
        """Before the first delta; ``usage``: the prompt's, when continuous usage was asked."""
        for i in range(choices):
            if (chunk := self.first_chunk(i, usage)) is not None:
                yield sse(chunk)

    def stream_delta(
        self, index: int, out: ChoiceOutput, usage: dict[str, Any] | None
    ) -> Iterator[bytes]:
        if not out.has_content:
            return
        if self._text_only(out, usage) and (around := self._text_template(index)) is not None:
            head, tail = around  # the chunk as chunk() writes it, the text put in its place
            yield head + json.dumps(out.text, ensure_ascii=False).encode() + tail
        else:
            yield sse(self.chunk(index, out, usage))

    def _text_only(self, out: ChoiceOutput, usage: dict[str, Any] | None) -> bool:
        """Whether this chunk differs from any other of its choice by its text alone (the
        common one: no logprobs, calls, finish or usage of its own)."""
        return (
            self.text_template
            and self.logprobs is None
            and not (self.continuous_usage and usage is not None)
            and bool(out.text)
            and not (
                out.finish_reason
                or out.tool_calls
                or out.echo_text
                or out.prompt_logprobs
                or out.reasoning
            )
        )

    def _text_template(self, index: int) -> tuple[bytes, bytes] | None:
        """The SSE event of a text-only chunk of choice ``index``, split where its text goes:
        built once per choice by chunk() itself, so the bytes are the same."""
        around = self._templates.get(index)
        if around is None:
            event = sse(self.chunk(index, ChoiceOutput(text=_TEXT_MARK), None))
            parts = event.split(_TEXT_MARK_JSON)
            around = self._templates[index] = (parts[0], parts[1]) if len(parts) == 2 else ()
        return around or None

    def stream_end(self, usage: dict[str, Any]) -> Iterator[bytes]:
        if self.include_usage:
            yield sse(self.usage_chunk(usage))
        yield SSE_DONE

    def stream_error(self, error: APIError) -> Iterator[bytes]:
        """A choice failed mid-stream (the others are aborted already)."""
        yield sse(error.body())
        yield SSE_DONE

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        body = self._envelope(self.object_chunk, [])
        body["usage"] = usage
        return body

    def _add_prompt_logprobs(self, body: dict[str, Any], out: ChoiceOutput) -> None:
        """Where the endpoint puts vLLM's prompt_logprobs at the top level (chat); completions
        put them in each choice instead."""
        return None

    @abstractmethod
    def _full_choice(self, index: int, out: ChoiceOutput) -> dict[str, Any]:
        """One choice of the non-streaming body."""

    @abstractmethod
    def _chunk_choice(self, index: int, out: ChoiceOutput) -> dict[str, Any]:
        """One choice of a stream chunk."""


class CompletionFormat(ChoicesFormat):
    id_prefix, object_full, object_chunk = "cmpl", "text_completion", "text_completion"
    text_template = True

    def _full_choice(self, index: int, out: ChoiceOutput) -> dict[str, Any]:
        body = {
            "index": index,
            "text": out.echo_text + out.text,
            "logprobs": None,
            "finish_reason": out.finish_reason,
        }
        if self.logprobs is not None:
            body["logprobs"] = self._logprobs(index, out)
        if self.prompt_logprobs:
            body["prompt_logprobs"] = prompt_logprobs_body(out.prompt_logprobs) or None
        return body

    _chunk_choice = _full_choice

    def _logprobs(self, index: int, out: ChoiceOutput) -> dict[str, Any]:
        """With echo the prompt's entries come first; the output's offsets then start where the
        echoed text ends."""
        offsets = self._offsets.setdefault(index, TextOffsets())
        entries, text_offset = [], []
        if self.echo and (out.echo_text or out.prompt_logprobs):
            entries += out.prompt_logprobs
            text_offset += [offsets.next(e.bytes) for e in out.prompt_logprobs]
            offsets.jump(len(out.echo_text))
        entries += out.logprobs
        text_offset += [offsets.next(e.bytes) for e in out.logprobs]
        assert self.logprobs is not None
        return completion_logprobs(entries, self.logprobs, text_offset)


class ChatFormat(ChoicesFormat):
    id_prefix, object_full, object_chunk = "chatcmpl", "chat.completion", "chat.completion.chunk"
    text_template = True

    def _full_choice(self, index: int, out: ChoiceOutput) -> dict[str, Any]:
        message = message_with_calls({"role": "assistant", "content": out.text}, out.tool_calls)
        if out.reasoning:
            message["reasoning_content"] = out.reasoning
        return {
            "index": index,
            "message": message,
            "logprobs": self._logprobs(out),
            "finish_reason": out.finish_reason,
        }

    def _chunk_choice(self, index: int, out: ChoiceOutput) -> dict[str, Any]:
        reason = out.finish_reason
        delta: dict[str, Any] = {}
        if out.text or (reason is None and not out.reasoning):
            delta["content"] = out.text
        if out.reasoning:  # a thinking-only chunk has no content key, as vLLM's
            delta["reasoning_content"] = out.reasoning
        delta = delta_with_calls(delta, out.tool_calls)
        return {
            "index": index,
            "delta": delta,
            "logprobs": self._logprobs(out),
            "finish_reason": reason,
        }

    def _logprobs(self, out: ChoiceOutput) -> dict[str, Any] | None:
        return None if self.logprobs is None else chat_logprobs(out.logprobs, self.logprobs)

    def _add_prompt_logprobs(self, body: dict[str, Any], out: ChoiceOutput) -> None:
        if self.prompt_logprobs and out.prompt_logprobs:  # one prompt: shown once, as vLLM does
            body["prompt_logprobs"] = prompt_logprobs_body(out.prompt_logprobs)

    def first_chunk(self, index: int, usage: dict[str, Any] | None = None) -> dict[str, Any] | None:
        # OpenAI's first chunk of each choice names the role, with empty content.
        body = self._envelope(
            self.object_chunk,
            [
                {
                    "index": index,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ],
        )
        self._chunk_usage(body, usage)
        return body


def models_body(model: str, created: int, max_model_len: int) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [
            {
                "id": model,
                "object": "model",
                "created": created,
                "owned_by": "splitserve",
                "max_model_len": max_model_len,
            }
        ],
    }
