"""What every tool-call parser shares (detok_worker.tool_parsers registers them).

A parser takes the request's text deltas (``feed``) and returns what can be said so far: plain
content, and tool-call deltas, the first of each call carrying its id, type and name, the
following ones fragments of its ``arguments`` JSON (concatenated, they are the arguments).
Text that may still turn out to be the start of a call is held back, as stop strings are.

A call is reported once its arguments have begun: from then on its id and name are out in a
stream, so a call cut by max_tokens stays a call, with the arguments written so far and
finish_reason "length" (what OpenAI answers). A call cut before its arguments began is dropped,
streamed or not: it never surfaces as text.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from ipc.structured import ToolCallDelta


@dataclass(slots=True)
class ParsedDelta:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


class ToolCallParser(Protocol):
    calls: int  # calls started so far
    # Special tokens of the format: the detokenizer keeps their text in what it feeds the
    # parser even when the request skips special tokens.
    markers: tuple[str, ...]

    def feed(self, text: str) -> ParsedDelta: ...

    def finish(self, cut: bool = False) -> ParsedDelta:
        """The output ended (``cut``: by max_tokens or an abort, not by the model): release
        what was held back, settle an unclosed call."""
        ...


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


# A call object whose name comes first, up to where its arguments begin.
CALL_HEAD = re.compile(
    r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*'
)
# The start of an object that may still become such a call (its first key is, or begins,
# "name"): cut there, it was a call.
CALL_START = re.compile(r'\s*\{\s*(?:"(?:n(?:a(?:m(?:e(?:"\s*:.*)?)?)?)?)?)?$', re.DOTALL)


class JsonEnd:
    """Finds where a JSON object or array ends in text fed piece by piece: nesting and strings
    (with their escapes) are tracked across pieces."""

    __slots__ = ("depth", "in_string", "escaped", "done")

    def __init__(self, depth: int = 0) -> None:
        self.depth = depth
        self.in_string = self.escaped = self.done = False

    def scan(self, text: str, halt: str = "") -> int:
        """How much of ``text`` belongs to the value: all of it, or up to its closing bracket
        (then ``done``); it stops before ``halt`` outside strings (a tag that ends the call
        inside malformed arguments)."""
        i = 0
        while i < len(text) and not self.done:
            c = text[i]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
            elif halt and c == halt[0] and text.startswith(halt, i):
                break
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                self.done = self.depth <= 0
            i += 1
        return i


def whole_call(body: str) -> tuple[str, str] | None:
    """(name, arguments JSON) of a complete call object, or None when it is not one."""
    try:
        call = json.loads(body)
    except (json.JSONDecodeError, RecursionError):
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return call["name"], arguments


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that begins ``tag`` (held back for now)."""
    for k in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


class CallCounter:
    """Numbers a request's calls and gives each its id; holds the whitespace before a call,
    which is layout, not content."""

    def __init__(self, new_id: Callable[[], str] = new_call_id) -> None:
        self.new_id = new_id
        self.calls = 0  # calls started so far
        self._blank = ""  # whitespace between calls, released only if content follows

    def _content(self, out: ParsedDelta, text: str) -> None:
        # Trailing whitespace is held until text follows: before a call (or between two) it
        # is layout, not content.
        body = text.rstrip()
        if body:
            out.content += self._blank + body
            self._blank = ""
        self._blank += text[len(body) :]

    def _release_blank(self, out: ParsedDelta) -> None:
        """At the end: held whitespace is content only when there was no call."""
        if not self.calls:
            out.content += self._blank
        self._blank = ""

    def _start(self, name: str) -> ToolCallDelta:
        self.calls += 1
        self._blank = ""
        return ToolCallDelta(self.calls - 1, id=self.new_id(), name=name)

    def _arguments(self, out: ParsedDelta, text: str) -> None:
        """A fragment of the current call's arguments (one delta per call per feed)."""
        if not text:
            return
        last = out.tool_calls[-1] if out.tool_calls else None
        if last is not None and last.index == self.calls - 1:
            last.arguments += text
        else:
            out.tool_calls.append(ToolCallDelta(self.calls - 1, arguments=text))


class ObjectCall:
    """One call written as a JSON object, ``{"name": "f", "arguments": {...}}`` ("parameters"
    also names the arguments), read from its "{" as it streams: the call starts once its
    arguments begin, their fragments follow; an object in another key order is read whole when
    it closes. ``feed`` returns the text after the object, or None while the object goes on;
    a complete object that is no call leaves its text in ``not_call``."""

    __slots__ = ("head", "scan", "args", "rest", "started", "not_call")

    def __init__(self) -> None:
        self.head = ""  # the object's text before its arguments began
        self.scan = JsonEnd()  # the object's extent, while its arguments have not begun
        self.args: JsonEnd | None = None
        self.rest = JsonEnd(depth=1)  # after the arguments, up to the object's "}"
        self.started = False
        self.not_call = ""

    def feed(self, text: str, owner: CallCounter, out: ParsedDelta, halt: str = "") -> str | None:
        if self.args is None:
            self.head += text
            head = CALL_HEAD.match(self.head)
            if head and head.end() < len(self.head) and self.head[head.end()] == "{":
                name = json_string(head.group(1))
                if name is not None:
                    out.tool_calls.append(owner._start(name))
                    self.started = True
                    self.args, text, self.head = JsonEnd(), self.head[head.end() :], ""
            if self.args is None:
                return self._whole(text, owner, out)
        if not self.args.done:
            n = self.args.scan(text, halt)
            owner._arguments(out, text[:n])
            text = text[n:]
            if not self.args.done:
                return text if halt and text.startswith(halt) else None
        n = self.rest.scan(text, halt)
        return text[n:] if self.rest.done or (halt and text[n:].startswith(halt)) else None

    def _whole(self, text: str, owner: CallCounter, out: ParsedDelta) -> str | None:
        n = self.scan.scan(text)
        if not self.scan.done:
            return None
        end = len(self.head) - len(text) + n
        body, after = self.head[:end], self.head[end:]
        call = whole_call(body)
        if call is None:
            self.not_call = body
        else:
            delta = owner._start(call[0])
            delta.arguments = call[1]
            out.tool_calls.append(delta)
            self.started = True
        return after

    def cut_short(self) -> bool:
        """At the end of the output, unfinished: whether it was becoming a call."""
        return not self.started and bool(CALL_START.match(self.head) or CALL_HEAD.match(self.head))


def json_string(body: str) -> str | None:
    try:
        return json.loads(f'"{body}"')
    except json.JSONDecodeError:
        return None
