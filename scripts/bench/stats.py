"""The benchmark's statistics, in one place: per-request timestamps (``RequestRecord``) and the
summary of a run, percentiles, medians over repeats, spreads, ratios. Every timestamp is
``time.monotonic()`` seconds, system-wide on Linux: every process's stamps compare directly.

Conventions (vLLM's ``bench serve``):
- TTFT = first text delta received by the client - t_submit (the client's own clock).
- TPOT per request = (latency - TTFT) / (output_tokens - 1); one-token outputs have none.
- ITL = gaps between consecutive deltas received by one request, pooled over all requests.
TTFT is split into four parts that add up to it exactly:
  submit->tokenized, tokenized->scheduled (queue wait), scheduled->first token (prefill),
  first token->client (detokenize + transport).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

PERCENTILES = (50, 95, 99)

# TTFT's parts: (name, from-stamp, to-stamp). They tile [t_submit, t_first_delta].
TTFT_PARTS = (
    ("submit->tokenized", "t_submit", "t_tokenized"),
    ("tokenized->scheduled", "t_tokenized", "t_scheduled"),
    ("scheduled->first token", "t_scheduled", "t_first_token"),
    ("first token->client", "t_first_token", "t_first_delta"),
)


@dataclass(slots=True)
class RequestRecord:
    index: int
    request_id: str
    t_planned: float = 0.0  # when the arrival schedule wanted it submitted
    t_submit: float = 0.0  # submit() called
    t_submit_done: float = 0.0  # submit() returned
    submit_cpu_s: float = 0.0  # CPU time of the submitting thread inside submit()
    # Server side (from the request's timings): 0.0 where unknown.
    t_tokenize_start: float = 0.0
    t_tokenized: float = 0.0
    t_arrived: float = 0.0  # at the engine
    t_scheduled: float = 0.0  # first prefill chunk scheduled
    t_first_token: float = 0.0  # the engine step that produced the first token
    t_last_token: float = 0.0
    t_finished: float = 0.0
    # Client side: when each delta that carried tokens was received.
    delta_times: list[float] = field(default_factory=list)
    t_done: float = 0.0  # the terminal event received
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.finish_reason not in (None, "error", "abort")

    @property
    def has_server_stamps(self) -> bool:
        """False where the client could not see them (the OpenAI API carries none)."""
        return bool(self.t_tokenized and self.t_scheduled and self.t_first_token)

    @property
    def t_first_delta(self) -> float:
        return self.delta_times[0] if self.delta_times else self.t_done

    # Derived seconds, None where the request has no such value.
    @property
    def ttft(self) -> float:
        return self.t_first_delta - self.t_submit

    @property
    def latency(self) -> float:
        return self.t_done - self.t_submit

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.delta_times, self.delta_times[1:])]

    def ttft_parts(self) -> dict[str, float]:
        return {name: getattr(self, end) - getattr(self, start) for name, start, end in TTFT_PARTS}


def percentiles(values: list[float], scale: float = 1.0) -> dict[str, float | None]:
    if not values:
        return {f"p{p}": None for p in PERCENTILES}
    arr = np.asarray(values, dtype=float) * scale
    return {f"p{p}": float(np.percentile(arr, p)) for p in PERCENTILES}


def summarize(records: list[RequestRecord], cpu_seconds: dict[str, float]) -> dict:
    """One run's metrics as a flat {name: value} dict; times in ms unless the name says _s."""
    ok = [r for r in records if r.ok]
    out: dict[str, float | None] = {
        "requests": len(records),
        "errors": len(records) - len(ok),
        "prompt_tokens_total": sum(r.prompt_tokens for r in ok),
        "output_tokens_total": sum(r.output_tokens for r in ok),
        "cached_tokens_total": sum(r.cached_tokens for r in ok),
    }
    t0 = min(r.t_submit for r in records)
    out["submit_wall_s"] = max(r.t_submit_done for r in records) - t0
    duration = max(r.t_done for r in records) - t0
    out["duration_s"] = duration

    def add(name: str, values: list[float], scale: float = 1e3) -> None:
        for key, value in percentiles(values, scale).items():
            out[f"{name}_{key}"] = value

    add("submit_latency_ms", [r.t_submit_done - r.t_submit for r in records])
    # The submitting thread's own CPU time: what submit() costs apart from waiting for a core.
    add("submit_cpu_ms", [r.submit_cpu_s for r in records])
    add("submit_lag_ms", [r.t_submit - r.t_planned for r in records])
    stamped = [r for r in ok if r.has_server_stamps]
    add("tokenize_ms", [r.t_tokenized - r.t_tokenize_start for r in stamped])
    add("queue_wait_ms", [r.t_scheduled - r.t_tokenized for r in stamped])
    add("prefill_to_first_token_ms", [r.t_first_token - r.t_scheduled for r in stamped])
    add("ttft_ms", [r.ttft for r in ok])
    # From the planned arrival: a submitter running behind its schedule counts as waiting.
    add("ttft_from_arrival_ms", [r.t_first_delta - r.t_planned for r in ok])
    add("tpot_ms", [r.tpot for r in ok if r.tpot is not None])
    add("itl_ms", [x for r in ok for x in r.itls])
    add("e2el_ms", [r.latency for r in ok])
    for name, _, _ in TTFT_PARTS:
        add(f"ttft_part[{name}]_ms", [r.ttft_parts()[name] for r in stamped])
    for name, _, _ in TTFT_PARTS:  # means add up to the mean TTFT, which medians do not
        values = [r.ttft_parts()[name] * 1e3 for r in stamped]
        out[f"ttft_part[{name}]_ms_mean"] = sum(values) / len(values) if values else None
    out["ttft_ms_mean"] = sum(r.ttft for r in ok) * 1e3 / len(ok) if ok else None

    out["arrival_rate_rps"] = span_rate([r.t_planned for r in records])
    out["completion_rate_rps"] = span_rate([r.t_done for r in ok])
    out["request_throughput_rps"] = len(ok) / duration if duration > 0 else None
    out["output_throughput_tps"] = out["output_tokens_total"] / duration if duration > 0 else None
    out["total_throughput_tps"] = (
        (out["prompt_tokens_total"] + out["output_tokens_total"]) / duration
        if duration > 0
        else None
    )
    for role, seconds in cpu_seconds.items():
        out[f"cpu_s[{role}]"] = seconds
    return out


