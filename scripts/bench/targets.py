"""The targets the serving benchmark checks, declared in one place (the report reads them).

Each compares a cluster mode with the in-process baseline measured in the same run: the ratio
mode / baseline of a metric must be at most ``max_ratio``. They are stated for a burst, where
every request is due at once and the submit wall is what a caller waits for. The README holds
the figures measured against them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Target:
    label: str
    metric: str  # a key of the run's summary
    max_ratio: float

    def verdict(self, ratio: float | None) -> str:
        return "n/a" if ratio is None else ("met" if ratio <= self.max_ratio else "MISSED")


SERVING_TARGETS = (
    Target("submit wall >=10x lower", "submit_wall_s", 0.1),
    Target("submit latency p99 >=10x lower", "submit_latency_ms_p99", 0.1),
    Target("TTFT p50 no worse", "ttft_ms_p50", 1.0),
)


def targets_apply(mode: str, baseline: str, arrival_kind: str) -> bool:
    """Stated for the cluster against the single process, for a burst."""
    return mode.startswith("cluster") and baseline.startswith("inproc") and arrival_kind == "burst"


# --- a rate sweep (open-loop Poisson arrivals), stated for long prompts on the fast engine --------
SWEEP_RATE_RATIO = 1.5  # a cluster mode's highest sustainable rate / the baseline's, at least
SUBMIT_P99_MAX_MS = 0.050  # the SDK's submit() latency p99 at every offered rate, at most


def sweep_targets_apply(mode: str) -> bool:
    """The rate and TTFT targets compare cluster modes (the SDK) with the baseline; the HTTP
    frontend's figures are reported beside them."""
    return mode.startswith("cluster")
