"""ClientCore without sockets or threads: deadlines and the reconnect window."""

from __future__ import annotations

import time

import pytest

from ipc.client.core import ClientCore
from ipc.client.errors import UnavailableError
from ipc.client.records import HandleBase, RequestRecord
from ipc.messages import ClientWelcome, StreamEvent


class Handle(HandleBase):
    def __init__(self, record: RequestRecord) -> None:
        super().__init__(None, record)
        self.deltas = []

    def deliver(self, delta) -> None:
        self.deltas.append(delta)


class Pipes:
    """Tokenizer pipes that take every frame (``sent[i]``: what worker i got)."""

    def __init__(self, n: int = 1) -> None:
        self.sent: list[list[bytes]] = [[] for _ in range(n)]

    def __len__(self) -> int:
        return len(self.sent)

    def offer(self, index: int, frame: bytes) -> bool:
        self.sent[index].append(frame)
        return True


WELCOME = ClientWelcome(["inproc://t0"], "m", 1024, 100)


def connected(n: int = 1, **kwargs) -> tuple[ClientCore, Pipes]:
    core = ClientCore(**kwargs)
    pipes = Pipes(n)
    core.connected(WELCOME, pipes)
    return core, pipes


def submit(core: ClientCore, request_id=None, deadline_s=None):
    return core.submit(
        Handle,
        request_id,
        deadline_s,
        prompt="hi",
        messages=None,
        prompt_token_ids=None,
        sampling=None,
        sampling_kwargs={},
        add_generation_prompt=True,
    )


def finish(core: ClientCore, handle: Handle) -> None:
    core.apply(
        handle,
        StreamEvent(request_id=handle.record.wire_id, finished=True, finish_reason="stop"),
        time.monotonic(),
    )


def test_a_reused_request_id_keeps_its_own_deadline():
    """The first request's heap entry must not time out a later request with the same id."""
    core, _ = connected(deadline_s=None)
    first = submit(core, request_id="a", deadline_s=10.0)
    finish(core, first)
    second = submit(core, request_id="a", deadline_s=100.0)
    t_first_deadline = first.record.deadline
    assert core.expired(t_first_deadline + 0.001) == []  # only the finished first one was due
    assert core.expired(second.record.deadline + 0.001) == [second.record.wire_id]


def test_a_submit_racing_the_disconnect_is_refused_not_orphaned():
    """The receiver thread sees the detokenizer connection drop while submit() runs: the request
    is either in the list of lost ones (and ends) or refused, never open and unlisted."""
    core, pipes = connected(deadline_s=None)
    lost = []

    def disconnect_now():  # stands for the receiver thread, between the check and the send
        if not core.reconnecting:
            lost.extend(core.on_disconnected())

    # The receiver thread's snapshot happens after the check but before registration: emulate
    # it by flipping the flag when the handle is made.
    orig = ClientCore.new_record

    def new_record(self, request_id, deadline_s):
        record = orig(self, request_id, deadline_s)
        disconnect_now()
        return record

    ClientCore.new_record = new_record
    try:
        with pytest.raises(UnavailableError):
            submit(core)
    finally:
        ClientCore.new_record = orig
    assert core.records == {}  # nothing open that no terminal event will ever reach
    assert pipes.sent == [[]]


def test_a_reused_request_id_gets_a_new_wire_id_and_duplicates_in_flight_are_refused():
    """The cluster keys everything by wire id: a request_id reused once its first request ended
    must not meet that one's leftovers (an abort that crossed its finish would end it at once)."""
    from ipc.client.errors import BadRequestError

    core, _ = connected(deadline_s=None)
    first = submit(core, request_id="a")
    with pytest.raises(BadRequestError, match="already in flight"):
        submit(core, request_id="a")
    core.apply(
        first,
        StreamEvent(request_id=first.record.wire_id, finished=True, finish_reason="stop"),
        time.monotonic(),
    )
    second = submit(core, request_id="a")
    assert second.record.request_id == "a"
    assert second.record.wire_id != first.record.wire_id
    assert set(core.records) == {second.record.wire_id} and core.open_ids == {"a"}


def test_an_error_about_a_copy_it_never_sent_does_not_end_an_open_request():
    """The cluster refuses a copy of a live id with ERR_DUPLICATE_REQUEST under the live id; the
    SDK never sends one (its wire ids are unique), so such an event is not its request's end."""
    from ipc import codec
    from ipc.messages import ERR_DUPLICATE_REQUEST, ClientEvents

    core, _ = connected(deadline_s=None)
    live = submit(core, request_id="a")
    copy = StreamEvent(
        request_id=live.record.wire_id,
        finished=True,
        finish_reason="error",
        error="already in flight",
        error_code=ERR_DUPLICATE_REQUEST,
    )
    core.route(codec.encode(ClientEvents([copy])))
    assert live.deltas == [] and live.record.wire_id in core.records
    core.route(codec.encode(ClientEvents([StreamEvent(live.record.wire_id, "x", finished=True)])))
    assert [d.text for d in live.deltas] == ["x"] and not core.records


