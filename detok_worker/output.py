"""What the detokenizer's core hands its process loop each pass (``DetokenizerOutput``; see
core.py for each part), and what it keeps per client."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from ipc.messages import ClusterNotice, StreamEvent
from ipc.messages.queries import EngineStatsReport, TokenizeResult

EVERY_REPLICA = -1  # an abort's replica when the request's is not known here


@dataclass(slots=True)
class DetokenizerOutput:
    welcomes: list[bytes] = field(default_factory=list)
    events: dict[bytes, list[StreamEvent]] = field(default_factory=dict)
    notices: dict[bytes, list[ClusterNotice]] = field(default_factory=dict)
    replies: dict[bytes, list[TokenizeResult | EngineStatsReport]] = field(default_factory=dict)
    aborts: list[tuple[str, int]] = field(default_factory=list)


class ClientInfo:
    __slots__ = ("request_ids", "pending_aborts")

    def __init__(self) -> None:
        self.request_ids: set[str] = set()
        # Aborts for requests not seen here yet, oldest first. Some never show up (ended before
        # the abort arrived, lost with a worker): the oldest are forgotten past the cap, which
        # is safe because every abort also goes to the engine at once.
        self.pending_aborts: OrderedDict[str, None] = OrderedDict()
