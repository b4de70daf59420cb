"""The SDK's record of a request keeps the thinking apart: each delta carries its piece as
``reasoning``, the result joins them, and ``text`` holds the answer only; the events round-trip
the codec with the field."""

from __future__ import annotations

from ipc import codec
from ipc.client.records import RequestRecord
from ipc.codec import pack_ids
from ipc.messages import ClientEvents, StreamEvent


def test_reasoning_pieces_join_apart_from_the_text():
    events = [
        StreamEvent("r", reasoning="weigh ", token_ids=pack_ids([1])),
        StreamEvent("r", reasoning="it", token_ids=pack_ids([2])),
        StreamEvent("r", text="9.8", token_ids=pack_ids([3]), finished=True, finish_reason="stop"),
    ]
    wire = codec.decode(codec.encode(ClientEvents(events)))
    record = RequestRecord("r", "r", None)
    deltas = [record.apply(e, float(i)) for i, e in enumerate(wire.events)]
    assert [d.reasoning for d in deltas] == ["weigh ", "it", ""]
    result = record.result()
    assert (result.reasoning, result.text, result.token_ids) == ("weigh it", "9.8", [1, 2, 3])
