"""The one launcher of the systems under test, and the CPU accounting of what they run.

splitserve: always the supervisor as a library (``launch_cluster``), configured either by
`splitserve launch` flags as a user types them (parsed by the CLI's own parser, so a flag means
what it means there) or by config knobs, or both. llama.cpp: its own binaries, built from the
pinned source by scripts/build_llama_server.sh: `llama-server` as a process serving the OpenAI API.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil


def default_gguf() -> Path:
    """The GGUF splitserve's default model is served from: both peers read the same file."""
    from procs import model_store

    gguf = model_store.gguf_file(model_store.ensure_default_model())
    assert gguf is not None, "the default model directory holds its GGUF"
    return gguf


# --- CPU accounting ------------------------------------------------------------------------------
def cpu_of(pids: list[int]) -> float:
    """User+system CPU seconds of these processes (0 for any that has exited)."""
    total = 0.0
    for pid in pids:
        try:
            t = psutil.Process(pid).cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += t.user + t.system
    return total


def cpu_of_threads(tids: set[int]) -> float:
    return sum(t.user_time + t.system_time for t in psutil.Process().threads() if t.id in tids)


def cluster_cpu(cluster: Any) -> dict[str, float]:
    """CPU seconds of a cluster's processes per role, in the order requests flow through them."""
    flow = {"http": 0, "tokenizer": 1, "engine": 2, "detokenizer": 3}  # then any other role
    roles: dict[str, list[int]] = {}
    for child in sorted(cluster.children, key=lambda c: flow.get(c.role, 4)):
        roles.setdefault(child.role, []).append(child.popen.pid)
    return {role: cpu_of(pids) for role, pids in roles.items()}


def cpu_by_role(cluster: Any = None) -> dict[str, float]:
    """CPU seconds of this process (the client) and of each role of ``cluster`` (if any)."""
    return {"client": cpu_of([os.getpid()])} | (cluster_cpu(cluster) if cluster else {})


# --- splitserve ----------------------------------------------------------------------------------
def launch_args(text: str, *, http: bool = False) -> Any:
    """`splitserve launch` flags parsed by the CLI's own parser; ValueError if they do not parse."""
    from procs.cli import build_parser

    argv = ["launch", *shlex.split(text)] + (["--http-port", "0"] if http else [])
    try:
        return build_parser().parse_args(argv)
    except SystemExit:  # argparse has printed why
        raise ValueError(f"not a valid `splitserve launch` command line: {text!r}") from None


@contextlib.contextmanager
def splitserve(
    model: str | os.PathLike | None = None, *, flags: str = "", http: bool = False, **knobs: Any
) -> Iterator[Any]:
    """A running cluster: ``flags`` as `splitserve launch` takes them, then ``knobs`` (config
    fields) over them; ``http`` adds the OpenAI frontend on a free port."""
    from procs.cli import cluster_kwargs
    from procs.launch_cluster import launch_cluster

    args = launch_args(flags, http=http)
    with launch_cluster(
        model if model is not None else args.model,
        run_dir=args.run_dir,
        start_timeout_s=args.start_timeout_s,
        **(cluster_kwargs(args) | knobs),
    ) as cluster:
        yield cluster


class SplitserveServer:
    """A cluster with its OpenAI frontend, as `splitserve launch --http-port 0 FLAGS` serves."""

    def __init__(self, flags: str = "") -> None:
        self.name = f"splitserve {flags}".strip() if flags else "splitserve defaults"
        self.flags = flags
        self._stack = contextlib.ExitStack()
        self.cluster = self._stack.enter_context(splitserve(flags=flags, http=True))
        self.url = f"{self.cluster.http_url}/v1"

    def pids(self) -> list[int]:
        return [c.popen.pid for c in self.cluster.children]

    def cpu_seconds(self) -> float:
        return sum(cluster_cpu(self.cluster).values())

    def describe(self) -> str:
        from procs.thread_budget import describe_budget

        shown = "splitserve launch --http-port 0" + (f" {self.flags}" if self.flags else "")
        return f"{shown} ({describe_budget(self.cluster.config)})"

    def close(self) -> None:
        self._stack.close()


# --- llama.cpp -----------------------------------------------------------------------------------
class LlamaServer:
    """``llama-server`` with ``threads`` threads for both decode and prompt batches, ``parallel``
    slots of ``ctx_per_slot`` tokens each, the GGUF's own chat template (jinja). Its log outlives
    it only where it failed."""

    def __init__(
        self,
        binary: str,
        gguf: str | os.PathLike,
        threads: int,
        parallel: int = 32,
        ctx_per_slot: int = 512,
        extra_args: str = "",
        start_timeout_s: float = 180.0,
    ) -> None:
        from procs.cluster_setup import free_tcp_port

        self.name, self.keep_log = f"llama.cpp t{threads}", False
        self.log = tempfile.NamedTemporaryFile(
            "w+", prefix=f"llama-server-t{threads}-", suffix=".log", delete=False
        )
        port = free_tcp_port("127.0.0.1")
        self.command = [
            binary,
            *("-m", str(gguf), "--host", "127.0.0.1", "--port", str(port)),
            *("-t", str(threads), "-tb", str(threads), "-np", str(parallel)),
            *("-c", str(parallel * ctx_per_slot), "--jinja", "--no-webui"),
            *shlex.split(extra_args),
        ]
        self.popen = subprocess.Popen(
            self.command,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        self.url = f"http://127.0.0.1:{port}/v1"
        try:
            self._wait_healthy(port, start_timeout_s)
        except BaseException:
            self.keep_log = True
            self.close()
            raise

    def _wait_healthy(self, port: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if self.popen.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with status {self.popen.returncode} while starting; "
                    f"its log ({self.log.name}) ends:\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass  # not listening yet, or 503 while the model loads
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"{self.name} not healthy after {timeout_s:.0f} s; its log: {self.log.name}"
                )
            time.sleep(0.2)

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(Path(self.log.name).read_text(errors="replace").splitlines()[-lines:])

    def pids(self) -> list[int]:
        """llama-server and its live descendants."""
        try:
            children = psutil.Process(self.popen.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []
        return [self.popen.pid, *(p.pid for p in children)]

    def cpu_seconds(self) -> float:
        return cpu_of(self.pids())

    def describe(self) -> str:
        return " ".join(shlex.quote(c) for c in self.command)

    def close(self) -> None:
        if self.popen.poll() is None:
            # SIGTERM, not SIGINT: a background job's children may ignore SIGINT.
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.keep_log = True
                self.popen.kill()
                self.popen.wait()
        self.log.close()
        if not self.keep_log:
            Path(self.log.name).unlink(missing_ok=True)


def renice(servers: dict, niceness: int) -> None:
    """Every thread of every server process and of this client at ``niceness``. Linux keeps a
    niceness per thread (a thread started later inherits its starter's), so each running thread
    is set, not only each process's first one; and where the kernel groups each session for
    scheduling (autogroup: llama-server runs in its own session), a niceness only weighs inside
    its group, so the group's own is set too."""
    pids = [os.getpid()] + [pid for s in servers.values() for pid in s.pids()]
    for pid in pids:
        proc = psutil.Process(pid)
        for thread in proc.threads():
            os.setpriority(os.PRIO_PROCESS, thread.id, niceness)
        autogroup = Path(f"/proc/{pid}/autogroup")
        if autogroup.exists():
            autogroup.write_text(str(niceness))
