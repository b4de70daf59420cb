"""The peer benchmark's statistics and tables: each figure's median and spread over repeats,
llama.cpp at its best thread count per concurrency, ratios splitserve / llama.cpp, markdown."""

from __future__ import annotations

from scripts.bench.stats import ratio, spread

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


def best(stats: dict, key: str, higher_is_better: bool) -> float | None:
    """The best repeat's figure: what a server can do when the shared machine lets it."""
    entry = stats.get(key)
    return None if entry is None else entry["max" if higher_is_better else "min"]


def pick(stats: dict, key: str, higher_is_better: bool, statistic: str) -> float | None:
    if statistic not in STATISTICS:
        raise ValueError(f"statistic must be one of {STATISTICS}, got {statistic!r}")
    return median(stats, key) if statistic == "median" else best(stats, key, higher_is_better)


STATISTICS = ("median", "best")


def best_of(
    stats_by_target: dict[str, dict], targets: list[str], statistic: str = "median"
) -> str | None:
    """The target with the highest headline figure (llama.cpp at its best)."""
    scored = [
        (pick(stats_by_target[t], HEADLINE, True, statistic), t)
        for t in targets
        if t in stats_by_target
    ]
    scored = [(v, t) for v, t in scored if v is not None]
    return max(scored)[1] if scored else None


def _fmt(value: float | None, decimals: int) -> str:
    return "n/a" if value is None else f"{value:,.{decimals}f}"


def _ratio_text(ours: float | None, theirs: float | None) -> str:
    r = ratio(ours, theirs)
    return "n/a" if r is None else f"{r:.2f}x"


def comparison_rows(
    stats: dict[str, dict[int, dict]],
    ours: str,
    peers: list[str],
    levels: list[int],
    statistic: str = "median",
) -> list[dict]:
    """One row per concurrency: each figure ours, theirs (the best peer at that concurrency)
    and the ratio ours / theirs; ``statistic`` says which repeat's figures (median or best)."""
    rows = []
    for level in levels:
        at_level = {t: stats[t][level] for t in [ours, *peers] if level in stats.get(t, {})}
        peer = best_of(at_level, peers, statistic)
        row = {"concurrency": level, "peer": peer, "figures": {}, "statistic": statistic}
        for _label, key, higher, _ in FIGURES:
            a = pick(at_level.get(ours, {}), key, higher, statistic)
            b = pick(at_level[peer], key, higher, statistic) if peer else None
            row["figures"][key] = {
                "ours": a,
                "theirs": b,
                "ratio": ratio(a, b),
                "higher_is_better": higher,
            }
        rows.append(row)
    return rows


def markdown_comparison(rows: list[dict], ours: str, peer_label: str = "llama.cpp") -> str:
    head = ["streams", *[label for label, *_ in FIGURES], "llama.cpp at its best"]
    statistic = rows[0]["statistic"] if rows else "median"
    which = "medians" if statistic == "median" else "best repeat of each figure"
    lines = [
        f"**{ours}** / {peer_label} ({which}; each cell ours / theirs = ratio; "
        "TTFT and ITL: lower is better)",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for row in rows:
        cells = [str(row["concurrency"])]
        for _, key, _, decimals in FIGURES:
            f = row["figures"][key]
            cells.append(
                f"{_fmt(f['ours'], decimals)} / {_fmt(f['theirs'], decimals)} = "
                f"{_ratio_text(f['ours'], f['theirs'])}"
            )
        cells.append(row["peer"] or "n/a")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


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
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for target, by_level in stats.items():
        for level in [level for level in levels if level in by_level]:
            s = by_level[level]
            tput = s.get(HEADLINE)
            cells = [target, str(level)]
            cells.append(
                "n/a"
                if tput is None
                else f"{tput['median']:.1f} [{tput['min']:.1f}-{tput['max']:.1f}]"
            )
            cells += [_fmt(median(s, key), decimals) for _, key, decimals in ALL_COLUMNS]
            cells += [_fmt(s["errors"]["max"] if s.get("errors") else None, 0)]
            cells += [str(tput["n"] if tput else 0)]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
