"""The idle-engine batching window.

A burst reaches an idle engine one request at a time: the first is tokenized alone, the rest a
moment later. Stepping at once makes the first request's prefill a step of its own (seconds for a
long prompt on a CPU) while the others queue behind it. The window lets an engine that had
nothing to do wait a little after the first arrival, so requests arriving within it share the
first step (and, for a shared prefix, its cached blocks). It never delays a busy engine: requests
that arrive while others run join the next step as always.

The window closes at its deadline, as soon as a first step could take no more requests
(``max_requests`` waiting), or when the engine steps. Times are ``time.monotonic()`` seconds.
"""

from __future__ import annotations


class IdleBatchWindow:
    def __init__(self, window_s: float, max_requests: int) -> None:
        if window_s < 0 or max_requests < 1:
            raise ValueError("window_s must be >= 0 and max_requests >= 1")
        self.window_s = window_s
        self.max_requests = max_requests
        self.deadline: float | None = None  # open while not None

    def on_arrival(self, now: float, engine_was_idle: bool) -> None:
        """A request was added; ``engine_was_idle``: the engine had nothing running or waiting
        just before it."""
        if engine_was_idle and self.window_s > 0:
            self.deadline = now + self.window_s

    def remaining_s(self, now: float, waiting_requests: int) -> float:
        """How much longer to wait before stepping (0: step now)."""
        if self.deadline is None:
            return 0.0
        if now >= self.deadline or waiting_requests >= self.max_requests:
            self.deadline = None
            return 0.0
        return self.deadline - now

    def close(self) -> None:
        self.deadline = None
