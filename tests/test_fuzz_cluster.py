"""Hostile input at the cluster's sockets (issue 7 item 3, DESIGN.md properties 3 and 4).

Hypothesis throws malformed msgpack, wrong types, unknown kinds and fields, invalid UTF-8,
out-of-vocabulary and negative token ids, NaN/negative/huge sampling parameters and weird chat
messages, sent raw (no SDK) to a tokenizer's ingress, straight to the engine's ingress and to the
detokenizer's client ROUTER of a real cluster on the tiny model. Every frame that names a request
and a client (so it can be attributed) must end with exactly one terminal event at that client,
an error with code ``bad_request`` where the input is known to be wrong; afterwards a normal
request still succeeds and no process died or was replaced.

Example counts are moderate so the whole file runs in well under a minute; raise them with
SPLITSERVE_FUZZ_EXAMPLES for a longer hunt.
"""

from __future__ import annotations

import itertools
import os
import struct
import time
from collections import defaultdict

import msgpack
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ipc import codec
from ipc.client import Client
from ipc.messages import (
    ERR_DUPLICATE_REQUEST,
    ClientEvents,
    ClientHello,
    ClientWelcome,
    SamplingParams,
    SubmitRequest,
)
from procs.launch_cluster import launch_cluster

EXAMPLES = int(os.environ.get("SPLITSERVE_FUZZ_EXAMPLES", "150"))
DEADLINE_S = 30.0
MAX_MODEL_LEN = 64  # bounds every accidentally valid request to a few dozen tokens
# Derandomized by default so CI replays the same examples; SPLITSERVE_FUZZ_RANDOM=1 explores.
FUZZ_SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    derandomize=not os.environ.get("SPLITSERVE_FUZZ_RANDOM"),
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@pytest.fixture(scope="module")
def cluster(tiny_model_dir):
    with launch_cluster(
        str(tiny_model_dir),
        tokenizer_workers=1,
        max_model_len=MAX_MODEL_LEN,
        kv_cache_tokens=4096,
        max_batch_size=16,
    ) as c:
        yield c


class RawClient:
    """A client speaking the wire protocol by hand: it counts every event per request, so a
    second terminal event (or an event after the terminal one) would not go unnoticed."""

    def __init__(self, cluster) -> None:
        self.ctx = zmq.Context()
        self.client_id = b"fuzz-" + os.urandom(4).hex().encode()
        self.dealer = self.ctx.socket(zmq.DEALER)
        self.dealer.setsockopt(zmq.IDENTITY, self.client_id)
        self.dealer.setsockopt(zmq.LINGER, 0)
        self.dealer.connect(cluster.client_addr)
        self.dealer.send(codec.encode(ClientHello(self.client_id)))
        assert self.dealer.poll(int(DEADLINE_S * 1000)), "no welcome"
        codec.decode_as(self.dealer.recv(), ClientWelcome)
        self.pushes = {}
        for name, addr in (
            ("tokenizer", cluster.config.tokenizer_addr(0)),
            ("engine", cluster.config.engine_addr(0)),
        ):
            push = self.ctx.socket(zmq.PUSH)
            push.setsockopt(zmq.LINGER, 0)
            push.connect(addr)
            self.pushes[name] = push
        self.events: dict[str, list] = defaultdict(list)
        # Terminal events of refused copies of a live id (they carry the live id, their code
        # tells them apart): one per copy sent, never counted against the live request.
        self.refused_copies: dict[str, list] = defaultdict(list)
        self.after_terminal: list[str] = []
        self._ids = itertools.count()

    def new_id(self) -> str:
        return f"{self.client_id.decode()}:{next(self._ids):08d}"  # fixed length: stable draws

    def send(self, where: str, frame: bytes) -> None:
        self.pushes[where].send(frame)

    def pump(self, timeout_ms: int) -> None:
        if not self.dealer.poll(timeout_ms):
            return
        while True:
            try:
                frame = self.dealer.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            for event in codec.decode_as(frame, ClientEvents).events:  # strict: must decode
                if event.error_code == ERR_DUPLICATE_REQUEST:
                    self.refused_copies[event.request_id].append(event)
                    continue
                seen = self.events[event.request_id]
                if any(e.finished for e in seen):
                    self.after_terminal.append(event.request_id)
                seen.append(event)

    def terminal(self, rid: str, timeout_s: float = DEADLINE_S):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            final = [e for e in self.events.get(rid, []) if e.finished]
            if final:
                return final[0]
            self.pump(50)
        raise AssertionError(f"request {rid!r} got no terminal event within {timeout_s} s (lost)")

    def check_exactly_once(self) -> None:
        self.pump(300)
        assert not self.after_terminal, f"events after a terminal one: {self.after_terminal[:5]}"
        doubles = [rid for rid, evs in self.events.items() if sum(e.finished for e in evs) > 1]
        assert not doubles, f"more than one terminal event: {doubles[:5]}"

    def close(self) -> None:
        self.ctx.destroy(linger=0)


