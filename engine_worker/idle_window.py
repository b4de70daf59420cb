"""The idle-engine batching window.

A burst reaches an idle engine one request at a time: the first is tokenized alone, the rest a
moment later. Stepping at once makes the first request's prefill a step of its own (seconds for a
long prompt on a CPU) while the others queue behind it. The window lets an engine that had
nothing to do wait a little after the first arrival, so requests arriving within it share the
first step (and, for a shared prefix, its cached blocks). It never delays a busy engine: requests
that arrive while others run join the next step as always.

How long: at most ``max_s``, and at most ``step_fraction`` of the time the first step is expected
to take (the prompt's tokens at the seconds per prefill token of recent steps). What a lone
request can lose is then a small share of its own time to first token on any engine: a CPU
engine whose long-prompt step takes seconds waits long enough for a tokenizer to deliver the rest
of a burst, a GPU engine whose step takes milliseconds hardly waits. Before any prefill step has
been timed there is no expectation, and no wait (``step_fraction`` 0 turns the bound off, leaving
the fixed ``max_s``); nor is there below ``MIN_WAIT_S``, the loop's resolution.

The window closes at its deadline, as soon as a first step could take no more requests
(``max_requests`` waiting), or when the engine steps. Times are ``time.monotonic()`` seconds.
"""

from __future__ import annotations

# Steps with at least this many prefill tokens time the per-token cost (decode-only steps cost
# far more per token and would inflate it).
MIN_TIMED_PREFILL_TOKENS = 64
SMOOTHING = 0.5  # weight of the newest step in the running per-token cost
# The engine loop waits in whole milliseconds (its poll's unit): a shorter window would wait a
# whole one, more than the fraction allows, for a first step expected to take a few ms (a fully
# cached prompt computes one token). Below this the window does not open.
MIN_WAIT_S = 0.001


class IdleBatchWindow:
    def __init__(self, max_s: float, step_fraction: float, max_requests: int) -> None:
        if max_s < 0 or step_fraction < 0 or max_requests < 1:
            raise ValueError("max_s and step_fraction must be >= 0 and max_requests >= 1")
        self.max_s = max_s
        self.step_fraction = step_fraction
        self.max_requests = max_requests
        self.seconds_per_token: float | None = None  # of recent prefill steps
        self.deadline: float | None = None  # open while not None

    def window_s(self, first_step_tokens: int) -> float:
        """The wait for a first step of this many prompt tokens."""
        if not self.step_fraction:
            return self.max_s
        if self.seconds_per_token is None:
            return 0.0
        expected = self.seconds_per_token * first_step_tokens
        return min(self.max_s, self.step_fraction * expected)

    def on_arrival(self, now: float, engine_was_idle: bool, first_step_tokens: int) -> None:
        """A request was added; ``engine_was_idle``: the engine had nothing running or waiting
        just before it; ``first_step_tokens``: what a step would compute of its prompt."""
        if engine_was_idle:
            wait = self.window_s(first_step_tokens)
            self.deadline = now + wait if wait >= MIN_WAIT_S else None

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

    def observe_step(self, step_s: float, prefill_tokens: int) -> None:
        """Times a finished step; only prefill-heavy ones update the per-token cost."""
        if prefill_tokens < MIN_TIMED_PREFILL_TOKENS:
            return
        cost = step_s / prefill_tokens
        self.seconds_per_token = (
            cost
            if self.seconds_per_token is None
            else (SMOOTHING * cost + (1 - SMOOTHING) * self.seconds_per_token)
        )