def test_requests_lost_with_a_tokenizer_are_sent_again_once_under_a_fresh_wire_id():
    """A tokenizer's death: what it held goes to a live worker under a new wire id (the old one
    is aborted by the caller), keeping its t_submit and deadline; a second death of the same
    request's worker, an abort the caller sent meanwhile, or a request already past its
    tokenizer end it instead."""
    from ipc import codec
    from ipc.messages import ClusterNotice, SubmitRequest

    core, pipes = connected(2, deadline_s=50.0, tokenizer_retries=1)
    handles = [submit(core, request_id=f"q{i}") for i in range(4)]
    on_1 = [h for h in handles if h.record.tokenizer == 1]
    assert len(on_1) == 2
    started, aborted = on_1
    core.apply(
        started, StreamEvent(request_id=started.record.wire_id, text="x"), time.monotonic()
    )  # past its tokenizer: not lost with it
    aborted.record.aborted = True
    waiting = submit(core, request_id="w")
    assert waiting.record.tokenizer == 0
    waiting_wire, t_submit, deadline = (
        waiting.record.wire_id,
        waiting.record.t_submit,
        waiting.record.deadline,
    )
    waiting.record.tokenizer = 1  # say it went to worker 1 too

    def died(index):
        notice = ClusterNotice(role="tokenizer", index=index, event="died")
        routed = core.route(codec.encode(notice))
        assert routed.retry
        return routed.lost

    lost = died(1)
    assert {wid for wid, _ in lost} == {aborted.record.wire_id, waiting_wire}
    sent_before = len(pipes.sent[0])
    ended = core.resubmit(lost)
    assert [(wid, ev.finish_reason) for wid, ev in ended] == [(aborted.record.wire_id, "abort")]
    # The waiting one went to worker 0 (worker 1 is down) under a new wire id.
    assert len(pipes.sent[0]) == sent_before + 1
    resent = codec.decode_as(pipes.sent[0][-1], SubmitRequest)
    record = waiting.record
    assert resent.request_id == record.wire_id != waiting_wire
    assert resent.prompt == "hi" and resent.t_submit == t_submit == record.t_submit
    assert record.tokenizer == 0 and record.resubmits == 1 and record.deadline == deadline
    assert waiting_wire not in core.records and core.records[record.wire_id] is waiting
    due = core.expired(deadline + 0.001)  # the deadline follows the new wire id
    assert record.wire_id in due and waiting_wire not in due
    core.end_lost(ended)
    assert aborted.deltas[-1].finish_reason == "abort"
    assert aborted.record.request_id not in core.open_ids
    # Its new worker dies too: out of retries, it ends with the tokenizer's error.
    lost = died(0)
    assert waiting.record.wire_id in {wid for wid, _ in lost}
    ended = core.resubmit(lost)
    core.end_lost(ended)
    assert waiting.deltas[-1].error_code == "unavailable"
    assert "tokenizer worker 0 died" in waiting.deltas[-1].error
    assert "w" not in core.open_ids


def query(core: ClientCore, **kwargs):
    from ipc.client.queries import tokenize_builder

    build = tokenize_builder(core.client_id, "hello", None, None, True, None, False)
    return core.send(Handle, None, kwargs.get("deadline_s"), build)


def test_a_query_ends_with_its_reply_and_survives_an_engine_death():
    from ipc import codec
    from ipc.messages import NOTICE_DIED, ClusterNotice
    from ipc.messages.queries import TokenizeRequest, TokenizeResult

    core, pipes = connected(deadline_s=None)
    generation, tokenize = submit(core), query(core)
    sent = codec.decode(pipes.sent[0][1])
    assert isinstance(sent, TokenizeRequest) and sent.prompt == "hello"
    assert sent.request_id == tokenize.record.wire_id and sent.add_special_tokens
    lost, retry = core.on_notice(ClusterNotice(NOTICE_DIED, "engine", 0))
    assert [wid for wid, _ in lost] == [
        generation.record.wire_id
    ] and not retry  # queries never reach it
    reply = TokenizeResult(tokenize.record.wire_id, core.client_id, codec.pack_ids([7]))
    core.route(codec.encode(reply))
    assert tokenize.record.reply == reply and [d.finished for d in tokenize.deltas] == [True]
    assert tokenize.record.wire_id not in core.records
    core.route(codec.encode(reply))  # a second copy (a resent query answered twice): dropped
    assert len(tokenize.deltas) == 1


