"""The peer workload's parts that need no llama.cpp: its command line, its statistics and tables,
its prompts, and each part (serve, hops, startup) end to end with splitserve launches alone on
the tiny model (the benchmarks' HTTP client against real servers). Timings are not a test."""

from __future__ import annotations

import json
import sys

import pytest

from scripts.bench import peer, report
from scripts.bench.stats import RequestRecord, summarize


def _args(*extra: str):
    return peer.validate(peer.build_parser().parse_args(["--llama-server", sys.executable, *extra]))


def test_defaults_and_lists():
    args = _args()
    assert args.llama_threads == [1, 2] and args.concurrency == [1, 8, 32]
    assert args.splitserve == [""] and args.parallel == 32 and args.prompt_tokens == 158
    args = _args(
        "--splitserve",
        "",
        "--splitserve",
        "--dtype bfloat16 --engine-threads 2",
        "--llama-threads",
        "2",
        "--concurrency",
        "4,16",
    )
    assert args.splitserve == ["", "--dtype bfloat16 --engine-threads 2"]
    assert args.llama_threads == [2] and args.concurrency == [4, 16]
    assert peer.requests_for(args, 1) == 8 and peer.requests_for(args, 16) == 32


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--concurrency", "64"], "exceeds llama-server's --parallel 32"),
        (["--splitserve", "", "--splitserve", ""], "must differ"),
        (["--repeats", "0"], "--repeats must be at least 1"),
        (["--ctx-per-slot", "64"], "--ctx-per-slot is too small"),
        (["--requests", "0"], "--requests must be at least 1"),
        (["--gguf", "/nonexistent.gguf"], "is not a file"),
    ],
)
def test_bad_arguments_are_refused(extra, message):
    with pytest.raises(ValueError, match=message):
        _args(*extra)


def test_llama_server_must_be_executable(tmp_path):
    with pytest.raises(ValueError, match="not an executable"):
        peer.validate(peer.build_parser().parse_args(["--llama-server", str(tmp_path / "missing")]))


def test_bad_list_is_a_usage_error(capsys):
    with pytest.raises(SystemExit):
        peer.build_parser().parse_args(["--llama-server", "x", "--concurrency", "1,x"])
    assert "expected integers" in capsys.readouterr().err


def _run(tokens_per_s: float, ttft_s: float, requests: int = 4, tokens: int = 5) -> dict:
    """A run's summary from records with known times: requests one after another, each with a
    TTFT of ttft_s and then one token every 1/tokens_per_s."""
    records, t = [], 100.0
    for i in range(requests):
        rec = RequestRecord(
            index=i,
            request_id=str(i),
            t_submit=t,
            t_submit_done=t,
            prompt_tokens=158,
            output_tokens=tokens,
            finish_reason="length",
        )
        rec.delta_times = [t + ttft_s + k / tokens_per_s for k in range(tokens)]
        rec.t_done = rec.delta_times[-1]
        t = rec.t_done
        records.append(rec)
    return summarize(records, {"server": 1.0})


def test_aggregate_gives_median_and_spread():
    stats = report.aggregate([_run(10, 0.1), _run(20, 0.1), _run(40, 0.1)])
    itl = stats["itl_ms_p50"]
    assert itl["median"] == pytest.approx(50.0) and itl["min"] == pytest.approx(25.0)
    assert itl["max"] == pytest.approx(100.0) and itl["n"] == 3
    assert stats["ttft_ms_p50"]["median"] == pytest.approx(100.0)
    assert stats["output_tokens_mean"]["median"] == 5 and stats["prompt_tokens_mean"]["min"] == 158
    # 20 output tokens per run, 1 CPU second: 50 ms of server CPU per token
    assert stats["server_cpu_ms_per_token"]["median"] == pytest.approx(50.0)
    assert report.spread([None, None]) is None


def median_tps(stats: dict) -> float:
    return stats["output_throughput_tps"]["median"]


def test_comparison_takes_llama_at_its_best_per_level():
    stats = {
        "ours": {1: report.aggregate([_run(30, 0.05)]), 8: report.aggregate([_run(60, 0.05)])},
        "llama t1": {1: report.aggregate([_run(40, 0.2)]), 8: report.aggregate([_run(20, 0.2)])},
        "llama t2": {1: report.aggregate([_run(20, 0.4)]), 8: report.aggregate([_run(50, 0.1)])},
    }
    rows = report.comparison_rows(stats, "ours", ["llama t1", "llama t2"], [1, 8])
    assert [r["peer"] for r in rows] == ["llama t1", "llama t2"]
    out = rows[1]["figures"]["output_throughput_tps"]
    assert out["ratio"] == pytest.approx(out["ours"] / out["theirs"])
    assert out["ours"] > out["theirs"] > median_tps(stats["llama t1"][8])
    ttft = rows[0]["figures"]["ttft_ms_p50"]
    assert ttft["ours"] == pytest.approx(50) and ttft["theirs"] == pytest.approx(200)
    assert ttft["ratio"] == pytest.approx(0.25) and not ttft["higher_is_better"]
    table = report.markdown_comparison(rows, "ours")
    assert "| 1 |" in table and "50 / 200 = 0.25x" in table and "llama t2 |" in table
    everything = report.markdown_all(stats, [1, 8])
    assert everything.count("\n") == 1 + 6  # header, rule, 3 targets x 2 levels


