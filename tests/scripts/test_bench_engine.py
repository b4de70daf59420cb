"""The engine workload for real on the tiny model, every part of it. Timings are not a test."""

from __future__ import annotations

import re

import pytest
import torch

from scripts.bench import engine


@pytest.fixture(autouse=True)
def _keep_torch_threads():
    """The workload sets this process's torch threads (--threads): later tests keep theirs."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_every_engine_part_runs_and_prints_its_figures(tiny_model_dir, capsys):
    engine.main(
        ["core", "prefix", "mixed", "speculative"]
        + ["--model", str(tiny_model_dir), "--threads", "1", "--repeats", "1"]
        + ["--prefill-tokens", "24", "--decode-batch", "1,2", "--decode-tokens", "3"]
        + ["--decode-prompt-tokens", "16", "--kv-cache-tokens", "4096"]
        + ["--num-requests", "3", "--shared-prefix-tokens", "64", "--new-tokens", "2"]
        + ["--long-prompts", "1", "--long-prompt-tokens", "96", "--chunk-tokens", "32"]
        + ["--texts", "chat,code", "--streams", "1,2", "--rounds", "2", "--max-tokens", "6"]
    )
    out = capsys.readouterr().out
    rates = re.findall(
        r"^(prefill 24 tokens|decode batch [12]) +([\d.]+) +([\d.]+) +([\d.]+)x", out, re.M
    )
    assert len(rates) == 3 and all(float(ours) > 0 and float(hf) > 0 for _, ours, hf, _ in rates)
    for line in (
        "prefix cache on : prompt tokens computed",
        "chunked prefill   32 tokens: ITL p50",
    ):
        assert line in out, line
    computed = [int(n) for n in re.findall(r"prompt tokens computed +(\d+)", out)]
    assert computed[1] < computed[0]  # the shared prefix is computed once with the cache on
    # speculative: a row per (text, streams); greedy output is the same with drafts or without
    rows = re.findall(r"^(chat|code) +([12]) +([\d.]+) +([\d.]+) .* (yes|NO)$", out, re.M)
    assert [(t, int(n)) for t, n, *_ in rows] == [
        ("chat", 1),
        ("chat", 2),
        ("code", 1),
        ("code", 2),
    ]
    assert all(same == "yes" and float(off) > 0 for _, _, off, _, same in rows)
    assert "proposer: " in out
