"""Open-loop load at a sweep of request rates: which rate each mode sustains, and the curves.

At each offered rate the requests arrive on a Poisson schedule whatever the system does (open
loop); TTFT is counted from the planned arrival, so a submitter that falls behind (the in-process
baseline tokenizing in its caller's thread) shows its backlog as latency, as a real client's
request would wait in a socket queue.

A finite run cannot prove a rate is sustainable forever, so "sustains" is decided from what a run
of several seconds can show:
  - every request succeeded;
  - TTFT p99 (from arrival) is within the SLO: an engine that falls behind by a fraction e of the
    offered load accumulates a backlog of e x the run's length, which breaks any SLO shorter than
    that well before the run ends;
  - requests completed at >= 95% of the rate they arrived at, both measured over the run's own
    span (first to last arrival, first to last completion), so the latency of the first and last
    requests does not count against it.
The highest sustainable rate of a mode is the highest swept rate that it sustains together with
every lower swept rate (a noisy pass above a failure does not count).
"""

from __future__ import annotations

import math

from scripts.bench.targets import SUBMIT_P99_MAX_MS, SWEEP_RATE_RATIO, sweep_targets_apply

SUSTAIN_THROUGHPUT_FRACTION = 0.95


def parse_rates(text: str) -> list[float]:
    """'2,4,8' -> [2.0, 4.0, 8.0] (requests per second, ascending, distinct); 'inf' alone is a
    burst."""
    try:
        rates = [float(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise ValueError(
            f"--request-rate takes numbers separated by commas, got {text!r}"
        ) from None
    if not rates or any(not r > 0 or math.isnan(r) for r in rates):
        raise ValueError(f"request rates must be > 0, got {text!r}")
    if len(rates) > 1 and any(math.isinf(r) for r in rates):
        raise ValueError("inf (a burst) cannot be part of a rate sweep")
    if len(set(rates)) != len(rates):
        raise ValueError(f"request rates must be distinct, got {text!r}")
    return sorted(rates)


def requests_at(rate: float, duration_s: float, num_requests: int, minimum: int = 10) -> int:
    """Requests for one run at ``rate``: ``rate x duration_s`` (at least ``minimum``) when a
    duration is given, else ``num_requests``."""
    if duration_s <= 0 or math.isinf(rate):
        return num_requests
    return max(minimum, round(rate * duration_s))


def sustains(summary: dict, slo_ttft_p99_ms: float) -> bool:
    """The decision the module docstring describes, for one mode at one rate."""
    p99 = summary.get("ttft_from_arrival_ms_p99")
    arrived, completed = summary.get("arrival_rate_rps"), summary.get("completion_rate_rps")
    if summary.get("errors") or p99 is None or p99 > slo_ttft_p99_ms:
        return False
    if arrived is None or completed is None:
        return False
    return completed >= SUSTAIN_THROUGHPUT_FRACTION * arrived


def highest_sustained(by_rate: dict[float, dict], slo_ttft_p99_ms: float) -> float | None:
    """The highest swept rate sustained together with every lower one (None: not the lowest)."""
    best = None
    for rate in sorted(by_rate):
        if not sustains(by_rate[rate], slo_ttft_p99_ms):
            break
        best = rate
    return best


def nearest_at_or_below(rates: list[float], target: float) -> float | None:
    below = [r for r in rates if r <= target * (1 + 1e-9)]
    return max(below) if below else None


# --- the report ---------------------------------------------------------------------------------
def _ms(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _us(value_ms: float | None) -> str:
    return "n/a" if value_ms is None else f"{value_ms * 1e3:.1f}"


def sweep_lines(sweep: dict[str, dict[float, dict]], slo_ttft_p99_ms: float) -> list[str]:
    """One table per mode (a row per rate), then each mode's highest sustainable rate."""
    lines = [
        f"=== rate sweep (medians over measured runs; TTFT from the planned arrival; "
        f"SLO: TTFT p99 <= {slo_ttft_p99_ms:g} ms; submit CPU: the submitting thread's own "
        "CPU time in submit()) ==="
    ]
    header = (
        f"{'rate':>8} {'arrived':>8} {'done':>8} {'TTFT p50':>9} {'TTFT p99':>9} "
        f"{'submit p50':>10} {'submit p99':>10} {'CPU p99':>8} {'lag p99':>8}  sustains"
    )
    units = (
        f"{'req/s':>8} {'req/s':>8} {'req/s':>8} {'ms':>9} {'ms':>9} {'us':>10} {'us':>10} "
        f"{'us':>8} {'ms':>8}"
    )
    for mode, by_rate in sweep.items():
        lines += ["", f"--- {mode} ---", header, units]
        for rate in sorted(by_rate):
            s = by_rate[rate]
            lines.append(
                f"{rate:>8g} {_ms(s.get('arrival_rate_rps'), 2):>8} "
                f"{_ms(s.get('completion_rate_rps'), 2):>8} "
                f"{_ms(s.get('ttft_from_arrival_ms_p50')):>9} "
                f"{_ms(s.get('ttft_from_arrival_ms_p99')):>9} "
                f"{_us(s.get('submit_latency_ms_p50')):>10} "
                f"{_us(s.get('submit_latency_ms_p99')):>10} {_us(s.get('submit_cpu_ms_p99')):>8} "
                f"{_ms(s.get('submit_lag_ms_p99')):>8}  "
                f"{'yes' if sustains(s, slo_ttft_p99_ms) else 'NO'}"
                + (f" ({int(s['errors'])} errors)" if s.get("errors") else "")
            )
    lines += [
        "",
        "highest sustainable rate (req/s): "
        + ", ".join(
            f"{mode} {_rate(highest_sustained(by_rate, slo_ttft_p99_ms))}"
            for mode, by_rate in sweep.items()
        ),
    ]
    return lines


def _rate(rate: float | None) -> str:
    return "below the lowest rate swept" if rate is None else f"{rate:g}"


def sweep_target_lines(
    sweep: dict[str, dict[float, dict]], slo_ttft_p99_ms: float, baseline: str
) -> list[str]:
    """The sweep's targets for every cluster mode against the baseline (targets.py)."""
    if baseline not in sweep:
        return []
    rates = sorted(sweep[baseline])
    base_best = highest_sustained(sweep[baseline], slo_ttft_p99_ms)
    half = nearest_at_or_below(rates, base_best / 2) if base_best is not None else None
    lines = []
    for mode, by_rate in sweep.items():
        if mode == baseline:
            continue
        worst_submit = max((s.get("submit_latency_ms_p99") or 0.0) for s in by_rate.values())
        worst_cpu = max((s.get("submit_cpu_ms_p99") or 0.0) for s in by_rate.values())
        submit = (
            f"submit p99 < {SUBMIT_P99_MAX_MS * 1e3:g} us at every rate (worst "
            f"{worst_submit * 1e3:.1f} us; its CPU time {worst_cpu * 1e3:.1f} us): "
            f"{'met' if worst_submit < SUBMIT_P99_MAX_MS else 'MISSED'}"
        )
        if not sweep_targets_apply(mode):
            lines.append(f"{mode}: {submit} (reported beside the SDK's, not a target)")
            continue
        best = highest_sustained(by_rate, slo_ttft_p99_ms)
        checks = []
        if base_best is None or best is None:
            checks.append(
                f"highest sustainable rate >= {SWEEP_RATE_RATIO:g}x {baseline}'s: "
                f"n/a ({_rate(best)} vs {_rate(base_best)})"
            )
        else:
            ratio = best / base_best
            checks.append(
                f"highest sustainable rate >= {SWEEP_RATE_RATIO:g}x {baseline}'s "
                f"({best:g} / {base_best:g} = {ratio:.2f}x): "
                f"{'met' if ratio >= SWEEP_RATE_RATIO else 'MISSED'}"
            )
        if half is None:
            checks.append(f"TTFT p50 at half of {baseline}'s saturation rate: n/a")
        else:
            ours = by_rate.get(half, {}).get("ttft_from_arrival_ms_p50")
            theirs = sweep[baseline][half].get("ttft_from_arrival_ms_p50")
            verdict = (
                "n/a" if ours is None or theirs is None else ("met" if ours <= theirs else "MISSED")
            )
            checks.append(
                f"TTFT p50 at {half:g} req/s (half of {baseline}'s {base_best:g}) no "
                f"worse ({_ms(ours)} vs {_ms(theirs)} ms): {verdict}"
            )
        lines.append(f"targets {mode} vs {baseline}: " + "; ".join(checks + [submit]))
    return lines


# --- the plot -----------------------------------------------------------------------------------
def plot_sweep(
    path, sweep: dict[str, dict[float, dict]], slo_ttft_p99_ms: float, title: str = ""
) -> None:
    """Left: TTFT p99 (solid) and p50 (dotted) against offered rate, per mode, with the SLO.
    Right: submit latency p99 against offered rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_ttft, ax_submit) = plt.subplots(1, 2, figsize=(13, 5))
    for mode, by_rate in sweep.items():
        rates = sorted(by_rate)
        (line,) = ax_ttft.plot(
            rates,
            [by_rate[r].get("ttft_from_arrival_ms_p99") for r in rates],
            marker="o",
            label=f"{mode} p99",
        )
        ax_ttft.plot(
            rates,
            [by_rate[r].get("ttft_from_arrival_ms_p50") for r in rates],
            linestyle=":",
            color=line.get_color(),
            label=f"{mode} p50",
        )
        ax_submit.plot(
            rates,
            [(by_rate[r].get("submit_latency_ms_p99") or 0) * 1e3 for r in rates],
            marker="o",
            label=mode,
        )
    ax_ttft.axhline(slo_ttft_p99_ms, color="grey", linestyle="--", label="SLO (p99)")
    ax_ttft.set_yscale("log")
    ax_ttft.set_xlabel("offered rate (req/s)")
    ax_ttft.set_ylabel("TTFT from arrival (ms)")
    ax_ttft.set_title("TTFT vs offered rate" + (f" ({title})" if title else ""))
    ax_ttft.grid(alpha=0.3, which="both")
    ax_ttft.legend(fontsize=8)
    ax_submit.set_yscale("log")
    ax_submit.set_xlabel("offered rate (req/s)")
    ax_submit.set_ylabel("submit latency p99 (us)")
    ax_submit.set_title("submit() latency p99")
    ax_submit.grid(alpha=0.3, which="both")
    ax_submit.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
