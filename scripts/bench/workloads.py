"""What the benchmark sends and when: the prompts (synthetic, shared-prefix or a JSONL file) and
the arrival schedule (burst, fixed interval, Poisson/gamma)."""

from __future__ import annotations

import itertools
import json
import math
import random
from dataclasses import dataclass, replace
from pathlib import Path

SCHEDULES = ("relative", "absolute")


@dataclass(slots=True)
class BenchRequest:
    """One request of the workload: exactly one of prompt or messages (chat)."""

    index: int
    max_tokens: int
    prompt: str | None = None
    messages: list[dict[str, str]] | None = None


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    num_requests: int = 256
    max_new_tokens: int = 16
    prompt_tokens: int = 256  # target length of synthetic prompts (the unique part)
    prompt_tokens_range_ratio: float = 0.0  # lengths uniform in [P*(1-r), P*(1+r)]
    prompt_text: str | None = None  # a literal prompt instead of synthetic text
    unique_prompts: bool = False  # False: every request sends the same prompt text
    shared_prefix_tokens: int = 0  # >0: every prompt starts with one shared text this long
    jsonl_path: str | None = None  # prompts / chats from a file (cycled to num_requests)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_requests < 1:
            raise ValueError(f"num_requests must be at least 1, got {self.num_requests}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {self.max_new_tokens}")
        if self.prompt_tokens < 1:
            raise ValueError(f"prompt_tokens must be at least 1, got {self.prompt_tokens}")
        if not 0.0 <= self.prompt_tokens_range_ratio < 1.0:
            raise ValueError(
                f"prompt_tokens_range_ratio must be in [0, 1), got {self.prompt_tokens_range_ratio}"
            )
        if self.shared_prefix_tokens < 0:
            raise ValueError("shared_prefix_tokens must be >= 0")
        sources = [
            self.prompt_text is not None,
            self.jsonl_path is not None,
            self.shared_prefix_tokens > 0,
        ]
        if sum(sources) > 1:
            raise ValueError(
                "give at most one of a literal prompt, a JSONL file or a shared prefix"
            )

    @property
    def source(self) -> str:
        if self.jsonl_path is not None:
            return f"jsonl:{self.jsonl_path}"
        if self.shared_prefix_tokens > 0:
            return "shared-prefix"
        if self.prompt_text is not None:
            return "literal"
        return "synthetic"


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
    if spec.jsonl_path is not None:
        return _from_jsonl(spec)
    synth = TextSynthesizer(tokenizer, spec.seed)
    length_rng = random.Random(spec.seed + 1)

    def length() -> int:
        r = spec.prompt_tokens_range_ratio
        lo = max(1, math.floor(spec.prompt_tokens * (1 - r)))
        return length_rng.randint(lo, math.ceil(spec.prompt_tokens * (1 + r)))

    n = spec.num_requests
    if spec.shared_prefix_tokens > 0:
        # A blank line between the parts keeps BPE from merging across them, so the shared
        # text tokenizes identically in every request and the prefix cache can share it.
        shared = synth.text(spec.shared_prefix_tokens)
        prompts = [f"{shared}\n\n{synth.text(length())}" for _ in range(n)]
    elif spec.prompt_text is not None:
        prompts = (
            [f"Request {i}: {spec.prompt_text}" for i in range(n)]
            if spec.unique_prompts
            else [spec.prompt_text] * n
        )
    elif spec.unique_prompts:
        prompts = [synth.text(length()) for _ in range(n)]
    else:
        prompts = [synth.text(length())] * n
    return [
        BenchRequest(index=i, max_tokens=spec.max_new_tokens, prompt=p)
        for i, p in enumerate(prompts)
    ]


