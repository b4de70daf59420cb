"""vLLM's inter-token latency series as a request's deltas arrive (RequestClock keeps its
engine's series between tokens): one sample per token after the first, under the engine that
produced it."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from http_worker.request_metrics import RequestClock, RequestSeries


def test_one_gap_sample_per_token_after_the_first_under_its_engine():
    registry = CollectorRegistry()
    clock = RequestClock(RequestSeries(registry), "m", t_arrived=0.0)
    clock.on_tokens(0, 1, 1.0)  # the first token: TTFT, no gap
    clock.on_tokens(0, 1, 1.5)
    clock.on_tokens(0, 2, 2.5)  # two tokens in one delta: two samples of half the gap each
    clock.on_tokens(1, 1, 3.0)  # served by another replica from here (a resend)

    def sample(name: str, engine: str) -> float | None:
        labels = {"model_name": "m", "engine": engine}
        return registry.get_sample_value(f"vllm:inter_token_latency_seconds_{name}", labels)

    assert (sample("count", "0"), sample("sum", "0")) == (3.0, 1.5)
    assert (sample("count", "1"), sample("sum", "1")) == (1.0, 0.5)
    ttft = {"model_name": "m", "engine": "0"}
    assert registry.get_sample_value("vllm:time_to_first_token_seconds_count", ttft) == 1.0
