"""A relative ``--model`` (and a relative $SPLITSERVE_CACHE) is served: the workers start in
another working directory, so what they are given is absolute (before: the supervisor's check
passed, then the engine said "<path> has no config.json" and the launch ended)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

from procs.children import REPO_ROOT
from procs.local_model import resolve_local


def test_resolve_local_gives_an_absolute_directory(tiny_model_dir, tmp_path, monkeypatch):
    shutil.copytree(tiny_model_dir, tmp_path / "tiny")
    monkeypatch.chdir(tmp_path)
    got = resolve_local("tiny", tmp_path / "cache")
    assert got.is_absolute() and got == tmp_path / "tiny"
    assert resolve_local("./tiny/", tmp_path / "cache").name == "tiny"


def test_chat_serves_a_model_named_relative_to_the_working_directory(tiny_model_dir, tmp_path):
    shutil.copytree(tiny_model_dir, tmp_path / "tiny")
    env = dict(os.environ, SPLITSERVE_CACHE="cache", SPLITSERVE_LOG_LEVEL="WARNING")
    env["SPLITSERVE_NO_KERNEL_BUILD"] = "1"  # its own cache holds no kernel build: aten serves
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, "-m", "procs.cli", "chat", "--model", "tiny", "--max-tokens", "2", "hi"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
