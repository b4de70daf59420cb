"""The client's request deadlines: a heap of (deadline, wire id), shared by the thread that
submits and the one that expires (the sync client has both)."""

from __future__ import annotations

import heapq
import threading
import time


class Deadlines:
    def __init__(self) -> None:
        self._heap: list[tuple[float, str]] = []
        self._lock = threading.Lock()

    def watch(self, deadline: float, wire_id: str) -> None:
        with self._lock:
            heapq.heappush(self._heap, (deadline, wire_id))

    def due(self, now: float) -> list[tuple[float, str]]:
        """Every (deadline, wire id) at or before ``now``, taken off the heap."""
        out = []
        with self._lock:
            while self._heap and self._heap[0][0] <= now:
                out.append(heapq.heappop(self._heap))
        return out

    def next_ms(self, cap_ms: int) -> int:
        """Milliseconds until the next deadline, at most ``cap_ms``."""
        with self._lock:
            if not self._heap:
                return cap_ms
            first = self._heap[0][0]
        return max(0, min(cap_ms, int((first - time.monotonic()) * 1000) + 1))
