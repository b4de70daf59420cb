"""What the benchmark sends and when: the prompts (synthetic, or with a shared prefix) and the
arrival schedule (a burst, or Poisson/gamma at a rate)."""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass, replace


@dataclass(slots=True)
class BenchRequest:
    index: int
    max_tokens: int
    prompt: str


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    num_requests: int = 256
    max_new_tokens: int = 16
    prompt_tokens: int = 256  # target length of synthetic prompts (the unique part)
    unique_prompts: bool = False  # False: every request sends the same prompt text
    shared_prefix_tokens: int = 0  # >0: every prompt starts with one shared text this long
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_requests", "max_new_tokens", "prompt_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.shared_prefix_tokens < 0:
            raise ValueError("shared_prefix_tokens must be >= 0")


class TextSynthesizer:
    """Varied English-looking text of a chosen token length. Words come from the tokenizer's own
    vocabulary (whole-word pieces), drawn with Zipf-like weights by merge rank (earlier merges
    are commoner words), so the text tokenizes like prose, with a realistic mix of common and
    rare words, rather than like random ids."""

    def __init__(self, tokenizer, seed: int = 0) -> None:
        self.tokenizer = tokenizer
        vocab = tokenizer.get_vocab()
        # "\u0120" marks a leading space in byte-level BPE vocabularies (GPT-2, Llama-3, SmolLM2).
        ranked = sorted(
            (i, w[1:])
            for w, i in vocab.items()
            if w.startswith("\u0120") and w[1:].isascii() and w[1:].isalpha() and len(w) > 3
        )
        if len(ranked) < 100:  # a vocabulary without that convention: plain words instead
            ranked = sorted(
                (i, w.strip("\u2581").lower())
                for w, i in vocab.items()
                if w.strip("\u2581").isalpha() and w.isascii() and len(w) > 3
            )
        if not ranked:
            raise ValueError("the tokenizer's vocabulary has no usable words")
        self.words = [w for _, w in ranked]
        self._cum_weights = list(itertools.accumulate(1.0 / (r + 50) for r in range(len(ranked))))
        self.rng = random.Random(seed)

    def _prose(self, n_words: int) -> str:
        rng, out, count = self.rng, [], 0
        while count < n_words:
            sentence = rng.choices(self.words, cum_weights=self._cum_weights, k=rng.randint(6, 16))
            sentence[0] = sentence[0].capitalize()
            out.append(" ".join(sentence) + rng.choice((".", ".", ".", ",", "?", ";")))
            count += len(sentence)
        return " ".join(out)

    def text(self, n_tokens: int) -> str:
        n_words = max(8, int(n_tokens * 0.8))
        while True:
            ids = self.tokenizer.encode(self._prose(n_words), add_special_tokens=False).ids
            if len(ids) >= n_tokens:
                return self.tokenizer.decode(ids[:n_tokens]).strip()
            n_words = int(n_words * 1.5) + 8


def build_workload(spec: WorkloadSpec, tokenizer) -> list[BenchRequest]:
    synth, n = TextSynthesizer(tokenizer, spec.seed), spec.num_requests
    if spec.shared_prefix_tokens > 0:
        # A blank line between the parts keeps BPE from merging across them, so the shared
        # text tokenizes identically in every request and the prefix cache can share it.
        shared = synth.text(spec.shared_prefix_tokens)
        prompts = [f"{shared}\n\n{synth.text(spec.prompt_tokens)}" for _ in range(n)]
    elif spec.unique_prompts:
        prompts = [synth.text(spec.prompt_tokens) for _ in range(n)]
    else:
        prompts = [synth.text(spec.prompt_tokens)] * n
    return [
        BenchRequest(index=i, max_tokens=spec.max_new_tokens, prompt=p)
        for i, p in enumerate(prompts)
    ]


def salt_requests(requests: list[BenchRequest], salt: str) -> list[BenchRequest]:
    """Puts a run-specific tag at the very start of every prompt, so one run never hits the prefix
    cache entries of an earlier run on the same server, while prompts that share a prefix within
    the run still share it."""
    return [replace(req, prompt=f"[{salt}] {req.prompt}") for req in requests]


@dataclass(frozen=True, slots=True)
class ArrivalSpec:
    """When requests are submitted. Default: all at once (burst)."""

    request_rate: float = math.inf  # finite: Poisson arrivals at this many requests/s
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.request_rate > 0:
            raise ValueError("request_rate must be > 0 (inf for a burst)")

    @property
    def kind(self) -> str:
        return "poisson" if math.isfinite(self.request_rate) else "burst"

    def describe(self) -> str:
        if self.kind == "poisson":
            return f"{self.request_rate:g} req/s, Poisson (exponential gaps)"
        return "burst (all requests at once)"

    def offsets_s(self, n: int) -> list[float]:
        """Planned submit times in seconds from the start."""
        if self.kind == "burst":
            return [0.0] * n
        rng, t, out = random.Random(self.seed), 0.0, []
        for _ in range(n):
            out.append(t)
            t += rng.gammavariate(1.0, 1.0 / self.request_rate)  # exponential: Poisson arrivals
        return out
