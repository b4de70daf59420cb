"""The serving benchmark end to end on the tiny model: real engine, real cluster processes.

No timing assertions (the machine is shared); only that every metric is there, non-negative
and consistent, and that the JSON file round-trips."""

from __future__ import annotations

import json

import pytest

from scripts.bench import report, serving
from scripts.bench.stats import PERCENTILES, summarize

MODES = ["inproc", "inproc-pretok", "cluster-tw1"]
PERCENTILE_KEYS = (
    "submit_latency_ms",
    "tokenize_ms",
    "queue_wait_ms",
    "prefill_to_first_token_ms",
    "ttft_ms",
    "tpot_ms",
    "itl_ms",
    "e2el_ms",
)
SCALAR_KEYS = (
    "submit_wall_s",
    "duration_s",
    "request_throughput_rps",
    "output_throughput_tps",
    "total_throughput_tps",
    "goodput_rps",
    "goodput_fraction",
)
CPU_ROLES = {
    "inproc": {"client", "engine"},
    "inproc-pretok": {"client", "engine"},
    "cluster-tw1": {"client", "tokenizer", "engine", "detokenizer"},
}
TOLERANCE_S = 1e-6


def _check_record(rec, mode: str, max_new_tokens: int) -> None:
    assert rec.ok, (mode, rec.error)
    assert rec.output_tokens == max_new_tokens  # --ignore-eos
    assert 1 <= len(rec.delta_times) <= max_new_tokens
    # The stamps follow the request through the system, on one clock.
    chain = [
        rec.t_submit,
        rec.t_tokenize_start,
        rec.t_tokenized,
        rec.t_arrived,
        rec.t_scheduled,
        rec.t_first_token,
        rec.t_first_delta,
        rec.t_done,
    ]
    assert all(b >= a - TOLERANCE_S for a, b in zip(chain, chain[1:])), (mode, chain)
    assert rec.t_submit_done >= rec.t_submit
    prefill = rec.t_first_token - rec.t_scheduled
    queue_wait = rec.t_scheduled - rec.t_tokenized
    assert rec.ttft >= prefill
    parts = rec.ttft_parts()
    assert parts["tokenized->scheduled"] == pytest.approx(queue_wait)
    assert sum(parts.values()) == pytest.approx(rec.ttft, abs=TOLERANCE_S)
    assert rec.tpot is not None and rec.tpot >= 0
    if mode == "inproc-pretok":
        # tokenized before the timed region: no time inside submit() goes to it
        assert rec.t_tokenized == rec.t_tokenize_start <= rec.t_submit_done


def _check_summary(summary: dict, mode: str, requests: int) -> None:
    assert summary["requests"] == requests and summary["errors"] == 0
    for key in PERCENTILE_KEYS:
        for p in PERCENTILES:
            value = summary[f"{key}_p{p}"]
            assert value is not None and value >= 0, (mode, key, p, value)
    for key in SCALAR_KEYS:
        assert summary[key] is not None and summary[key] >= 0, (mode, key)
    roles = {k[len("cpu_s[") : -1] for k in summary if k.startswith("cpu_s[")}
    assert roles == CPU_ROLES[mode]
    assert all(summary[f"cpu_s[{r}]"] >= 0 for r in roles)
    assert (
        summary["ttft_ms_p50"] >= summary["prefill_to_first_token_ms_p50"] - 1e-3
        or summary["ttft_ms_p99"] >= summary["prefill_to_first_token_ms_p99"]
    )


