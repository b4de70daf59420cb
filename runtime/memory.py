"""Handing memory a process freed back to the system once it is idle.

glibc's malloc keeps freed memory in its heaps for reuse: after a burst (a step's transient
buffers, a grammar check, logits for prompt logprobs) a process's RSS stays at its high-water
mark although nothing holds that memory. ``malloc_trim`` returns it; on the default model's
engine it took ~30 ms and returned 0.3-0.4 GB after each phase of 60-90 requests (see
docs/operations-memory.md). ``IdleTrim`` calls it once per idle period, never while there is
work, so no request waits on it. Elsewhere than glibc it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import time

TRIM_MIN_INTERVAL_S = 1.0


def _malloc_trim():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


_TRIM = _malloc_trim()


def release_free_memory() -> bool:
    """Returns the heaps' free memory to the system; False where that is not possible."""
    if _TRIM is None:
        return False
    _TRIM(0)
    return True


class IdleTrim:
    """Call ``busy()`` when work was done and ``idle()`` when a wait for work ran out: the
    first idle call after some work trims (at most every ``min_interval_s``)."""

    def __init__(self, min_interval_s: float = TRIM_MIN_INTERVAL_S) -> None:
        self.min_interval_s = min_interval_s
        self._dirty = False
        self._last = 0.0
        self.trims = 0

    def busy(self) -> None:
        self._dirty = True

    def idle(self) -> None:
        now = time.monotonic()
        if self._dirty and now - self._last >= self.min_interval_s:
            self._dirty = False
            self._last = now
            if release_free_memory():
                self.trims += 1
