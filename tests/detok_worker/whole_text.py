"""A tool-call parser run over a whole output at once, for tests that check what a text parses
to (the detokenizer itself always streams: detok_worker.core feeds each step's text)."""

from __future__ import annotations

from detok_worker.tool_parsers import ToolCallParser
from ipc.structured import ToolCall, add_tool_call_deltas


def parse_complete(
    parser: ToolCallParser, text: str, cut: bool = False
) -> tuple[str, list[ToolCall]]:
    """A whole output at once (non-streaming): its content and its calls, deltas merged."""
    content, calls = "", []  # type: tuple[str, list[ToolCall]]
    for delta in (parser.feed(text), parser.finish(cut)):
        content += delta.content
        add_tool_call_deltas(calls, delta.tool_calls)
    return content, calls
