"""Tool calls in OpenAI's response bodies: ``message.tool_calls`` of a whole answer, and
``delta.tool_calls`` of a stream chunk (the first piece of a call with its id, type and name,
the next ones with fragments of its arguments)."""

from __future__ import annotations

from typing import Any

from ipc.structured import ToolCall, ToolCallDelta


def with_tool_calls(body: dict[str, Any], calls: list[list[ToolCall]]) -> dict[str, Any]:
    """A chat completion body with each choice's calls; ``content`` is null when a choice
    said nothing besides its calls, as OpenAI's is."""
    for choice, choice_calls in zip(body["choices"], calls):
        if choice_calls:
            message = choice["message"]
            message["tool_calls"] = [c.as_openai() for c in choice_calls]
            message["content"] = message["content"] or None
    return body


def with_tool_call_deltas(chunk: dict[str, Any], deltas: list[ToolCallDelta]) -> dict[str, Any]:
    """A chat stream chunk (one choice) carrying these pieces of calls."""
    delta = chunk["choices"][0]["delta"]
    if not delta.get("content"):
        delta.pop("content", None)
    delta["tool_calls"] = [d.as_openai() for d in deltas]
    return chunk
