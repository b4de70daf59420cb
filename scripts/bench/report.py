"""The benchmark's outputs: the text report (in the seeds' format), the JSON file, the plot."""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

from scripts.bench.runner import RunResult
from scripts.bench.stats import TTFT_PARTS, RequestRecord, ratio
from scripts.bench.targets import SERVING_TARGETS, targets_apply

# (label, metric key prefix, unit) for the "p50/p95/p99" lines, in the seeds' order.
PERCENTILE_LINES = (
    ("Submit latency", "submit_latency_ms", "ms"),
    ("Submit lag", "submit_lag_ms", "ms"),
    ("Tokenize", "tokenize_ms", "ms"),
    ("Queue wait (post-tok)", "queue_wait_ms", "ms"),
    ("Prefill->first token", "prefill_to_first_token_ms", "ms"),
    ("TTFT", "ttft_ms", "ms"),
    ("TPOT", "tpot_ms", "ms/token"),
    ("ITL", "itl_ms", "ms"),
    ("Latency (end-to-end)", "e2el_ms", "ms"),
)

# What the comparison table and the ratio lines show: (label, key).
COMPARED = (
    ("submit wall (s)", "submit_wall_s"),
    ("submit latency p50 (ms)", "submit_latency_ms_p50"),
    ("submit latency p99 (ms)", "submit_latency_ms_p99"),
    ("tokenize p50 (ms)", "tokenize_ms_p50"),
    ("queue wait p50 (ms)", "queue_wait_ms_p50"),
    ("prefill->first token p50 (ms)", "prefill_to_first_token_ms_p50"),
    ("TTFT p50 (ms)", "ttft_ms_p50"),
    ("TTFT p99 (ms)", "ttft_ms_p99"),
    ("TTFT from arrival p50 (ms)", "ttft_from_arrival_ms_p50"),
    ("TPOT p50 (ms/token)", "tpot_ms_p50"),
    ("latency p50 (ms)", "e2el_ms_p50"),
    ("request throughput (req/s)", "request_throughput_rps"),
    ("output throughput (tok/s)", "output_throughput_tps"),
)

RATIO_KEYS = (
    ("submit wall", "submit_wall_s"),
    ("submit p99", "submit_latency_ms_p99"),
    ("TTFT p50", "ttft_ms_p50"),
    ("TTFT p99", "ttft_ms_p99"),
    ("throughput", "request_throughput_rps"),
)


