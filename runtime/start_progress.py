"""Long start-up work says, while it runs, that its worker is alive: the supervisor's start
timeout counts a worker's silence, not its work (a first launch builds our int4 kernel, a minute
or more of g++ on a loaded machine).

The worker's main thread wraps its start in ``reporting(send)``; the long work calls
``alive(doing)`` between short waits. Only calls from the thread that entered ``reporting``
reach ``send``: the supervisor link is a ZeroMQ socket, not thread-safe."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

_reporter: tuple[int, Callable[[str], None]] | None = None


@contextlib.contextmanager
def reporting(send: Callable[[str], None]) -> Iterator[None]:
    global _reporter
    previous, _reporter = _reporter, (threading.get_ident(), send)
    try:
        yield
    finally:
        _reporter = previous


def alive(doing: str) -> None:
    """Tells the supervisor (where a worker is starting, from its thread) what it is doing."""
    reporter = _reporter
    if reporter is not None and reporter[0] == threading.get_ident():
        reporter[1](doing)
