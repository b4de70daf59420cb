"""The benchmarks' one report writer: the serving report (text in the seeds' format, and the JSON
file), and the peer comparison (each figure's median and spread over repeats, llama.cpp at its
best thread count per concurrency, ratios splitserve / llama.cpp, as markdown)."""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import asdict
from pathlib import Path

from scripts.bench.runner import RunResult
from scripts.bench.stats import TTFT_PARTS, num, ratio, spread

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

# What the comparison table shows: (label, key, its label in the ratio lines or None).
COMPARED = (
    ("submit wall (s)", "submit_wall_s", "submit wall"),
    ("submit latency p50 (ms)", "submit_latency_ms_p50", None),
    ("submit latency p99 (ms)", "submit_latency_ms_p99", "submit p99"),
    ("tokenize p50 (ms)", "tokenize_ms_p50", None),
    ("queue wait p50 (ms)", "queue_wait_ms_p50", None),
    ("prefill->first token p50 (ms)", "prefill_to_first_token_ms_p50", None),
    ("TTFT p50 (ms)", "ttft_ms_p50", "TTFT p50"),
    ("TTFT p99 (ms)", "ttft_ms_p99", "TTFT p99"),
    ("TTFT from arrival p50 (ms)", "ttft_from_arrival_ms_p50", None),
    ("TPOT p50 (ms/token)", "tpot_ms_p50", None),
    ("latency p50 (ms)", "e2el_ms_p50", None),
    ("request throughput (req/s)", "request_throughput_rps", "throughput"),
    ("output throughput (tok/s)", "output_throughput_tps", None),
)


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
        f"Submit wall: {num(s['submit_wall_s'], 6)} s",
    ]
    for label, key, unit in PERCENTILE_LINES:
        if key == "submit_lag_ms" and arrival_kind == "burst":
            continue  # every request is due at t0: the lag is just the submit wall again
        values = "/".join(num(s.get(f"{key}_p{p}")) for p in (50, 95, 99))
        lines.append(f"{label} p50/p95/p99: {values} {unit}")
    parts = " + ".join(
        f"{name} {num(s.get(f'ttft_part[{name}]_ms_mean'))}" for name, _, _ in TTFT_PARTS
    )
    lines.append(f"TTFT parts (mean, ms): {parts} = {num(s.get('ttft_ms_mean'))}")
    lines += [
        f"Duration: {num(s['duration_s'], 3)} s",
        f"Request throughput: {num(s['request_throughput_rps'])} req/s",
        f"Throughput (completion,total): {num(s['output_throughput_tps'])}/"
        f"{num(s['total_throughput_tps'])} tokens/s",
    ]
    cpu = {k[len("cpu_s[") : -1]: v for k, v in s.items() if k.startswith("cpu_s[")}
    if cpu:
        lines.append(
            "CPU time: "
            + ", ".join(f"{role} {num(v)} s" for role, v in cpu.items())
            + f" (total {num(sum(v for v in cpu.values() if v is not None))} s)"
        )
    return lines


def comparison_lines(medians: dict[str, dict], baseline: str | None) -> list[str]:
    modes = list(medians)
    width = max(len(label) for label, _, _ in COMPARED) + 2
    col = max(12, *(len(m) + 2 for m in modes))
    lines = [
        "=== comparison (medians over measured runs) ===",
        "metric".ljust(width) + "".join(m.rjust(col) for m in modes),
    ]
    for label, key, _ in COMPARED:
        lines.append(
            label.ljust(width) + "".join(num(medians[m].get(key), 3).rjust(col) for m in modes)
        )
    base = medians.get(baseline or "")
    for mode in [m for m in modes if base is not None and m != baseline]:
        ratios = ", ".join(
            f"{shown} {_ratio(medians[mode].get(key), base.get(key))}"
            for _, key, shown in COMPARED
            if shown
        )
        lines.append(f"{mode} vs {baseline}: {ratios}")
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
    repeats: int,
    arrival_kind: str,
    baseline: str | None,
) -> str:
    lines = header_lines(setup)
    for mode, summary in medians.items():
        lines.append("")
        lines += mode_block(mode, summary, repeats, arrival_kind)
        lines += error_lines(runs, mode)
    lines.append("")
    lines += comparison_lines(medians, baseline)
    return "\n".join(lines)


# --- JSON ---------------------------------------------------------------------------------------
def to_json(
    setup: dict, runs: list[RunResult], summaries: list[dict], medians: dict[str, dict]
) -> dict:
    return {
        "setup": setup,
        "runs": [  # every field of the run (its records too), its summary; a burst's rate null
            asdict(r)
            | {
                "summary": s,
                "request_rate": r.request_rate if math.isfinite(r.request_rate) else None,
            }
            for r, s in zip(runs, summaries)
        ],
        "medians": medians,
    }


def write_json(path: str | Path, data: dict) -> None:
    Path(path).write_text(json.dumps(data, indent=1, allow_nan=False))


