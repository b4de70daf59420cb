"""Stop strings over streamed text, with hold-back.

Text released to the client never contains a stop string, nor ends with a prefix of one that a
later token could complete: such a tail is held back until it either completes (the request stops
and the tail is dropped) or can no longer match (it is released). State per request is the held
tail only, shorter than the longest stop string.
"""

from __future__ import annotations


class StopStringMatcher:
    """``include_stop``: the matched stop string stays at the end of the released text."""

    __slots__ = ("stops", "held", "include_stop")

    def __init__(self, stops: list[str], include_stop: bool = False) -> None:
        self.stops = [s for s in stops if s]
        self.held = ""
        self.include_stop = include_stop

    def feed(self, text: str) -> tuple[str, bool]:
        """Returns (text safe to release now, whether a stop string matched)."""
        if not self.stops:
            return text, False
        buf = self.held + text
        # Released text never ends in a prefix of a stop string, so a match lies within buf.
        # The earliest match wins; of two starting there, the one listed first.
        first, stop = min(
            ((i, s) for s in self.stops if (i := buf.find(s)) >= 0),
            key=lambda match: match[0],
            default=(-1, ""),
        )
        if first >= 0:
            self.held = ""
            return buf[: first + len(stop) if self.include_stop else first], True
        keep = self._partial_match_len(buf)
        self.held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        """At the end of generation a held tail can no longer complete: release it."""
        out, self.held = self.held, ""
        return out

    def _partial_match_len(self, buf: str) -> int:
        longest = max(len(s) for s in self.stops) - 1
        for k in range(min(len(buf), longest), 0, -1):
            tail = buf[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0
