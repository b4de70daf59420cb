"""The engine's series in /metrics: requests running and waiting, KV-cache usage, prefix-cache
queried and hit tokens, preemptions (README: each one's vLLM name, for existing dashboards).

Where they come from: every engine step's StepOutput carries the engine's stats to the
detokenizer, which keeps the latest and answers an EngineStatsQuery with them. The frontend that
answers a scrape asks once per scrape and writes what it gets, so:
- several frontends on one port report the same figures whichever answers (one source, nothing
  summed across processes, no multiprocess files to merge or to go stale with a dead frontend);
- a restarted frontend reports at once what the engine reports (nothing lives in the frontend);
- the counters count since the engine started, as the engine keeps them (a restarted engine
  starts from 0, which Prometheus' rate() reads as a counter reset).
The supervisor's heartbeats carry similar stats, but the supervisor may be any program that
launched the cluster and has no channel to the frontends; the detokenizer is the process every
frontend is already connected to.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from ipc.messages import EngineStats

# (our name, kind, help, the vLLM series it stands for, value from the engine's stats)
ENGINE_SERIES = (
    (
        "splitserve_engine_requests_running",
        "gauge",
        "Requests in the engine's running batch.",
        "vllm:num_requests_running",
        lambda s: s.running,
    ),
    (
        "splitserve_engine_requests_waiting",
        "gauge",
        "Requests waiting in the engine's queue.",
        "vllm:num_requests_waiting",
        lambda s: s.waiting,
    ),
    (
        "splitserve_engine_kv_cache_usage_ratio",
        "gauge",
        "Share of KV-cache blocks held by requests (0 to 1; cached blocks nobody holds are free).",
        "vllm:kv_cache_usage_perc",
        lambda s: s.kv_blocks_used / s.kv_blocks_total if s.kv_blocks_total else 0.0,
    ),
    (
        "splitserve_engine_prefix_cache_queried_tokens",
        "counter",
        "Prompt tokens looked up in the prefix cache when requests were admitted.",
        "vllm:prefix_cache_queries",
        lambda s: s.prefix_queried_tokens_total,
    ),
    (
        "splitserve_engine_prefix_cache_hit_tokens",
        "counter",
        "Prompt tokens found in the prefix cache (hit rate = hits / queried).",
        "vllm:prefix_cache_hits",
        lambda s: s.prefix_hit_tokens_total,
    ),
    (
        "splitserve_engine_preemptions",
        "counter",
        "Requests preempted because KV-cache blocks ran out (recomputed later).",
        "vllm:num_preemptions",
        lambda s: s.preemptions_total,
    ),
)


class _EngineCollector:
    def __init__(self, stats: EngineStats, model_name: str) -> None:
        self.stats, self.model_name = stats, model_name

    def collect(self) -> Iterator[Metric]:
        for name, kind, help_text, _, value in ENGINE_SERIES:
            family_type = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
            family = family_type(name, help_text, labels=["model_name"])
            family.add_metric([self.model_name], float(value(self.stats)))
            yield family


def render_engine_metrics(stats: EngineStats, model_name: str) -> bytes:
    """The engine's series as exposition text, labelled with the served model's name as vLLM's
    are, to append to the frontend's own."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_EngineCollector(stats, model_name))
    return generate_latest(registry)
