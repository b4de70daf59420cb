"""Background work at a lower OS priority than the engine's step (DESIGN.md, "Sharing the CPU").

Linux keeps a nice value per thread, and any thread may raise its own (lower its priority)
without privilege: ``os.setpriority(PRIO_PROCESS, native thread id, n)``. Raising the engine's
priority would need privilege that users and CI do not have, so the other roles lower their
background threads instead (grammar checks, long prompts' encoding, large bodies' parsing):
when the cores are contended the scheduler gives the engine's threads ~10x the share of a thread
10 steps nicer (weights 1024 vs 110). The supervisor hands the tokenizer workers and the HTTP
frontends the cluster's ``background_niceness`` in ``BACKGROUND_NICENESS_ENV``; a process
without it (a test, a Ray replica) lowers nothing.
"""

from __future__ import annotations

import logging
import os
import threading

BACKGROUND_NICENESS_ENV = "SPLITSERVE_BACKGROUND_NICENESS"
MAX_NICENESS = 19

logger = logging.getLogger("splitserve.priority")


def background_niceness() -> int:
    """How much nicer this process's background threads run (0: as nice as the rest)."""
    try:
        return max(0, int(os.environ.get(BACKGROUND_NICENESS_ENV, "0")))
    except ValueError:
        return 0


def lower_this_thread(by: int | None = None) -> int:
    """Makes the calling thread ``by`` (default: ``background_niceness()``) nicer than it is,
    up to 19; returns its nice value afterwards. Where the OS has no per-thread priority (not
    Linux) or refuses, the thread goes on as it was."""
    by = background_niceness() if by is None else by
    if not hasattr(os, "setpriority") or not hasattr(threading, "get_native_id"):
        return 0
    thread = threading.get_native_id()
    current = os.getpriority(os.PRIO_PROCESS, thread)
    wanted = min(MAX_NICENESS, current + max(0, by))
    if wanted != current:
        try:
            os.setpriority(os.PRIO_PROCESS, thread, wanted)
        except OSError as exc:
            logger.warning("could not lower the priority of thread %d: %s", thread, exc)
            return current
    return wanted


def thread_niceness(native_id: int) -> int:
    """A thread's nice value (for tests and /proc-less reports)."""
    return os.getpriority(os.PRIO_PROCESS, native_id)
