"""What a ClusterNotice "a worker died" means for a client's open requests: which are lost,
with what error, and whether they may be sent again (decided from the records alone)."""

from __future__ import annotations

from collections.abc import Mapping

from ipc.client.records import HandleBase, unavailable_event
from ipc.messages import NOTICE_DIED, ClusterNotice, StreamEvent


def lost_with(
    notice: ClusterNotice, records: Mapping[str, HandleBase]
) -> tuple[list[tuple[str, StreamEvent]], bool]:
    """(the open requests lost with the dead worker, each with its terminal event; whether they
    may be sent again). A tokenizer's: those sent to it that the detokenizer does not list alive
    (they never reached the engine; they may be sent again). The only engine's: every open
    generation (queries never reach an engine). One engine replica of several: every open
    generation that produced nothing and is not listed alive on another replica (sent again)."""
    if notice.event != NOTICE_DIED or notice.role not in ("tokenizer", "engine"):
        return [], False
    detail = f" ({notice.detail})" if notice.detail else ""
    # list(): atomic against a submitting thread.
    open_records = [(wid, h.record) for wid, h in list(records.items())]
    if notice.role == "engine" and not notice.resend_unstarted:
        message = f"unavailable: the engine died{detail}; the request was lost with it"
        lost = [wid for wid, record in open_records if not record.query]
        return [(wid, unavailable_event(wid, message)) for wid in lost], False
    tokenizer = notice.role == "tokenizer"
    message = (
        f"unavailable: tokenizer worker {notice.index} died{detail} before the request "
        "reached the engine"
        if tokenizer
        else f"unavailable: engine replica {notice.index} died{detail} before the "
        "request produced anything"
    ) + ", and it could not be sent again; retry it"
    alive = set(notice.alive_ids)
    lost = [
        wid
        for wid, record in open_records
        if (record.tokenizer == notice.index if tokenizer else not record.query)
        and not record.seen
        and wid not in alive
    ]
    return [(wid, unavailable_event(wid, message)) for wid in lost], True
