"""The serving benchmark end to end on the tiny model: real engine, real cluster processes.

No timing assertions (the machine is shared); only that every metric is there, non-negative
and consistent, and that the JSON file round-trips."""

from __future__ import annotations

import json

import pytest

from scripts.bench import serving
from scripts.bench.stats import PERCENTILES, RequestRecord, summarize

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
    json_path = tmp_path / "bench.json"
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
            "--json",
            str(json_path),
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
        "CPU time: ",
        "cluster-tw1 vs inproc: submit wall",
    ):
        assert line in text, line

    stored = json.loads(json_path.read_text())
    runs = stored["runs"]
    assert [(r["mode"], r["warmup"]) for r in runs] == [
        (m, w) for w in (True, False) for m in MODES
    ]
    for run in runs:
        records = [RequestRecord(**r) for r in run["records"]]
        assert len(records) == (3 if run["warmup"] else n) and run["timed_out"] == 0
        for rec in records:
            _check_record(rec, run["mode"], max_new)
        again = summarize(records, run["cpu_seconds"])
        assert again == run["summary"]  # the file holds everything the summary needs
    for mode in MODES:
        _check_summary(stored["medians"][mode], mode, n)
    assert stored["medians"] == data["medians"]


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
        "--request-rate",
        "--max-concurrency",
        "--prompt-tokens",
        "--shared-prefix-tokens",
        "--tokenizer-workers",
        "--engine-threads",
        "--warmup-runs",
        "--repeats",
        "--json",
        "--request-timeout-s",
        "--kv-cache-tokens",
    ):
        assert flag in text, flag


def test_stream_interval_and_the_concurrency_cap_apply_to_every_mode(tiny_model_dir, capsys):
    """The in-process baseline runs the cluster's DetokenizerCore: the same options, the same
    deltas; --max-concurrency holds every mode to that many requests in flight."""
    cap = 2
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
            "--stream-interval-tokens",
            "3",
            "--max-concurrency",
            str(cap),
        ]
    )
    for run in data["runs"]:  # tokens 1 | 2 3 4 | 5 6 7 (with the terminal event)
        records = [RequestRecord(**r) for r in run["records"]]
        assert [len(r.delta_times) for r in records] == [3] * 4, run["mode"]
        for rec in records:  # never more than `cap` in flight when a request was submitted
            in_flight = sum(
                1 for o in records if o is not rec and o.t_submit <= rec.t_submit < o.t_done
            )
            assert in_flight < cap
    assert "Stream interval (tokens): 3" in capsys.readouterr().out
