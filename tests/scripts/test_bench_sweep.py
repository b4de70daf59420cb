"""The rate sweep: parsing the rates, the sustainable-rate decision, and the fast-engine
scenario end to end on a tiny workload (real tokenizer, real engine, real cluster)."""

from __future__ import annotations

import json
import math

import pytest

from scripts.bench import serving
from scripts.bench.stats import RequestRecord, span_rate, summarize
from scripts.bench.sweep import highest_sustained, parse_rates, requests_at, sustains

SLO_MS = 500.0


def test_rates_parse_sorted_and_reject_nonsense():
    assert parse_rates("8,2, 4") == [2.0, 4.0, 8.0]
    assert parse_rates("inf") == [math.inf]
    assert parse_rates("0.5") == [0.5]
    for bad in ("", "0", "-1,2", "two", "2,inf", "2,2", "nan"):
        with pytest.raises(ValueError):
            parse_rates(bad)


def test_requests_per_rate_follow_the_duration():
    assert requests_at(8.0, 0.0, 100) == 100  # no duration: --num-requests
    assert requests_at(8.0, 5.0, 100) == 40
    assert requests_at(0.5, 5.0, 100) == 10  # at least 10
    assert requests_at(math.inf, 5.0, 100) == 100


def point(
    p99_ms: float = 100.0, arrived: float = 10.0, completed: float = 10.0, errors: int = 0
) -> dict:
    return {
        "ttft_from_arrival_ms_p99": p99_ms,
        "arrival_rate_rps": arrived,
        "completion_rate_rps": completed,
        "errors": errors,
    }


def test_sustaining_needs_the_slo_the_throughput_and_no_errors():
    assert sustains(point(), SLO_MS)
    assert sustains(point(p99_ms=SLO_MS), SLO_MS)
    assert not sustains(point(p99_ms=SLO_MS + 1), SLO_MS)
    assert sustains(point(completed=9.5), SLO_MS)  # 95% of the arrival rate
    assert not sustains(point(completed=9.4), SLO_MS)
    assert not sustains(point(errors=1), SLO_MS)
    assert not sustains(point(p99_ms=None), SLO_MS)
    assert not sustains(point(completed=None), SLO_MS)


def test_the_highest_sustained_rate_stops_at_the_first_failure():
    by_rate = {2.0: point(), 4.0: point(), 8.0: point(p99_ms=900), 16.0: point()}
    assert highest_sustained(by_rate, SLO_MS) == 4.0  # the pass at 16 after a failure is noise
    assert highest_sustained({2.0: point(errors=3)}, SLO_MS) is None


def test_rates_are_measured_over_their_own_span():
    assert span_rate([0.0, 1.0, 2.0]) == 1.0
    assert span_rate([5.0]) is None and span_rate([1.0, 1.0]) is None
    records = [
        RequestRecord(
            index=i,
            request_id=str(i),
            t_planned=i * 0.5,
            t_submit=i * 0.5,
            t_submit_done=i * 0.5 + 1e-5,
            delta_times=[i * 0.5 + 0.1],
            t_done=i * 1.0 + 0.2,
            finish_reason="length",
            output_tokens=1,
        )
        for i in range(5)
    ]
    summary = summarize(records, {})
    assert summary["arrival_rate_rps"] == pytest.approx(2.0)
    assert summary["completion_rate_rps"] == pytest.approx(1.0)  # falling behind
    assert summary["ttft_from_arrival_ms_p50"] == pytest.approx(100.0)


def test_the_fast_engine_sweep_runs_every_mode_at_every_rate(tmp_path, capsys):
    json_path = tmp_path / "sweep.json"
    data = serving.main(
        [
            "--fast-engine",
            "--modes",
            "inproc,inproc-pretok,cluster",
            "--request-rate",
            "40,20",
            "--duration-s",
            "0.3",
            "--prompt-tokens",
            "64",
            "--unique-prompts",
            "--max-new-tokens",
            "2",
            "--warmup-runs",
            "1",
            "--warmup-num-requests",
            "2",
            "--json",
            str(json_path),
        ]
    )
    text = capsys.readouterr().out
    assert "Fast engine: 2 layers, hidden size 64" in text and "tokenize/prefill" in text
    assert "highest sustainable rate (req/s): inproc" in text
    modes = ["inproc", "inproc-pretok", "cluster-tw1"]
    assert list(data["sweep"]) == modes
    stored = json.loads(json_path.read_text())
    for mode in modes:
        assert list(stored["sweep"][mode]) == ["20", "40"]
        for rate, summary in stored["sweep"][mode].items():
            assert summary["requests"] == requests_at(float(rate), 0.3, 0)
            assert summary["errors"] == 0 and summary["ttft_from_arrival_ms_p99"] > 0
            assert summary["submit_cpu_ms_p50"] > 0
    measured = [(r["mode"], r["request_rate"]) for r in stored["runs"] if not r["warmup"]]
    assert measured == [(m, rate) for rate in (20.0, 40.0) for m in modes]
