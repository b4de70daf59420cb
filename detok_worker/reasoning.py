"""The thinking split out of a reasoning model's streamed text (ipc.reasoning says the rules).

``ReasoningSplitter.feed`` takes the text the stop strings release and returns (reasoning,
content) so far; text that may still be the start of a tag is held back, as stop strings are.
It runs before the tool-call parser, which reads the content only: calls (and a grammar's
output) come after the thinking.
"""

from __future__ import annotations

from detok_worker.tool_call_text import partial_suffix
from ipc.reasoning import THINK_CLOSE, THINK_OPEN

# BEFORE: no text yet, or blanks and the start of a tag; CLOSED: right after "</think>",
# whose blank lines are layout, not answer.
BEFORE, THINKING, CLOSED, ANSWER = "before", "thinking", "closed", "answer"


class ReasoningSplitter:
    __slots__ = ("phase", "_otherwise", "_held")

    def __init__(self, starts_open: bool) -> None:
        # A "<think>" first opens the thinking (again, when the prompt opened it already);
        # other text first is thinking when the prompt opened it, else the answer.
        self.phase = BEFORE
        self._otherwise = THINKING if starts_open else ANSWER
        self._held = ""

    def feed(self, text: str) -> tuple[str, str]:
        reasoning = ""
        text = self._held + text
        self._held = ""
        if self.phase == BEFORE:
            stripped = text.lstrip()
            if stripped.startswith(THINK_OPEN):
                self.phase, text = THINKING, stripped[len(THINK_OPEN) :]
            elif not stripped and self._otherwise == THINKING:
                return text, ""  # blanks inside the thinking the prompt opened, "<think>" or not
            elif THINK_OPEN.startswith(stripped):  # blank, or a "<thi" that may go on
                self._held = text
                return "", ""
            else:
                self.phase = self._otherwise
        if self.phase == THINKING:
            end = text.find(THINK_CLOSE)
            if end < 0:
                held = partial_suffix(text, THINK_CLOSE)
                self._held = text[len(text) - held :]
                return text[: len(text) - held], ""
            reasoning, text = text[:end], text[end + len(THINK_CLOSE) :]
            self.phase = CLOSED
        if self.phase == CLOSED:
            text = text.lstrip("\n")
            if not text:
                return reasoning, ""
            self.phase = ANSWER
        return reasoning, text

    def finish(self) -> tuple[str, str]:
        """The output ended: held text is released where it was going (an unclosed thinking
        stays thinking; a lone "<thi" before anything is content)."""
        held, self._held = self._held, ""
        thinking = self.phase == THINKING or (self.phase == BEFORE and self._otherwise == THINKING)
        return (held, "") if thinking else ("", held)
