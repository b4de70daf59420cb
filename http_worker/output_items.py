"""An answer as a list of typed items, for the APIs that answer that way: OpenAI's Responses
(``reasoning``, ``message`` and ``function_call`` output items) and Anthropic's Messages
(``thinking``, ``text`` and ``tool_use`` content blocks). Thinking goes to the open thinking
item, text to the open text item; the first piece of a tool call opens a call item, its next
pieces extend that call's arguments.

The same builder serves a whole answer and a stream: ``feed`` takes a ChoiceOutput (one delta's
worth, or all of it, its ``parts`` in the order they came) and returns what changed, which a
stream turns into events; so a streamed answer, accumulated, is the answer given whole.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from http_worker.answer_format import ChoiceOutput, Reasoning
from ipc.messages import LogprobEntry
from ipc.structured import ToolCallDelta


@dataclass(slots=True)
class OutputItem:
    kind: Literal["text", "call", "thinking"]
    text: str = ""  # the text, or the call's arguments (JSON text)
    call_id: str = ""
    name: str = ""
    logprobs: list[LogprobEntry] = field(default_factory=list)  # of a text item's tokens
    done: bool = False


@dataclass(slots=True)
class Change:
    """What one feed did to item ``index``: opened it, added ``text`` (and ``logprobs``) to it,
    or closed it."""

    what: Literal["open", "add", "close"]
    index: int
    text: str = ""
    logprobs: list[LogprobEntry] = field(default_factory=list)


class OutputItems:
    """Logprobs of tokens that produced no text (held back, or a call's) go with the next text,
    or, at the end, with the last text item."""

    def __init__(self) -> None:
        self.items: list[OutputItem] = []
        self._call_items: dict[int, int] = {}  # a call's index among the calls -> its item
        self._pending: list[LogprobEntry] = []

    def feed(self, out: ChoiceOutput) -> list[Change]:
        changes: list[Change] = []
        self._pending += out.logprobs
        for part in out.parts:
            if isinstance(part, Reasoning):
                self._add_text(part.text, changes, "thinking")
            elif isinstance(part, str):
                self._add_text(part, changes)
            else:
                self._add_call_piece(part, changes)
        return changes

    def finish(self, ensure_text: bool = False) -> list[Change]:
        """Closes the open item; ``ensure_text``: an answer without text gets an empty text
        item (a Responses answer always has its message, after any thinking)."""
        changes: list[Change] = []
        if ensure_text and not any(item.kind == "text" for item in self.items):
            self._close_open(changes)
            self._open(OutputItem("text"), changes)
        texts = [item for item in self.items if item.kind == "text"]
        if texts and self._pending:
            texts[-1].logprobs += self._pending
            self._pending = []
        self._close_open(changes)
        return changes

    def _add_text(
        self, text: str, changes: list[Change], kind: Literal["text", "thinking"] = "text"
    ) -> None:
        if not text:
            return
        if not self.items or self.items[-1].kind != kind or self.items[-1].done:
            self._close_open(changes)
            self._open(OutputItem(kind), changes)
        item = self.items[-1]
        item.text += text
        logprobs: list[LogprobEntry] = []
        if kind == "text":  # the thinking's token logprobs go with the answer's text
            logprobs, self._pending = self._pending, []
        item.logprobs += logprobs
        changes.append(Change("add", len(self.items) - 1, text, logprobs))

    def _add_call_piece(self, piece: ToolCallDelta, changes: list[Change]) -> None:
        if piece.id is not None:
            self._close_open(changes)
            self._open(OutputItem("call", call_id=piece.id, name=piece.name or ""), changes)
            self._call_items[piece.index] = len(self.items) - 1
        index = self._call_items.get(piece.index)
        if index is None or not piece.arguments:
            return
        self.items[index].text += piece.arguments
        changes.append(Change("add", index, piece.arguments))

    def _open(self, item: OutputItem, changes: list[Change]) -> None:
        self.items.append(item)
        changes.append(Change("open", len(self.items) - 1))

    def _close_open(self, changes: list[Change]) -> None:
        if self.items and not self.items[-1].done:
            self.items[-1].done = True
            changes.append(Change("close", len(self.items) - 1))