def test_every_mode_reports_consistent_metrics_and_the_json_round_trips(
    tiny_model_dir, tmp_path, capsys
):
    json_path, plot_path = tmp_path / "bench.json", tmp_path / "bench.png"
    n, max_new = 6, 4
    data = serving.main(
        [
            "--model",
            str(tiny_model_dir),
            "--modes",
            "inproc,inproc-pretok,cluster",
            "--num-requests",
            str(n),
            "--prompt-tokens",
            "48",
            "--unique-prompts",
            "--max-new-tokens",
            str(max_new),
            "--ignore-eos",
            "--warmup-runs",
            "1",
            "--warmup-num-requests",
            "3",
            "--repeats",
            "1",
            "--goodput",
            "ttft:60000",
            "tpot:60000",
            "--no-progress",
            "--json",
            str(json_path),
            "--plot",
            str(plot_path),
        ]
    )
    text = capsys.readouterr().out
    for line in (
        "Model: ",
        "Submit wall: ",
        "Submit latency p50/p95/p99",
        "Tokenize p50/p95/p99",
        "Queue wait (post-tok)",
        "Prefill->first token",
        "TTFT p50/p95/p99",
        "TPOT p50/p95/p99",
        "ITL p50/p95/p99",
        "TTFT parts (mean, ms)",
        "Goodput: ",
        "CPU time: ",
        "cluster-tw1 vs inproc: submit wall",
        "targets cluster-tw1 vs inproc",
    ):
        assert line in text, line

    runs = report.load_runs(json.loads(json_path.read_text()))
    assert [(r.mode, r.warmup) for r in runs] == [(m, w) for w in (True, False) for m in MODES]
    stored = json.loads(json_path.read_text())
    for run, run_json in zip(runs, stored["runs"]):
        assert len(run.records) == (3 if run.warmup else n) and run.timed_out == 0
        for rec in run.records:
            _check_record(rec, run.mode, max_new)
        again = summarize(run.records, run.cpu_seconds, {"ttft": 60000.0, "tpot": 60000.0})
        assert again == run_json["summary"]  # the file holds everything the summary needs
    for mode in MODES:
        _check_summary(stored["medians"][mode], mode, n)
        assert stored["medians"][mode]["goodput_fraction"] == 1.0
    assert stored["medians"] == data["medians"]
    assert plot_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_chat_file_paced_submits_and_the_concurrency_cap(tiny_model_dir, tmp_path, capsys):
    path = tmp_path / "chats.jsonl"
    path.write_text(
        "\n".join(
            json.dumps(row)
            for row in [
                {
                    "messages": [
                        {"role": "system", "content": "Be brief."},
                        {"role": "user", "content": "What is the capital of France?"},
                    ]
                },
                {"prompt": "Once upon a time", "max_tokens": 3},
            ]
        )
    )
    cap = 2
    data = serving.main(
        [
            "--model",
            str(tiny_model_dir),
            "--modes",
            "inproc,cluster",
            "--dataset-jsonl",
            str(path),
            "--num-requests",
            "6",
            "--max-new-tokens",
            "2",
            "--ignore-eos",
            "--submit-interval-ms",
            "2",
            "--submit-schedule",
            "relative",
            "--max-concurrency",
            str(cap),
            "--warmup-runs",
            "0",
            "--no-progress",
        ]
    )
    assert "fixed interval 2 ms, relative schedule" in capsys.readouterr().out
    for run in report.load_runs(data):
        records = run.records
        assert [r.output_tokens for r in records] == [2, 3, 2, 3, 2, 3]
        assert all(r.ok for r in records)
        # chats are rendered with the template: far longer than their text
        assert records[0].prompt_tokens > 15
        for rec in records:  # never more than `cap` in flight when a request was submitted
            in_flight = sum(
                1 for o in records if o is not rec and o.t_submit <= rec.t_submit < o.t_done
            )
            assert in_flight < cap
        gaps = [b.t_submit - a.t_submit for a, b in zip(records, records[1:])]
        assert all(g >= 0.002 for g in gaps)


def test_modes_are_validated():
    assert serving.expand_modes("inproc,cluster", [1, 2]) == [
        "inproc",
        "cluster-tw1",
        "cluster-tw2",
    ]
    with pytest.raises(ValueError, match="unknown mode"):
        serving.expand_modes("inproc,magic", [1])
    with pytest.raises(ValueError, match="once"):
        serving.expand_modes("inproc,inproc", [1])