# --- the peer comparison ------------------------------------------------------------------------
# (label, summary key, higher is better, decimals): the figures compared per concurrency.
FIGURES = (
    ("output tok/s", "output_throughput_tps", True, 1),
    ("TTFT p50 (ms)", "ttft_ms_p50", False, 0),
    ("TTFT p99 (ms)", "ttft_ms_p99", False, 0),
    ("ITL p50 (ms)", "itl_ms_p50", False, 1),
    ("ITL p99 (ms)", "itl_ms_p99", False, 1),
    ("req/s", "request_throughput_rps", True, 2),
)
HEADLINE = "output_throughput_tps"  # what "llama.cpp at its best" maximizes


def aggregate(summaries: list[dict]) -> dict[str, dict[str, float] | None]:
    """Per figure of stats.summarize (plus what this module derives), its spread."""
    derived = [dict(s, **per_request(s)) for s in summaries]
    keys = list(dict.fromkeys(k for s in derived for k in s))
    return {k: spread([s.get(k) for s in derived]) for k in keys}


def per_request(summary: dict) -> dict[str, float | None]:
    """Averages per successful request, and the server's CPU seconds per output token."""
    ok = summary["requests"] - summary["errors"]
    out_tokens = summary["output_tokens_total"]
    return {
        "prompt_tokens_mean": summary["prompt_tokens_total"] / ok if ok else None,
        "output_tokens_mean": out_tokens / ok if ok else None,
        "cached_tokens_mean": summary["cached_tokens_total"] / ok if ok else None,
        "server_cpu_ms_per_token": (
            1e3 * summary["cpu_s[server]"] / out_tokens
            if out_tokens and "cpu_s[server]" in summary
            else None
        ),
    }


def median(stats: dict, key: str) -> float | None:
    entry = stats.get(key)
    return None if entry is None else entry["median"]


def best_of(stats_by_target: dict[str, dict], targets: list[str]) -> str | None:
    """The target with the highest median headline figure (llama.cpp at its best)."""
    scored = [(median(stats_by_target[t], HEADLINE), t) for t in targets if t in stats_by_target]
    scored = [(v, t) for v, t in scored if v is not None]
    return max(scored)[1] if scored else None


def comparison_rows(
    stats: dict[str, dict[int, dict]], ours: str, peers: list[str], levels: list[int]
) -> list[dict]:
    """One row per concurrency: each figure's median ours, theirs (the best peer at that
    concurrency) and the ratio ours / theirs."""
    rows = []
    for level in levels:
        at_level = {t: stats[t][level] for t in [ours, *peers] if level in stats.get(t, {})}
        peer = best_of(at_level, peers)
        row: dict = {"concurrency": level, "peer": peer, "figures": {}}
        for _label, key, higher, _ in FIGURES:
            a = median(at_level.get(ours, {}), key)
            b = median(at_level[peer], key) if peer else None
            row["figures"][key] = dict(ours=a, theirs=b, ratio=ratio(a, b), higher_is_better=higher)
        rows.append(row)
    return rows


def markdown_table(head: list[str], rows: list[list[str]]) -> str:
    return "\n".join(
        "| " + " | ".join(cells) + " |" for cells in [head, ["---"] * len(head), *rows]
    )


def markdown_comparison(rows: list[dict], ours: str) -> str:
    head = ["streams", *[label for label, *_ in FIGURES], "llama.cpp at its best"]
    cells = []
    for row in rows:
        shown = [str(row["concurrency"])]
        for _, key, _, d in FIGURES:
            a, b = row["figures"][key]["ours"], row["figures"][key]["theirs"]
            shown.append(f"{num(a, d)} / {num(b, d)} = {_ratio(a, b)}")
        cells.append(shown + [row["peer"] or "n/a"])
    intro = f"**{ours}** / llama.cpp (medians; each cell ours / theirs = ratio; TTFT and ITL: "
    return intro + "lower is better)\n\n" + markdown_table(head, cells)


# (label, figure, decimals): the per-request medians of the all-servers table.
ALL_COLUMNS = (
    ("TTFT p50 (ms)", "ttft_ms_p50", 0),
    ("ITL p50 (ms)", "itl_ms_p50", 1),
    ("req/s", "request_throughput_rps", 2),
    ("prompt tok/req", "prompt_tokens_mean", 1),
    ("output tok/req", "output_tokens_mean", 1),
    ("cached tok/req", "cached_tokens_mean", 1),
    ("server CPU ms/token", "server_cpu_ms_per_token", 1),
)


def markdown_all(stats: dict[str, dict[int, dict]], levels: list[int]) -> str:
    """Every target at every concurrency: median [min-max] of the headline figures, and what
    each request really was (tokens in and out, from the server's usage)."""
    head = ["target", "streams", "output tok/s median [min-max]"]
    head += [label for label, _, _ in ALL_COLUMNS] + ["errors", "runs"]
    rows = []
    for target, by_level in stats.items():
        for level in [level for level in levels if level in by_level]:
            s = by_level[level]
            tput = s.get(HEADLINE)
            shown = tput and f"{tput['median']:.1f} [{tput['min']:.1f}-{tput['max']:.1f}]"
            cells = [target, str(level), shown or "n/a"]
            cells += [num(median(s, key), decimals) for _, key, decimals in ALL_COLUMNS]
            errors = s["errors"]["max"] if s.get("errors") else None
            rows.append(cells + [num(errors, 0), str(tput["n"] if tput else 0)])
    return markdown_table(head, rows)
