"""Open-loop load at a sweep of request rates: which rate each mode sustains, and the curves.

Requests arrive on a Poisson schedule whatever the system does (open loop); TTFT counts from
the planned arrival, so a submitter that falls behind (the in-process baseline tokenizing in its
caller's thread) shows its backlog as latency, as a socket queue would. A mode sustains a rate
when every request succeeded, TTFT p99 is within the SLO (falling behind by a fraction e of the
load builds a backlog of e x the run's length, which breaks the SLO well before the run ends),
and requests completed at >= 95% of the rate they arrived at, both over the run's own span.
Its highest sustainable rate is the highest it sustains with every lower one swept.
"""

from __future__ import annotations

import math

from scripts.bench.stats import num

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


# --- the report ---------------------------------------------------------------------------------
# The table's columns after the rate: (header, unit, width, the summary's key, scale, decimals).
COLUMNS = (
    ("arrived", "req/s", 8, "arrival_rate_rps", 1, 2),
    ("done", "req/s", 8, "completion_rate_rps", 1, 2),
    ("TTFT p50", "ms", 9, "ttft_from_arrival_ms_p50", 1, 1),
    ("TTFT p99", "ms", 9, "ttft_from_arrival_ms_p99", 1, 1),
    ("submit p50", "us", 10, "submit_latency_ms_p50", 1e3, 1),
    ("submit p99", "us", 10, "submit_latency_ms_p99", 1e3, 1),
    ("CPU p99", "us", 8, "submit_cpu_ms_p99", 1e3, 1),
    ("lag p99", "ms", 8, "submit_lag_ms_p99", 1, 1),
)


def sweep_lines(sweep: dict[str, dict[float, dict]], slo_ttft_p99_ms: float) -> list[str]:
    """One table per mode (a row per rate), then each mode's highest sustainable rate."""
    lines = [
        f"=== rate sweep (medians over measured runs; TTFT from the planned arrival; "
        f"SLO: TTFT p99 <= {slo_ttft_p99_ms:g} ms; submit CPU: the submitting thread's own "
        "CPU time in submit()) ==="
    ]
    header = f"{'rate':>8} " + " ".join(f"{h:>{w}}" for h, _, w, *_ in COLUMNS) + "  sustains"
    units = f"{'req/s':>8} " + " ".join(f"{u:>{w}}" for _, u, w, *_ in COLUMNS)
    for mode, by_rate in sweep.items():
        lines += ["", f"--- {mode} ---", header, units]
        for rate in sorted(by_rate):
            s = by_rate[rate]
            cells = [
                f"{num(None if s.get(key) is None else s[key] * scale, digits):>{width}}"
                for _, _, width, key, scale, digits in COLUMNS
            ]
            verdict = "yes" if sustains(s, slo_ttft_p99_ms) else "NO"
            verdict += f" ({int(s['errors'])} errors)" if s.get("errors") else ""
            lines.append(f"{rate:>8g} " + " ".join(cells) + f"  {verdict}")
    highest = {mode: highest_sustained(by_rate, slo_ttft_p99_ms) for mode, by_rate in sweep.items()}
    shown = [
        f"{m} {'below the lowest rate swept' if r is None else f'{r:g}'}"
        for m, r in highest.items()
    ]
    return lines + ["", "highest sustainable rate (req/s): " + ", ".join(shown)]
