"""Every message kind round-trips; malformed frames are rejected with DecodeError, never crash."""

from __future__ import annotations

from unittest.mock import patch

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ipc import codec
from ipc.codec import DecodeError, decode, encode, pack_ids, unpack_id_list
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
    KVDescriptor,
    KVExportAsk,
    KVHandoverReply,
    KVImportAsk,
    KVNetDone,
    KVNetRegion,
    KVRelease,
    LogprobEntry,
    PrefilledRequest,
    PromptLogprobs,
    ReplicaLoad,
    RequestError,
    RequestMeta,
    RequestStart,
    RequestTimings,
    SamplingParams,
    StepOutput,
    StreamEvent,
    SubmitRequest,
    TokenizedRequest,
    TokenLogprobs,
    TopLogprob,
    Usage,
    WorkerFailed,
    WorkerReady,
)
from ipc.messages.queries import (
    EngineStatsQuery,
    EngineStatsReport,
    ReplicaStats,
    TokenizeRequest,
    TokenizeResult,
)
from ipc.salvage import salvage_fields
from ipc.structured import GrammarVocabulary

META = RequestMeta(
    request_id="r1", client_id=b"c1", prompt_tokens=3, stop=["\n"], t_submit=1.5, t_tokenized=2.0
)
SAMPLING = SamplingParams(
    max_tokens=8, temperature=0.7, top_p=0.9, top_k=20, seed=3, stop=["END"], stop_token_ids=[2]
)
# Every issue-15 field away from its default (logit_bias: integer map keys on the wire).
SCORING = SamplingParams(
    max_tokens=0,
    logprobs=5,
    prompt_logprobs=20,
    echo=True,
    min_p=0.1,
    logit_bias={7: -100.0, 49151: 2.5},
    include_stop_str_in_output=True,
)
SCORING_META = RequestMeta(
    request_id="r4",
    client_id=b"c1",
    prompt_tokens=3,
    prompt_token_ids=pack_ids([1, 2, 3]),
    echo=True,
    prompt_logprobs=True,
    include_stop_str_in_output=True,
)
ENTRY = LogprobEntry(
    42,
    " the",
    -0.25,
    b" the",
    [TopLogprob(42, " the", -0.25, b" the"), TopLogprob(7, "\ufffd", -3.5, b"\xe2\x80")],
)

