"""Every message kind round-trips; malformed frames are rejected with DecodeError, never crash."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ipc import codec
from ipc.codec import DecodeError, decode, encode, pack_ids, salvage_fields, unpack_id_list
from ipc.messages import (
    AbortRequests,
    ChatMessage,
    ClientAbort,
    ClientBye,
    ClientEvents,
    ClientHello,
    ClientWelcome,
    ClusterNotice,
    EngineStats,
    FinishRecord,
    Heartbeat,
    RequestError,
    RequestMeta,
    RequestStart,
    RequestTimings,
    SamplingParams,
    StepOutput,
    StreamEvent,
    SubmitRequest,
    TokenizedRequest,
    Usage,
    WorkerReady,
)
from ipc.structured import GrammarVocabulary

META = RequestMeta(request_id="r1", client_id=b"c1", prompt_tokens=3, stop=["\n"],
                   t_submit=1.5, t_tokenized=2.0)
SAMPLING = SamplingParams(max_tokens=8, temperature=0.7, top_p=0.9, top_k=20, seed=3,
                          stop=["END"], stop_token_ids=[2])

EXAMPLES = [
    SubmitRequest("r1", b"c1", SAMPLING, prompt="héllo ✓", t_submit=1.0),
    SubmitRequest("r2", b"c1", SamplingParams(), messages=[ChatMessage("user", "hi")]),
    SubmitRequest("r3", b"c1", SamplingParams(), prompt_token_ids=pack_ids([1, 2, 3])),
    TokenizedRequest("r1", pack_ids([5, 6]), SAMPLING, META),
    RequestError("r1", b"c1", "too long", "bad_request", 1.0),
    AbortRequests(["a", "b"]),
    StepOutput(step=3, t_step=9.0, new_requests=[META], request_ids=["r1"],
               token_ids=pack_ids([42]), started=[RequestStart("r1", 1.0, 2.0, 16)],
               finished=[FinishRecord("r1", "stop"),
                         FinishRecord("r2", "error", "too long", "bad_request")],
               stats=EngineStats(running=1, step_ms=2.5), engine_pid=77),
    ClientHello(b"c1"),
    ClientWelcome(["ipc:///x"], "m", 2048, 49152),
    ClientAbort(["r1"]),
    ClientBye(),
    ClientEvents([StreamEvent("r1", "txt", pack_ids([1]), True, "length", None, None,
                              Usage(3, 1, 0), RequestTimings(t_submit=1.0))]),
    WorkerReady("engine", 0, 123, ["ipc:///e"], "m", 2048, 49152),
    Heartbeat("tokenizer", 1, 124, 5.0, {"served": 3.0}),
    ClusterNotice("died", "tokenizer", 1, 125, "exited with code -9", ["r1"]),
    GrammarVocabulary(8, b"<e>ab\xc3", pack_ids([3, 4, 5, 6]), pack_ids([0]), [0], "f00d"),
]


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    assert decode(encode(msg)) == msg


def test_every_registered_kind_has_an_example():
    assert {type(m).KIND for m in EXAMPLES} == set(codec._REGISTRY)


def test_ids_are_packed_int32():
    assert unpack_id_list(pack_ids([0, 1, 49151, 2**31 - 1])) == [0, 1, 49151, 2**31 - 1]


@pytest.mark.parametrize("obj, fragment", [
    ([1, 2], "must be a map"),
    ({"x": 1}, "no 'kind'"),
    ({"kind": "nope"}, "unknown message kind"),
    ({"kind": "abort"}, "missing field 'request_ids'"),
    ({"kind": "abort", "request_ids": "a"}, "expected a list"),
    ({"kind": "abort", "request_ids": [1]}, "expected str"),
    ({"kind": "abort", "request_ids": [], "extra": 1}, "unknown field"),
    ({"kind": "submit", "request_id": "r", "client_id": b"c", "prompt": "p",
      "sampling": {"max_tokens": 0}}, "max_tokens"),
    ({"kind": "submit", "request_id": "r", "client_id": b"c", "sampling": {}},
     "exactly one of"),
    ({"kind": "submit", "request_id": "r", "client_id": "not-bytes", "prompt": "p",
      "sampling": {}}, "expected bytes"),
    ({"kind": "step", "step": 1, "t_step": 0.0, "finished": [{"request_id": "r"}]},
     "missing field 'reason'"),
    ({"kind": "step", "step": 1, "t_step": 0.0,
      "finished": [{"request_id": "r", "reason": "stop", "code": 3}]}, r"finished\[0\]\.code"),
    ({"kind": "step", "step": 1, "t_step": 0.0, "finished": ["r"]}, "expected a map"),
])
def test_malformed_maps_are_rejected(obj, fragment):
    with pytest.raises(DecodeError, match=fragment):
        decode(msgpack.packb(obj, use_bin_type=True))


def test_an_error_finish_always_carries_a_code():
    """A sender that leaves an error's code out gets "internal", on both sides of the wire."""
    record = FinishRecord("r1", "error", "boom")
    assert record.code == "internal" and FinishRecord("r2", "stop").code == ""
    frame = msgpack.packb({"kind": "step", "step": 1, "t_step": 0.0, "finished": [
        {"request_id": "r1", "reason": "error", "error": "boom"}]}, use_bin_type=True)
    assert decode(frame).finished == [record]


def test_invalid_utf8_is_a_decode_error_and_still_attributable():
    good = msgpack.packb({"kind": "submit", "request_id": "r9", "client_id": b"c9",
                          "prompt": "PLACEHOLDER", "sampling": {}}, use_bin_type=True)
    bad = good.replace(b"PLACEHOLDER", b"\xff\xfe\xfdPLACEHOL")
    with pytest.raises(DecodeError, match="UTF-8"):
        decode(bad)
    assert salvage_fields(bad, "request_id", "client_id") == {"request_id": "r9",
                                                              "client_id": b"c9"}


def test_salvage_reads_nested_paths_and_never_raises():
    frame = encode(TokenizedRequest("r1", pack_ids([1]), SamplingParams(), META))
    assert salvage_fields(frame, "meta.client_id") == {"meta.client_id": b"c1"}
    assert salvage_fields(b"\xc1garbage", "request_id") == {}


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=256))
def test_random_bytes_never_crash_the_decoder(data):
    try:
        decode(data)
    except DecodeError:
        pass
    salvage_fields(data, "request_id", "client_id")


_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats(allow_nan=True)
    | st.text(max_size=8) | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner,
                                                                 max_size=4),
    max_leaves=12)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(sorted(codec._REGISTRY)), st.dictionaries(
    st.sampled_from(["request_id", "client_id", "sampling", "prompt", "messages", "token_ids",
                     "meta", "request_ids", "events", "step", "t_step", "stats", "x"]),
    _values, max_size=6))
def test_random_maps_of_known_kinds_decode_or_raise_decode_error(kind, body):
    try:
        decode(msgpack.packb({"kind": kind, **body}, use_bin_type=True))
    except DecodeError:
        pass
