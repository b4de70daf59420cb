"""The data-parallel benchmark runs end to end on the cost-model engine, a small workload (its
figures are printed, never asserted: the machine is shared)."""

from __future__ import annotations

import json

from scripts.bench import data_parallel
from scripts.bench.cost_model_engine import CostModelRunner, StepCost


def test_the_cost_model_waits_what_it_models_and_divides_by_the_cores():
    cost = StepCost(base_ms=2.0, prefill_us_per_token=10.0, decode_us_per_row=100.0)
    assert cost.seconds(100, 3) == 2e-3 + 1e-3 + 3e-4
    assert StepCost(*map(float, cost.to_env().split(","))) == cost
    assert CostModelRunner(cost, speed=2).cost.seconds(0, 0) / 2 == 1e-3


def test_a_small_run_prints_its_figures(capsys, tmp_path):
    """One mode (a cluster's start is most of the test's time); report() with two modes is
    checked on figures made up below."""
    out_json = tmp_path / "dp.json"
    data_parallel.main(
        [
            "--modes",
            "cache_aware",
            "--conversations",
            "3",
            "--turns",
            "2",
            "--system-tokens",
            "32",
            "--user-tokens",
            "32",
            "--reply-tokens",
            "4",
            "--conversation-rate",
            "50",
            "--kv-cache-tokens",
            "4096",
            "--json",
            str(out_json),
        ]
    )
    text = capsys.readouterr().out
    for row in ("prefix-cache hit rate", "TTFT p50 ms", "requests per replica", "routing us"):
        assert row in text
    (mode,) = json.loads(out_json.read_text())["modes"].values()
    assert mode["requests"] == 6 and mode["errors"] == 0 and sum(mode["spread"]) == 6
    assert mode["hit_rate"] > 0  # the second turns found their history
    assert mode["routing_us_per_request"] > 0 and mode["outcomes"]


def test_the_report_sets_cache_aware_against_round_robin_beside_the_targets():
    figures = dict(ttft_p95_ms=1.0, output_tokens_per_s=1.0, duration_s=1.0, errors=0)
    results = {
        "cache_aware": dict(figures, hit_rate=0.8, requests_per_s=13.0, ttft_p50_ms=50.0),
        "round_robin": dict(figures, hit_rate=0.5, requests_per_s=10.0, ttft_p50_ms=100.0),
    }
    for mode in results.values():
        mode.update(spread=[1, 1], routing_us_per_request=None)
    lines = data_parallel.report(results)
    assert "  prefix-cache hit rate      1.60x (target >= 2x: MISSED)" in lines
    assert "  throughput (requests/s)    1.30x (target >= 1.3x: met)" in lines
    assert "  TTFT p50                   0.50x (target <= 0.6x: met)" in lines