EXAMPLES = [
    SubmitRequest("r1", b"c1", SAMPLING, prompt="héllo ✓", t_submit=1.0),
    SubmitRequest("r2", b"c1", SamplingParams(), messages=[ChatMessage("user", "hi")]),
    SubmitRequest("r3", b"c1", SamplingParams(), prompt_token_ids=pack_ids([1, 2, 3])),
    TokenizedRequest("r1", pack_ids([5, 6]), SAMPLING, META),
    TokenizedRequest("r4", pack_ids([1, 2, 3]), SCORING, SCORING_META),
    RequestError("r1", b"c1", "too long", "bad_request", 1.0),
    AbortRequests(["a", "b"]),
    StepOutput(
        step=3,
        t_step=9.0,
        new_requests=[META],
        request_ids=["r1"],
        token_ids=pack_ids([42]),
        started=[RequestStart("r1", 1.0, 2.0, 16)],
        finished=[
            FinishRecord("r1", "stop"),
            FinishRecord("r2", "error", "too long", "bad_request"),
        ],
        stats=EngineStats(running=1, step_ms=2.5),
        engine_pid=77,
    ),
    StepOutput(
        step=4,
        t_step=9.5,
        request_ids=["r1", "r2"],
        token_ids=pack_ids([42, 43]),
        logprobs=[TokenLogprobs(1, -0.5, pack_ids([43, 9]), b"\x00" * 8)],
        prompt_logprobs=[PromptLogprobs("r4", 1, b"\x00" * 8, 1, pack_ids([5, 6]), b"\x00" * 8)],
    ),
    ClientHello(b"c1"),
    ClientWelcome(["ipc:///x"], "m", 2048, 49152),
    ClientAbort(["r1"]),
    ClientBye(),
    ClientEvents(
        [
            StreamEvent(
                "r1",
                "txt",
                pack_ids([1]),
                True,
                "length",
                None,
                None,
                Usage(3, 1, 0),
                RequestTimings(t_submit=1.0),
            )
        ]
    ),
    ClientEvents(
        [
            StreamEvent(
                "r4",
                "x",
                pack_ids([42]),
                logprobs=[ENTRY],
                prompt_logprobs=[LogprobEntry(1, "<s>", None, b"<s>"), ENTRY],
                echo_text="<s> the",
            )
        ]
    ),
    WorkerReady("engine", 0, 123, ["ipc:///e"], "m", 2048, 49152),
    Heartbeat("tokenizer", 1, 124, 5.0, {"served": 3.0}),
    WorkerFailed("engine", 0, 123, "model_type 'bogus' is not supported"),
    ClusterNotice("died", "tokenizer", 1, 125, "exited with code -9", ["r1"]),
    GrammarVocabulary(8, b"<e>ab\xc3", pack_ids([3, 4, 5, 6]), pack_ids([0]), [0], "f00d"),
    SubmitRequest(
        "r4",
        b"c1",
        SamplingParams(),
        messages=[ChatMessage("user", "hi")],
        chat_template_kwargs={"enable_thinking": False, "n": [1, {"x": None}]},
        continuous_usage_stats=True,
    ),
    TokenizeRequest(
        "q1",
        b"c1",
        messages=[ChatMessage("user", "hi")],
        add_special_tokens=False,
        chat_template_kwargs={"enable_thinking": False},
        return_token_strs=True,
    ),
    TokenizeRequest("q2", b"c1", detokenize_ids=pack_ids([1, 2])),
    TokenizeRequest("q3", b"c1", info=True),
    TokenizeResult("q1", b"c1", pack_ids([1, 2]), "", 2048, ["a", "b"]),
    TokenizeResult(
        "q3",
        b"c1",
        info={"eos_token": "</s>", "bos_token": None, "n": 3.5, "nested": {"a": [1, "x"]}},
    ),
    EngineStatsQuery("q4"),
    EngineStatsReport(
        "q4",
        EngineStats(running=2, waiting=1, kv_blocks_used=3, kv_blocks_total=8, preemptions_total=4),
        9.5,
        77,
    ),
    EngineStatsReport(
        "q5",
        EngineStats(running=3),
        9.5,
        78,
        [ReplicaStats(0, EngineStats(running=1), 9.0, 77), ReplicaStats(1, EngineStats(running=2))],
        "cache_aware",
        {"cache_hit": 5, "balanced": 2},
        0.0004,
    ),
    ClusterNotice("died", "engine", 1, 126, "killed", ["r2"], resend_unstarted=True),
    ReplicaLoad(
        index=1,
        pid=78,
        running=3,
        waiting=2,
        kv_usage=0.25,
        received_from=[4, 0],
        kv_blocks_available=17,
    ),
    PrefilledRequest(
        request_id="r9",
        token_ids=pack_ids([5, 6, 7, 8]),
        prompt_len=3,
        sampling=SamplingParams(temperature=0.7, seed=4),
        meta=RequestMeta("r9", b"c", 3, decode_index=1),
        kv=KVDescriptor(7, "shm", "/dev/shm/x-0-1", 4, 4096, 1, 2, 2, 16, 8, "bfloat16", 4),
        prefill_index=0,
        generator_state=b"\x01\x02",
        t_arrived=1.5,
        t_export_start=2.5,
    ),
    KVRelease(transfer_ids=[7, 8], imported=[True, False], decode_index=1),
    KVExportAsk("r1", pack_ids([1, 2, 3]), "ipc:///tmp/x/kv-handover-replies", "salt"),
    KVImportAsk(
        "r1",
        pack_ids([1, 2, 3]),
        KVDescriptor(
            9, "net", "10.0.0.2:15000", 3, 4096, 1, 2, 2, 16, 8, "float32", 3, 1 << 40, 64
        ),
        "ipc:///tmp/y/kv-handover-replies",
    ),
    KVHandoverReply("r1", blocks=4, seconds=0.002),
    KVHandoverReply("r2", error="no full block of the prompt is cached"),
    KVNetRegion("r1", "mooncake-tcp", "192.0.2.1:15001", [2**47 + 4096, 2**40], [2048, 64]),
    KVNetDone("r1", ok=True, nbytes=2112, seconds=0.12),
]


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    assert decode(encode(msg)) == msg