def _from_jsonl(spec: WorkloadSpec) -> list[BenchRequest]:
    """Lines are {"prompt": str} or {"messages": [{"role", "content"}, ...]}, optionally with
    "max_tokens" (else --max-new-tokens). The file is cycled until num_requests are made."""
    items = []
    path = Path(spec.jsonl_path or "")
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        if not isinstance(row, dict) or (("prompt" in row) == ("messages" in row)):
            raise ValueError(
                f"{path}:{lineno}: each line needs exactly one of 'prompt' or 'messages'"
            )
        messages = row.get("messages")
        if messages is not None and not all(
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)
            for m in messages
        ):
            raise ValueError(f"{path}:{lineno}: messages must be [{{'role', 'content'}}, ...]")
        items.append((row.get("prompt"), messages, int(row.get("max_tokens", spec.max_new_tokens))))
    if not items:
        raise ValueError(f"{path} holds no prompts")
    out = []
    for i in range(spec.num_requests):
        prompt, messages, max_tokens = items[i % len(items)]
        out.append(
            BenchRequest(
                index=i,
                max_tokens=max_tokens,
                prompt=prompt,
                messages=[dict(m) for m in messages] if messages else None,
            )
        )
    return out


def salt_requests(requests: list[BenchRequest], salt: str) -> list[BenchRequest]:
    """Puts a run-specific tag at the very start of every prompt, so one run never hits the prefix
    cache entries of an earlier run on the same server, while prompts that share a prefix within
    the run still share it."""
    out = []
    for req in requests:
        if req.messages:
            messages = [dict(m) for m in req.messages]
            messages[0]["content"] = f"[{salt}] {messages[0]['content']}"
            out.append(replace(req, messages=messages))
        else:
            out.append(replace(req, prompt=f"[{salt}] {req.prompt}"))
    return out


@dataclass(frozen=True, slots=True)
class ArrivalSpec:
    """When requests are submitted. Default: all at once (burst)."""

    submit_interval_ms: float = 0.0  # >0: a fixed gap between submits
    submit_schedule: str = "absolute"  # absolute: i-th at t0 + i*gap; relative: gap after each
    request_rate: float = math.inf  # finite: Poisson-like arrivals at this many requests/s
    burstiness: float = 1.0  # gamma shape of the gaps: 1 Poisson, <1 burstier, >1 steadier
    seed: int = 0

    def __post_init__(self) -> None:
        if self.submit_schedule not in SCHEDULES:
            raise ValueError(f"submit_schedule must be one of {SCHEDULES}")
        if self.submit_interval_ms < 0:
            raise ValueError("submit_interval_ms must be >= 0")
        if not self.request_rate > 0:
            raise ValueError("request_rate must be > 0 (inf for a burst)")
        if not self.burstiness > 0:
            raise ValueError("burstiness must be > 0")
        if self.submit_interval_ms > 0 and math.isfinite(self.request_rate):
            raise ValueError("give either a submit interval or a request rate, not both")

    @property
    def kind(self) -> str:
        if self.submit_interval_ms > 0:
            return "interval"
        return "poisson" if math.isfinite(self.request_rate) else "burst"

    def describe(self) -> str:
        if self.kind == "interval":
            return f"fixed interval {self.submit_interval_ms:g} ms, {self.submit_schedule} schedule"
        if self.kind == "poisson":
            return (
                f"{self.request_rate:g} req/s, gamma gaps (burstiness {self.burstiness:g}), "
                "absolute schedule"
            )
        return "burst (all requests at once)"

    @property
    def relative(self) -> bool:
        return self.kind == "interval" and self.submit_schedule == "relative"

    def offsets_s(self, n: int) -> list[float]:
        """Planned submit times in seconds from the start (for a relative schedule, the gaps
        are what counts: each is slept after the previous submit returns)."""
        if self.kind == "burst":
            return [0.0] * n
        if self.kind == "interval":
            return [i * self.submit_interval_ms / 1e3 for i in range(n)]
        # The vLLM convention: gamma-distributed gaps with mean 1/rate; shape = burstiness.
        rng = random.Random(self.seed)
        theta = 1.0 / (self.request_rate * self.burstiness)
        t, out = 0.0, []
        for _ in range(n):
            out.append(t)
            t += rng.gammavariate(self.burstiness, theta)
        return out
