"""Starting one HTTP frontend process by hand for a cluster a test already runs (the supervisor
starts its own through procs.run_worker, never through these)."""

from __future__ import annotations

import sys
import time
import urllib.error
import urllib.request
from typing import Any


def frontend_command(
    client_addr: str,
    *,
    port: int,
    host: str = "127.0.0.1",
    index: int = 0,
    reuse_port: bool = False,
    model_name: str = "",
    extra_args: tuple[str, ...] = (),
) -> list[str]:
    """The command line that starts one frontend (``python -m http_worker.worker``); run it with
    the repository root as cwd or on PYTHONPATH."""
    cmd = [sys.executable, "-m", "http_worker.worker", "--client-addr", client_addr]
    cmd += ["--host", host, "--port", str(port), "--index", str(index)]
    if reuse_port:
        cmd.append("--reuse-port")
    if model_name:
        cmd += ["--model-name", model_name]
    return cmd + list(extra_args)


def wait_until_serving(base_url: str, popen: Any = None, timeout_s: float = 60.0) -> None:
    """Blocks until GET {base_url}/health answers 200; raises if ``popen`` exits or time runs
    out. /health succeeding means the handshake and one round trip through every process."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        if popen is not None and popen.poll() is not None:
            raise RuntimeError(f"the frontend exited with code {popen.returncode} during start-up")
        try:
            with urllib.request.urlopen(f"{base_url}/health", timeout=5) as reply:
                if reply.status == 200:
                    return
        except urllib.error.HTTPError as exc:
            last = f"HTTP {exc.code}"
        except OSError as exc:
            last = str(exc)
        time.sleep(0.1)
    raise TimeoutError(f"{base_url} not serving after {timeout_s:.0f} s ({last})")