def test_every_registered_kind_has_an_example():
    assert {type(m).KIND for m in EXAMPLES} == set(codec._REGISTRY)


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"x": b"bytes"}, "JSON value"),
        ({"x": float("nan")}, "finite"),
        ({"messages": []}, "may not set 'messages'"),
        ({"add_generation_prompt": False}, "may not set"),
        ({"a": [[[[[[[[[1]]]]]]]]]}, "deeper"),
        ({"a": list(range(5000))}, "more than"),
        ({f"k{i}": 1 for i in range(65)}, "at most 64 keys"),
        ({"": 1}, "non-empty strings"),
    ],
)
def test_chat_template_kwargs_are_bounded_json(kwargs, fragment):
    for make in (
        lambda: SubmitRequest(
            "r",
            b"c",
            SamplingParams(),
            chat_template_kwargs=kwargs,
            messages=[ChatMessage("user", "hi")],
        ),
        lambda: TokenizeRequest(
            "q", b"c", chat_template_kwargs=kwargs, messages=[ChatMessage("user", "hi")]
        ),
    ):
        with pytest.raises(ValueError, match=fragment):
            make()


@pytest.mark.parametrize(
    "make, fragment",
    [
        (
            lambda: SubmitRequest(
                "r", b"c", SamplingParams(), prompt="x", chat_template_kwargs={"a": 1}
            ),
            "chat messages only",
        ),
        (lambda: TokenizeRequest("q", b"c"), "exactly one"),
        (lambda: TokenizeRequest("q", b"c", prompt="x", info=True), "exactly one"),
        (lambda: TokenizeRequest("q", b"c", prompt=""), "empty"),
        (lambda: TokenizeRequest("q", b"c", messages=[]), "empty"),
    ],
)
def test_invalid_queries_are_refused(make, fragment):
    with pytest.raises(ValueError, match=fragment):
        make()


def test_ids_are_packed_int32():
    assert unpack_id_list(pack_ids([0, 1, 49151, 2**31 - 1])) == [0, 1, 49151, 2**31 - 1]


