"""Batched sampling: penalties, logit bias, min_tokens, greedy, temperature, min-p, top-k,
top-p, with a per-request seed.

Each sampling request owns a ``torch.Generator`` (seeded from its seed, or at random) and draws
one uniform from it per step, so a seeded request produces the same tokens whatever else shares
its batch. A draw is an inverse-CDF lookup (cumsum + searchsorted) over the row's probabilities,
or over its top-k / top-p candidates, found with a partial top-k rather than a sort of the whole
vocabulary wherever the nucleus fits in the first ``CANDIDATES`` tokens.

Penalties (repetition, then frequency and presence, before temperature) read per-request token
statistics on the device that each request keeps up to date itself: it folds in only the tokens
added since its last step, so a step costs O(batch x vocab), not O(batch x sequence length).
Then logit_bias is added and, until a request has min_tokens tokens, its stop ids (eos and
stop_token_ids) are masked; all of it on a copy, so the caller's logits stay raw. min_p drops
the tokens less likely than min_p x the most likely one (after temperature) and renormalizes,
before top-k / top-p."""

from __future__ import annotations

import random

import torch

from ipc.messages import SamplingParams

# Where a request without a seed gets one; the engine seeds it from its --seed knob.
_UNSEEDED = random.Random()


def seed_unseeded_requests(seed: int) -> None:
    """The same seed gives the same sequence of unseeded requests' seeds (by arrival order)."""
    _UNSEEDED.seed(seed)


class RequestSampler:
    """The per-request part: parameters and the request's own random stream."""

    __slots__ = (
        "greedy",
        "temperature",
        "top_k",
        "top_p",
        "filtered",
        "generator",
        "penalized",
        "presence",
        "frequency",
        "repetition",
        "counts",
        "seen",
        "folded",
        "logprobs",
        "min_p",
        "bias_ids",
        "bias_values",
        "min_tokens",
        "stop_ids",
        "needs_history",
        "adjusts",
    )

    def __init__(
        self, params: SamplingParams, device: torch.device, stop_ids: frozenset[int] = frozenset()
    ) -> None:
        """``stop_ids``: the ids that end the request (masked until it has min_tokens)."""
        self.greedy = params.greedy
        self.temperature = params.temperature
        self.top_k = params.top_k if params.top_k > 0 else 0
        self.top_p = params.top_p
        self.filtered = bool(self.top_k) or self.top_p < 1.0  # draws from a top-k/top-p set
        self.generator = None
        if not self.greedy:
            self.generator = torch.Generator(device=device)
            seed = params.seed if params.seed is not None else _UNSEEDED.getrandbits(63)
            self.generator.manual_seed(seed)
        self.penalized = params.penalized
        self.presence = params.presence_penalty
        self.frequency = params.frequency_penalty
        self.repetition = params.repetition_penalty
        self.counts: torch.Tensor | None = None  # [V] float: times each token was generated
        self.seen: torch.Tensor | None = None  # [V] bool: in the prompt or generated
        self.folded = 0  # how many of the request's tokens the two above account for
        self.logprobs = params.logprobs  # top logprobs per sampled token (None: not asked)
        self.min_p = params.min_p
        self.bias_ids = self.bias_values = None
        if params.logit_bias:
            self.bias_ids = torch.tensor(list(params.logit_bias), device=device)
            self.bias_values = torch.tensor(list(params.logit_bias.values()), device=device)
        self.min_tokens = params.min_tokens
        self.stop_ids = None
        if params.min_tokens and stop_ids:
            self.stop_ids = torch.tensor(sorted(stop_ids), device=device)
        self.needs_history = self.penalized or self.stop_ids is not None
        self.adjusts = self.needs_history or self.bias_ids is not None

    def fold(self, token_ids: list[int], prompt_len: int, vocab: int, device: torch.device) -> None:
        """Brings ``counts`` and ``seen`` up to date with the request's tokens."""
        if self.counts is None or self.seen is None:
            self.counts = torch.zeros(vocab, device=device)
            self.seen = torch.zeros(vocab, dtype=torch.bool, device=device)
        counts, seen = self.counts, self.seen
        if self.folded >= len(token_ids):
            return
        new = torch.tensor(token_ids[self.folded :], device=device)
        seen[new] = True
        generated = new[max(0, prompt_len - self.folded) :]
        if generated.numel():
            counts.index_add_(0, generated, torch.ones_like(generated, dtype=torch.float32))
        self.folded = len(token_ids)