def _num(value: float | None, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _pct_line(label: str, summary: dict, key: str, unit: str) -> str:
    values = "/".join(_num(summary.get(f"{key}_p{p}")) for p in (50, 95, 99))
    return f"{label} p50/p95/p99: {values} {unit}"


def header_lines(setup: dict) -> list[str]:
    """The knobs, one per line, so a pasted report explains itself."""
    lines = ["=== splitserve serving benchmark ==="]
    for key, value in setup.items():
        if isinstance(value, dict):
            lines.append(f"{key}:")
            lines += [f"  {k}: {v}" for k, v in value.items()]
        else:
            lines.append(f"{key}: {value}")
    return lines


def mode_block(mode: str, summary: dict, runs: int, arrival_kind: str) -> list[str]:
    s = summary
    lines = [
        f"=== {mode} (median of {runs} measured run{'s' if runs != 1 else ''}) ===",
        f"Requests: {int(s['requests'])} (errors {int(s['errors'])})",
        f"Prompt tokens (total): {int(s['prompt_tokens_total'])} "
        f"(from prefix cache {int(s['cached_tokens_total'])})",
        f"Completion tokens (total): {int(s['output_tokens_total'])}",
        f"Submit wall: {_num(s['submit_wall_s'], 6)} s",
    ]
    for label, key, unit in PERCENTILE_LINES:
        if key == "submit_lag_ms" and arrival_kind == "burst":
            continue  # every request is due at t0: the lag is just the submit wall again
        lines.append(_pct_line(label, s, key, unit))
    if s.get(f"ttft_part[{TTFT_PARTS[0][0]}]_ms_mean") is None:
        lines.append(
            "TTFT parts: not visible to this client (the OpenAI API carries no server timestamps)"
        )
    else:
        parts = " + ".join(
            f"{name} {_num(s.get(f'ttft_part[{name}]_ms_mean'))}" for name, _, _ in TTFT_PARTS
        )
        lines.append(f"TTFT parts (mean, ms): {parts} = {_num(s.get('ttft_ms_mean'))}")
    lines += [
        f"Duration: {_num(s['duration_s'], 3)} s",
        f"Request throughput: {_num(s['request_throughput_rps'])} req/s",
        f"Throughput (completion,total): {_num(s['output_throughput_tps'])}/"
        f"{_num(s['total_throughput_tps'])} tokens/s",
    ]
    if s.get("goodput_rps") is not None:
        lines.append(
            f"Goodput: {_num(s['goodput_rps'])} req/s "
            f"({100 * s['goodput_fraction']:.1f}% of requests meet every SLO)"
        )
    cpu = {k[len("cpu_s[") : -1]: v for k, v in s.items() if k.startswith("cpu_s[")}
    if cpu:
        lines.append(
            "CPU time: "
            + ", ".join(f"{role} {_num(v)} s" for role, v in cpu.items())
            + f" (total {_num(sum(v for v in cpu.values() if v is not None))} s)"
        )
    return lines


def comparison_lines(
    medians: dict[str, dict], baseline: str | None, arrival_kind: str = "burst"
) -> list[str]:
    modes = list(medians)
    width = max(len(label) for label, _ in COMPARED) + 2
    col = max(12, *(len(m) + 2 for m in modes))
    lines = [
        "=== comparison (medians over measured runs) ===",
        "metric".ljust(width) + "".join(m.rjust(col) for m in modes),
    ]
    for label, key in COMPARED:
        lines.append(
            label.ljust(width) + "".join(_num(medians[m].get(key), 3).rjust(col) for m in modes)
        )
    if baseline is None or baseline not in medians:
        return lines
    base = medians[baseline]
    for mode in modes:
        if mode == baseline:
            continue
        ratios = ", ".join(
            f"{label} {_ratio(medians[mode].get(key), base.get(key))}" for label, key in RATIO_KEYS
        )
        lines.append(f"{mode} vs {baseline}: {ratios}")
    for mode in modes:
        if not targets_apply(mode, baseline, arrival_kind):
            continue
        checks = []
        for target in SERVING_TARGETS:
            value, base_value = medians[mode].get(target.metric), base.get(target.metric)
            checks.append(
                f"{target.label} ({_ratio(value, base_value)}): "
                f"{target.verdict(ratio(value, base_value))}"
            )
        lines.append(f"targets {mode} vs {baseline}: " + "; ".join(checks))
    return lines


def _ratio(a: float | None, b: float | None) -> str:
    r = ratio(a, b)
    return "n/a" if r is None else f"{r:.2f}x"


def error_lines(runs: list[RunResult], mode: str) -> list[str]:
    """Failed requests, loudly: the latency metrics above cover only the successful ones."""
    errors = Counter(
        rec.error or rec.finish_reason
        for r in runs
        if r.mode == mode
        for rec in r.records
        if not rec.ok
    )
    if not errors:
        return []
    total = sum(len(r.records) for r in runs if r.mode == mode)
    lines = [
        f"WARNING: {sum(errors.values())} of {total} requests of {mode} failed (all runs, "
        "warmups included); the latency metrics cover only the others:"
    ]
    lines += [f"  {count} x {message}" for message, count in errors.most_common(3)]
    return lines


def render(
    setup: dict,
    runs: list[RunResult],
    medians: dict[str, dict],
    measured_runs: dict[str, int],
    arrival_kind: str,
    baseline: str | None,
) -> str:
    lines = header_lines(setup)
    for mode, summary in medians.items():
        lines.append("")
        lines += mode_block(mode, summary, measured_runs[mode], arrival_kind)
        lines += error_lines(runs, mode)
    lines.append("")
    lines += comparison_lines(medians, baseline, arrival_kind)
    return "\n".join(lines)


# --- JSON ---------------------------------------------------------------------------------------
def to_json(
    setup: dict, runs: list[RunResult], summaries: list[dict], medians: dict[str, dict]
) -> dict:
    return {
        "setup": setup,
        "runs": [
            {
                "mode": r.mode,
                "run_index": r.run_index,
                "warmup": r.warmup,
                "timed_out": r.timed_out,
                "cpu_seconds": r.cpu_seconds,
                "summary": s,
                "request_rate": r.request_rate if math.isfinite(r.request_rate) else None,
                "records": [rec.to_json() for rec in r.records],
            }
            for r, s in zip(runs, summaries)
        ],
        "medians": medians,
    }


def write_json(path: str | Path, data: dict) -> None:
    Path(path).write_text(json.dumps(data, indent=1, allow_nan=False))


def load_runs(data: dict) -> list[RunResult]:
    """The RunResults of a written JSON file (to re-summarize or re-plot a past benchmark)."""
    return [
        RunResult(
            mode=r["mode"],
            run_index=r["run_index"],
            warmup=r["warmup"],
            records=[RequestRecord.from_json(x) for x in r["records"]],
            cpu_seconds=r["cpu_seconds"],
            timed_out=r["timed_out"],
            request_rate=r.get("request_rate") or math.inf,
        )
        for r in data["runs"]
    ]


# --- plot ---------------------------------------------------------------------------------------
def plot(path: str | Path, runs: list[RunResult], medians: dict[str, dict]) -> None:
    """Left: TTFT CDF per mode (all measured runs pooled). Right: mean TTFT split into its
    parts, stacked, per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    modes = list(medians)
    fig, (ax_cdf, ax_bar) = plt.subplots(1, 2, figsize=(13, 5))
    for mode in modes:
        ttft = np.sort(
            [
                rec.ttft * 1e3
                for r in runs
                if r.mode == mode and not r.warmup
                for rec in r.records
                if rec.ok
            ]
        )
        if ttft.size:
            ax_cdf.plot(ttft, np.arange(1, ttft.size + 1) / ttft.size, label=mode)
    ax_cdf.set_xlabel("TTFT (ms)")
    ax_cdf.set_ylabel("fraction of requests")
    ax_cdf.set_title("TTFT CDF")
    ax_cdf.grid(alpha=0.3)
    ax_cdf.legend()
    bottom = np.zeros(len(modes))
    for name, _, _ in TTFT_PARTS:
        values = np.array([medians[m].get(f"ttft_part[{name}]_ms_mean") or 0.0 for m in modes])
        ax_bar.bar(modes, values, bottom=bottom, label=name)
        bottom += values
    ax_bar.set_ylabel("mean TTFT (ms)")
    ax_bar.set_title("where TTFT goes (means, median over runs)")
    ax_bar.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
