"""The benchmark's workloads and metric conventions, without any model running."""

from __future__ import annotations

import os
import statistics

import pytest

from scripts.bench.stats import RequestRecord, summarize
from scripts.bench.workloads import ArrivalSpec, WorkloadSpec, build_workload, salt_requests


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(default_model_dir / "tokenizer.json"))


def _lengths(tokenizer, requests):
    return [len(tokenizer.encode(r.prompt).ids) for r in requests]


def test_synthetic_prompts_hit_the_target_length(tokenizer):
    reqs = build_workload(
        WorkloadSpec(num_requests=8, prompt_tokens=100, unique_prompts=True), tokenizer
    )
    assert all(abs(n - 100) <= 3 for n in _lengths(tokenizer, reqs))
    assert len({r.prompt for r in reqs}) == 8


def test_prompts_repeat_unless_unique(tokenizer):
    reqs = build_workload(WorkloadSpec(num_requests=5, prompt_tokens=20), tokenizer)
    assert len({r.prompt for r in reqs}) == 1


def test_shared_prefix_shares_its_tokens_and_survives_the_run_tag(tokenizer):
    reqs = build_workload(
        WorkloadSpec(num_requests=4, prompt_tokens=16, shared_prefix_tokens=64), tokenizer
    )
    tagged = salt_requests(reqs, "run 1 cluster-tw1")
    for batch in (reqs, tagged):
        ids = [tokenizer.encode(r.prompt).ids for r in batch]
        assert len(os.path.commonprefix(ids)) >= 60
        assert len({r.prompt for r in batch}) == 4
    # another run's tag makes every token sequence differ from the first token on
    other = salt_requests(reqs, "run 2 cluster-tw1")
    assert tokenizer.encode(other[0].prompt).ids[:8] != tokenizer.encode(tagged[0].prompt).ids[:8]


def test_arrival_schedules():
    assert ArrivalSpec().offsets_s(3) == [0.0, 0.0, 0.0]
    offsets = ArrivalSpec(request_rate=50).offsets_s(4000)
    gaps = [b - a for a, b in zip(offsets, offsets[1:])]
    assert statistics.mean(gaps) == pytest.approx(1 / 50, rel=0.1)
    # exponential gaps (Poisson arrivals): the standard deviation is the mean
    assert statistics.pstdev(gaps) / statistics.mean(gaps) == pytest.approx(1.0, rel=0.15)
    with pytest.raises(ValueError):
        ArrivalSpec(request_rate=0)


def _record(i, t_submit, deltas, output_tokens, **stamps):
    rec = RequestRecord(
        index=i,
        request_id=str(i),
        t_planned=t_submit,
        t_submit=t_submit,
        t_submit_done=t_submit + 0.001,
        delta_times=list(deltas),
        t_done=deltas[-1],
        output_tokens=output_tokens,
        prompt_tokens=10,
        finish_reason="length",
        **stamps,
    )
    return rec


def test_summary_follows_the_vllm_conventions():
    # Two requests: 4 tokens in 4 deltas; 1 token in 1 delta (no TPOT, no ITL).
    a = _record(
        0,
        10.0,
        [10.100, 10.120, 10.150, 10.190],
        4,
        t_tokenize_start=10.002,
        t_tokenized=10.010,
        t_arrived=10.011,
        t_scheduled=10.050,
        t_first_token=10.090,
    )
    b = _record(
        1,
        10.0,
        [10.300],
        1,
        t_tokenize_start=10.003,
        t_tokenized=10.020,
        t_arrived=10.021,
        t_scheduled=10.200,
        t_first_token=10.290,
    )
    s = summarize([a, b], {"client": 1.5})
    assert s["requests"] == 2 and s["errors"] == 0
    assert s["ttft_ms_p50"] == pytest.approx(200.0)  # median of 100 and 300
    assert s["tpot_ms_p50"] == pytest.approx((190 - 100) / 3)  # (latency - ttft) / (n - 1)
    assert s["itl_ms_p50"] == pytest.approx(30.0)  # pooled gaps 20, 30, 40
    assert s["e2el_ms_p99"] == pytest.approx(190 + 0.99 * 110)  # linear interpolation
    assert s["queue_wait_ms_p50"] == pytest.approx((40 + 180) / 2)
    parts = sum(s[k] for k in s if k.startswith("ttft_part[") and k.endswith("_mean"))
    assert parts == pytest.approx(s["ttft_ms_mean"])
    assert s["submit_wall_s"] == pytest.approx(0.001)
    assert s["output_tokens_total"] == 5
    assert s["cpu_s[client]"] == 1.5
