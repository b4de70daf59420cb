"""The engine's abort bookkeeping: aborts of live requests wait for the next step, and aborts
that overtook their request (an abort and a submit travel on different sockets) are remembered,
so the request ends the moment it arrives."""

from __future__ import annotations

from collections import OrderedDict

REMEMBERED_ABORTS = 100_000  # ids aborted before they arrived, newest kept


class AbortBook:
    def __init__(self, remembered: int = REMEMBERED_ABORTS) -> None:
        self.remembered = remembered
        self._live: set[str] = set()  # running or waiting requests to end at the next step
        self._before_arrival: OrderedDict[str, None] = OrderedDict()
        self._arrived: list[str] = []  # arrived after their abort: end at the next step

    def abort(self, request_id: str, live: bool) -> None:
        if live:
            self._live.add(request_id)
            return
        self._before_arrival[request_id] = None
        self._before_arrival.move_to_end(request_id)
        while len(self._before_arrival) > self.remembered:
            self._before_arrival.popitem(last=False)

    def arrived(self, request_id: str) -> bool:
        """A request arrives: True if it was aborted already (it is then only to be ended)."""
        if request_id not in self._before_arrival:
            return False
        del self._before_arrival[request_id]
        self._arrived.append(request_id)
        return True

    def pending(self) -> bool:
        """Whether the next step has aborts to report."""
        return bool(self._live or self._arrived)

    def take(self) -> tuple[list[str], list[str]]:
        """(requests that arrived already aborted, live requests to end), emptied."""
        arrived, live = self._arrived, sorted(self._live)
        self._arrived, self._live = [], set()
        return arrived, live
