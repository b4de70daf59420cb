"""Tool calls of the Llama 3.x and Mistral families, read back from streamed text (the rules
every parser follows: detok_worker.tool_call_text).

Llama 3.1-3.3 (``llama3_json``): the output is the call, ``{"name": "f", "parameters": {...}}``
("arguments" is read too), optionally after ``<|python_tag|>``; several calls are separated by
";". An output that begins otherwise is plain content, and so is an object that turns out to
be no call (held back until it closes, since until then it could be one).

Mistral (``mistral``): calls follow its ``[TOOL_CALLS]`` token, either as a JSON list of call
objects (``[TOOL_CALLS] [{"name": "f", "arguments": {...}}, ...]``, the v3 tokenizers) or, from
the v11 tokenizers on, one call per token, ``[TOOL_CALLS]f[ARGS]{...}`` (a ``[CALL_ID]id``
before ``[ARGS]`` is skipped). Text before the token is content. Call ids are 9 letters and
digits: Mistral's templates refuse others when the calls come back in the history.
"""

from __future__ import annotations

import re
import secrets
import string
from collections.abc import Callable

from detok_worker.tool_call_text import (
    CallCounter,
    JsonEnd,
    ObjectCall,
    ParsedDelta,
    new_call_id,
    partial_suffix,
)

_ID_CHARS = string.ascii_letters + string.digits
_FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_LONGEST_NAME = 64 + len("[CALL_ID]")  # longer without a marker: not a name


def mistral_call_id() -> str:
    return "".join(secrets.choice(_ID_CHARS) for _ in range(9))


class Llama3JsonToolParser(CallCounter):
    TAG = "<|python_tag|>"
    markers: tuple[str, ...] = (TAG,)

    def __init__(self, new_id: Callable[[], str] = new_call_id) -> None:
        super().__init__(new_id)
        self._buffer = ""
        self._held = ""  # the whole output while no call began: content if none does
        self._mode = "start"  # start, call, between (calls), content (no more calls)
        self._call: ObjectCall | None = None

    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        if self._mode == "content":
            out.content = text
            return out
        self._buffer += text
        if not self.calls:
            self._held += text
        while self._step(out):
            pass
        return out

    def _step(self, out: ParsedDelta) -> bool:
        if self._mode == "call":
            assert self._call is not None
            after, self._buffer = self._call.feed(self._buffer, self, out), ""
            if after is None:
                return False
            if self._call.not_call:
                return self._to_content(out, self._call.not_call + after)
            self._buffer, self._mode, self._call = after, "between", None
            return True
        text = self._buffer.lstrip()
        if self._mode == "between" and text.startswith(";"):
            self._buffer = text[1:]
            return True
        if text.startswith(self.TAG):
            self._buffer = text[len(self.TAG) :]
            return True
        if text.startswith("{"):
            self._buffer, self._mode, self._call = text, "call", ObjectCall()
            return True
        if not text or self.TAG.startswith(text):
            return False  # undecided yet
        return self._to_content(out, text)

    def _to_content(self, out: ParsedDelta, text: str) -> bool:
        """No (more) calls: what was held is content, and so is whatever follows."""
        out.content += text if self.calls else self._held
        self._mode, self._buffer, self._held = "content", "", ""
        return False

    def finish(self, cut: bool = False) -> ParsedDelta:
        out = ParsedDelta()
        call, rest = self._call, self._buffer.strip()
        if self._mode == "call" and call is not None and call.args is None:
            if call.feed("", self, out) is None and not call.cut_short():
                self._to_content(out, call.head)  # an unfinished object that is no call
        elif self._mode == "start" and not (cut and rest):
            out.content += self._held  # only blanks, or a "<|python" the model ended on
        self._mode, self._buffer, self._held, self._call = "content", "", "", None
        return out


class MistralToolParser(CallCounter):
    MARK, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
    markers: tuple[str, ...] = (MARK, ARGS, CALL_ID)

    def __init__(self, new_id: Callable[[], str] = mistral_call_id) -> None:
        super().__init__(new_id)
        self._buffer = ""
        # content; after_mark; list (between objects of a list); object; name; args
        self._mode = "content"
        self._call: ObjectCall | None = None
        self._args = JsonEnd()

    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        self._buffer += text
        while getattr(self, "_step_" + self._mode)(out):
            pass
        return out

    def finish(self, cut: bool = False) -> ParsedDelta:
        out = ParsedDelta()
        if self._mode == "content" and not (cut and self._buffer):
            self._content(out, self._buffer)  # cut, a held "[TOOL_" began a call: dropped
            self._release_blank(out)
        elif self._mode == "object" and self._call is not None and self._call.args is None:
            self._call.feed("", self, out, halt=self.MARK)  # a complete object still counts
        # Anything else is a call cut before its arguments began: dropped.
        self._mode, self._buffer, self._call, self._blank = "content", "", None, ""
        return out

    def _step_content(self, out: ParsedDelta) -> bool:
        start = self._buffer.find(self.MARK)
        if start >= 0:
            self._content(out, self._buffer[:start])
            self._buffer, self._mode = self._buffer[start + len(self.MARK) :], "after_mark"
            return True
        held = partial_suffix(self._buffer, self.MARK)
        self._content(out, self._buffer[: len(self._buffer) - held])
        self._buffer = self._buffer[len(self._buffer) - held :]
        return False

    def _step_after_mark(self, out: ParsedDelta) -> bool:
        text = self._buffer.lstrip()
        if not text:
            return False
        if text[0] in "[{":  # a list of call objects (a bare object: a list of one)
            self._buffer, self._mode = text[1:] if text[0] == "[" else text, "list"
        else:
            self._buffer, self._mode = text, "name"
        return True

    def _step_list(self, out: ParsedDelta) -> bool:
        text = self._buffer.lstrip()
        if not text:
            return False
        if text[0] == "{":
            self._buffer, self._mode, self._call = text, "object", ObjectCall()
        elif text[0] in ",]":
            self._buffer = text[1:]
            self._mode = "list" if text[0] == "," else "content"
        else:  # malformed: the rest is text
            self._buffer, self._mode = text, "content"
        return True

    def _step_object(self, out: ParsedDelta) -> bool:
        assert self._call is not None
        after, self._buffer = self._call.feed(self._buffer, self, out, halt=self.MARK), ""
        if after is None:
            return False
        if self._call.not_call:
            self._content(out, self._call.not_call)
        self._buffer, self._mode, self._call = after, "list", None
        return True

    def _step_name(self, out: ParsedDelta) -> bool:
        text = self._buffer
        found = [i for i in (text.find(self.ARGS), text.find(self.CALL_ID)) if i >= 0]
        if not found and len(text) <= _LONGEST_NAME:
            return False  # the name goes on
        name = text[: min(found)].strip() if found else text
        if not _FUNCTION_NAME.match(name):  # malformed: what the model wrote is text
            self._buffer, self._mode = "", "content"
            self._content(out, self.MARK + text)
            return True
        args = text.find(self.ARGS, min(found))
        if args < 0:
            return False  # "[CALL_ID]id" goes on
        out.tool_calls.append(self._start(name))
        self._buffer, self._mode, self._args = text[args + len(self.ARGS) :], "args", JsonEnd()
        return True

    def _step_args(self, out: ParsedDelta) -> bool:
        n = self._args.scan(self._buffer, halt=self.MARK)
        self._arguments(out, self._buffer[:n])
        self._buffer = self._buffer[n:]
        if self._args.done or self._buffer.startswith(self.MARK):
            self._mode = "content"
            return True
        return False
