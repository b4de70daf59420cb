"""The startup workload: real launches on the tiny model, timed from nothing to the first token
(the figures themselves are not a test)."""

from __future__ import annotations

import json

import pytest

from scripts.bench import startup


def test_each_case_starts_from_nothing_and_serves_a_token(tiny_model_dir, tmp_path, capsys):
    flags = f"--model {tiny_model_dir} --kv-cache-tokens 2048"
    out = tmp_path / "startup.json"
    data = startup.main(
        ["--splitserve", flags, "--repeats", "2", "--prompt-tokens", "40", "--json", str(out)]
    )
    runs = data["runs"]
    assert [(r["case"], r["repeat"]) for r in runs] == [(f"splitserve {flags}", i) for i in (0, 1)]
    for run in runs:
        assert 0 < run["ready_s"] < run["first_token_s"] < run["wall_s"]
    assert f"| splitserve {flags} |" in capsys.readouterr().out
    assert json.loads(out.read_text())["runs"] == runs


@pytest.mark.parametrize("argv", [["--repeats", "0"], ["--llama-server", "/nonexistent"]])
def test_bad_arguments_are_refused(argv, capsys):
    with pytest.raises(SystemExit):
        startup.main(argv)
    assert "error:" in capsys.readouterr().err


def test_llama_server_runs_the_given_gguf(tmp_path, capsys):
    parsed = startup.build_parser().parse_args(["--gguf", str(tmp_path / "m.gguf")])
    assert parsed.gguf == str(tmp_path / "m.gguf")
    with pytest.raises(SystemExit):
        startup.main(["--gguf", str(tmp_path / "missing.gguf")])
    assert "is not a file" in capsys.readouterr().err