def test_help_names_every_knob_with_its_unit():
    text = serving.build_parser().format_help()
    for flag in (
        "--submit-interval-ms",
        "--request-rate",
        "--burstiness",
        "--max-concurrency",
        "--prompt-tokens",
        "--shared-prefix-tokens",
        "--dataset-jsonl",
        "--goodput",
        "--tokenizer-workers",
        "--engine-threads",
        "--warmup-runs",
        "--repeats",
        "--json",
        "--plot",
        "--request-timeout-s",
        "--kv-cache-tokens",
    ):
        assert flag in text, flag


def test_http_mode_matches_the_sdk_and_drives_an_endpoint(tiny_model_dir, capsys):
    """Mode http: the same workload through the cluster's own OpenAI frontend, then through
    --endpoint (a frontend some other process launched). Counts agree with the SDK's; TTFT is
    measured, its server-side parts are reported as not visible."""
    from procs.launch_cluster import launch_cluster

    common = [
        "--model",
        str(tiny_model_dir),
        "--num-requests",
        "5",
        "--max-new-tokens",
        "4",
        "--ignore-eos",
        "--prompt-tokens",
        "40",
        "--unique-prompts",
        "--warmup-runs",
        "0",
        "--no-progress",
    ]
    data = serving.main(common + ["--modes", "cluster,http"])
    medians = data["medians"]
    for key in ("requests", "prompt_tokens_total", "output_tokens_total"):
        assert medians["http"][key] == medians["cluster-tw1"][key], key
    assert medians["http"]["errors"] == 0 and medians["http"]["ttft_ms_p50"] > 0
    assert medians["http"]["tokenize_ms_p50"] is None
    assert {k for k in medians["http"] if k.startswith("cpu_s[")} == {
        "cpu_s[client]",
        "cpu_s[http]",
        "cpu_s[tokenizer]",
        "cpu_s[engine]",
        "cpu_s[detokenizer]",
    }
    assert "not visible to this client" in capsys.readouterr().out

    with launch_cluster(str(tiny_model_dir), http_port=0, kv_cache_tokens=4096) as cluster:
        data = serving.main(common + ["--modes", "http", "--endpoint", f"{cluster.http_url}/v1"])
    (run,) = report.load_runs(data)
    assert all(r.ok and r.output_tokens == 4 and r.delta_times for r in run.records)
    assert data["medians"]["http"]["prompt_tokens_total"] == medians["http"]["prompt_tokens_total"]


def test_stream_interval_and_stop_strings_apply_to_every_mode(tiny_model_dir, capsys):
    """The in-process baseline runs the cluster's DetokenizerCore: the same options, the same
    deltas. Greedy on one model, so each mode stops at the same place."""
    data = serving.main(
        [
            "--model",
            str(tiny_model_dir),
            "--modes",
            "inproc,inproc-pretok,cluster",
            "--num-requests",
            "4",
            "--prompt-tokens",
            "24",
            "--unique-prompts",
            "--max-new-tokens",
            "7",
            "--ignore-eos",
            "--warmup-runs",
            "0",
            "--no-progress",
            "--stream-interval-tokens",
            "3",
        ]
    )
    for run in report.load_runs(data):  # tokens 1 | 2 3 4 | 5 6 7 (with the terminal event)
        assert [len(r.delta_times) for r in run.records] == [3] * 4, run.mode
    assert "Stream interval (tokens): 3" in capsys.readouterr().out
    data = serving.main(
        [
            "--model",
            str(tiny_model_dir),
            "--modes",
            "inproc,cluster",
            "--num-requests",
            "4",
            "--prompt-tokens",
            "24",
            "--unique-prompts",
            "--max-new-tokens",
            "16",
            "--ignore-eos",
            "--warmup-runs",
            "0",
            "--no-progress",
            "--max-concurrency",
            "1",
            "--stop",
            " ",
        ]
    )
    outcomes = {
        run.mode: [(r.finish_reason, r.output_tokens) for r in run.records]
        for run in report.load_runs(data)
    }
    assert outcomes["inproc"] == outcomes["cluster-tw1"]
    assert all(
        reason == "stop" and n < 16 or (reason, n) == ("length", 16)
        for reason, n in outcomes["inproc"]
    )
    assert any(reason == "stop" for reason, _ in outcomes["inproc"])  # random text has spaces