def test_chats_are_distinct_real_text_of_the_asked_length(default_model_dir):
    from scripts.bench.peer_workload import PromptCounter, build_chats

    counter = PromptCounter(default_model_dir)
    chats = build_chats(counter, 12, 158, start=5)
    assert [counter.count(c) for c in chats] == [158] * 12
    texts = [c[1]["content"] for c in chats]
    assert len(set(texts)) == 12 and all(t.count(" ") > 60 for t in texts)  # words, not ids
    # distinct from the first tokens on: neither server can reuse a cached prefix
    assert len({c[0]["content"] for c in chats}) == 12
    with pytest.raises(ValueError, match="leaves no room"):
        build_chats(counter, 1, 20)


def test_the_workload_end_to_end_with_a_splitserve_launch_alone(tiny_model_dir, tmp_path, capsys):
    """Without --llama-server only the splitserve launches run: the real workload (launcher,
    HTTP client, closed loop, statistics, JSON) on the tiny model."""
    json_path = tmp_path / "peer.json"
    flags = f"--model {tiny_model_dir} --kv-cache-tokens 4096"
    data = peer.main(
        ["--splitserve", flags, "--concurrency", "1,3", "--repeats", "1", "--prompt-tokens", "60"]
        + ["--output-tokens", "7", "--warmup-requests", "2", "--min-requests", "3"]
        + ["--requests-per-stream", "1", "--json", str(json_path)]
    )["serve"]
    name = f"splitserve {flags}"
    assert [(r["target"], r["concurrency"]) for r in data["runs"]] == [(name, 1), (name, 3)]
    for run in data["runs"]:
        records = [RequestRecord(**r) for r in run["records"]]
        assert len(records) == 3
        for rec in records:
            assert rec.ok, rec.error
            assert rec.output_tokens == 7 and rec.prompt_tokens == 60  # ignore_eos; usage
            assert rec.finish_reason == "length" and 1 <= len(rec.delta_times) <= 7
            assert rec.t_submit < rec.delta_times[0] <= rec.t_done
        assert run["summary"]["errors"] == 0 and run["summary"]["cpu_s[server]"] > 0
    assert "splitserve launch --http-port 0 --model" in data["setup"]["servers"][name]
    assert data["stats"][name][3]["output_tokens_mean"]["median"] == 7
    assert f"**{name}** / llama.cpp" in capsys.readouterr().out
    assert json.loads(json_path.read_text())["serve"]["setup"]["peers"] == []


def test_a_launch_that_cannot_start_or_parse_is_refused(tmp_path):
    from scripts.bench.launcher import SplitserveServer

    with pytest.raises(ValueError, match="holds no model"):
        SplitserveServer(f"--model {tmp_path}")
    with pytest.raises(ValueError, match="not a valid `splitserve launch` command line"):
        _args("--splitserve=--no-such-flag")


def test_warm_cache_measures_prompts_the_server_has_cached(tiny_model_dir):
    """--warm-cache sends each run's requests once, unmeasured, before the run: every measured
    request then finds its prompt's whole blocks in the prefix cache."""
    flags = f"--model {tiny_model_dir} --kv-cache-tokens 4096"
    data = peer.main(
        ["--splitserve", flags, "--concurrency", "2", "--repeats", "1", "--prompt-tokens", "60"]
        + ["--output-tokens", "3", "--warmup-requests", "0", "--min-requests", "3"]
        + ["--requests-per-stream", "1", "--warm-cache"]
    )["serve"]
    (run,) = data["runs"]  # the warming pass is not a measured run
    records = [RequestRecord(**r) for r in run["records"]]
    assert len(records) == 3 and all(r.ok for r in records)
    assert all(r.cached_tokens >= 48 for r in records)  # 60 tokens: 3 whole 16-token blocks
    assert "warm caches" in data["setup"]["workload"]


def test_hops_and_startup_of_a_splitserve_launch(tiny_model_dir, capsys):
    """hops: each token's path times split into hops; startup: a launch from nothing to its first
    token, twice (the first start apart)."""
    flags = f"--model {tiny_model_dir} --kv-cache-tokens 4096"
    data = peer.main(
        ["hops", "startup", "--splitserve", flags, "--repeats", "2", "--requests", "2"]
        + ["--prompt-tokens", "60", "--output-tokens", "5"]
    )
    name = f"splitserve {flags}"
    stats = data["hops"]["stats"][name]
    assert stats["itl_p50_ms"] > 0 and stats["ttft_cached_p50_ms"] > 0
    assert stats["token_hops_p50_ms"]["engine step"] > 0  # the path times came with the tokens
    assert stats["first_token_hops_p50_ms"]["tokenize"] is not None
    runs = data["startup"]["runs"]
    assert [(r["case"], r["repeat"]) for r in runs] == [(name, 0), (name, 1)]
    for run in runs:
        assert 0 < run["ready_s"] < run["first_token_s"] < run["wall_s"]
    out = capsys.readouterr().out
    assert f"| figure (p50, ms) | {name} |" in out and f"| {name} |" in out