@pytest.fixture(scope="module")
def raw(cluster):
    client = RawClient(cluster)
    yield client
    client.close()


@pytest.fixture(scope="module")
def tally():
    counts = defaultdict(lambda: defaultdict(int))
    yield counts
    print("\nfuzz tally (input | frames | attributable | ended correctly | lost):")
    for name, c in counts.items():
        print(f"  {name} | {c['frames']} | {c['attributable']} | {c['ended']} | 0")


# --- strategies ---------------------------------------------------------------------------------

wild = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.binary(max_size=12),
    st.lists(st.one_of(st.integers(-3, 50000), st.text(max_size=4)), max_size=4),
    st.dictionaries(st.text(max_size=6), st.integers(-(2**63), 2**64 - 1), max_size=2),
)
sampling_fields = st.sampled_from(
    [
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "stop",
        "stop_token_ids",
        "ignore_eos",
        "skip_special_tokens",
        "bogus",
    ]
)
bad_numbers = st.sampled_from(
    [float("nan"), float("inf"), -float("inf"), -1, -1.5, 0, -(2**63), 2**64 - 1, 1e308]
)
invalid_utf8 = st.binary(min_size=1, max_size=40).filter(lambda b: not _is_utf8(b))
token_ids = st.one_of(
    st.lists(st.integers(-(2**31), 2**31 - 1), min_size=0, max_size=8),
    st.lists(st.integers(0, 49151), min_size=MAX_MODEL_LEN, max_size=MAX_MODEL_LEN + 8),
)


def _is_utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def _msgpack_str(raw_bytes: bytes) -> bytes:
    """A msgpack *str* holding arbitrary bytes (msgpack-python would refuse to write this)."""
    n = len(raw_bytes)
    head = (
        bytes([0xA0 | n])
        if n < 32
        else (b"\xd9" + bytes([n]) if n < 256 else b"\xda" + struct.pack(">H", n))
    )
    return head + raw_bytes


def _with_raw_str(body: dict, field: str, raw_bytes: bytes, nested: str | None = None) -> bytes:
    placeholder = "\x00PLACEHOLDER\x00"
    if nested:
        body[nested][field] = placeholder
    else:
        body[field] = placeholder
    frame = msgpack.packb(body, use_bin_type=True)
    return frame.replace(msgpack.packb(placeholder), _msgpack_str(raw_bytes))


def _pack_ids(ids: list[int]) -> bytes:
    return np.asarray(ids, dtype="<i8").astype("<i4").tobytes() if ids else b""


def _valid_sampling(sampling: dict) -> bool:
    try:
        SamplingParams(**sampling)
        return True
    except (TypeError, ValueError):
        return False


def _with_sampling(draw, body: dict, how: str):
    """A wild value in one sampling field ("sampling"), or a bad number ("bad_number", which must
    fail unless it happens to be valid)."""
    if how == "sampling":
        body["sampling"][draw(sampling_fields)] = draw(wild)
        return msgpack.packb(body), True, None
    body["sampling"][
        draw(st.sampled_from(["temperature", "top_p", "top_k", "max_tokens", "seed"]))
    ] = draw(bad_numbers)
    return msgpack.packb(body), True, not _valid_sampling(body["sampling"])


