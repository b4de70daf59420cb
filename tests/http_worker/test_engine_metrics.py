"""Speculative decoding's counters in /metrics under vLLM's names, per replica, and the cluster's
sum of counts by draft position (the detokenizer's total_stats)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from detok_worker.engine_book import total_stats
from http_worker.engine_metrics import render_engine_metrics
from ipc.messages import EngineStats
from ipc.messages.queries import EngineStatsReport, ReplicaStats


def spec_stats(drafts: int, accepted_per_position: list[int]) -> EngineStats:
    return EngineStats(
        spec_drafts_total=drafts,
        spec_draft_tokens_total=3 * drafts,
        spec_accepted_tokens_total=sum(accepted_per_position),
        spec_accepted_per_position_total=accepted_per_position,
    )


def test_spec_decode_counters_have_vllm_names_per_replica_and_sum_by_position():
    replicas = [ReplicaStats(0, spec_stats(10, [7, 4, 1])), ReplicaStats(1, spec_stats(2, [1]))]
    total = total_stats([r.stats for r in replicas])
    assert total.spec_accepted_per_position_total == [8, 4, 1]
    assert (total.spec_drafts_total, total.spec_accepted_tokens_total) == (12, 13)
    text = render_engine_metrics(EngineStatsReport("q", total, replicas=replicas), "m").decode()
    samples = {
        (s.name, s.labels.get("engine"), s.labels.get("position")): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    assert samples["vllm:spec_decode_num_drafts_total", "0", None] == 10
    assert samples["vllm:spec_decode_num_draft_tokens_total", "1", None] == 6
    assert samples["vllm:spec_decode_num_accepted_tokens_total", "0", None] == 12
    assert samples["vllm:spec_decode_num_accepted_tokens_per_pos_total", "0", "1"] == 4
    assert samples["vllm:spec_decode_num_accepted_tokens_per_pos_total", "1", "0"] == 1
    assert samples["splitserve_engine_spec_decode_accepted_tokens_total", None, None] == 13
