"""The routing-cost benchmark runs (its figures are printed, never asserted: the machine is
shared)."""

from __future__ import annotations

from scripts.bench.kv_routing_cost import routing_cost


def test_routing_cost_measures_hashing_and_lookup():
    figures = routing_cost(repeats=20)
    assert set(figures) == {"hash_cold_us", "hash_warm_us", "lookup_us", "hash_warm_and_lookup_us"}
    assert all(value > 0 for value in figures.values())
