"""Start-up of a worker process: logging that names its role, and dying with the supervisor."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys

PR_SET_PDEATHSIG = 1
PARENT_PID_ENV = "SPLITSERVE_SUPERVISOR_PID"  # set by the supervisor for every child


def setup_logging(role: str, index: int | None = None, level: str | None = None) -> None:
    """Every line names the role (and index) and the pid: several processes share one stderr."""
    name = role if index is None else f"{role}-{index}"
    logging.basicConfig(
        level=(level or os.environ.get("SPLITSERVE_LOG_LEVEL", "INFO")).upper(),
        format=f"%(asctime)s {name} pid=%(process)d %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
        force=True,
    )


def under_supervisor() -> bool:
    return bool(os.environ.get(PARENT_PID_ENV))


def die_with_parent() -> None:
    """Asks Linux to SIGKILL us when the supervisor dies, however it dies."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    expected = os.environ.get(PARENT_PID_ENV)
    if expected and os.getppid() != int(expected):
        os._exit(1)  # the supervisor died before prctl took effect
