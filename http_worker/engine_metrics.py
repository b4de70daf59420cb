"""The engines' series in /metrics: requests running and waiting, KV-cache usage, prefix-cache
queried and hit tokens, preemptions, speculative decoding's drafts and accepted tokens; once
per engine replica under vLLM's names (``vllm:num_requests_running{model_name, engine="r"}``,
...), so vLLM dashboards work unchanged,
and for the cluster as a whole under ours (``splitserve_engine_*``, the replicas summed). With
several replicas, the routing decisions of the tokenizer workers too:
``splitserve_routing_decisions_total{policy, outcome}`` and the time spent on them,
``splitserve_routing_seconds_total`` (its rate over the decisions' is the cost per request).
A mixture-of-experts model's expert load, per replica: ``splitserve_engine_moe_expert_rows``, a
histogram of the rows each expert took in each step's MoE layers.

Where they come from: every engine step's StepOutput carries its replica's stats to the
detokenizer, which keeps the latest per replica, counts the routing decisions each request's
meta reports, and answers an EngineStatsQuery with all of it. The frontend that answers a scrape
asks once per scrape and writes what it gets, so:
- several frontends on one port report the same figures whichever answers (one source, nothing
  summed across processes, no multiprocess files to merge or to go stale with a dead frontend);
- a restarted frontend reports at once what the engine reports (nothing lives in the frontend);
- the counters count since the engine started, as the engine keeps them (a restarted engine
  starts from 0, which Prometheus' rate() reads as a counter reset); the routing counters since
  the detokenizer started, whatever tokenizer worker restarts in between (a decision is counted
  when its request reaches the detokenizer, not kept in the worker that made it).
The supervisor's heartbeats carry similar stats, but the supervisor may be any program that
launched the cluster and has no channel to the frontends; the detokenizer is the process every
frontend is already connected to.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from ipc.messages import EXPERT_ROWS_BUCKETS, EngineStats
from ipc.messages.queries import EngineStatsReport

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
    (
        "splitserve_engine_spec_decode_drafts",
        "counter",
        "Speculative decoding: times a request verified drafts in a step.",
        "vllm:spec_decode_num_drafts",
        lambda s: s.spec_drafts_total,
    ),
    (
        "splitserve_engine_spec_decode_draft_tokens",
        "counter",
        "Speculative decoding: draft tokens verified.",
        "vllm:spec_decode_num_draft_tokens",
        lambda s: s.spec_draft_tokens_total,
    ),
    (
        "splitserve_engine_spec_decode_accepted_tokens",
        "counter",
        "Speculative decoding: draft tokens accepted (acceptance rate = accepted / draft tokens; "
        "mean accepted length = 1 + accepted / drafts).",
        "vllm:spec_decode_num_accepted_tokens",
        lambda s: s.spec_accepted_tokens_total,
    ),
)
EXPERT_ROWS = (
    "splitserve_engine_moe_expert_rows",
    "Mixture-of-experts models: rows an expert took in one step's MoE layer, one observation "
    "per step, layer and expert (0: no row chose it); a wide spread is an imbalance.",
)
ACCEPTED_PER_POSITION = (
    "vllm:spec_decode_num_accepted_tokens_per_pos",
    "Speculative decoding: draft tokens accepted, by their position in the draft (from 0).",
)


class _EngineCollector:
    def __init__(self, report: EngineStatsReport, model_name: str) -> None:
        self.report, self.model_name = report, model_name

    def collect(self) -> Iterator[Metric]:
        replicas = self.report.replicas
        for name, kind, help_text, vllm_name, value in ENGINE_SERIES:
            family_type = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
            ours = family_type(name, help_text, labels=["model_name"])
            ours.add_metric([self.model_name], float(value(self.report.stats)))
            yield ours
            # Disaggregated: role="prefill"/"decode" beside the replica's index.
            roles = any(r.role for r in replicas)
            names = ["model_name", "engine", *(["role"] if roles else [])]
            per_replica = family_type(vllm_name, help_text, labels=names)
            for replica in replicas:
                labels = [self.model_name, str(replica.index), *([replica.role] if roles else [])]
                per_replica.add_metric(labels, float(value(replica.stats)))
            yield per_replica
        yield self._accepted_per_position()
        if self.report.stats.expert_rows_buckets_total:
            yield self._expert_rows()
        if self.report.routing_policy:
            yield from self._routing()

    def _accepted_per_position(self) -> Metric:
        name, help_text = ACCEPTED_PER_POSITION
        family = CounterMetricFamily(name, help_text, labels=["model_name", "engine", "position"])
        for replica in self.report.replicas:
            for position, count in enumerate(replica.stats.spec_accepted_per_position_total):
                labels = [self.model_name, str(replica.index), str(position)]
                family.add_metric(labels, float(count))
        return family

    def _expert_rows(self) -> Metric:
        """Each replica's histogram, under its ``engine`` label (sum them for the cluster's)."""
        name, help_text = EXPERT_ROWS
        family = HistogramMetricFamily(name, help_text, labels=["model_name", "engine"])
        for replica in self.report.replicas:
            stats = replica.stats
            if stats.expert_rows_buckets_total:
                labels = [self.model_name, str(replica.index)]
                family.add_metric(labels, _cumulative(stats), stats.expert_rows_total)
        return family

    def _routing(self) -> Iterator[Metric]:
        report = self.report
        decisions = CounterMetricFamily(
            "splitserve_routing_decisions",
            "Requests routed to an engine replica by the tokenizer workers, by policy and by "
            "what decided (cache_hit, balanced, imbalanced, round_robin; skip_prefill: straight "
            "to a decode engine caching the prompt).",
            labels=["policy", "outcome"],
        )
        for outcome, count in sorted(report.routing_decisions.items()):
            decisions.add_metric([report.routing_policy, outcome], float(count))
        yield decisions
        seconds = CounterMetricFamily(
            "splitserve_routing_seconds",
            "Time the tokenizer workers spent choosing replicas (block hashes, prefix lookup, "
            "the rule), over all decisions.",
            labels=["policy"],
        )
        seconds.add_metric([report.routing_policy], report.routing_seconds_total)
        yield seconds


def _cumulative(stats: EngineStats) -> list[tuple[str, float]]:
    """Prometheus' buckets (counts at or below each bound, +Inf last) of an expert-load
    histogram kept per bucket."""
    bounds = [str(float(b)) for b in EXPERT_ROWS_BUCKETS] + ["+Inf"]
    total, buckets = 0, []
    for bound, count in zip(bounds, stats.expert_rows_buckets_total):
        total += count
        buckets.append((bound, float(total)))
    return buckets


def render_engine_metrics(report: EngineStatsReport, model_name: str) -> bytes:
    """The engines' series as exposition text, labelled with the served model's name as vLLM's
    are, to append to the frontend's own."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_EngineCollector(report, model_name))
    return generate_latest(registry)
