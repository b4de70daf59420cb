"""The Responses API's answer: the ``response`` object and its stream of typed events, in the
documented order: ``response.created``, ``response.in_progress``; per output item
``response.output_item.added``, then for a message ``response.content_part.added``,
``response.output_text.delta``..., ``response.output_text.done``, ``response.content_part.done``,
for a function call ``response.function_call_arguments.delta``...,
``response.function_call_arguments.done``, then ``response.output_item.done``; last
``response.completed`` (``response.incomplete`` when max_output_tokens cut the answer, and
``response.failed`` when it failed mid-stream). Every event has a ``sequence_number``."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

from http_worker.answer_format import ChoiceOutput, sse
from http_worker.logprobs import chat_logprobs
from http_worker.output_items import Change, OutputItem, OutputItems
from http_worker.protocol import APIError
from http_worker.responses_api import ResponsesRequest
from ipc.messages import FINISH_LENGTH, LogprobEntry

ITEM_ID_PREFIXES = {"call": "fc", "text": "msg", "thinking": "rs"}


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponsesFormat:
    """The Responses API's ``AnswerFormat``."""

    def __init__(self, model: str, request: ResponsesRequest) -> None:
        self.id = _id("resp")
        self.created = int(time.time())
        self.model = model
        self.logprobs = (request.top_logprobs or 0) if request.logprobs else None
        self.request = request
        self.output = OutputItems()
        self._item_ids: list[str] = []
        self._sequence = 0
        self._finish_reason: str | None = None

    # --- a whole answer ---------------------------------------------------------------------

    def full(self, choices: list[ChoiceOutput], usage: dict[str, Any]) -> dict[str, Any]:
        (out,) = choices  # one choice: the API has no n
        self._feed(out)
        self._feed_end()
        return self._response(usage)

    def _feed(self, out: ChoiceOutput) -> list[Change]:
        self._finish_reason = out.finish_reason or self._finish_reason
        changes = self.output.feed(out)
        self._item_ids += [_id(ITEM_ID_PREFIXES[it.kind]) for it in self._new_items()]
        return changes

    def _feed_end(self) -> list[Change]:
        changes = self.output.finish(ensure_text=True)
        self._item_ids += [_id("msg") for _ in self._new_items()]
        return changes

    def _new_items(self) -> list[OutputItem]:
        return self.output.items[len(self._item_ids) :]

    @property
    def _incomplete(self) -> bool:
        return self._finish_reason == FINISH_LENGTH

    def _response(
        self, usage: dict[str, Any] | None, status: str = "", error: dict | None = None
    ) -> dict[str, Any]:
        r = self.request
        status = status or ("incomplete" if self._incomplete else "completed")
        text_format = r.text.format if r.text is not None else None
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": error,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete"
            else None,
            "instructions": r.instructions,
            "max_output_tokens": r.max_output_tokens,
            "model": self.model,
            "output": [self._item(i) for i in range(len(self.output.items))]
            if status != "in_progress"
            else [],
            "parallel_tool_calls": r.parallel_tool_calls is not False,
            "previous_response_id": None,
            "reasoning": None,
            "store": False,  # nothing is kept (responses_api.py)
            "temperature": r.temperature,
            "text": {
                "format": text_format.model_dump(by_alias=True, exclude_none=True)
                if text_format is not None
                else {"type": "text"}
            },
            "tool_choice": _dumped(r.tool_choice) if r.tool_choice is not None else "auto",
            "tools": [tool.model_dump() for tool in r.tools or []],
            "top_logprobs": r.top_logprobs,
            "top_p": r.top_p,
            "truncation": "disabled",
            "usage": _usage(usage) if usage is not None else None,
            "user": r.user,
            "metadata": r.metadata or {},
        }

    def _item(self, index: int, opening: bool = False) -> dict[str, Any]:
        item, item_id = self.output.items[index], self._item_ids[index]
        last = index == len(self.output.items) - 1
        status = (
            "in_progress" if opening else "incomplete" if self._incomplete and last else "completed"
        )
        if item.kind == "call":
            return {
                "type": "function_call",
                "id": item_id,
                "call_id": item.call_id,
                "name": item.name,
                "arguments": "" if opening else item.text,
                "status": status,
            }
        if item.kind == "thinking":
            return {
                "type": "reasoning",
                "id": item_id,
                "summary": [],
                "content": [] if opening else [_reasoning_part(item.text)],
                "status": status,
            }
        return {
            "type": "message",
            "id": item_id,
            "status": status,
            "role": "assistant",
            "content": [] if opening else [self._text_part(item.text, item.logprobs)],
        }

    def _text_part(self, text: str, logprobs: list[LogprobEntry]) -> dict[str, Any]:
        return {
            "type": "output_text",
            "text": text,
            "annotations": [],
            "logprobs": self._logprobs(logprobs),
        }

    def _logprobs(self, entries: list[LogprobEntry]) -> list[dict[str, Any]]:
        if self.logprobs is None:
            return []
        return chat_logprobs(entries, self.logprobs)["content"]

    # --- a stream ---------------------------------------------------------------------------

    def _event(self, kind: str, **fields: Any) -> bytes:
        self._sequence += 1
        return sse({"type": kind, "sequence_number": self._sequence - 1, **fields}, kind)

    def stream_start(self, choices: int, usage: dict[str, Any] | None) -> Iterator[bytes]:
        opening = self._response(None, "in_progress")
        yield self._event("response.created", response=opening)
        yield self._event("response.in_progress", response=opening)

    def stream_delta(
        self, index: int, out: ChoiceOutput, usage: dict[str, Any] | None
    ) -> Iterator[bytes]:
        for change in self._feed(out):
            yield from self._change_events(change)

    def stream_end(self, usage: dict[str, Any]) -> Iterator[bytes]:
        for change in self._feed_end():
            yield from self._change_events(change)
        response = self._response(usage)
        kind = "response.incomplete" if self._incomplete else "response.completed"
        yield self._event(kind, response=response)

    def stream_error(self, error: APIError) -> Iterator[bytes]:
        failure = {"code": error.code or "server_error", "message": error.message}
        yield self._event("response.failed", response=self._response(None, "failed", failure))

    def _thinking_events(self, change: Change, where: dict[str, Any]) -> Iterator[bytes]:
        """A reasoning item's thinking: ``response.reasoning_text.delta`` events, then its
        ``.done`` with the whole text (its item's opening was sent already)."""
        index = change.index
        if change.what == "add":
            yield self._event(
                "response.reasoning_text.delta", **where, content_index=0, delta=change.text
            )
        elif change.what == "close":
            text = self.output.items[index].text
            yield self._event("response.reasoning_text.done", **where, content_index=0, text=text)
            yield self._event(
                "response.output_item.done", output_index=index, item=self._item(index)
            )

    def _change_events(self, change: Change) -> Iterator[bytes]:
        index = change.index
        item, item_id = self.output.items[index], self._item_ids[index]
        where = {"item_id": item_id, "output_index": index}
        if change.what == "open":
            yield self._event(
                "response.output_item.added", output_index=index, item=self._item(index, True)
            )
            if item.kind == "text":
                part = self._text_part("", [])
                yield self._event(
                    "response.content_part.added", **where, content_index=0, part=part
                )
        elif item.kind == "thinking":
            yield from self._thinking_events(change, where)
        elif change.what == "add" and item.kind == "text":
            yield self._event(
                "response.output_text.delta",
                **where,
                content_index=0,
                delta=change.text,
                logprobs=self._logprobs(change.logprobs),
            )
        elif change.what == "add":
            yield self._event("response.function_call_arguments.delta", **where, delta=change.text)
        elif item.kind == "text":
            part = self._text_part(item.text, item.logprobs)
            yield self._event(
                "response.output_text.done",
                **where,
                content_index=0,
                text=item.text,
                logprobs=part["logprobs"],
            )
            yield self._event("response.content_part.done", **where, content_index=0, part=part)
            yield self._event(
                "response.output_item.done", output_index=index, item=self._item(index)
            )
        else:
            yield self._event(
                "response.function_call_arguments.done",
                **where,
                name=item.name,
                arguments=item.text,
            )
            yield self._event(
                "response.output_item.done", output_index=index, item=self._item(index)
            )


def _reasoning_part(text: str) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text}


def _dumped(value: Any) -> Any:
    return value.model_dump() if hasattr(value, "model_dump") else value


def _usage(usage: dict[str, Any]) -> dict[str, Any]:
    """From chat's usage: the Responses API's names."""
    return {
        "input_tokens": usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]},
        "output_tokens": usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage["total_tokens"],
    }