# --- the tokenizer's ingress ----------------------------------------------------------------------


@st.composite
def submit_frames(draw, rid: str, cid: bytes):
    """(frame, attributable, must_fail) for a SubmitRequest-shaped frame with one defect."""
    body = {
        "kind": "submit",
        "request_id": rid,
        "client_id": cid,
        "sampling": {"max_tokens": 2, "temperature": 0.0},
        "prompt": "hello there",
    }
    how = draw(
        st.sampled_from(
            [
                "sampling",
                "bad_number",
                "field",
                "utf8",
                "ids",
                "kind",
                "messages",
                "unknown_field",
                "raw",
                "request_id",
                "truncated",
            ]
        )
    )
    if how in ("sampling", "bad_number"):
        return _with_sampling(draw, body, how)
    if how == "field":
        field = draw(
            st.sampled_from(
                [
                    "prompt",
                    "messages",
                    "prompt_token_ids",
                    "sampling",
                    "add_generation_prompt",
                    "t_submit",
                ]
            )
        )
        body[field] = draw(wild)
        return msgpack.packb(body), True, None
    if how == "utf8":
        return _with_raw_str(body, "prompt", draw(invalid_utf8)), True, True
    if how == "ids":
        del body["prompt"]
        return _with_ids(draw, body, "prompt_token_ids", min_raw=1)
    if how == "kind":
        body["kind"] = draw(st.text(max_size=10).filter(lambda k: k != "submit"))
        return msgpack.packb(body), True, True
    if how == "messages":
        del body["prompt"]
        body["messages"] = draw(
            st.lists(
                st.one_of(
                    st.fixed_dictionaries(
                        {
                            "role": st.sampled_from(["user", "system", "assistant", ""]),
                            "content": st.text(max_size=20),
                        }
                    ),
                    st.dictionaries(st.text(max_size=6), wild, max_size=3),
                    wild,
                ),
                max_size=3,
            )
        )
        return msgpack.packb(body), True, None
    if how == "unknown_field":
        body[draw(st.text(min_size=1, max_size=8).filter(lambda k: k not in body))] = draw(wild)
        return msgpack.packb(body), True, True
    if how == "raw":
        return draw(st.binary(max_size=64)), False, None
    if how == "request_id":
        body["request_id"] = draw(wild.filter(lambda v: not isinstance(v, str)))
        return msgpack.packb(body), False, None
    frame = msgpack.packb(body)  # truncated: msgpack that ends early
    return frame[: draw(st.integers(0, len(frame) - 1))], False, None


def _check(raw, tally, name, rid, frame, attributable, must_fail):
    tally[name]["frames"] += 1
    if not attributable:
        return
    tally[name]["attributable"] += 1
    final = raw.terminal(rid)
    assert final.finish_reason in ("stop", "length", "abort", "error")
    if must_fail:
        assert final.finish_reason == "error" and final.error_code == "bad_request", (frame, final)
        assert final.error
    if final.finish_reason == "error":
        assert final.error and final.error_code, final
    tally[name]["ended"] += 1


def test_fuzz_tokenizer_ingress(raw, tally):
    @FUZZ_SETTINGS
    @given(st.data())
    def run(data):
        rid = raw.new_id()
        frame, attributable, must_fail = data.draw(submit_frames(rid, raw.client_id))
        raw.send("tokenizer", frame)
        _check(raw, tally, "tokenizer ingress", rid, frame, attributable, must_fail)

    run()
    raw.check_exactly_once()


# --- the engine's ingress (internal, but reachable by anyone who can reach the run dir) ----------


