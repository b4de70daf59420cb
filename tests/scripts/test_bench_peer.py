"""The peer benchmark's parts that need no llama.cpp: its command line, its statistics and
tables, its prompts, its weight-byte count, and its client against a real splitserve server on
the tiny model. The benchmark itself (timings) is not a test."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from scripts import bench_peer
from scripts.bench import peer_report
from scripts.bench.metrics import RequestRecord, summarize


def _args(*extra: str):
    return bench_peer.validate(
        bench_peer.build_parser().parse_args(["--llama-server", sys.executable, *extra])
    )


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
    assert bench_peer.requests_for(args, 1) == 8 and bench_peer.requests_for(args, 16) == 32


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--concurrency", "64"], "exceeds llama-server's --parallel 32"),
        (["--splitserve", "", "--splitserve", ""], "must differ"),
        (["--repeats", "0"], "--repeats must be at least 1"),
        (["--ctx-per-slot", "64"], "--ctx-per-slot is too small"),
    ],
)
def test_bad_arguments_are_refused(extra, message):
    with pytest.raises(ValueError, match=message):
        _args(*extra)


def test_llama_server_must_be_executable(tmp_path):
    with pytest.raises(ValueError, match="not an executable"):
        bench_peer.validate(
            bench_peer.build_parser().parse_args(["--llama-server", str(tmp_path / "missing")])
        )


def test_bad_list_is_a_usage_error(capsys):
    with pytest.raises(SystemExit):
        bench_peer.build_parser().parse_args(["--llama-server", "x", "--concurrency", "1,x"])
    assert "expected integers" in capsys.readouterr().err


def test_run_order_rotates_so_each_goes_first():
    targets = ["a", "b", "c"]
    orders = [bench_peer.run_order(targets, r) for r in range(3)]
    assert orders == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]
    assert {o[0] for o in orders} == set(targets)


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
    stats = peer_report.aggregate([_run(10, 0.1), _run(20, 0.1), _run(40, 0.1)])
    itl = stats["itl_ms_p50"]
    assert itl["median"] == pytest.approx(50.0) and itl["min"] == pytest.approx(25.0)
    assert itl["max"] == pytest.approx(100.0) and itl["n"] == 3
    assert stats["ttft_ms_p50"]["median"] == pytest.approx(100.0)
    assert stats["output_tokens_mean"]["median"] == 5 and stats["prompt_tokens_mean"]["min"] == 158
    # 20 output tokens per run, 1 CPU second: 50 ms of server CPU per token
    assert stats["server_cpu_ms_per_token"]["median"] == pytest.approx(50.0)
    assert peer_report.spread([None, None]) is None


def median_tps(stats: dict) -> float:
    return stats["output_throughput_tps"]["median"]


def test_comparison_takes_llama_at_its_best_per_level():
    stats = {
        "ours": {
            1: peer_report.aggregate([_run(30, 0.05)]),
            8: peer_report.aggregate([_run(60, 0.05)]),
        },
        "llama t1": {
            1: peer_report.aggregate([_run(40, 0.2)]),
            8: peer_report.aggregate([_run(20, 0.2)]),
        },
        "llama t2": {
            1: peer_report.aggregate([_run(20, 0.4)]),
            8: peer_report.aggregate([_run(50, 0.1)]),
        },
    }
    rows = peer_report.comparison_rows(stats, "ours", ["llama t1", "llama t2"], [1, 8])
    assert [r["peer"] for r in rows] == ["llama t1", "llama t2"]
    out = rows[1]["figures"]["output_throughput_tps"]
    assert out["ratio"] == pytest.approx(out["ours"] / out["theirs"])
    assert out["ours"] > out["theirs"] > median_tps(stats["llama t1"][8])
    ttft = rows[0]["figures"]["ttft_ms_p50"]
    assert ttft["ours"] == pytest.approx(50) and ttft["theirs"] == pytest.approx(200)
    assert ttft["ratio"] == pytest.approx(0.25) and not ttft["higher_is_better"]
    table = peer_report.markdown_comparison(rows, "ours")
    assert "| 1 |" in table and "50 / 200 = 0.25x" in table and "llama t2 |" in table
    everything = peer_report.markdown_all(stats, [1, 8])
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


def test_weight_bytes_count_a_tied_lm_head_once_and_quantized_layers_as_stored(tiny_model_dir):
    import torch

    from engine_worker.model import LlamaFamilyModel
    from engine_worker.weight_format import WeightFormat
    from scripts.bench.peer_engine import weight_bytes_per_token

    cpu, bf16 = torch.device("cpu"), torch.bfloat16
    model = LlamaFamilyModel.load(tiny_model_dir, cpu, bf16, 64, WeightFormat("bf16", bf16, cpu))
    assert model.lm_head.weight is model.embed
    expected = sum(
        t.numel() * 2
        for layer in model.layers
        for t in (
            layer.input_norm,
            layer.qkv.weight,
            layer.o_proj.weight,
            layer.post_attention_norm,
            layer.gate_up.weight,
            layer.down.weight,
        )
    ) + 2 * (model.norm.numel() + model.embed.numel())
    assert weight_bytes_per_token(model) == expected
    # int8 layers read one byte a weight (plus scales), though each keeps a dense copy too
    int8 = LlamaFamilyModel.load(tiny_model_dir, cpu, bf16, 64, WeightFormat("int8", bf16, cpu))
    assert expected / 2 < weight_bytes_per_token(int8) < expected * 0.6


def test_client_against_a_real_splitserve_server(tiny_model_dir):
    from scripts.bench.peer_client import run_chats
    from scripts.bench.peer_servers import SplitserveServer
    from scripts.bench.peer_workload import PromptCounter, build_chats

    chats = build_chats(PromptCounter(tiny_model_dir), 6, 60)
    server = SplitserveServer(f"--model {tiny_model_dir} --kv-cache-tokens 4096")
    try:
        records = run_chats(server.url, chats, 3, 7, tag="t")
        cpu = server.cpu_seconds()
    finally:
        server.close()
    assert server.popen.returncode == 0
    assert not Path(server.log.name).exists()  # a clean stop leaves no log behind
    assert "splitserve launch --http-port 0 --model" in server.describe()
    assert cpu > 0
    for rec in records:
        assert rec.ok, rec.error
        assert rec.output_tokens == 7 and rec.prompt_tokens == 60  # ignore_eos; usage
        assert rec.finish_reason == "length" and 1 <= len(rec.delta_times) <= 7
        assert rec.t_submit < rec.delta_times[0] <= rec.t_done
    summary = summarize(records, {"server": cpu})
    assert summary["errors"] == 0 and summary["output_tokens_total"] == 42


def test_best_statistic_takes_each_figures_best_repeat():
    stats = {
        "ours": {1: peer_report.aggregate([_run(10, 0.1), _run(40, 0.3)])},
        "peer": {1: peer_report.aggregate([_run(20, 0.2)])},
    }
    (row,) = peer_report.comparison_rows(stats, "ours", ["peer"], [1], "best")
    assert row["figures"]["ttft_ms_p50"]["ours"] == pytest.approx(100)  # the lowest
    assert row["figures"]["itl_ms_p50"]["ours"] == pytest.approx(25)
    assert "best repeat" in peer_report.markdown_comparison([row], "ours")
    with pytest.raises(ValueError, match="statistic"):
        peer_report.comparison_rows(stats, "ours", ["peer"], [1], "mean")


def test_saved_json_renders_again_with_either_statistic(tmp_path):
    import json

    stats = {
        "splitserve defaults": {1: peer_report.aggregate([_run(30, 0.05), _run(10, 0.05)])},
        "llama.cpp t2": {1: peer_report.aggregate([_run(20, 0.2)])},
    }
    setup = {
        "gguf": "m.gguf",
        "host": "h",
        "workload": "w",
        "client": "c",
        "servers": {"splitserve defaults": "splitserve launch", "llama.cpp t2": "llama"},
        "idle_cpu_percent": {},
        "peers": ["llama.cpp t2"],
        "ours": ["splitserve defaults"],
    }
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"setup": setup, "runs": [], "stats": stats}))
    median = bench_peer.render_saved(str(path), "median")
    best = bench_peer.render_saved(str(path), "best")
    fig = "output_throughput_tps"
    assert (
        best["comparisons"]["splitserve defaults"][0]["figures"][fig]["ours"]
        > median["comparisons"]["splitserve defaults"][0]["figures"][fig]["ours"]
    )
    assert "best repeat" in best["text"] and "(medians;" in median["text"]


def test_a_server_that_cannot_start_is_reported_with_its_log(tmp_path):
    from scripts.bench.peer_servers import SplitserveServer

    with pytest.raises(RuntimeError, match="exited with status") as failure:
        SplitserveServer(f"--model {tmp_path}")  # no config.json: the CLI refuses it
    log = str(failure.value).split("its log (", 1)[1].split(")", 1)[0]
    assert Path(log).is_file()
    Path(log).unlink()
