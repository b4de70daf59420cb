"""The real default model end to end, through the README's main command."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_chat_command_answers_paris(default_model_dir):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "procs.cli",
            "chat",
            "What is the capital of France?",
            "--max-tokens",
            "24",
            "--temperature",
            "0",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Paris" in proc.stdout
    assert "Traceback" not in proc.stderr
