"""vLLM's per-request series, measured in the frontend and labelled as vLLM labels them
(``model_name``, and ``engine``: the replica that served the request, which its events carry).

One engine request is one choice of an HTTP request. TTFT and end-to-end latency count from the
HTTP request's arrival, as vLLM counts from its own frontend's; the inter-token latency is one
sample per generated token after the first (a delta of k tokens gives k samples of its gap / k),
the time per output token one sample per request. Requests that end with an error get no
latency samples (vLLM observes finished requests only).

Several frontends share the series through prometheus_client's multiprocess mode (metrics.py).
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

LABELS = ("model_name", "engine")
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
)
TOKEN_GAP_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0)
# Token counts, 1-2-5 steps up to a million (the buckets are fixed before the model is known).
TOKEN_COUNT_BUCKETS = tuple(m * 10**e for e in range(6) for m in (1, 2, 5)) + (1_000_000,)


class RequestSeries:
    def __init__(self, registry: CollectorRegistry) -> None:
        def histogram(name: str, help_text: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, help_text, LABELS, buckets=buckets, registry=registry)

        def counter(name: str, help_text: str) -> Counter:
            return Counter(name, help_text, LABELS, registry=registry)

        self.ttft = histogram(
            "vllm:time_to_first_token_seconds",
            "From the HTTP request's arrival to an engine request's first token.",
            TTFT_BUCKETS,
        )
        self.itl = histogram(
            "vllm:inter_token_latency_seconds",
            "Gap between an engine request's consecutive tokens, one sample per token.",
            TOKEN_GAP_BUCKETS,
        )
        self.tpot = histogram(
            "vllm:request_time_per_output_token_seconds",
            "(last token - first token) / (tokens - 1), one sample per engine request.",
            TOKEN_GAP_BUCKETS,
        )
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds",
            "From the HTTP request's arrival to an engine request's terminal event.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.prompt_tokens_per_request = histogram(
            "vllm:request_prompt_tokens",
            "Prompt tokens of a finished request.",
            TOKEN_COUNT_BUCKETS,
        )
        self.generation_tokens_per_request = histogram(
            "vllm:request_generation_tokens",
            "Generated tokens of a finished request.",
            TOKEN_COUNT_BUCKETS,
        )
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter(
            "vllm:generation_tokens", "Generated tokens of finished requests."
        )


class RequestClock:
    """One engine request's times as its deltas arrive, feeding a RequestSeries."""

    __slots__ = ("series", "model_name", "t_arrived", "t_first", "t_last", "_gap")

    def __init__(self, series: RequestSeries, model_name: str, t_arrived: float) -> None:
        self.series, self.model_name, self.t_arrived = series, model_name, t_arrived
        self.t_first = self.t_last = 0.0
        self._gap: tuple[int, Any] = (-1, None)  # (engine index, its ITL series)

    def on_tokens(self, engine_index: int, tokens: int, t: float) -> None:
        if not self.t_first:
            self.t_first = t
            labels = (self.model_name, str(engine_index))
            self.series.ttft.labels(*labels).observe(t - self.t_arrived)
        elif tokens:
            if self._gap[0] != engine_index:  # labels() per token cost more than observe()
                series = self.series.itl.labels(self.model_name, str(engine_index))
                self._gap = (engine_index, series)
            gap = self._gap[1]
            for _ in range(tokens):
                gap.observe((t - self.t_last) / tokens)
        self.t_last = t

    def on_finished(
        self, engine_index: int, prompt_tokens: int, generation_tokens: int, t: float
    ) -> None:
        """A request that ended without error (the others count no latency)."""
        if engine_index < 0:
            return
        labels = (self.model_name, str(engine_index))
        series = self.series
        series.e2e.labels(*labels).observe(t - self.t_arrived)
        if generation_tokens >= 2 and self.t_last > self.t_first:
            series.tpot.labels(*labels).observe(
                (self.t_last - self.t_first) / (generation_tokens - 1)
            )
        series.prompt_tokens_per_request.labels(*labels).observe(prompt_tokens)
        series.generation_tokens_per_request.labels(*labels).observe(generation_tokens)
        series.prompt_tokens.labels(*labels).inc(prompt_tokens)
        series.generation_tokens.labels(*labels).inc(generation_tokens)
