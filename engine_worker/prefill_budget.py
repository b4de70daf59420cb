"""What one step may spend on prompts, and the rule that lets short prompts past long ones.

A step's prompt work is bounded three ways (``Budget``):

* in sequences, the requests that prefill in it (``prefill_max_batch_size``);
* in tokens (``prefill_max_tokens``);
* in token-keys (``prefill_max_token_keys``), a measure of time: a prompt token's attention
  grows with the keys it attends (its position + 1), and its own layers cost about as much as
  attending ``TOKEN_WORK_KEYS`` more. A chunk of C tokens after P computed ones costs
  ``chunk_cost(P, C) = C * (P + TOKEN_WORK_KEYS) + C * (C + 1) / 2``, so deep into a long
  context the same token budget would take several times longer: there the chunk shrinks
  (``chunk_tokens``) until both bounds hold, and each step stays short. The first chunk of a
  step never shrinks below ``MIN_CHUNK_TOKENS`` for the cost alone, so a prompt whose context
  outgrows the budget still moves.

How many token-keys a step may spend is measured as the engine runs (``StepPace``): the seconds
a step with prompt work took per token-key it computed (its decode rows' included), on the
threads it ran on, give the token-keys that fit in ``prefill_step_target_ms``, so a step takes
about that long on any machine, under any load and on one thread or all, and
``prefill_max_token_keys`` (when given) stays the upper bound.

The fairness rule (``short_prompts``): a waiting request whose whole prompt fits in
``SHORT_PROMPT_SHARE`` of the step's budgets goes first, before the chunks of prompts already
being prefilled and before longer waiting prompts, so a short request starts in the step after
it arrives instead of queueing behind a long prefill. Short prompts together take at most that
share: the prompts being prefilled keep the rest, every step, so they always finish.

Chunk sizes never change a request's tokens: every path attends with one arithmetic
(attention/flash_rows.py) and prompt rows run on one set of weights (tests/engine_worker/
test_determinism_tiny.py computes a prompt in chunks of 7 and gets a cold prefill's bits).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

from engine_worker.request import EngineRequest

SHORT_PROMPT_SHARE = 0.5
# A paced step's short lane never has fewer token-keys than a prompt of this many tokens costs:
# a step paced to a time its fixed costs nearly fill (200 ms, 2 cores, beside two 7k prompts)
# left the lane no keys, and short requests waited 20-27 s for the long prompts to end.
SHORT_LANE_TOKENS = 128
MIN_CHUNK_TOKENS = 16
# A prompt token's own work (its linear layers) in keys attended: on the default model, 2 CPU
# cores, a step of C tokens after P computed ones took ~a C + b (C P + C^2 / 2) with a ~0.78 ms
# and b ~0.6 us (docs/benchmarks.md): a / b ~1.3k.
TOKEN_WORK_KEYS = 1280


def chunk_cost(start: int, count: int) -> int:
    """Token-keys of ``count`` prompt tokens after ``start`` computed ones: the keys they attend
    (causal), and ``TOKEN_WORK_KEYS`` each for their own layers."""
    return count * (start + TOKEN_WORK_KEYS) + count * (count + 1) // 2


SHORT_LANE_KEYS = chunk_cost(0, SHORT_LANE_TOKENS)


def tokens_within_keys(start: int, keys: int) -> int:
    """The most tokens after ``start`` computed ones whose ``chunk_cost`` fits in ``keys``."""
    if keys <= 0:
        return 0
    b = 2 * (start + TOKEN_WORK_KEYS) + 1  # cost <= keys  <=>  c^2 + b c - 2 keys <= 0
    count = (math.isqrt(b * b + 8 * keys) - b) // 2
    while chunk_cost(start, count + 1) <= keys:  # isqrt's floor can leave one out
        count += 1
    return count


# The step pace's smoothing (the newest step's weight) and the steps it ignores: a step whose
# work is this small is mostly its fixed costs, not a measure of its token-keys.
PACE_WEIGHT = 0.25
PACE_MIN_KEYS = 8 * TOKEN_WORK_KEYS


class StepPace:
    """The token-keys a step may spend to take about ``target_s``, from the steps measured.

    Measured per torch thread count (``observe``'s ``threads``): the thread tuner runs some
    prompt steps on one thread (engine_worker/thread_tuner.py), which take about twice as long,
    and a step is sized for the threads it will run on (``threads``, set before it is
    scheduled). A count not yet measured is taken as proportionally slower than the most
    threads measured, never faster."""

    def __init__(self, target_s: float, keys: int, most_keys: int) -> None:
        self.target_s = target_s
        self.default_keys = min(keys, most_keys)  # until measured: the device's default
        self.most_keys = most_keys
        self.rates: dict[int, float] = {}  # seconds per token-key, by threads
        self.threads = 0  # the next step's threads (0: not known)

    def observe(self, token_keys: int, prefill_tokens: int, seconds: float, threads: int = 0):
        """A step's measure: its token-keys in all (prompt chunks and decode rows), the
        prompt tokens among them, its seconds and threads. Steps without prompt work are not
        paced."""
        if self.target_s <= 0 or prefill_tokens == 0 or token_keys < PACE_MIN_KEYS:
            return
        rate = seconds / token_keys
        old = self.rates.get(threads, 0.0)
        self.rates[threads] = rate if old == 0 else old + PACE_WEIGHT * (rate - old)

    @property
    def seconds_per_key(self) -> float:
        """The rate of a step on ``threads`` (0.0: nothing measured)."""
        if self.threads in self.rates:
            return self.rates[self.threads]
        if not self.rates:
            return 0.0
        most, rate = max(self.rates.items())
        return rate * max(1.0, most / self.threads) if self.threads else rate

    @property
    def keys(self) -> int:
        rate = self.seconds_per_key
        if self.target_s <= 0 or rate == 0:
            return self.default_keys
        keys = int(self.target_s / rate)
        return max(MIN_CHUNK_TOKENS * TOKEN_WORK_KEYS, min(keys, self.most_keys))


class Share(NamedTuple):
    """A part of a step's budget, set aside: tokens, token-keys and sequences."""

    tokens: int
    keys: int
    sequences: int


@dataclass(slots=True)
class Budget:
    """What is left of one step's prompt budget: tokens, token-keys and sequences (requests
    that may still prefill), and prompt positions that may still compute prompt logprobs."""

    tokens: int
    keys: int
    sequences: int
    logprob_tokens: int
    spent_keys: int = 0
    lane_keys: int = 0  # the short lane's least token-keys (paced steps: SHORT_LANE_TOKENS')

    def chunk_tokens(self, request: EngineRequest, start: int, wanted: int) -> int:
        """How many of ``wanted`` tokens after ``start`` the budget lets ``request`` compute."""
        if self.sequences <= 0:
            return 0
        count = min(wanted, self.tokens)
        if request.wants_prompt_logprobs:
            count = min(count, self.logprob_tokens)
        by_keys = tokens_within_keys(start, self.keys)
        if self.spent_keys == 0:  # the step's first chunk: progress, even past the key budget
            by_keys = max(by_keys, MIN_CHUNK_TOKENS)
        return max(0, min(count, by_keys))

    def charge(self, request: EngineRequest, start: int, count: int) -> None:
        cost = chunk_cost(start, count)
        self.tokens -= count
        self.keys -= cost
        self.spent_keys += cost
        self.sequences -= 1
        if request.wants_prompt_logprobs:
            self.logprob_tokens -= count

    def withhold(self, share: Share) -> None:
        """Sets ``share`` aside (the short prompts', while the running requests take theirs)."""
        self.tokens -= share.tokens
        self.keys -= share.keys
        self.sequences -= share.sequences

    def give_back(self, share: Share) -> None:
        """``share`` back, whole: what the running requests spent past the rest (a first chunk
        may, ``chunk_tokens``) is not taken from it."""
        self.tokens = max(self.tokens, 0) + share.tokens
        self.keys = max(self.keys, 0) + share.keys
        self.sequences += share.sequences

    def short_prompts(
        self, waiting: Iterable[EngineRequest], chunk_limit: int, room: int
    ) -> tuple[list[EngineRequest], Share]:
        """The waiting requests (arrival order, at most ``room``) whose whole prompt fits in
        ``SHORT_PROMPT_SHARE`` of this budget and in one chunk, and the share of the budget they
        may take (counted as if nothing of them were cached: the most they can take)."""
        token_share = min(int(self.tokens * SHORT_PROMPT_SHARE), chunk_limit)
        # However small a paced step, the short lane stays open (``lane_keys``)
        key_share = max(int(self.keys * SHORT_PROMPT_SHARE), self.lane_keys)
        sequences = min(room, self.sequences - 1)  # one stays for the prompts being prefilled
        short: list[EngineRequest] = []
        tokens = keys = 0
        for request in waiting:
            if len(short) >= sequences:
                break
            n = request.num_tokens
            if not request.ready or request.wants_prompt_logprobs or n > token_share - tokens:
                continue  # (prompt logprobs have a budget of their own: they wait their turn)
            if chunk_cost(0, n) > key_share - keys:
                continue
            short.append(request)
            tokens += n
            keys += chunk_cost(0, n)
        return short, Share(tokens, keys, len(short))