def _with_ids(draw, body: dict, key: str, min_raw: int):
    """``body[key]`` = packed ids (maybe out of vocabulary or too many) or raw bytes; the frame
    must fail unless they are a valid packed prompt."""
    body[key] = packed = draw(
        st.one_of(st.just(_pack_ids(draw(token_ids))), st.binary(min_size=min_raw, max_size=11))
    )
    ok = (
        packed
        and len(packed) % 4 == 0
        and all(0 <= i < 49152 for i in np.frombuffer(packed, "<i4"))
        and len(packed) // 4 < MAX_MODEL_LEN
    )
    return msgpack.packb(body), True, not ok


@st.composite
def tokenized_frames(draw, rid: str, cid: bytes):
    meta = {"request_id": rid, "client_id": cid, "prompt_tokens": 3}
    body = {
        "kind": "tokenized",
        "request_id": rid,
        "token_ids": _pack_ids([5, 6, 7]),
        "sampling": {"max_tokens": 2, "temperature": 0.0},
        "meta": meta,
    }
    how = draw(
        st.sampled_from(
            [
                "ids",
                "sampling",
                "bad_number",
                "meta",
                "meta_id",
                "stop",
                "unknown_field",
                "utf8_stop",
                "raw",
            ]
        )
    )
    if how == "ids":
        return _with_ids(draw, body, "token_ids", min_raw=0)
    if how in ("sampling", "bad_number"):
        return _with_sampling(draw, body, how)
    if how == "meta":
        field = draw(
            st.sampled_from(
                [
                    "prompt_tokens",
                    "stop",
                    "skip_special_tokens",
                    "tokenizer_index",
                    "t_submit",
                    "t_tokenized",
                    "bogus",
                ]
            )
        )
        meta[field] = draw(wild)
        return msgpack.packb(body), True, None
    if how == "meta_id":
        meta["request_id"] = rid + "-other"
        return msgpack.packb(body), False, None  # the error goes to meta's id (checked below)
    if how == "stop":
        meta["stop"] = draw(st.lists(st.text(max_size=6), max_size=4))
        body["sampling"]["max_tokens"] = 8
        return msgpack.packb(body), True, None
    if how == "unknown_field":
        body[draw(st.text(min_size=1, max_size=8).filter(lambda k: k not in body))] = draw(wild)
        return msgpack.packb(body), True, True
    if how == "utf8_stop":
        meta["stop"] = ["x"]
        frame = msgpack.packb(body)
        return (
            frame.replace(msgpack.packb(["x"]), b"\x91" + _msgpack_str(draw(invalid_utf8))),
            True,
            True,
        )
    return draw(st.binary(max_size=64)), False, None


def test_fuzz_engine_ingress(raw, tally):
    @FUZZ_SETTINGS
    @given(st.data())
    def run(data):
        rid = raw.new_id()
        frame, attributable, must_fail = data.draw(tokenized_frames(rid, raw.client_id))
        raw.send("engine", frame)
        _check(raw, tally, "engine ingress", rid, frame, attributable, must_fail)
        if rid + "-other" in frame.decode("latin-1"):  # meta names another id: it gets the error
            final = raw.terminal(rid + "-other")
            assert final.error_code == "bad_request" and "differs" in final.error

    run()
    raw.check_exactly_once()


# --- the detokenizer's client ROUTER --------------------------------------------------------------

client_messages = st.one_of(
    st.binary(max_size=64),
    st.builds(
        lambda kind, body: msgpack.packb({"kind": kind, **body}),
        st.sampled_from(
            ["hello", "client_abort", "bye", "events", "welcome", "step", "submit", "nonsense"]
        ),
        st.dictionaries(
            st.sampled_from(["client_id", "request_ids", "events", "extra"]), wild, max_size=3
        ),
    ),
    st.builds(
        lambda ids: msgpack.packb({"kind": "client_abort", "request_ids": ids}),
        st.lists(st.text(max_size=30), max_size=5),
    ),
)