def span_rate(times: list[float]) -> float | None:
    """Events per second over their own span, first to last (None for fewer than two events
    or a zero span, as in a burst)."""
    if len(times) < 2:
        return None
    span = max(times) - min(times)
    return (len(times) - 1) / span if span > 0 else None


def median_summary(summaries: list[dict[str, float | None]]) -> dict[str, float | None]:
    """The per-metric median over repeat runs (None where no run has the metric)."""
    keys = list(dict.fromkeys(k for s in summaries for k in s))
    out = {}
    for key in keys:
        values = [s[key] for s in summaries if s.get(key) is not None]
        out[key] = float(np.median(values)) if values else None
    return out


def spread(values: list[float | None]) -> dict[str, float] | None:
    """Median, min and max of one figure over repeats (None values, a run without the figure,
    are left out; None when no run has it)."""
    kept = [v for v in values if v is not None]
    if not kept:
        return None
    return {
        "median": float(np.median(kept)),
        "min": float(min(kept)),
        "max": float(max(kept)),
        "n": len(kept),
    }


def describe_ms(seconds: list[float]) -> str:
    """'p50 .. p90 .. p99 .. mean .. ms' of a list of durations in seconds."""
    ms = np.asarray(seconds, dtype=float) * 1e3
    p50, p90, p99 = np.percentile(ms, (50, 90, 99))
    return f"p50 {p50:8.1f}  p90 {p90:8.1f}  p99 {p99:8.1f}  mean {ms.mean():8.1f} ms"


def num(value: float | None, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0 or math.isnan(a) or math.isnan(b):
        return None
    return a / b
