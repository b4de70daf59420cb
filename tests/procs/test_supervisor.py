"""The supervisor as a process: `splitserve launch`, SIGTERM with requests in flight, SIGKILL."""

from __future__ import annotations

import io
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ipc.client import Client
from procs.cli import build_parser, cluster_kwargs
from procs.cluster_setup import make_config
from runtime.worker import write_line

FAKE_ENGINE = "tests.procs.fake_engine:make"
REPO = Path(__file__).resolve().parents[2]


class Launched:
    def __init__(self, run_dir: Path, *extra: str, env: dict | None = None) -> None:
        self.run_dir = run_dir
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "procs.cli", "launch", "--run-dir", str(run_dir), *extra],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **(env or {})},
        )
        self.stderr: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()
        self.client_addr = None
        for line in self.proc.stdout:
            if line.startswith("client address: "):
                self.client_addr = line.split(": ", 1)[1].strip()
                break
        assert self.client_addr, "the supervisor never printed its client address"

    def _pump(self) -> None:
        for line in self.proc.stderr:
            self.stderr.append(line)

    def child_pids(self, expected: int) -> list[int]:
        """The pids of the children's start-up lines (every child printed one before the
        supervisor printed its address; the pump thread may still be reading them)."""
        deadline = time.monotonic() + 30
        while True:
            pids = [
                int(m.group(1))
                for line in list(self.stderr)
                if (m := re.search(r"^splitserve \w+\[\d+\] pid=(\d+) ready", line))
            ]
            if len(pids) >= expected or time.monotonic() > deadline:
                return pids
            time.sleep(0.05)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:  # a zombie is dead; once its parent is gone, reaping it is init's job
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _wait_all_gone(pids: list[int], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(_gone(p) for p in pids):
            return True
        time.sleep(0.05)
    return False


def test_sigterm_with_requests_in_flight(tmp_path):
    run_dir = tmp_path / "run"
    sup = Launched(run_dir, "--tokenizer-workers", "2", "--engine-factory", FAKE_ENGINE)
    pids = sup.child_pids(4)
    assert len(pids) == 4
    with Client(sup.client_addr, deadline_s=60) as client:
        handles = [client.submit("in flight " * 3, max_tokens=240) for _ in range(8)]
        next(handles[0].stream(timeout=30))  # generation is under way
        sup.proc.send_signal(signal.SIGTERM)
        time.sleep(0.03)  # the tokenizers are draining now: new submits are refused, loudly
        late = [client.submit("too late", max_tokens=240) for _ in range(4)]
        results = [h.result(timeout=30, check=False) for h in handles]
        late_results = [h.result(timeout=30, check=False) for h in late]
    # Each ends: generating ones finish or are aborted; one still queued in a draining
    # tokenizer (possible on a loaded machine) is refused as unavailable, never lost.
    for r in results:
        assert r.finish_reason in ("abort", "length") or (
            r.error_code == "unavailable" and "shutting down" in r.error
        ), r
    assert any(r.finish_reason == "abort" for r in results)
    for r in late_results:
        assert r.finish_reason == "abort" or (
            r.error_code == "unavailable" and "shutting down" in r.error
        )
    assert sup.proc.wait(timeout=30) == 0
    assert _wait_all_gone(pids)
    assert not run_dir.exists()


def test_a_start_up_line_reaches_stderr_in_one_write(monkeypatch):
    """Children run with PYTHONUNBUFFERED=1, where stderr writes through at every write() call:
    a line written as text, then newline (print()) let a second child's line land in between
    under load, and the test above read 3 ready lines of 4 (one glued onto another)."""
    chunks: list[bytes] = []

    class Raw(io.RawIOBase):
        def writable(self) -> bool:
            return True

        def write(self, data) -> int:
            chunks.append(bytes(data))
            return len(data)

    unbuffered = io.TextIOWrapper(Raw(), write_through=True, line_buffering=True)
    monkeypatch.setattr(sys, "stderr", unbuffered)
    print("splitserve engine[0] pid=1 ready: ipc://e", file=sys.stderr, flush=True)
    assert chunks == [b"splitserve engine[0] pid=1 ready: ipc://e", b"\n"]  # what it did
    chunks.clear()
    write_line("splitserve engine[0] pid=1 ready: ipc://e")
    assert chunks == [b"splitserve engine[0] pid=1 ready: ipc://e\n"]


def test_children_die_with_a_killed_supervisor(tmp_path):
    sup = Launched(tmp_path / "run", "--engine-factory", FAKE_ENGINE)
    pids = sup.child_pids(3)
    assert len(pids) == 3
    sup.proc.kill()
    sup.proc.wait()
    assert _wait_all_gone(pids)


def test_help_explains_every_knob():
    help_text = build_parser()._subparsers._group_actions[0].choices["launch"].format_help()
    for flag in (
        "--model",
        "--tokenizer-workers",
        "--engine-threads",
        "--max-batch-size",
        "--prefill-max-batch-size",
        "--prefill-max-tokens",
        "--prefill-chunk-tokens",
        "--kv-cache-tokens",
        "--block-size",
        "--no-prefix-cache",
        "--stream-interval-tokens",
        "--transport",
        "--port",
        "--run-dir",
    ):
        assert flag in help_text


def test_shutdown_waits_for_a_stop_the_watcher_began(tmp_path):
    """A failure makes the watcher thread stop the children (restart_policy=shutdown, or a slot
    out of restarts) and Cluster.wait() returns at once; the shutdown() that follows must not
    return, close the sockets and remove the run directory while that stop is still going."""
    from ipc.config import ClusterConfig
    from procs.launch_cluster import Child, Cluster

    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    config = ClusterConfig.build(str(tmp_path), str(run_dir))
    cluster = Cluster(config, owns_run_dir=True)
    # An "engine" that takes 7 s to exit after SIGTERM: longer than shutdown()'s 5 s join.
    slow = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import signal, sys, time\n"
                "signal.signal(signal.SIGTERM, lambda *a: (time.sleep(7), sys.exit(0)))\n"
                "print('up', flush=True)\n"
                "time.sleep(60)\n"
            ),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert slow.stdout.readline().strip() == "up"
        cluster.children.append(Child("engine", 0, slow))
        failing = threading.Thread(target=cluster._stop_children)  # what the watcher does
        failing.start()
        time.sleep(0.3)
        cluster.shutdown()
        assert slow.poll() is not None, "shutdown() returned with a child still running"
    finally:
        if slow.poll() is None:
            slow.kill()
            slow.wait()


def test_speculative_flags_parse_into_the_engine_config(tiny_model_dir):
    model = str(tiny_model_dir)
    launch = ["launch", "--model", model]
    argv = [*launch, "--speculative", "ngram", "--num-speculative-tokens", "5"]
    argv += ["--prompt-lookup-min", "1", "--prompt-lookup-max", "3", "--speculative-max-batch", "4"]
    config, _ = make_config(model, None, **cluster_kwargs(build_parser().parse_args(argv)))
    engine = config.engine
    assert (engine.speculative, engine.num_speculative_tokens) == ("ngram", 5)
    assert (engine.prompt_lookup_min, engine.prompt_lookup_max) == (1, 3)
    assert engine.speculative_max_batch == 4
    default, _ = make_config(model, None, **cluster_kwargs(build_parser().parse_args(launch)))
    assert default.engine.speculative == "off"
    with pytest.raises(SystemExit):
        build_parser().parse_args([*launch, "--speculative", "eagle"])
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        make_config(model, None, prompt_lookup_min=4, prompt_lookup_max=2)
