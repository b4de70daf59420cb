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
                f"{rate:>8g} {num(s.get('arrival_rate_rps')):>8} "
                f"{num(s.get('completion_rate_rps')):>8} "
                f"{num(s.get('ttft_from_arrival_ms_p50'), 1):>9} "
                f"{num(s.get('ttft_from_arrival_ms_p99'), 1):>9} "
                f"{_us(s.get('submit_latency_ms_p50')):>10} "
                f"{_us(s.get('submit_latency_ms_p99')):>10} {_us(s.get('submit_cpu_ms_p99')):>8} "
                f"{num(s.get('submit_lag_ms_p99'), 1):>8}  "
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
