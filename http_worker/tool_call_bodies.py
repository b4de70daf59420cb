"""Tool calls in OpenAI's chat bodies: ``message.tool_calls`` of a whole answer, and
``delta.tool_calls`` of a stream chunk (the first piece of a call with its id, type and name,
the next ones with fragments of its arguments)."""

from __future__ import annotations

from typing import Any

from ipc.structured import ToolCall, ToolCallDelta, add_tool_call_deltas


def message_with_calls(message: dict[str, Any], deltas: list[ToolCallDelta]) -> dict[str, Any]:
    """A whole answer's message with the calls its deltas make up; ``content`` is null when it
    said nothing besides its calls, as OpenAI's is."""
    if deltas:
        calls: list[ToolCall] = []
        add_tool_call_deltas(calls, deltas)
        message["tool_calls"] = [c.as_openai() for c in calls]
        message["content"] = message["content"] or None
    return message


def delta_with_calls(delta: dict[str, Any], deltas: list[ToolCallDelta]) -> dict[str, Any]:
    """A stream chunk's delta carrying these pieces of calls (no empty content beside them)."""
    if deltas:
        if not delta.get("content"):
            delta.pop("content", None)
        delta["tool_calls"] = [d.as_openai() for d in deltas]
    return delta