def test_a_query_in_a_dead_tokenizer_is_sent_again_or_ends_unavailable():
    from ipc import codec
    from ipc.messages import NOTICE_DIED, ClusterNotice

    for retries, expect_resent in ((1, True), (0, False)):
        core, pipes = connected(2, deadline_s=None, tokenizer_retries=retries)
        handle = query(core)
        dead = handle.record.tokenizer
        lost, retry = core.on_notice(ClusterNotice(NOTICE_DIED, "tokenizer", dead))
        assert [wid for wid, _ in lost] == [handle.record.wire_id] and retry
        still_lost = core.resubmit(lost)
        if expect_resent:
            assert still_lost == [] and handle.record.tokenizer != dead
            resent = codec.decode(pipes.sent[handle.record.tokenizer][-1])
            assert resent.request_id == handle.record.wire_id and resent.prompt == "hello"
        else:
            core.end_lost(still_lost)
            assert handle.deltas[-1].error_code == "unavailable"


def test_a_dead_engine_replica_sends_again_what_produced_nothing_and_is_not_alive():
    """One replica of several died: the detokenizer lists the client's requests alive on the
    others and ended those that had produced tokens; every other open generation is sent again
    (queries never reach an engine and are left alone). With one engine, everything ends."""
    from ipc import codec
    from ipc.messages import NOTICE_DIED, ClusterNotice

    core, _ = connected(2, deadline_s=None)
    alive, started, unstarted = (submit(core, request_id=n) for n in ("a", "s", "u"))
    tokenize = query(core)
    core.apply(started, StreamEvent(request_id=started.record.wire_id, text="x"), time.monotonic())
    notice = ClusterNotice(
        NOTICE_DIED, "engine", 1, alive_ids=[alive.record.wire_id], resend_unstarted=True
    )
    routed = core.route(codec.encode(notice))
    assert routed.retry and [wid for wid, _ in routed.lost] == [unstarted.record.wire_id]
    assert "engine replica 1 died" in routed.lost[0][1].error
    old = unstarted.record.wire_id
    assert core.resubmit(routed.lost) == []
    assert unstarted.record.wire_id != old and unstarted.record.resubmits == 1
    assert tokenize.record.wire_id in core.records
    one_engine = core.route(codec.encode(ClusterNotice(NOTICE_DIED, "engine", 0)))
    assert not one_engine.retry
    assert {wid for wid, _ in one_engine.lost} == {
        h.record.wire_id for h in (alive, started, unstarted)
    }


def test_the_ways_in_answer_with_the_frames_to_send():
    """What the transports send comes from the core alone: a notice's lost requests are aborted
    under their old wire ids and sent again; a deadline ends and aborts; a dropped connection
    says hello again and aborts what was open; after shut, nothing more is accepted or sent."""
    from ipc import codec
    from ipc.messages import NOTICE_DIED, ClientAbort, ClientHello, ClusterNotice

    core, pipes = connected(2, deadline_s=None)
    resent, timed, dropped = (submit(core, request_id=n) for n in ("r", "t", "d"))
    timed.record.deadline = 0.0
    core.deadlines.watch(0.0, timed.record.wire_id)
    old = resent.record.wire_id
    dead = resent.record.tokenizer
    frames = core.on_frame(codec.encode(ClusterNotice(NOTICE_DIED, "tokenizer", dead)))
    aborted = codec.decode_as(frames[0], ClientAbort)
    assert old in aborted.request_ids and resent.record.wire_id != old
    assert resent.record.tokenizer != dead and not resent.done
    [frame] = core.on_tick(time.monotonic())
    assert codec.decode_as(frame, ClientAbort).request_ids == [timed.record.wire_id]
    assert timed.deltas[-1].error_code == "timeout"
    hello, abort = core.on_disconnect()
    assert codec.decode_as(hello, ClientHello).client_id == core.client_id
    assert set(codec.decode_as(abort, ClientAbort).request_ids) == {
        resent.record.wire_id,
        dropped.record.wire_id,
    }
    assert resent.done and dropped.done and core.records == {}
    with pytest.raises(UnavailableError, match="reconnecting"):
        submit(core)
    core.route(codec.encode(WELCOME))  # the restarted detokenizer answered
    late = submit(core, request_id="late")
    assert core.shut() and not core.shut()
    assert core.abort_frame(late.record) is None  # closing aborts everything (ClientBye)
    with pytest.raises(UnavailableError, match="closed"):
        submit(core)
    core.end_open()
    assert late.deltas[-1].error_code == "unavailable" and core.records == {}
