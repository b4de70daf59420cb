"""The engine's start builds our int4 kernel where this torch has no build (engine_worker/
int4_decode.py ``load_op``): two starts at once on an empty cache build it once, under the cache's
lock, and both load it. Skipped where it cannot be built (no g++, no AVX-512 BF16/VNNI)."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from engine_worker import int4_decode

ROOT = Path(__file__).resolve().parents[2]
START = """
import logging, torch
logging.basicConfig(level=logging.INFO)
from engine_worker import int4_decode
print("loaded" if int4_decode.load_op() and hasattr(torch.ops.splitserve, "int4_decode_mm")
      else "aten")
"""


@pytest.mark.skipif(
    shutil.which("g++") is None or not int4_decode.cpu_supported(), reason="no g++ / AVX-512 BF16"
)
@pytest.mark.timeout(900)
def test_two_starts_at_once_build_once_and_both_load(tmp_path):
    env = dict(os.environ, SPLITSERVE_CACHE=str(tmp_path), PYTHONPATH=str(ROOT))
    env.pop(int4_decode.NO_BUILD, None)
    starts = [
        subprocess.Popen(
            ["nice", "-n", "10", sys.executable, "-c", START],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=850) for p in starts]
    assert [p.returncode for p in starts] == [0, 0], [err for _, err in outs]
    assert [out.strip() for out, _ in outs] == ["loaded", "loaded"], [err for _, err in outs]
    logs = "".join(err for _, err in outs)
    assert logs.count("building our int4 decode kernel (once for this torch)") == 1, logs
    assert logs.count("built our int4 decode kernel in") == 1, logs
    assert "unavailable" not in logs
    assert len(list(tmp_path.glob("kernels/*/int4_decode_op.so"))) == 1


HANGING_GXX = """#!/bin/sh
echo $$ > {pid_file}
exec sleep 120
"""


@pytest.fixture
def hanging_gxx(tmp_path, monkeypatch) -> Path:
    """A g++ first on PATH that never finishes (it writes its pid to the returned file), and
    a cache of the test's own."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "g++").write_text(HANGING_GXX.format(pid_file=tmp_path / "gxx.pid"))
    (bin_dir / "g++").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(int4_decode, "CACHE_DIR", tmp_path / "cache")
    return tmp_path / "gxx.pid"


def gone(pid_file: Path) -> bool:
    return not Path(f"/proc/{int(pid_file.read_text())}").exists()


@pytest.mark.skipif(not int4_decode.cpu_supported(), reason="no AVX-512 BF16")
def test_a_build_past_its_limit_kills_gxx_and_says_why(hanging_gxx, tmp_path):
    """The build calls its progress callback while g++ runs, and at its limit kills g++ (no
    process left) and raises; nothing is left in the cache."""
    said: list[str] = []
    with pytest.raises(int4_decode.BuildTimeout, match=r"g\+\+ ran past the build limit: killed"):
        int4_decode.build_op(said.append, limit_s=3)
    assert said.count(int4_decode.BUILDING) >= 3, said
    assert gone(hanging_gxx)
    assert not list((tmp_path / "cache").glob("kernels/*/*.so"))


@pytest.mark.skipif(not int4_decode.cpu_supported(), reason="no AVX-512 BF16")
def test_a_build_whose_progress_raises_kills_gxx(hanging_gxx):
    """How a SIGTERM ends an engine mid-build (runtime.worker: its progress raises SystemExit):
    g++ ends with it."""

    def stopped(doing: str) -> None:
        if hanging_gxx.exists():  # g++ has started
            raise SystemExit(0)

    with pytest.raises(SystemExit):
        int4_decode.build_op(stopped)
    assert gone(hanging_gxx)


@pytest.mark.skipif(not int4_decode.cpu_supported(), reason="no AVX-512 BF16")
def test_waiting_for_another_build_reports_progress_and_ends_at_the_limit(tmp_path, monkeypatch):
    monkeypatch.setattr(int4_decode, "CACHE_DIR", tmp_path / "cache")
    lock_path = int4_decode.op_path().parent / "build.lock"
    lock_path.parent.mkdir(parents=True)
    said: list[str] = []
    with open(lock_path, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # another build (flock: per open file, not process)
        with pytest.raises(int4_decode.BuildTimeout, match="another build held"):
            int4_decode.build_op(said.append, limit_s=2)
    assert said.count(int4_decode.WAITING) >= 2 and int4_decode.BUILDING not in said, said
