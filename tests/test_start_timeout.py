"""The start timeout counts a child's silence, not its work (procs/supervision.py ``wait_ready``):
an engine whose start outlasts ``start_timeout_s`` but heartbeats meanwhile (a first launch
building our int4 kernel) starts, and the supervisor says once what it is doing; one silent that
long still fails the start with one line. Real processes: the supervisor, its workers, a
stand-in engine whose start takes a set time (tests/procs/fake_engine.py), and for the kernel
the real engine on the tiny model with a slow g++ in front of the real one."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import zmq

from engine_worker import int4_decode
from ipc.client import Client
from ipc.messages import Heartbeat, WorkerReady
from ipc.sockets import PullQueue
from procs.children import REPO_ROOT
from procs.cluster_setup import make_config
from procs.launch_cluster import launch_cluster
from procs.supervision import ClusterStartError
from tests.procs.fake_engine import START_S_ENV

TIMEOUT_S = 8.0  # the start timeout; each stand-in engine takes longer to start
BUILDING = "tests.procs.fake_engine:make_building"


def test_an_engine_that_beats_past_the_start_timeout_starts(monkeypatch, capfd):
    """The tokenizer and detokenizer start beside it (their start does not wait for the
    engine's), wait past the start timeout for its limits without failing the start, and serve."""
    monkeypatch.setenv(START_S_ENV, str(TIMEOUT_S + 5))
    t0, wall0 = time.monotonic(), time.time()
    with launch_cluster(
        None, tokenizer_workers=1, engine_factory=BUILDING, start_timeout_s=TIMEOUT_S
    ) as cluster:
        took = time.monotonic() - t0
        engine = cluster.child("engine")
        assert engine is not None and engine.ready is not None
        started = {n: psutil.Process(pid).create_time() - wall0 for n, pid in cluster.pids.items()}
        assert started["tokenizer[0]"] < TIMEOUT_S and started["detokenizer[0]"] < TIMEOUT_S
        assert cluster.config.model_name == "fake-echo"
        with Client(cluster.client_addr) as client:
            assert client.submit("after a long start", max_tokens=2).result(timeout=30).ok
    assert took > TIMEOUT_S + 5, took
    err = capfd.readouterr().err
    line = f"splitserve engine[0] pid={engine.popen.pid}: building a stand-in for a kernel"
    assert err.count(line) == 1, err


def test_an_engine_silent_past_the_start_timeout_fails_the_start(monkeypatch):
    monkeypatch.setenv(START_S_ENV, "60")
    t0 = time.monotonic()
    with (
        pytest.raises(ClusterStartError) as failed,
        launch_cluster(
            None,
            tokenizer_workers=1,
            engine_factory="tests.procs.fake_engine:make_silent",
            start_timeout_s=TIMEOUT_S,
        ),
    ):
        pass
    assert str(failed.value) == f"not ready after {TIMEOUT_S:.0f} s: engine[0]"
    assert TIMEOUT_S < time.monotonic() - t0 < TIMEOUT_S + 15


SLOW_GXX = """#!/bin/sh
sleep {sleep_s}
exec {gxx} "$@"
"""


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.skipif(
    shutil.which("g++") is None or not int4_decode.cpu_supported(), reason="no g++ / AVX-512 BF16"
)
def test_a_first_launch_whose_kernel_build_outlasts_the_start_timeout_serves_on_it(
    tiny_model_dir, tmp_path, monkeypatch, capfd
):
    """A fresh cache and a g++ that first sleeps past the start timeout, then compiles: the
    engine beats while it builds, the cluster starts and its engine serves on our kernel."""
    timeout_s = 20  # the engine's silent parts (torch's import, the tiny model's load) fit in it
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    gxx = bin_dir / "g++"
    gxx.write_text(SLOW_GXX.format(sleep_s=timeout_s + 2, gxx=shutil.which("g++")))
    gxx.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SPLITSERVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("SPLITSERVE_LOG_LEVEL", "INFO")
    monkeypatch.delenv(int4_decode.NO_BUILD, raising=False)
    with launch_cluster(
        tiny_model_dir,
        tokenizer_workers=1,
        weights="int4",
        dtype="bfloat16",
        int4_kernel="own",
        kv_cache_tokens=2048,
        start_timeout_s=timeout_s,
    ) as cluster:
        assert cluster.child("engine").ready is not None
    err = capfd.readouterr().err
    assert err.count(f": {int4_decode.BUILDING}") == 1, err
    assert "int4 on our kernel" in err and "unavailable" not in err, err
    assert list(Path(tmp_path, "cache").glob("kernels/*/int4_decode_op.so"))


def test_a_sigterm_ends_a_start_in_long_work_at_once(tmp_path, monkeypatch):
    """The engine worker alone (python -m procs.run_worker), its supervisor socket read here:
    it beats while its start runs, and a SIGTERM then ends it within seconds, not after the
    work (a first launch's kernel build: minutes)."""
    monkeypatch.setenv(START_S_ENV, "120")
    config, _ = make_config(None, run_dir=str(tmp_path), engine_factory=BUILDING)
    ctx = zmq.Context()
    inbox = PullQueue(ctx, config.supervisor_addr, WorkerReady, Heartbeat)
    worker = subprocess.Popen(
        [sys.executable, "-m", "procs.run_worker", "engine", "0", str(config.write())],
        cwd=REPO_ROOT,
        env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)),
    )
    try:
        assert inbox.wait(60_000), "no heartbeat"
        beat = inbox.get()
        assert isinstance(beat, Heartbeat) and beat.doing == "building a stand-in for a kernel"
        t0 = time.monotonic()
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(timeout=10) == 0
        assert time.monotonic() - t0 < 5
    finally:
        worker.kill()
        inbox.close()
        ctx.destroy(linger=0)
