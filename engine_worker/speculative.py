"""Speculative decoding without a draft model: n-gram (prompt lookup) drafts, verified in the
ordinary step.

* Proposing (``NgramProposer``): the longest n-gram (n from ``max_n`` down to ``min_n``) that
  ends the request's context (prompt + output) and also occurs earlier in it, at its most recent
  earlier place; the draft is the tokens that followed there. Token ids only, numpy over a
  per-request copy of the context that grows by the step's new tokens (``LookupContext``): one
  vectorized compare of the context with its last token, then at most ``max_n`` compares over the
  places that matched it, so a step costs O(context) at worst, microseconds for a few thousand
  tokens.
* Verifying (``accepted_tokens``): a request with k drafts computes its last sampled token and
  the drafts as k + 1 rows of one step; row j's logits give the token the request would sample
  at that position. Drafts are taken while each equals the token sampled from the row before it;
  the token sampled at the first mismatch (or from the last row when all match) follows them.

Why this is the standard rejection rule: with a one-hot draft x (q(x) = 1), the rule accepts x
with probability min(1, p(x) / q(x)) = p(x) and otherwise draws from p with x removed,
renormalized. Drawing y from p and accepting x exactly when y == x does the same: P(accept) =
p(x), and a rejected y is distributed as p given y != x. So each position's token is the token
the request's own sampler draws there, whatever the drafts were: greedy output is the argmax
chain, and a sampled token uses the position's uniform (the request's generator advances by one
uniform per token it emits, as without speculation). Same seed, same tokens, with or without
speculation and however positions group into steps, as long as the logits are the same bits
(verification rows are decode rows for the kernels: ``docs/speculative.md``).
"""

from __future__ import annotations

import numpy as np
import torch

from engine_worker.sampler import RequestSampler
from ipc.messages import SamplingParams


class LookupContext:
    """A request's tokens as a growing int32 array (``token_ids`` stays the source of truth;
    ``sync`` copies what was appended since the last call)."""

    __slots__ = ("tokens", "length")

    def __init__(self, capacity: int) -> None:
        self.tokens: np.ndarray = np.empty(max(capacity, 1), dtype=np.int32)
        self.length = 0

    def sync(self, token_ids: list[int]) -> np.ndarray:
        n = len(token_ids)
        if n > self.tokens.size:
            grown: np.ndarray = np.empty(max(n, 2 * self.tokens.size), dtype=np.int32)
            grown[: self.length] = self.tokens[: self.length]
            self.tokens = grown
        if n > self.length:
            self.tokens[self.length : n] = token_ids[self.length :]
        self.length = n
        return self.tokens[:n]


class NgramProposer:
    """Drafts from the request's own context (see the module docstring)."""

    def __init__(self, num_tokens: int, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(
                f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {min_n}, {max_n}"
            )
        self.num_tokens, self.min_n, self.max_n = num_tokens, min_n, max_n

    def propose(self, context: np.ndarray, limit: int) -> list[int]:
        """At most ``min(limit, num_tokens)`` tokens that followed the most recent earlier
        occurrence of the longest n-gram ending ``context`` (that has that many after it);
        [] when none has ``min_n``."""
        limit = min(limit, self.num_tokens)
        end = context.size - 1  # the last token's position
        if limit <= 0 or end < self.min_n:
            return []
        places = np.flatnonzero(context[:end] == context[end])  # candidate n-gram ends
        if places.size == 0:
            return []
        length: np.ndarray = np.ones(places.size, dtype=np.int64)
        alive: np.ndarray = np.ones(places.size, dtype=bool)
        for back in range(1, min(self.max_n, end + 1)):
            alive &= places >= back
            alive[alive] = context[places[alive] - back] == context[end - back]
            if not alive.any():
                break
            length += alive
        best = int(length.max())
        if best < self.min_n:
            return []
        longest = places[length == best]
        # The most recent of the longest that is followed by ``limit`` tokens (in a run of one
        # repeated token the most recent is followed by one), else the earliest.
        full = longest[longest + limit < end + 1]
        place = int(full[-1] if full.size else longest[0])
        return context[place + 1 : place + 1 + limit].tolist()


def may_speculate(params: SamplingParams, sampler: RequestSampler, constrained: bool) -> bool:
    """Whether a request may verify drafts. Each row's token is what the sampler draws from that
    row alone; a grammar's masks and penalties or min_tokens (which read the tokens before the
    row) would need the drafts before it, so those requests decode one token a step."""
    return params.speculative and not constrained and not sampler.needs_history


def accepted_tokens(sampled: list[int], drafts: list[int]) -> list[int]:
    """The tokens a verifying request emits: ``sampled[j]`` is the token drawn from row j (row 0
    computes the last sampled token, row j > 0 the draft j - 1). Draft j is accepted while it
    equals ``sampled[j]``; the token drawn at the first mismatch, or the bonus token from the
    last row, ends the run. Returns sampled[: accepted + 1]."""
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == sampled[accepted]:
        accepted += 1
    return sampled[: accepted + 1]


def row_offsets(widths: np.ndarray) -> np.ndarray:
    """0 .. w - 1 for each width w, concatenated: each sampling row's place in its request."""
    total = int(widths.sum())
    return np.arange(total) - np.repeat(np.cumsum(widths) - widths, widths)


def rows_of(widths: list[int], keep: list[int]) -> list[int]:
    """The logit rows of the kept requests (``widths[j]`` consecutive rows each)."""
    firsts = np.cumsum([0, *widths])
    return [row for j in keep for row in range(int(firsts[j]), int(firsts[j + 1]))]


class VerifierDraws:
    """The uniforms a step's sampling rows draw with when some requests verify drafts: one per
    row, from the request's own generator, in order, as ``sampler.sample`` would draw them one
    step at a time. A verifying request draws one per row ahead of time from a saved state; once
    its accepted run is known, ``advance`` puts its generator where emitting exactly that many
    tokens leaves it (one uniform per token), so the next position draws the next uniform."""

    def __init__(self, samplers: list[RequestSampler], widths: list[int], device) -> None:
        self.samplers = samplers
        self.states: list[torch.Tensor | None] = []
        values: list[torch.Tensor] = []
        for sampler, width in zip(samplers, widths):
            generator = sampler.generator
            if generator is None:  # greedy: the uniform is never read
                values.append(torch.zeros(width, device=device))
                self.states.append(None)
                continue
            self.states.append(generator.get_state() if width > 1 else None)
            values += [torch.rand(1, generator=generator, device=device) for _ in range(width)]
        self.uniforms = torch.cat(values) if values else torch.zeros(0, device=device)

    def advance(self, index: int, emitted: int) -> None:
        state = self.states[index]
        generator = self.samplers[index].generator
        if state is None or generator is None:
            return
        generator.set_state(state)
        for _ in range(emitted):
            torch.rand(1, generator=generator, device=generator.device)


class SpeculationCounters:
    """Since the engine started: steps in which a request verified drafts, the drafts, those
    accepted, and accepted by position (index j: the (j + 1)-th draft of a step was accepted)."""

    __slots__ = ("drafts", "draft_tokens", "accepted_tokens", "accepted_per_position")

    def __init__(self, num_tokens: int) -> None:
        self.drafts = self.draft_tokens = self.accepted_tokens = 0
        self.accepted_per_position = [0] * num_tokens

    def record(self, draft_tokens: int, accepted: int) -> None:
        self.drafts += 1
        self.draft_tokens += draft_tokens
        self.accepted_tokens += accepted
        for position in range(accepted):
            self.accepted_per_position[position] += 1
