"""The edges workload for real on the tiny model: each part's clusters start, its streams run
beside the large work, and its figures are printed (never asserted: the machine is shared)."""

from __future__ import annotations

import re

from scripts.bench import edges


def test_every_part_runs_beside_its_large_work(tiny_model_dir, capsys):
    edges.main(
        ["long-context", "long-prompts", "hostile", "--model", str(tiny_model_dir)]
        + ["--max-model-len", "2048", "--long-tokens", "1500", "--short-tokens", "16"]
        + ["--stream-tokens", "8", "--interval-s", "0.05", "--streams", "3"]
        + ["--seconds", "1", "--pace-s", "0.3", "--burners", "0", "--hostile-values", "2000"]
        + ["--background-niceness", "0"]
    )
    out = capsys.readouterr().out
    assert re.search(r"\d+ unrelated streams; TTFT p50 .* gaps p50 \d+, p99 \d+, max \d+ ms", out)
    assert re.search(r"TTFT alone +\(\d+\)", out) and "TTFT beside 7.2 MB prompts" in out
    assert re.search(r"7.2 MB prompts: [1-9]\d*, answered \[", out), out
    gaps = re.findall(r"(alone|hostile) +burners ([01]): largest gap per run", out)
    assert sorted(gaps) == [("alone", "0"), ("hostile", "0")]  # (burners: none, to stay quick)
