"""Batched sampling: greedy, temperature, top-k, top-p, with a per-request seed.

Each sampling request owns a ``torch.Generator`` (seeded from its seed, or at random), and its
noise is drawn from that generator alone, so a seeded request produces the same tokens whatever
else shares its batch. Sampling uses the exponential race (argmax of p / E with E ~ Exp(1)),
which equals drawing from p, so the whole batch is one argmax after the per-row noise."""

from __future__ import annotations

import random

import torch

from ipc.messages import SamplingParams


class RequestSampler:
    """The per-request part: parameters and the request's own random stream."""

    __slots__ = ("greedy", "temperature", "top_k", "top_p", "generator")

    def __init__(self, params: SamplingParams, device: torch.device) -> None:
        self.greedy = params.greedy
        self.temperature = params.temperature
        self.top_k = params.top_k if params.top_k > 0 else 0
        self.top_p = params.top_p
        self.generator = None
        if not self.greedy:
            self.generator = torch.Generator(device=device)
            seed = params.seed if params.seed is not None else random.getrandbits(63)
            self.generator.manual_seed(seed)


def sample(logits: torch.Tensor, samplers: list[RequestSampler]) -> torch.Tensor:
    """logits [B, V] float32 -> token ids [B] (int64, on logits' device)."""
    if all(s.greedy for s in samplers):
        return logits.argmax(dim=-1)
    device = logits.device
    vocab = logits.shape[1]
    temperatures = torch.tensor([1.0 if s.greedy else s.temperature for s in samplers],
                                device=device)
    logits = logits / temperatures.unsqueeze(1)
    noise = torch.empty_like(logits)
    for row, s in enumerate(samplers):
        if s.greedy:
            noise[row].fill_(1.0)  # p / 1 keeps the argmax of p
        else:
            noise[row].exponential_(generator=s.generator)
    filtered = any(s.top_k or s.top_p < 1.0 for s in samplers)
    if not filtered:
        probs = logits.softmax(dim=-1)
        chosen = (probs / noise).argmax(dim=-1)
    else:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        top_k = torch.tensor([s.top_k or vocab for s in samplers], device=device)
        top_p = torch.tensor([s.top_p for s in samplers], device=device)
        ranks = torch.arange(vocab, device=device).unsqueeze(0)
        sorted_logits = sorted_logits.masked_fill(ranks >= top_k.unsqueeze(1), float("-inf"))
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the tokens ranked above it already reach top_p (the first stays).
        mass_before = probs.cumsum(dim=-1) - probs
        probs = probs.masked_fill(mass_before >= top_p.unsqueeze(1), 0.0)
        # Noise is indexed by vocabulary id, so a row's draw does not depend on the sort.
        picked = (probs / noise.gather(1, order)).argmax(dim=-1)
        chosen = order.gather(1, picked.unsqueeze(1)).squeeze(1)
    greedy_rows = [i for i, s in enumerate(samplers) if s.greedy]
    if greedy_rows:
        rows = torch.tensor(greedy_rows, device=device)
        chosen[rows] = logits[rows].argmax(dim=-1)
    return chosen