def apply_penalties(
    logits: torch.Tensor, samplers: list[RequestSampler], histories: list[tuple[list[int], int]]
) -> torch.Tensor:
    """``logits`` with each penalized row's penalties applied (other rows unchanged).
    ``histories``: per row, the request's tokens (prompt + generated) and its prompt length.
    Only the (row, token) pairs already seen are touched, so the cost beyond one pass over the
    rows' ``seen`` masks is O(distinct tokens), not O(rows x vocab)."""
    rows = [i for i, s in enumerate(samplers) if s.penalized]
    if not rows:
        return logits
    device, vocab = logits.device, logits.shape[1]
    for i in rows:
        samplers[i].fold(*histories[i], vocab, device)
    row_of, token = torch.stack([samplers[i].seen for i in rows]).nonzero(as_tuple=True)
    counts = torch.stack([samplers[i].counts for i in rows])[row_of, token]

    def per_pair(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, device=device, dtype=logits.dtype)[row_of]

    logits = logits.clone()
    at = (torch.tensor(rows, device=device)[row_of], token)
    picked = logits[at]
    rep = per_pair([samplers[i].repetition for i in rows])
    picked = torch.where(picked > 0, picked / rep, picked * rep)
    picked -= per_pair([samplers[i].frequency for i in rows]) * counts + per_pair(
        [samplers[i].presence for i in rows]
    ) * (counts > 0)
    logits[at] = picked
    return logits


def adjust_logits(
    logits: torch.Tensor,
    samplers: list[RequestSampler],
    histories: list[tuple[list[int], int]] | None,
) -> torch.Tensor:
    """Penalties, then logit_bias, then the min_tokens mask, on a copy of the rows' logits
    (``logits`` itself is returned when no sampler adjusts anything)."""
    raw = logits
    if histories is not None:
        logits = apply_penalties(logits, samplers, histories)
    elif any(s.needs_history for s in samplers):
        raise ValueError("penalties and min_tokens need the requests' token histories")
    biased = [i for i, s in enumerate(samplers) if s.bias_ids is not None]
    masked = [
        i
        for i, s in enumerate(samplers)
        if s.stop_ids is not None
        and histories
        and len(histories[i][0]) - histories[i][1] < s.min_tokens
    ]
    if not biased and not masked:
        return logits
    if logits is raw:
        logits = logits.clone()
    for i in biased:
        logits[i].index_add_(0, samplers[i].bias_ids, samplers[i].bias_values)
    for i in masked:
        logits[i].index_fill_(0, samplers[i].stop_ids, float("-inf"))
    return logits


def sample(
    logits: torch.Tensor,
    samplers: list[RequestSampler],
    histories: list[tuple[list[int], int]] | None = None,
    uniforms: torch.Tensor | None = None,
) -> torch.Tensor:
    """logits [B, V] float32 -> token ids [B] (int64, on logits' device); ``logits`` is not
    modified. ``histories`` (see apply_penalties) is needed when a sampler has penalties or
    min_tokens. ``uniforms`` [B]: each row's uniform, drawn by the caller (rows verifying
    drafts, engine_worker/speculative.py); by default each sampling row draws its own."""
    if any(s.adjusts for s in samplers):
        logits = adjust_logits(logits, samplers, histories)
    if all(s.greedy for s in samplers):
        return logits.argmax(dim=-1)
    device = logits.device
    chosen = torch.empty(len(samplers), dtype=torch.long, device=device)
    greedy_rows = [i for i, s in enumerate(samplers) if s.greedy]
    if greedy_rows:
        rows = torch.tensor(greedy_rows, device=device)
        chosen[rows] = logits[rows].argmax(dim=-1)
    drawn = [i for i, s in enumerate(samplers) if not s.greedy]
    rows = torch.tensor(drawn, device=device)
    subset = [samplers[i] for i in drawn]
    temperatures = torch.tensor([s.temperature for s in subset], device=device)
    probs = (logits[rows] / temperatures.unsqueeze(1)).softmax(dim=-1)
    if any(s.min_p for s in subset):
        probs = _apply_min_p(probs, [s.min_p for s in subset])
    # One uniform per row and step, from the row's own generator: its draws never depend on
    # what else shares the batch.
    if uniforms is None:
        uniforms = torch.cat([torch.rand(1, generator=s.generator, device=device) for s in subset])
    else:
        uniforms = uniforms[rows]
    picked = torch.empty(len(subset), dtype=torch.long, device=device)
    plain = [j for j, s in enumerate(subset) if not s.filtered]
    if plain:
        index = torch.tensor(plain, device=device)
        picked[index] = _inverse_cdf(probs[index], uniforms[index])
    filtered = [j for j, s in enumerate(subset) if s.filtered]
    if filtered:
        index = torch.tensor(filtered, device=device)
        picked[index] = _filtered_draw(probs[index], uniforms[index], [subset[j] for j in filtered])
    chosen[rows] = picked
    return chosen


def _apply_min_p(probs: torch.Tensor, min_p: list[float]) -> torch.Tensor:
    """Zeroes each row's tokens below min_p x its most likely one's probability, renormalized
    (so top-p then measures the kept mass); a row with min_p 0 keeps everything."""
    threshold = torch.tensor(min_p, device=probs.device, dtype=probs.dtype).unsqueeze(1)
    kept = probs.masked_fill(probs < threshold * probs.amax(dim=-1, keepdim=True), 0.0)
    return kept / kept.sum(dim=-1, keepdim=True)


