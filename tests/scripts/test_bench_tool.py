"""The benchmark tool's entry point and its one A/B interleaver."""

from __future__ import annotations

import pytest

from scripts.bench.__main__ import WORKLOADS, main
from scripts.bench.interleave import best_ms, best_of, interleave, rotated


def test_rotation_puts_each_case_first_as_often():
    orders = [rotated(["a", "b", "c"], r) for r in range(3)]
    assert orders == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]
    assert rotated([], 5) == []


def test_interleave_alternates_the_cases_and_keeps_each_ones_results():
    calls: list[str] = []

    def case(name: str, values: list[float]):
        it = iter(values)

        def run() -> float:
            calls.append(name)
            return next(it)

        return run

    results = interleave({"a": case("a", [1.0, 5.0]), "b": case("b", [3.0, 2.0])}, 2)
    assert calls == ["a", "b", "b", "a"]
    assert results == {"a": [1.0, 5.0], "b": [3.0, 2.0]}
    assert best_of({"a": case("a", [1.0, 5.0]), "b": case("b", [3.0, 2.0])}, 2) == {
        "a": 5.0,
        "b": 3.0,
    }
    ms, out = best_ms(lambda: "done", 3)
    assert out == "done" and ms >= 0


def test_the_entry_point_lists_every_workload_and_refuses_others(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(f"  {name} " in out for name in WORKLOADS)
    assert main(["nonsense"]) == 2
    assert "unknown workload 'nonsense'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["engine", "--help"])
    assert "python -m scripts.bench engine" in capsys.readouterr().out