@pytest.mark.parametrize(
    "obj, fragment",
    [
        ([1, 2], "must be a map"),
        ({"x": 1}, "no 'kind'"),
        ({"kind": "nope"}, "unknown message kind"),
        ({"kind": "abort"}, "missing field 'request_ids'"),
        ({"kind": "abort", "request_ids": "a"}, "expected a list"),
        ({"kind": "abort", "request_ids": [1]}, "expected str"),
        ({"kind": "abort", "request_ids": [], "extra": 1}, "unknown field"),
        (
            {
                "kind": "submit",
                "request_id": "r",
                "client_id": b"c",
                "prompt": "p",
                "sampling": {"max_tokens": 0},
            },
            "max_tokens",
        ),
        (
            {"kind": "submit", "request_id": "r", "client_id": b"c", "sampling": {}},
            "exactly one of",
        ),
        (
            {
                "kind": "submit",
                "request_id": "r",
                "client_id": "not-bytes",
                "prompt": "p",
                "sampling": {},
            },
            "expected bytes",
        ),
        (
            {"kind": "step", "step": 1, "t_step": 0.0, "finished": [{"request_id": "r"}]},
            "missing field 'reason'",
        ),
        (
            {
                "kind": "step",
                "step": 1,
                "t_step": 0.0,
                "finished": [{"request_id": "r", "reason": "stop", "code": 3}],
            },
            r"finished\[0\]\.code",
        ),
        ({"kind": "step", "step": 1, "t_step": 0.0, "finished": ["r"]}, "expected a map"),
        (
            {
                "kind": "submit",
                "request_id": "r",
                "client_id": b"c",
                "prompt": "p",
                "sampling": {"logit_bias": {"7": 1.0}},
            },
            r"logit_bias key: expected an integer",
        ),
        (
            {
                "kind": "submit",
                "request_id": "r",
                "client_id": b"c",
                "prompt": "p",
                "sampling": {"logit_bias": {7: 101.0}},
            },
            r"logit_bias values must be numbers in",
        ),
        (
            {
                "kind": "submit",
                "request_id": "r",
                "client_id": b"c",
                "prompt": "p",
                "sampling": {"logprobs": 21},
            },
            r"logprobs must be an integer in \[0, 20\]",
        ),
        (
            {"kind": "heartbeat", "role": "e", "index": 0, "pid": 1, "t": 0.0, "stats": {3: 1.0}},
            "stats key: expected str",
        ),
        (
            {"kind": "step", "step": 1, "t_step": 0.0, "logprobs": [{"row": 0}]},
            "missing field 'logprob'",
        ),
    ],
)
def test_malformed_maps_are_rejected(obj, fragment):
    with pytest.raises(DecodeError, match=fragment):
        decode(msgpack.packb(obj, use_bin_type=True))


def test_an_error_finish_always_carries_a_code():
    """A sender that leaves an error's code out gets "internal", on both sides of the wire."""
    record = FinishRecord("r1", "error", "boom")
    assert record.code == "internal" and FinishRecord("r2", "stop").code == ""
    frame = msgpack.packb(
        {
            "kind": "step",
            "step": 1,
            "t_step": 0.0,
            "finished": [{"request_id": "r1", "reason": "error", "error": "boom"}],
        },
        use_bin_type=True,
    )
    assert decode(frame).finished == [record]


def test_invalid_utf8_is_a_decode_error_and_still_attributable():
    good = msgpack.packb(
        {
            "kind": "submit",
            "request_id": "r9",
            "client_id": b"c9",
            "prompt": "PLACEHOLDER",
            "sampling": {},
        },
        use_bin_type=True,
    )
    bad = good.replace(b"PLACEHOLDER", b"\xff\xfe\xfdPLACEHOL")
    with pytest.raises(DecodeError, match="UTF-8"):
        decode(bad)
    assert salvage_fields(bad, "request_id", "client_id") == {
        "request_id": "r9",
        "client_id": b"c9",
    }


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
    st.none()
    | st.booleans()
    | st.integers(-(2**40), 2**40)
    | st.floats(allow_nan=True)
    | st.text(max_size=8)
    | st.binary(max_size=8),
    # Map keys: strings, and integers (the codec accepts them where a field's type says so).
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.text(max_size=12) | st.integers(-(2**40), 2**40), inner, max_size=4)
    ),
    max_leaves=12,
)


_bodies = st.dictionaries(
    st.sampled_from(
        [
            "request_id",
            "client_id",
            "sampling",
            "prompt",
            "messages",
            "token_ids",
            "meta",
            "request_ids",
            "events",
            "step",
            "t_step",
            "stats",
            "x",
        ]
    ),
    _values,
    max_size=6,
)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(sorted(codec._REGISTRY)), _bodies)
def test_random_maps_of_known_kinds_decode_or_raise_decode_error(kind, body):
    try:
        decode(msgpack.packb({"kind": kind, **body}, use_bin_type=True))
    except DecodeError:
        pass