def _inverse_cdf(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Per row, the column drawn with probability proportional to ``weights`` (rows need not
    sum to 1): the first whose running total exceeds u x the row's total. Zero weights are never
    drawn (their running total does not rise past the previous column's)."""
    totals = weights.cumsum(dim=-1)
    target = (uniforms * totals[:, -1]).unsqueeze(1)
    picked = torch.searchsorted(totals, target, right=True).clamp_(max=weights.shape[1] - 1)
    if not bool((weights.gather(1, picked) > 0).all()):
        # Only if the running total was not monotone (a parallel scan's rounding, e.g. on
        # CUDA): step back to the nearest column at or before the pick that has weight.
        columns = torch.arange(weights.shape[1], device=weights.device).expand_as(weights)
        last_weighted = torch.where(weights > 0, columns, 0).cummax(dim=-1).values
        picked = last_weighted.gather(1, picked)
    return picked.squeeze(1)


# Rows with top_k / top_p are first filtered among their CANDIDATES most likely tokens (a partial
# top-k); only a row whose kept set reaches the least likely candidate's probability (a nucleus
# wider than the candidates, or a tie there) pays for a sort of the whole vocabulary.
CANDIDATES = 256


def _canonical(probs: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorts each row by probability, most likely first, ties by vocabulary id: the order a
    draw walks must not depend on how a top-k call happened to order ties, or a seeded row's
    token would depend on the candidate width, which depends on the rest of the batch."""
    by_id = ids.argsort(dim=-1)
    probs, ids = probs.gather(1, by_id), ids.gather(1, by_id)
    probs, order = probs.sort(dim=-1, descending=True, stable=True)
    return probs, ids.gather(1, order)


def _filtered_draw(
    probs: torch.Tensor, uniforms: torch.Tensor, samplers: list[RequestSampler]
) -> torch.Tensor:
    """A draw restricted to each row's top-k / top-p set: in the canonical order (see
    _canonical), top-k keeps the first k tokens (renormalized), then top-p drops a token once
    the tokens before it hold top_p of the mass (the first always stays).

    Exact: a candidate set from topk() holds every token more likely than its last candidate,
    but an arbitrary part of the tokens tied with it; a row whose kept set stays above that
    probability is decided within the candidates, and any other row is drawn again, with the
    same uniform, over its whole vocabulary."""
    vocab = probs.shape[1]
    # One more than any row keeps at most, so a row that keeps its top_k still has a candidate
    # after its last one to compare against.
    k = min(vocab, max(s.top_k or CANDIDATES for s in samplers) + 1)
    cand_p, cand_i = _canonical(*probs.topk(k, dim=-1))
    picked, kept = _nucleus_draw(cand_p, cand_i, uniforms, samplers)
    if k == vocab:
        return picked
    # The least likely kept candidate, against the least likely candidate overall.
    least_kept = torch.where(kept, cand_p, float("inf")).amin(dim=-1)
    wide = (least_kept <= cand_p[:, -1]).nonzero().flatten().tolist()
    if wide:
        index = torch.tensor(wide, device=probs.device)
        # Columns are vocabulary ids in ascending order: a stable sort is the canonical one.
        full_p, full_i = probs[index].sort(dim=-1, descending=True, stable=True)
        picked[index], _ = _nucleus_draw(
            full_p, full_i, uniforms[index], [samplers[j] for j in wide]
        )
    return picked


def _nucleus_draw(
    cand_p: torch.Tensor,
    cand_i: torch.Tensor,
    uniforms: torch.Tensor,
    samplers: list[RequestSampler],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draws among candidates in canonical order (probabilities ``cand_p`` of the vocabulary
    ids ``cand_i``); also returns which candidates each row kept."""
    device, width = cand_p.device, cand_p.shape[1]
    ranks = torch.arange(width, device=device).unsqueeze(0)
    top_k = torch.tensor(
        [min(s.top_k, width) if s.top_k else width for s in samplers], device=device
    )
    cand_p = cand_p.masked_fill(ranks >= top_k.unsqueeze(1), 0.0)
    has_k = torch.tensor([bool(s.top_k) for s in samplers], device=device).unsqueeze(1)
    cand_p = torch.where(has_k, cand_p / cand_p.sum(dim=-1, keepdim=True), cand_p)
    # top_p == 1 filters nothing (an inf bound keeps rounding in the cumsum from dropping a tail).
    top_p = torch.tensor(
        [s.top_p if s.top_p < 1.0 else float("inf") for s in samplers], device=device
    ).unsqueeze(1)
    mass_before = cand_p.cumsum(dim=-1) - cand_p
    cand_p = cand_p.masked_fill(mass_before >= top_p, 0.0)
    picked = _inverse_cdf(cand_p, uniforms)
    return cand_i.gather(1, picked.unsqueeze(1)).squeeze(1), cand_p > 0
