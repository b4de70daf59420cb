"""The benchmark tool's entry point, its one A/B interleaver, and the benchmark commands the README
and docs print (each must parse with the tool as it is)."""

from __future__ import annotations

import importlib
import shlex
from pathlib import Path

import pytest

from scripts.bench.__main__ import WORKLOADS, main
from scripts.bench.interleave import best_of, interleave, rotated


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


def test_the_entry_point_lists_every_workload_and_refuses_others(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(f"  {name} " in out for name in WORKLOADS)
    assert main(["nonsense"]) == 2
    assert "unknown workload 'nonsense'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["engine", "--help"])
    assert "python -m scripts.bench engine" in capsys.readouterr().out


ROOT = Path(__file__).resolve().parents[2]
PREFIXES = (("python -m scripts.bench ", None), (".venv/bin/python -m scripts.bench ", None))


def bench_commands() -> list[tuple[str, str, list[str]]]:
    """(file, workload, arguments) of every benchmark command line printed in the README and the
    docs, continuation lines joined."""
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = path.read_text().replace("\\\n", " ")
        for line in text.splitlines():
            line = line.split("  #")[0].strip()
            for prefix, workload in PREFIXES:
                if line.startswith(prefix):
                    words = shlex.split(line[len(prefix) :])
                    if workload is None:
                        workload, words = words[0], words[1:]
                    if not workload.startswith("-"):  # `python -m scripts.bench --help`
                        found.append((path.name, workload, words))
                    break
    return found


def test_every_benchmark_command_in_the_docs_parses():
    commands = bench_commands()
    assert len(commands) >= 15 and {w for _, w, _ in commands} == set(WORKLOADS)
    for name, workload, words in commands:
        assert workload in WORKLOADS, (name, workload)
        parser = importlib.import_module(WORKLOADS[workload][0]).build_parser()
        try:
            parser.parse_args(words)
        except SystemExit as exc:  # --help exits 0; a bad flag exits 2
            assert exc.code == 0 and "--help" in words, (name, workload, words)