def test_max_tokens_zero_only_scores_a_prompt():
    assert SamplingParams(max_tokens=0, echo=True).scores_prompt
    assert SamplingParams(max_tokens=0, prompt_logprobs=0).max_tokens == 0
    with pytest.raises(ValueError, match="0 only with echo or prompt_logprobs"):
        SamplingParams(max_tokens=0, logprobs=1)
    with pytest.raises(ValueError, match="min_tokens .* must not exceed"):
        SamplingParams(max_tokens=2, min_tokens=3)


def _decoded_strictly(frame: bytes) -> str:
    """The message or the error, every map decoded field by field in field order (the codec's
    reference way; its fast way must read every frame the same)."""

    def strictly(cls, obj, where, skip=""):
        if not isinstance(obj, dict):
            raise DecodeError(f"{where}: expected a map, got {codec._type_name(obj)}")
        body = {k: v for k, v in obj.items() if not (skip and k == skip)}
        return codec._decode_strictly(cls, body, where)

    with patch.object(codec, "_decode_dataclass", strictly):
        return _decoded(frame)


def _decoded(frame: bytes) -> str:
    try:
        return repr(decode(frame))
    except DecodeError as exc:
        return f"DecodeError: {exc}"


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: type(m).__name__)
def test_the_fast_decode_reads_examples_as_the_strict_one(msg):
    frame = encode(msg)
    assert _decoded(frame) == _decoded_strictly(frame)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(sorted(codec._REGISTRY)), _bodies)
def test_the_fast_decode_reads_random_maps_as_the_strict_one(kind, body):
    frame = msgpack.packb({"kind": kind, **body}, use_bin_type=True)
    assert _decoded(frame) == _decoded_strictly(frame)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(EXAMPLES), st.data())
def test_the_fast_decode_reads_altered_examples_as_the_strict_one(msg, data):
    """Near-valid maps: an example with one field (or a field of a nested map) replaced,
    removed or added."""
    wire = codec.unpack_frame(encode(msg))  # a copy: the example stays as it is
    target = wire
    nested = [k for k, v in wire.items() if isinstance(v, dict) and v]
    if nested and data.draw(st.booleans()):
        target = wire[data.draw(st.sampled_from(sorted(nested)))]
    key = data.draw(st.sampled_from(sorted({*map(str, target), "x"} - {"kind"})))
    if data.draw(st.booleans()):
        target[key] = data.draw(_values | st.booleans() | st.integers(0, 3))
    else:
        target.pop(key, None)
    frame = msgpack.packb(wire, use_bin_type=True)
    assert _decoded(frame) == _decoded_strictly(frame)


def test_fields_at_their_defaults_stay_off_the_wire_and_come_back():
    event = StreamEvent("r", text="a", usage=Usage(3, 0), finished=False, step_ms=0.0)
    wire = codec.to_wire(ClientEvents(events=[event]))
    assert wire["events"] == [
        {"request_id": "r", "text": "a", "usage": {"prompt_tokens": 3, "completion_tokens": 0}}
    ]
    assert decode(encode(ClientEvents(events=[event]))) == ClientEvents(events=[event])
    # Of another type than the default, a value is written (and refused as it always was).
    odd = StreamEvent("r", finished=0)  # type: ignore[arg-type]
    with pytest.raises(DecodeError, match="finished"):
        decode(encode(ClientEvents(events=[odd])))


@pytest.mark.parametrize(
    "body",
    [{"events": [{"": None}]}, {"events": [{"request_id": "r", "": 1}]}, {"events": [], "": 0}],
)
def test_an_empty_field_name_is_unknown_at_every_depth(body):
    frame = msgpack.packb({"kind": "events", **body}, use_bin_type=True)
    assert "unknown field(s) ''" in _decoded(frame) == _decoded_strictly(frame)
