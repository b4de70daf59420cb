"""``splitserve bench``: the benchmark of the source checkout, run as a module in a child process
from the caller's working directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from procs.children import REPO_ROOT
from procs.cli import run_bench


def test_bench_runs_from_any_directory_and_relative_paths_stay_the_callers(
    tiny_model_dir, tmp_path
):
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "procs.cli",
            "bench",
            "--model",
            str(tiny_model_dir),
            "--modes",
            "inproc",
            "--num-requests",
            "2",
            "--prompt-tokens",
            "16",
            "--max-new-tokens",
            "2",
            "--warmup-runs",
            "0",
            "--no-progress",
            "--json",
            "out.json",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "=== inproc (median of 1 measured run) ===" in proc.stdout
    data = json.loads((tmp_path / "out.json").read_text())  # where the caller stands
    assert data["medians"]["inproc"]["requests"] == 2


def test_bench_without_a_source_checkout_says_so(tmp_path, capsys):
    assert run_bench(["--help"], root=tmp_path) == 2
    err = capsys.readouterr().err
    assert "splitserve bench needs a source checkout" in err and "scripts/bench/serving.py" in err
