"""Tool calls read back from a model's streamed text, incrementally, as OpenAI streams them.

A parser takes the request's text deltas (``feed``) and returns what can be said so far: plain
content, and tool-call deltas, the first of each call carrying its id, type and name, the
following ones fragments of its ``arguments`` JSON (concatenated, they are the arguments).
Text that may still turn out to be the start of a call is held back, as stop strings are.

``HermesToolParser`` reads ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (the
default model family's format, and what tokenizer_worker.tool_calls prompts and enforces).
Other formats add a class with the same two methods to ``TOOL_PARSERS``.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from ipc.structured import ToolCall, ToolCallDelta, add_tool_call_deltas


@dataclass(slots=True)
class ParsedDelta:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


class ToolCallParser(Protocol):
    calls: int  # calls started so far

    def feed(self, text: str) -> ParsedDelta: ...

    def finish(self) -> ParsedDelta:
        """The output ended: release what was held back, settle an unclosed call."""
        ...


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


# What comes between <tool_call> and the start of the arguments, when "name" comes first.
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')


class HermesToolParser:
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self, new_id: Callable[[], str] = new_call_id) -> None:
        self.new_id = new_id
        self.calls = 0  # calls started so far
        self._buffer = ""  # text not yet released or consumed
        self._in_call = False
        self._streaming_args = False  # the call's name went out; its arguments are streaming
        self._depth = 0  # JSON nesting inside the arguments being streamed
        self._in_string = self._escaped = self._args_done = False
        self._blank = ""  # whitespace between calls, released only if content follows

    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        self._buffer += text
        progress = True
        while progress:
            progress = self._step_call(out) if self._in_call else self._step_content(out)
        return out

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if self._in_call and not self._streaming_args:
            # Unclosed (max tokens, or eos right after the object): a complete object still
            # counts as a call, anything else is text.
            if not self._emit_whole_call(self._buffer, out):
                self._content(out, self.OPEN + self._buffer)
        elif not self._in_call:
            self._content(out, self._buffer)
            if not self.calls:
                out.content += self._blank
        self._buffer, self._blank, self._in_call = "", "", False
        return out

    # --- outside a call ----------------------------------------------------------------------
    def _step_content(self, out: ParsedDelta) -> bool:
        start = self._buffer.find(self.OPEN)
        if start >= 0:
            self._content(out, self._buffer[:start])
            self._buffer = self._buffer[start + len(self.OPEN) :]
            self._in_call, self._streaming_args = True, False
            return True
        held = _partial_suffix(self._buffer, self.OPEN)
        self._content(out, self._buffer[: len(self._buffer) - held])
        self._buffer = self._buffer[len(self._buffer) - held :]
        return False

    def _content(self, out: ParsedDelta, text: str) -> None:
        # Trailing whitespace is held until text follows: before a call (or between two) it
        # is layout, not content.
        body = text.rstrip()
        if body:
            out.content += self._blank + body
            self._blank = ""
        self._blank += text[len(body) :]

    # --- inside a call -----------------------------------------------------------------------
    def _step_call(self, out: ParsedDelta) -> bool:
        if not self._streaming_args:
            head = _HEAD.match(self._buffer)
            if head and head.end() < len(self._buffer):
                # The name is known and the arguments have begun: stream them from here.
                if self._buffer[head.end()] == "{":
                    name = json.loads(f'"{head.group(1)}"')
                    out.tool_calls.append(self._start(name))
                    self._buffer = self._buffer[head.end() :]
                    self._streaming_args, self._depth = True, 0
                    self._in_string = self._escaped = self._args_done = False
                    return True
            end = self._buffer.find(self.CLOSE)
            if end < 0:
                return False
            body, self._buffer = self._buffer[:end], self._buffer[end + len(self.CLOSE) :]
            if not self._emit_whole_call(body, out):
                self._content(out, self.OPEN + body + self.CLOSE)
            self._in_call = False
            return True
        return self._stream_arguments(out)

    def _stream_arguments(self, out: ParsedDelta) -> bool:
        text, i = self._buffer, 0
        while i < len(text) and not self._args_done:
            c = text[i]
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif c == "\\":
                    self._escaped = True
                elif c == '"':
                    self._in_string = False
            elif c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                self._args_done = self._depth == 0
            elif c == "<" and text.startswith(self.CLOSE, i):
                break  # malformed: the call closes inside its arguments
            i += 1
        if i:
            last = out.tool_calls[-1] if out.tool_calls else None
            if last is not None and last.index == self.calls - 1:
                last.arguments += text[:i]  # one delta per call per feed
            else:
                out.tool_calls.append(ToolCallDelta(self.calls - 1, arguments=text[:i]))
        self._buffer = text[i:]
        end = self._buffer.find(self.CLOSE)
        if (self._args_done or self._buffer.startswith(self.CLOSE)) and end >= 0:
            self._buffer = self._buffer[end + len(self.CLOSE) :]  # the object's "}" and spaces
            self._in_call = self._streaming_args = False
            return True
        return False

    def _emit_whole_call(self, body: str, out: ParsedDelta) -> bool:
        try:
            call = json.loads(body)
        except json.JSONDecodeError:
            return False
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return False
        arguments = call.get("arguments", call.get("parameters", {}))
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        delta = self._start(call["name"])
        delta.arguments = arguments
        out.tool_calls.append(delta)
        return True

    def _start(self, name: str) -> ToolCallDelta:
        self.calls += 1
        self._blank = ""
        return ToolCallDelta(self.calls - 1, id=self.new_id(), name=name)


TOOL_PARSERS: dict[str, Callable[..., ToolCallParser]] = {"hermes": HermesToolParser}


def parse_complete(parser: ToolCallParser, text: str) -> tuple[str, list[ToolCall]]:
    """A whole output at once (non-streaming): its content and its calls, deltas merged."""
    content, calls = "", []  # type: tuple[str, list[ToolCall]]
    for delta in (parser.feed(text), parser.finish()):
        content += delta.content
        add_tool_call_deltas(calls, delta.tool_calls)
    return content, calls


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that begins ``tag`` (held back for now)."""
    for k in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0
