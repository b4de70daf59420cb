"""The hops workload's arithmetic and tables (the path times it reads are tested end to end in
tests/test_http_tiny.py). Timings are not a test."""

from __future__ import annotations

import pytest

from scripts.bench import hops


def test_hop_values_split_a_token_and_skip_ends_not_known():
    times = {
        "t_prev_step": 9.990,
        "t_step": 10.010,
        "step_ms": 15.0,
        "t_detok_woke": 10.0103,
        "t_detok_sent": 10.0105,
        "t_http_in": 10.0110,
        "t_sse": 10.0112,
        "t_client": 10.0117,
    }
    got = hops.hop_values(times, hops.TOKEN_HOPS)
    assert got["engine loop between steps"] == pytest.approx(5.0)  # 9.990 -> 9.995 began
    assert got["engine step"] == pytest.approx(15.0)
    assert got["step end -> detok wakes"] == pytest.approx(0.3)
    assert got["step end -> client (path)"] == pytest.approx(1.7)
    # A server without path times (llama-server): only the client's own figures are known.
    assert hops.hop_values({"t_client": 10.0}, hops.TOKEN_HOPS) == {}


def test_summary_pools_runs_and_the_table_names_every_server():
    run = {
        "itl": [10.0, 12.0, 14.0],
        "ttft": [300.0],
        "ttft_cached": [80.0, 90.0],
        "hops": [{"engine step": 9.0}, {"engine step": 11.0}],
        "first": [{"tokenize": 0.5}],
        "threads": [1, 2, 2, 2],
        "first_threads": [2, 2],
    }
    stats = {"ours": hops.summarize([run, run]), "theirs": hops.summarize([run])}
    assert stats["ours"]["itl_p50_ms"] == 12.0 and stats["ours"]["ttft_cached_p50_ms"] == 85.0
    assert stats["ours"]["token_hops_p50_ms"]["engine step"] == 10.0
    assert stats["ours"]["token_hops_p50_ms"]["detok decode + send"] is None
    assert stats["ours"]["one_thread_steps_pct"] == 25.0
    assert stats["ours"]["one_thread_first_steps_pct"] == 0.0
    text = hops.render(stats, ["ours r0: 1.00 1.00 1.00"])
    assert "| figure (p50, ms) | ours | theirs |" in text and "| tokenize | 0.50 | 0.50" in text
