"""The two servers of the peer benchmark, each a real process started as a user starts it:
llama.cpp's ``llama-server`` on the GGUF, and ``splitserve launch --http-port``. Both expose
the OpenAI API; both are stopped (their whole process tree) when closed."""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[2]


def default_gguf() -> Path:
    """The GGUF splitserve's default model is served from: both servers read the same file."""
    from procs import model_store

    return model_store.gguf_file(model_store.ensure_default_model())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tree_cpu_seconds(pid: int) -> float:
    """User+system CPU seconds of a process and its live descendants."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    total = 0.0
    for proc in procs:
        try:
            t = proc.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += t.user + t.system
    return total


class _Server:
    name: str
    url: str  # base URL ending in /v1
    popen: subprocess.Popen

    def __init__(self, name: str) -> None:
        self.name = name
        self.keep_log = False  # a server's log outlives it only where it failed
        self.log = tempfile.NamedTemporaryFile(
            prefix=f"peer-{re.sub(r'[^a-z0-9]+', '-', name)}-",
            suffix=".log",
            delete=False,
            mode="w+",
        )

    def cpu_seconds(self) -> float:
        return tree_cpu_seconds(self.popen.pid)

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(Path(self.log.name).read_text(errors="replace").splitlines()[-lines:])

    def _check_alive(self) -> None:
        if self.popen.poll() is not None:
            self.keep_log = True  # the error below names it
            raise RuntimeError(
                f"{self.name} exited with status {self.popen.returncode} "
                f"while starting; its log ({self.log.name}) ends:\n"
                f"{self.log_tail()}"
            )

    def close(self) -> None:
        if self.popen.poll() is None:
            # Both shut down cleanly on SIGTERM (SIGINT may be ignored: a background job's
            # children inherit that).
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


class LlamaServer(_Server):
    """``llama-server`` with ``threads`` threads for both decode and prompt batches, ``parallel``
    slots of ``ctx_per_slot`` tokens each, the GGUF's own chat template (jinja)."""

    def __init__(
        self,
        binary: str,
        gguf: str,
        threads: int,
        parallel: int = 32,
        ctx_per_slot: int = 512,
        extra_args: str = "",
        start_timeout_s: float = 180.0,
    ):
        super().__init__(f"llama.cpp t{threads}")
        self.threads, self.parallel = threads, parallel
        port = free_port()
        self.command = [
            binary,
            "-m",
            gguf,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "-t",
            str(threads),
            "-tb",
            str(threads),
            "-np",
            str(parallel),
            "-c",
            str(parallel * ctx_per_slot),
            "--jinja",
            "--no-webui",
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
        deadline = time.monotonic() + start_timeout_s
        while True:
            self._check_alive()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass  # not listening yet, or 503 while the model loads
            if time.monotonic() > deadline:
                self.keep_log = True
                self.close()
                raise RuntimeError(
                    f"{self.name} not healthy after {start_timeout_s:.0f} s; "
                    f"its log: {self.log.name}"
                )
            time.sleep(0.2)

    def describe(self) -> str:
        return " ".join(shlex.quote(c) for c in self.command)


class SplitserveServer(_Server):
    """``splitserve launch --http-port 0 ARGS`` from this checkout (the CLI a user runs)."""

    def __init__(self, args: str = "", start_timeout_s: float = 300.0) -> None:
        super().__init__(f"splitserve {args}".strip() if args else "splitserve defaults")
        self.args = args
        self.command = [
            sys.executable,
            "-m",
            "procs.cli",
            "launch",
            "--http-port",
            "0",
            *shlex.split(args),
        ]
        env = dict(os.environ, PYTHONPATH=str(REPO), SPLITSERVE_LOG_LEVEL="INFO")
        self.popen = subprocess.Popen(
            self.command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=REPO,
            env=env,
            text=True,
            start_new_session=True,
        )
        self.budget = ""
        found = threading.Event()
        holder: dict[str, str] = {}

        def pump() -> None:  # copies the output to the log, noting the API's address
            for line in self.popen.stdout:
                self.log.write(line)
                self.log.flush()
                if m := re.search(r"OpenAI API: (\S+/v1)", line):
                    holder["url"] = m.group(1)
                    found.set()
                if "CPU budget" in line:
                    self.budget = line.split("CPU budget", 1)[1].strip(" :\n")

        self._pump = threading.Thread(target=pump, name=f"{self.name}-log", daemon=True)
        self._pump.start()
        deadline = time.monotonic() + start_timeout_s
        while not found.wait(0.2):
            self._check_alive()
            if time.monotonic() > deadline:
                self.keep_log = True
                self.close()
                raise RuntimeError(
                    f"{self.name} printed no API address in "
                    f"{start_timeout_s:.0f} s; its log: {self.log.name}"
                )
        self.url = holder["url"]

    def describe(self) -> str:
        shown = "splitserve launch --http-port 0" + (f" {self.args}" if self.args else "")
        return shown + (f" ({self.budget})" if self.budget else "")

    def close(self) -> None:
        super().close()
        self._pump.join(timeout=5)
