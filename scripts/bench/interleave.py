"""The one A/B interleaver: every compared case runs once per repeat, the cases one after another,
the order rotated by one each repeat. Load on a shared machine then hits a run, not a side, and
each case goes first as often as the others (the first run after a switch often pays for it).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import TypeVar

K = TypeVar("K")
T = TypeVar("T")


def progress(text: str) -> None:
    """A line on stderr between runs (the report goes to stdout)."""
    print(text, file=sys.stderr, flush=True)


def load() -> str:
    """The load average (1, 5 and 15 minutes), printed beside every figure."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def rotated(cases: Iterable[K], repeat: int) -> list[K]:
    """``cases`` rotated left by ``repeat``: [a, b, c] -> [b, c, a] for repeat 1."""
    order = list(cases)
    if not order:
        return order
    k = repeat % len(order)
    return order[k:] + order[:k]


def interleave(cases: Mapping[K, Callable[[], T]], repeats: int) -> dict[K, list[T]]:
    """Runs each case ``repeats`` times, interleaved and rotated; returns each case's results in
    the order they were taken."""
    results: dict[K, list[T]] = {case: [] for case in cases}
    for repeat in range(repeats):
        for case in rotated(cases, repeat):
            results[case].append(cases[case]())
    return results


def best_of(cases: Mapping[K, Callable[[], float]], repeats: int) -> dict[K, float]:
    """Each case's largest result (a rate) over interleaved repeats: on a shared machine the
    fastest run is the one least disturbed."""
    return {case: max(values) for case, values in interleave(cases, repeats).items()}
