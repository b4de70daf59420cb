"""The engine's start builds our int4 kernel where this torch has no build (engine_worker/
int4_decode.py ``load_op``): two starts at once on an empty cache build it once, under the cache's
lock, and both load it. Skipped where it cannot be built (no g++, no AVX-512 BF16/VNNI)."""

from __future__ import annotations

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
