"""Prometheus metrics of one HTTP frontend process (prometheus_client).

Everything here is measured in the frontend, from what the client SDK hands it: per HTTP
request (status, in flight, TTFT and end-to-end latency as the HTTP client sees them) and per
generation (finish reason, TPOT, tokens, prefix-cache hits, and the cluster's own per-request
timings: time in a tokenizer, queue wait in the engine).

Several frontends may serve one port (SO_REUSEPORT); a scrape reaches one of them. With
PROMETHEUS_MULTIPROC_DIR set (prometheus_client's multiprocess mode) every frontend writes its
values there and any of them answers for all. vLLM's per-request series, labelled per engine
replica, are in request_metrics.py.
"""

from __future__ import annotations

import os
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    multiprocess,
)

from http_worker.request_metrics import RequestSeries

# Seconds; from a few ms (a tiny model on a GPU) to minutes (long generations on a CPU).
LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
)
KV_BYTES_BUCKETS = tuple(float(1 << shift) for shift in range(16, 33, 2))  # 64 KiB .. 4 GiB
TOKEN_GAP_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    1.0,
    2.5,
)


def _multiprocess_dir() -> str | None:
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or None


class HttpMetrics:
    """The frontend's series, declared in three groups (a scrape lists them in this order):
    HTTP and engine requests counted by outcome and in flight, latencies, tokens."""

    def __init__(self) -> None:
        # A private registry: two apps in one process (tests) must not collide on names.
        self.registry = CollectorRegistry()
        self._declare_counts(self.registry)
        self._declare_latencies(self.registry)
        self._declare_tokens(self.registry)
        self.vllm = RequestSeries(self.registry)

    def _declare_counts(self, r: CollectorRegistry) -> None:
        self.requests = Counter(
            "splitserve_http_requests",
            "HTTP requests answered, by endpoint and status code.",
            ["endpoint", "status"],
            registry=r,
        )
        self.in_flight = Gauge(
            "splitserve_http_requests_in_flight",
            "HTTP generation requests not yet answered in full.",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.generations = Counter(
            "splitserve_generations",
            "Engine requests (one per choice) by outcome: a finish "
            "reason (stop, length, abort), 'disconnected', or the error code.",
            ["outcome"],
            registry=r,
        )
        self.generations_in_flight = Gauge(
            "splitserve_generations_in_flight",
            "Engine requests submitted by this frontend and not yet finished.",
            registry=r,
            multiprocess_mode="livesum",
        )

    def _declare_latencies(self, r: CollectorRegistry) -> None:
        self.ttft = Histogram(
            "splitserve_http_time_to_first_token_seconds",
            "From the HTTP request's arrival to its first generated text.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "splitserve_http_e2e_request_latency_seconds",
            "From the HTTP request's arrival to "
            "the end of its answer (the last choice's terminal event).",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "splitserve_time_per_output_token_seconds",
            "(last token - first token) / (tokens - 1), per engine request, from the engine steps "
            "that made them.",
            buckets=TOKEN_GAP_BUCKETS,
            registry=r,
        )
        self.tokenize = Histogram(
            "splitserve_tokenize_seconds",
            "Time a request spent in a tokenizer worker.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_wait = Histogram(
            "splitserve_engine_queue_wait_seconds",
            "From arrival at the engine to its first scheduled prefill.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.kv_transfer = Histogram(
            "splitserve_kv_transfer_seconds",
            "Disaggregated: from the prefill engine's export of a request's KV blocks to the "
            "decode engine's import of them.",
            buckets=TOKEN_GAP_BUCKETS,
            registry=r,
        )
        self.kv_transfer_bytes = Histogram(
            "splitserve_kv_transfer_bytes",
            "Disaggregated: bytes of KV blocks a request moved from its prefill engine to its "
            "decode engine.",
            buckets=KV_BYTES_BUCKETS,
            registry=r,
        )

    def _declare_tokens(self, r: CollectorRegistry) -> None:
        self.prompt_tokens = Counter(
            "splitserve_prompt_tokens", "Prompt tokens of finished engine requests.", registry=r
        )
        self.cached_tokens = Counter(
            "splitserve_prefix_cache_hit_tokens",
            "Prompt tokens served from the prefix cache (hit rate = this / prompt_tokens).",
            registry=r,
        )
        self.completion_tokens = Counter(
            "splitserve_generation_tokens",
            "Generated tokens of finished engine requests.",
            registry=r,
        )

    def observe_generation(
        self, finish_reason: str | None, usage: Any, timings: Any, t_first: float, t_last: float
    ) -> None:
        """One engine request that finished without error: its terminal event's usage and
        timings (ipc.messages.Usage / RequestTimings) and when its first/last text arrived."""
        self.generations.labels(finish_reason or "unknown").inc()
        if usage is not None:
            self.prompt_tokens.inc(usage.prompt_tokens)
            self.cached_tokens.inc(usage.cached_tokens)
            self.completion_tokens.inc(usage.completion_tokens)
            # The engine steps that made the first and the last token, where the timings carry
            # them: the arrival times collapse when the detokenizer coalesces a loaded stream's
            # deltas into one event.
            if timings is not None and timings.t_last_token > timings.t_first_token > 0:
                t_first, t_last = timings.t_first_token, timings.t_last_token
            if usage.completion_tokens >= 2 and t_last > t_first:
                self.tpot.observe((t_last - t_first) / (usage.completion_tokens - 1))
        if timings is not None:
            if timings.t_tokenized and timings.t_tokenize_start:
                self.tokenize.observe(timings.t_tokenized - timings.t_tokenize_start)
            if timings.t_scheduled and timings.t_arrived:
                self.queue_wait.observe(timings.t_scheduled - timings.t_arrived)
            if timings.kv_transfer_bytes:
                self.kv_transfer.observe(timings.kv_transfer_s)
                self.kv_transfer_bytes.observe(timings.kv_transfer_bytes)

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        path = _multiprocess_dir()
        if path is None:
            return generate_latest(self.registry), CONTENT_TYPE_LATEST
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry, path=path)
        return generate_latest(registry), CONTENT_TYPE_LATEST
