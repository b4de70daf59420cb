"""A launch whose model cannot be served ends within seconds with one line naming why, exit code
2, no traceback, and no process left behind: whether the supervisor sees it before starting
anything (an unknown architecture, a file that is not a model) or the engine refuses it at
start-up (a tensor type we do not serve; an unknown architecture that got past the supervisor).
Real processes: the ``splitserve`` command and its workers."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from procs import model_store
from procs.children import REPO_ROOT
from tests.gguf_files import write_tiny_gguf


def splitserve(*args: str, cache: Path) -> tuple[int, str, float]:
    """Runs the command; returns its exit code, stderr and seconds taken."""
    env = dict(os.environ, SPLITSERVE_CACHE=str(cache), SPLITSERVE_LOG_LEVEL="WARNING")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "procs.cli", *args],
        env=env,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=170,
    )
    return proc.returncode, proc.stderr, time.monotonic() - t0


def assert_one_line_error(stderr: str, *expected: str) -> str:
    assert "Traceback" not in stderr, stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("splitserve: error: "), stderr
    for text in expected:
        assert text in last, stderr
    return last


@pytest.fixture
def bogus_model(tiny_model_dir, tmp_path) -> Path:
    bogus = tmp_path / "bogus"
    shutil.copytree(tiny_model_dir, bogus)
    config = json.loads((bogus / "config.json").read_text())
    (bogus / "config.json").write_text(json.dumps({**config, "model_type": "bogus"}))
    return bogus


def test_an_unknown_architecture_ends_the_launch_before_anything_starts(bogus_model, tmp_path):
    code, stderr, took = splitserve("launch", "--model", str(bogus_model), cache=tmp_path)
    assert code == 2
    assert_one_line_error(stderr, "model_type 'bogus' is not supported", "llama, qwen2")
    assert took < 30, took  # was 180 s (the start-up timeout)


def test_a_file_that_is_not_a_model_ends_the_launch_with_one_line(tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("hello\n")
    for args in (["launch", "--model", str(notes)], ["chat", "--model", str(notes), "hi"]):
        code, stderr, _ = splitserve(*args, cache=tmp_path)
        assert code == 2
        assert_one_line_error(stderr, "is not a GGUF file", "--model takes a .gguf file")
    code, stderr, _ = splitserve("launch", "--model", str(tmp_path / "gone"), cache=tmp_path)
    assert code == 2
    assert_one_line_error(stderr, "no such file or directory")


def test_a_tensor_type_we_do_not_serve_ends_the_launch_with_the_engines_reason(
    tiny_model_dir, default_model_dir, tmp_path, monkeypatch
):
    """The engine refuses it at start-up: its reason reaches the command at once (before, the
    engine hung in ZeroMQ's term() and the launch waited out its 180 s)."""
    gguf = tmp_path / "iq.gguf"
    write_tiny_gguf(
        tiny_model_dir, gguf, default_model_dir=default_model_dir, unserved="blk.1.ffn_up.weight"
    )
    cache = tmp_path / "cache"
    monkeypatch.setenv("SPLITSERVE_CACHE", str(cache))
    model_store.resolve_model(gguf)  # the metadata read once, here: the launch's time is its own
    code, stderr, took = splitserve("launch", "--model", str(gguf), cache=cache)
    assert code == 2
    last = assert_one_line_error(
        stderr, "engine[0]: ", "tensor 'blk.1.ffn_up.weight' has GGUF type IQ4_NL", "Q4_0"
    )
    assert str(gguf.resolve()) in last  # the user's file, not the cache's link to it
    assert took < 90, took


def test_an_engine_that_refuses_its_model_stops_the_start_at_once(bogus_model, tmp_path):
    """Past the supervisor's own check (a library caller starting a Cluster from its config),
    the engine's refusal still ends the start within seconds: ClusterStartError with its line,
    the engine exits with EXIT_STARTUP_REFUSED, and no worker is left."""
    script = f"""
import sys, time
from ipc.config import ClusterConfig
from procs.launch_cluster import Cluster, ClusterStartError
config = ClusterConfig.build({str(bogus_model)!r}, {str(tmp_path / "run")!r})
t0 = time.monotonic()
try:
    Cluster.start(config, start_timeout_s=170)
except ClusterStartError as exc:
    print(f"{{time.monotonic() - t0:.1f}} {{exc}}")
"""
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    proc = subprocess.run(
        [sys.executable, "-c", script],
        env=env,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert proc.returncode == 0, proc.stderr
    took, _, reason = proc.stdout.strip().partition(" ")
    assert reason.startswith("engine[0]: model_type 'bogus' is not supported"), proc.stdout
    assert float(took) < 60
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "engine[0] cannot start: model_type 'bogus'" in proc.stderr
    assert not (tmp_path / "run").exists()  # stopped and cleaned up