def test_fuzz_client_router(cluster, raw, tally):
    ctx = zmq.Context()
    hostile = ctx.socket(zmq.DEALER)
    hostile.setsockopt(zmq.LINGER, 0)
    hostile.connect(cluster.client_addr)
    try:

        @FUZZ_SETTINGS
        @given(st.lists(client_messages, min_size=1, max_size=3))
        def run(frames):
            hostile.send_multipart(frames)  # several frames: a message the ROUTER must drop
            for frame in frames:
                hostile.send(frame)
            tally["client ROUTER"]["frames"] += 2 * len(frames)

        run()
        # Whatever the ROUTER was sent, the raw client is still served, by the book.
        rid = raw.new_id()
        raw.send(
            "tokenizer",
            msgpack.packb(
                {
                    "kind": "submit",
                    "request_id": rid,
                    "client_id": raw.client_id,
                    "sampling": {"max_tokens": 3, "temperature": 0.0, "ignore_eos": True},
                    "prompt": "still here",
                }
            ),
        )
        final = raw.terminal(rid)
        assert final.finish_reason == "length" and final.usage.completion_tokens == 3
    finally:
        ctx.destroy(linger=0)
    raw.check_exactly_once()


def test_a_prompt_over_the_decoding_limit_is_still_answered(raw):
    rid = raw.new_id()
    raw.send(
        "tokenizer",
        msgpack.packb(
            {
                "kind": "submit",
                "request_id": rid,
                "client_id": raw.client_id,
                "sampling": {"max_tokens": 2},
                "prompt": "x" * (codec.MAX_STR_BYTES + 1),
            }
        ),
    )
    final = raw.terminal(rid)
    assert final.error_code == "bad_request" and "max_str_len" in final.error
    raw.check_exactly_once()


def test_copies_of_a_live_request_id_each_get_an_error_and_leave_it_alone(raw):
    """Issue 23 item 12: five submits with one id, straight to a tokenizer worker's socket (the
    SDK never does this; the wire is the contract). The first runs to its end with all its
    tokens; each copy ends with one error of its own code (it used to get nothing)."""
    rid = raw.new_id()
    sampling = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)  # outlives copies
    frame = codec.encode(SubmitRequest(rid, raw.client_id, sampling, prompt="hi"))
    for _ in range(5):
        raw.send("tokenizer", frame)
    final = raw.terminal(rid)
    assert final.finish_reason == "length" and final.usage.completion_tokens == 48
    deadline = time.monotonic() + DEADLINE_S
    while len(raw.refused_copies[rid]) < 4 and time.monotonic() < deadline:
        raw.pump(50)
    copies = raw.refused_copies[rid]
    assert len(copies) == 4 and all(c.finished and "already in flight" in c.error for c in copies)
    raw.check_exactly_once()


def test_a_raw_submit_asking_more_than_the_context_ends_at_once(raw):
    """Issue 23 item 7: max_tokens 2**64-1 or 2**31 on a tokenizer's own socket kept the engine
    busy for ~95 s; past the wire's int32 it is a malformed frame, within it past the room."""
    for max_tokens, words in (
        (2**64 - 1, "max_tokens must be an integer in [0, 2147483647]"),
        (2**31, "max_tokens must be an integer"),
        (2**31 - 1, "at most"),
    ):
        rid = raw.new_id()
        frame = {
            "kind": "submit",
            "request_id": rid,
            "client_id": raw.client_id,
            "sampling": {"max_tokens": max_tokens},
            "prompt": "hi",
        }
        raw.send("tokenizer", msgpack.packb(frame))
        final = raw.terminal(rid)
        assert final.error_code == "bad_request" and words in final.error, final.error
    raw.check_exactly_once()


def test_after_the_fuzz_everything_is_alive_and_serving(cluster, raw, tally):
    with Client(cluster.client_addr, deadline_s=DEADLINE_S) as client:
        result = client.submit(
            "The capital of France is", max_tokens=4, temperature=0, ignore_eos=True
        ).result(timeout=DEADLINE_S)
        assert result.finish_reason == "length" and len(result.token_ids) == 4
    assert cluster.failure is None
    assert all(c.popen.poll() is None for c in cluster.children)
    restarts = getattr(cluster, "restarts", {})
    assert not any(restarts.values()), f"processes were replaced during the fuzz: {restarts}"
    raw.check_exactly_once()
