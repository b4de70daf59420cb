"""The structured and grammar workloads for real on the tiny model: the engine's grammar path,
one cluster for TTFT and ITL, our compile and mask path, and the backend comparison's child
process (llguidance; xgrammar is not a dependency). Timings are not a test."""

from __future__ import annotations

import json
import re

import pytest
import torch

from scripts.bench import grammar, structured


@pytest.fixture(autouse=True)
def _keep_torch_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_structured_decode_ttft_and_itl(tiny_model_dir, capsys):
    structured.main(
        ["decode", "ttft", "itl", "--model", str(tiny_model_dir), "--threads", "1"]
        + ["--batch", "2", "--decode-tokens", "3", "--repeats", "1", "--requests", "2"]
        + ["--streams", "2", "--stream-tokens", "12", "--arrival-interval-ms", "20"]
        + ["--schema-fields", "8"]
    )
    out = capsys.readouterr().out
    (row,) = re.findall(r"^float32 +([\d.]+) +([\d.]+) +[\d.]+x +[\d.]+ +[\d.]+ +(\d+)$", out, re.M)
    assert float(row[0]) > 0 and float(row[1]) > 0
    assert int(row[2]) == 2  # every row stayed under its grammar through the window
    assert "cached grammar / plain, p50" in out
    arrivals = [int(n) for n in re.findall(r"\((\s*\d+) arrivals\)", out)]
    assert len(arrivals) == 2 and all(n >= 1 for n in arrivals)
    assert "new schemas / no schema: p99" in out


def test_grammar_compile_mask_and_backends(tiny_model_dir, tmp_path, capsys):
    json_path = tmp_path / "grammar.json"
    grammar.main(
        ["compile", "mask", "backends", "--model", str(tiny_model_dir), "--batch", "3"]
        + ["--repeats", "1", "--decode-tokens", "4", "--schema-fields", "8"]
        + ["--mask-threads", "1", "--backends", "llguidance", "--json", str(json_path)]
    )
    out = capsys.readouterr().out
    assert re.search(r"tokenizer worker: check +[\d.]+ ms cold", out)
    assert re.search(r"engine thread: +build +[\d.]+ ms cold", out)
    assert "mask: batch 3, nested schema, 4 steps" in out
    figures = json.loads(json_path.read_text())["llguidance"]
    assert figures["imports tokenizers/transformers"] is False  # the engine may load it
    for kind in ("json_schema", "json_object", "regex", "grammar", "choice"):
        assert figures[kind]["mask_us_mean"] > 0 and figures[kind]["batch_fill_ms_t1"] > 0
