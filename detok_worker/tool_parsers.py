"""Tool calls read back from a model's streamed text, incrementally, as OpenAI streams them
(what every parser shares, and what a call cut short becomes: detok_worker.tool_call_text).

``HermesToolParser`` reads ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Qwen2.5
and Qwen3, Hermes, and what tokenizer_worker.tool_calls prompts a template without tools to
write); detok_worker.json_tool_parsers reads Llama 3.x's JSON calls and Mistral's
``[TOOL_CALLS]``. ``TOOL_PARSERS`` maps the names of ipc.structured.TOOL_CALL_FORMATS to them.
"""

from __future__ import annotations

from collections.abc import Callable

from detok_worker.json_tool_parsers import Llama3JsonToolParser, MistralToolParser
from detok_worker.tool_call_text import (
    CALL_HEAD,
    CallCounter,
    JsonEnd,
    ParsedDelta,
    ToolCallParser,
    json_string,
    new_call_id,
    partial_suffix,
    whole_call,
)
from ipc.structured import TOOL_FORMAT_HERMES, TOOL_FORMAT_LLAMA3_JSON, TOOL_FORMAT_MISTRAL

__all__ = ["TOOL_PARSERS", "HermesToolParser", "ParsedDelta", "ToolCallParser"]


class HermesToolParser(CallCounter):
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    markers: tuple[str, ...] = ()  # Qwen's tags are added tokens, not special ones

    def __init__(self, new_id: Callable[[], str] = new_call_id) -> None:
        super().__init__(new_id)
        self._buffer = ""  # text not yet released or consumed
        self._in_call = False
        self._args: JsonEnd | None = None  # the call's name went out; its arguments stream

    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        self._buffer += text
        progress = True
        while progress:
            progress = self._step_call(out) if self._in_call else self._step_content(out)
        return out

    def finish(self, cut: bool = False) -> ParsedDelta:
        out = ParsedDelta()
        if self._in_call and self._args is None:
            # Unclosed (max tokens, or eos right after the object): a complete object still
            # counts as a call; the start of one ("{..." or nothing yet) is dropped, other
            # text after the tag stays text.
            body = self._buffer
            if not self._emit_whole_call(body, out) and body.strip()[:1] not in ("", "{"):
                self._content(out, self.OPEN + body)
        elif not self._in_call and not (cut and self._buffer):
            self._content(out, self._buffer)  # cut, a held "<tool_c" began a call: dropped
            self._release_blank(out)
        self._buffer, self._in_call, self._blank = "", False, ""
        return out

    # --- outside a call ----------------------------------------------------------------------
    def _step_content(self, out: ParsedDelta) -> bool:
        start = self._buffer.find(self.OPEN)
        if start >= 0:
            self._content(out, self._buffer[:start])
            self._buffer = self._buffer[start + len(self.OPEN) :]
            self._in_call, self._args = True, None
            return True
        held = partial_suffix(self._buffer, self.OPEN)
        self._content(out, self._buffer[: len(self._buffer) - held])
        self._buffer = self._buffer[len(self._buffer) - held :]
        return False

    # --- inside a call -----------------------------------------------------------------------
    def _step_call(self, out: ParsedDelta) -> bool:
        if self._args is None:
            head = CALL_HEAD.match(self._buffer)
            if head and head.end() < len(self._buffer) and self._buffer[head.end()] == "{":
                # The name is known and the arguments have begun: stream them from here.
                name = json_string(head.group(1))
                if name is not None:
                    out.tool_calls.append(self._start(name))
                    self._buffer, self._args = self._buffer[head.end() :], JsonEnd()
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
        assert self._args is not None
        n = self._args.scan(self._buffer, halt=self.CLOSE)  # a close inside: malformed
        self._arguments(out, self._buffer[:n])
        self._buffer = self._buffer[n:]
        end = self._buffer.find(self.CLOSE)
        if (self._args.done or self._buffer.startswith(self.CLOSE)) and end >= 0:
            self._buffer = self._buffer[end + len(self.CLOSE) :]  # the object's "}" and spaces
            self._in_call, self._args = False, None
            return True
        return False

    def _emit_whole_call(self, body: str, out: ParsedDelta) -> bool:
        call = whole_call(body)
        if call is None:
            return False
        delta = self._start(call[0])
        delta.arguments = call[1]
        out.tool_calls.append(delta)
        return True


TOOL_PARSERS: dict[str, Callable[..., ToolCallParser]] = {
    TOOL_FORMAT_HERMES: HermesToolParser,
    TOOL_FORMAT_LLAMA3_JSON: Llama3JsonToolParser,
    TOOL_FORMAT_MISTRAL: MistralToolParser,
}
