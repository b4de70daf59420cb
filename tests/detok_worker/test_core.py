"""DetokenizerCore without sockets: messages in, events / notices / engine aborts out.

The real tokenizer of the default model decodes; StepOutputs are built the way the engine
process sends them."""

from __future__ import annotations

import pytest

from detok_worker.core import EVERY_REPLICA, DetokenizerCore
from ipc.codec import pack_ids, unpack_id_list
from ipc.messages import (
    NOTICE_DIED,
    NOTICE_READY,
    ClusterNotice,
    FinishRecord,
    RequestError,
    RequestMeta,
    RequestStart,
    StepOutput,
)
from runtime.model_files import load_tokenizer

CLIENT, OTHER = b"client-a", b"client-b"


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    return load_tokenizer(default_model_dir)


def meta(rid: str, client: bytes = CLIENT, stop=(), tokenizer_index: int = 0) -> RequestMeta:
    return RequestMeta(
        rid, client, prompt_tokens=3, stop=list(stop), tokenizer_index=tokenizer_index, t_submit=1.0
    )


def step(n: int, *, metas=(), tokens=(), finished=(), started=(), pid: int = 0) -> StepOutput:
    """tokens: (request_id, token id) pairs; finished: (request_id, reason[, error, code])."""
    finished = [tuple(f) + ("", "")[len(f) - 2 :] for f in finished]
    return StepOutput(
        step=n,
        t_step=10.0 + n,
        new_requests=list(metas),
        request_ids=[rid for rid, _ in tokens],
        token_ids=pack_ids([t for _, t in tokens]),
        started=list(started),
        finished=[FinishRecord(*f) for f in finished],
        engine_pid=pid,
    )


def feed_one_per_step(core: DetokenizerCore, meta, ids: list[int], reason: str = "stop"):
    """Request ``meta``'s tokens to ``core`` one per step, its meta with the first and its
    finish (``reason``) with the last; returns its client's events."""
    for i, token in enumerate(ids):
        core.on_step_output(
            step(
                i + 1,
                metas=[meta] if i == 0 else (),
                tokens=[(meta.request_id, token)],
                finished=[(meta.request_id, reason)] if i == len(ids) - 1 else (),
            )
        )
    return core.take_output().events.get(meta.client_id, [])


def core_with_clients(tokenizer, *clients: bytes, **kwargs) -> DetokenizerCore:
    core = DetokenizerCore(tokenizer, **kwargs)
    for client in clients:
        core.on_hello(client)
    assert core.take_output().welcomes == list(clients)
    return core


def stream(
    core: DetokenizerCore,
    rid: str,
    ids: list[int],
    *,
    first_step: int = 1,
    finish_reason: str | None = "length",
    **meta_kwargs,
):
    """Feeds a request's tokens one step each (meta with the first), the engine's finish with the
    last; returns every event its client got and the engine aborts, in order."""
    events, aborts = [], []
    for i, token in enumerate(ids):
        last = i == len(ids) - 1
        core.on_step_output(
            step(
                first_step + i,
                metas=[meta(rid, **meta_kwargs)] if i == 0 else (),
                tokens=[(rid, token)],
                finished=[(rid, finish_reason)] if last and finish_reason else (),
            )
        )
        out = core.take_output()
        events += out.events.get(CLIENT, [])
        aborts += out.aborts
    return events, aborts


def test_a_request_streams_its_text_and_ends_with_one_terminal_event(tokenizer):
    core = core_with_clients(tokenizer, CLIENT)
    text = "Héllo wörld! 日本語 🙂 naïve"
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    core.on_step_output(step(0, metas=[meta("r")]))
    core.on_step_output(step(1, tokens=[("r", ids[0])], started=[RequestStart("r", 2.0, 3.0, 1)]))
    for i, token in enumerate(ids[1:], 2):
        core.on_step_output(
            step(i, tokens=[("r", token)], finished=[("r", "length")] if i == len(ids) else ())
        )
    events = core.take_output().events[CLIENT]
    assert "".join(e.text for e in events) == text
    assert [e.finished for e in events].count(True) == 1 and events[-1].finished
    final = events[-1]
    assert final.finish_reason == "length" and final.error is None
    assert final.usage.completion_tokens == len(ids) and final.usage.cached_tokens == 1
    t = final.timings
    assert (t.t_submit, t.t_arrived, t.t_scheduled) == (1.0, 2.0, 3.0)
    assert (t.t_first_token, t.t_finished) == (11.0, 10.0 + len(ids))  # the steps' own times
    assert sum(len(unpack_id_list(e.token_ids)) for e in events) == len(ids)
    assert core.stats()["open_requests"] == 0


def test_the_stream_interval_batches_deltas_and_the_first_token_goes_at_once(tokenizer):
    core = core_with_clients(tokenizer, CLIENT, stream_interval_tokens=3)
    ids = tokenizer.encode("one two three four five six seven eight", add_special_tokens=False).ids
    events, _ = stream(core, "r", ids)
    sizes = [len(unpack_id_list(e.token_ids)) for e in events]
    assert sizes[0] == 1 and all(s == 3 for s in sizes[1:-1]) and sum(sizes) == len(ids)
    assert events[-1].finished and not any(e.finished for e in events[:-1])


def test_a_stop_string_ends_the_request_here_and_aborts_it_in_the_engine(tokenizer):
    core = core_with_clients(tokenizer, CLIENT)
    ids = tokenizer.encode("The answer is Paris. STOP here and more", add_special_tokens=False).ids
    events, aborts = stream(core, "r", ids[:-1], finish_reason=None, stop=[". ST"])
    assert "".join(e.text for e in events) == "The answer is Paris"
    assert events[-1].finished and events[-1].finish_reason == "stop"
    assert aborts == [("r", 0)]  # to the replica running it
    # The engine goes on until the abort lands, then reports its own finish: both are swallowed.
    core.on_step_output(step(50, tokens=[("r", ids[-1])], finished=[("r", "abort")]))
    out = core.take_output()
    assert out.events == {} and out.aborts == [] and "r" not in core.ignored


def test_the_token_of_the_finishing_step_rides_in_the_terminal_event(tokenizer):
    core = core_with_clients(tokenizer, CLIENT)
    ids = tokenizer.encode("alpha beta", add_special_tokens=False).ids
    core.on_step_output(
        step(1, metas=[meta("r")], tokens=[("r", ids[0])], finished=[("r", "stop")])
    )
    (event,) = core.take_output().events[CLIENT]
    assert event.finished and unpack_id_list(event.token_ids) == [ids[0]]


def test_an_abort_before_the_meta_is_repeated_when_the_request_shows_up(tokenizer):
    core = core_with_clients(tokenizer, CLIENT)
    core.on_client_abort(CLIENT, ["early"])
    # At once, to every replica: it may be queued in one, which is not known yet.
    assert core.take_output().aborts == [("early", EVERY_REPLICA)]
    core.on_step_output(step(1, metas=[meta("early")]))
    assert core.take_output().aborts == [("early", 0)]  # again: the engine may have missed it
    assert not core.clients[CLIENT].pending_aborts
    core.on_step_output(step(2, finished=[("early", "abort")]))
    (event,) = core.take_output().events[CLIENT]
    assert event.finished and event.finish_reason == "abort"


def test_a_gone_client_gets_nothing_more_and_its_requests_are_aborted(tokenizer):
    core = core_with_clients(tokenizer, CLIENT, OTHER)
    ids = tokenizer.encode("one two", add_special_tokens=False).ids
    core.on_step_output(
        step(1, metas=[meta("a1"), meta("b1", OTHER)], tokens=[("a1", ids[0]), ("b1", ids[0])])
    )
    # The worker drops a client whose queue is full: what was queued for it goes nowhere.
    core.on_client_gone(CLIENT, reason="stopped reading")
    out = core.take_output()
    assert set(out.events) == {OTHER} and out.aborts == [("a1", 0)]
    assert not core.has_client(CLIENT)
    core.on_step_output(
        step(
            2,
            metas=[meta("a2")],
            tokens=[("a1", ids[1]), ("b1", ids[1])],
            finished=[("a1", "abort"), ("b1", "length")],
        )
    )
    out = core.take_output()
    assert out.aborts == [("a2", 0)]  # a meta of a gone client: aborted, never streamed
    assert set(out.events) == {OTHER} and out.events[OTHER][-1].finished
    assert core.stats() == {"clients": 1, "open_requests": 0, "steps": 2, "notices": 0}
    assert list(core.ignored) == ["a2"]  # a1's finish came; a2's is still to come


def test_ignored_ids_are_bounded(tokenizer):
    core = core_with_clients(tokenizer, max_ignored=2)
    core.on_step_output(step(1, metas=[meta(f"r{i}") for i in range(5)]))  # no such client
    assert core.take_output().aborts == [(f"r{i}", 0) for i in range(5)]
    assert list(core.ignored) == ["r3", "r4"]


def test_a_request_error_is_the_requests_terminal_event(tokenizer):
    core = core_with_clients(tokenizer, CLIENT)
    core.on_client_abort(CLIENT, ["bad"])
    core.take_output()
    core.on_request_error(RequestError("bad", CLIENT, "the prompt is empty", "bad_request"))
    core.on_request_error(RequestError("x", b"nobody", "lost", "bad_request"))
    out = core.take_output()
    (event,) = out.events[CLIENT]
    assert (event.finished, event.finish_reason, event.error, event.error_code) == (
        True,
        "error",
        "the prompt is empty",
        "bad_request",
    )
    assert set(out.events) == {CLIENT} and not core.clients[CLIENT].pending_aborts


def test_an_engine_error_without_a_code_reaches_the_client_as_internal(tokenizer):
    core = core_with_clients(tokenizer, CLIENT)
    core.on_step_output(
        step(
            1, metas=[meta("a"), meta("b")], finished=[("a", "error", "boom", ""), ("b", "length")]
        )
    )
    events = {e.request_id: e for e in core.take_output().events[CLIENT]}
    assert (events["a"].error, events["a"].error_code) == ("boom", "internal")
    assert (events["b"].finish_reason, events["b"].error_code) == ("length", None)


def test_a_dead_engine_ends_every_request_and_its_late_output_is_dropped(tokenizer):
    core = core_with_clients(tokenizer, CLIENT, OTHER)
    ids = tokenizer.encode("one two", add_special_tokens=False).ids
    core.on_step_output(
        step(1, metas=[meta("a"), meta("b", OTHER)], tokens=[("a", ids[0])], pid=111)
    )
    core.take_output()
    core.on_notice(ClusterNotice(NOTICE_DIED, "engine", 0, pid=111, detail="killed"), now=99.0)
    out = core.take_output()
    for client, rid in ((CLIENT, "a"), (OTHER, "b")):
        (event,) = out.events[client]
        assert event.request_id == rid and event.finish_reason == "error"
        assert event.error_code == "unavailable" and "engine died (killed)" in event.error
        assert event.timings.t_finished == 99.0
        (notice,) = out.notices[client]
        assert notice.role == "engine" and notice.alive_ids == []
    core.on_step_output(step(2, tokens=[("a", ids[1])], finished=[("a", "length")], pid=111))
    assert core.take_output().events == {} and core.stats()["steps"] == 1
    core.on_step_output(step(3, metas=[meta("c")], tokens=[("c", ids[0])], pid=222))
    assert core.take_output().events[CLIENT][0].request_id == "c"  # the new engine streams


def test_a_dead_tokenizer_names_each_clients_requests_alive_in_the_engine(tokenizer):
    core = core_with_clients(tokenizer, CLIENT, OTHER)
    core.on_step_output(
        step(
            1,
            metas=[meta("a0"), meta("a1", tokenizer_index=1), meta("b1", OTHER, tokenizer_index=1)],
        )
    )
    core.on_notice(ClusterNotice(NOTICE_DIED, "tokenizer", 1, pid=5), now=0.0)
    core.on_notice(ClusterNotice(NOTICE_READY, "tokenizer", 1, pid=6), now=0.0)
    out = core.take_output()
    assert out.events == {}  # a tokenizer's death ends nothing the engine holds
    assert [n.alive_ids for n in out.notices[CLIENT]] == [["a1"], []]
    assert [n.alive_ids for n in out.notices[OTHER]] == [["b1"], []]
    assert core.stats()["notices"] == 2


def test_end_all_gives_every_open_request_its_terminal_event(tokenizer):
    core = core_with_clients(tokenizer, CLIENT)
    core.on_step_output(step(1, metas=[meta("a"), meta("b")]))
    core.end_all("abort", 7.0, error="unavailable: the cluster shut down", code="unavailable")
    events = core.take_output().events[CLIENT]
    assert sorted(e.request_id for e in events) == ["a", "b"]
    assert all(e.finished and e.finish_reason == "abort" for e in events)
    assert core.stats()["open_requests"] == 0


def test_a_step_with_a_token_count_mismatch_keeps_its_finishes(tokenizer):
    core = core_with_clients(tokenizer, CLIENT)
    bad = step(1, metas=[meta("a")], tokens=[("a", 5)], finished=[("a", "length")])
    bad.request_ids.append("a")  # two requests, one token: the tokens are dropped
    core.on_step_output(bad)
    (event,) = core.take_output().events[CLIENT]
    assert event.finished and event.usage.completion_tokens == 0


def test_an_error_for_a_live_id_ends_only_the_copy_it_is_about(tokenizer):
    """Issue 23 item 12: a refused copy of a live request (the engine's duplicate error, or a
    tokenizer's error for a copy with bad input) reaches its sender as one terminal event with
    its own code; the live request's stream, state and pending aborts are untouched."""
    core = core_with_clients(tokenizer, CLIENT)
    core.on_step_output(step(1, metas=[meta("a")], tokens=[("a", 5)]))
    core.take_output()
    core.on_request_error(
        RequestError("a", CLIENT, "request_id 'a' is already in flight", "duplicate_request_id")
    )
    core.on_request_error(RequestError("a", CLIENT, "the prompt is empty", "bad_request"))
    copies = core.take_output().events[CLIENT]
    assert [(e.finished, e.error_code) for e in copies] == [(True, "duplicate_request_id")] * 2
    assert "already in flight; this copy: the prompt is empty" in copies[1].error
    core.on_step_output(step(2, tokens=[("a", 6)], finished=[("a", "length")]))
    (last,) = core.take_output().events[CLIENT]
    assert last.finished and last.finish_reason == "length" and last.usage.completion_tokens == 2


def test_a_second_meta_for_a_live_request_changes_nothing(tokenizer):
    core = core_with_clients(tokenizer, CLIENT)
    core.on_step_output(step(1, metas=[meta("a")], tokens=[("a", 5)]))
    core.on_step_output(step(2, metas=[meta("a")], tokens=[("a", 6)], finished=[("a", "length")]))
    events = core.take_output().events[CLIENT]
    assert events[-1].finished and events[-1].usage.completion_tokens == 2


# --- queries and engine stats -------------------------------------------------------------------


def test_a_tokenize_result_goes_to_its_client_once_and_not_after_an_abort(tokenizer):
    from ipc.messages.queries import TokenizeResult

    core = core_with_clients(tokenizer, CLIENT, OTHER)
    answer = TokenizeResult("q1", CLIENT, pack_ids([1, 2]), max_model_len=64)
    core.on_tokenize_result(answer)
    out = core.take_output()
    assert out.replies == {CLIENT: [answer]} and not out.events and not out.aborts
    core.on_client_abort(CLIENT, ["q2"])  # given up before the answer came
    core.take_output()
    core.on_tokenize_result(TokenizeResult("q2", CLIENT))
    core.on_tokenize_result(TokenizeResult("q3", b"gone-client"))
    assert core.take_output().replies == {}


def test_stats_queries_get_the_engines_latest_stats_and_a_dead_engine_zeroes_them(tokenizer):
    from ipc.messages import EngineStats

    core = core_with_clients(tokenizer, CLIENT)
    core.on_stats_query(CLIENT, "s0")
    (before,) = core.take_output().replies[CLIENT]
    assert before.request_id == "s0" and before.stats == EngineStats() and before.engine_pid == 0
    busy = EngineStats(
        running=3,
        waiting=2,
        kv_blocks_used=5,
        kv_blocks_total=10,
        prefix_queried_tokens_total=40,
        prefix_hit_tokens_total=16,
    )
    out = step(1, pid=77)
    out.stats = busy
    core.on_step_output(out)
    core.on_step_output(step(2, pid=77))  # an output without stats keeps the last ones
    core.on_stats_query(CLIENT, "s1")
    core.on_stats_query(b"unknown-client", "s2")
    (report,) = core.take_output().replies[CLIENT]
    assert (report.stats, report.t_step, report.engine_pid) == (busy, 11.0, 77)
    core.on_notice(ClusterNotice(NOTICE_DIED, "engine", 0, pid=77), now=20.0)
    core.take_output()
    core.on_stats_query(CLIENT, "s3")
    (after,) = core.take_output().replies[CLIENT]
    assert after.stats == EngineStats(kv_blocks_total=10) and after.engine_pid == 0
    late = step(3, pid=77)  # the dead engine's last words do not bring its figures back
    late.stats = busy
    core.on_step_output(late)
    core.on_stats_query(CLIENT, "s4")
    assert core.take_output().replies[CLIENT][0].stats.running == 0


def test_continuous_usage_puts_the_usage_so_far_on_every_event(tokenizer):
    core = core_with_clients(tokenizer, CLIENT)
    ids = tokenizer.encode(" one two three").ids
    plain, counted = meta("plain"), meta("counted")
    counted.continuous_usage_stats = True
    core.on_step_output(
        step(1, metas=[plain, counted], tokens=[("plain", ids[0]), ("counted", ids[0])])
    )
    core.on_step_output(step(2, tokens=[("plain", ids[1]), ("counted", ids[1])]))
    core.on_step_output(
        step(
            3,
            tokens=[("plain", ids[2]), ("counted", ids[2])],
            finished=[("plain", "length"), ("counted", "length")],
        )
    )
    events = core.take_output().events[CLIENT]
    usage = {
        rid: [e.usage and e.usage.completion_tokens for e in events if e.request_id == rid]
        for rid in ("plain", "counted")
    }
    assert usage == {"plain": [None, None, 3], "counted": [1, 2, 3]}
    assert all(e.usage.prompt_tokens == 3 for e in events if e.request_id == "counted")


# --- several engine replicas --------------------------------------------------------------------


def test_a_dead_replica_ends_what_it_started_forgets_what_it_did_not_and_spares_the_other(
    tokenizer,
):
    core = core_with_clients(tokenizer, CLIENT, OTHER, engines=2, routing_policy="cache_aware")
    ids = tokenizer.encode("one two", add_special_tokens=False).ids
    metas = {rid: meta(rid) for rid in ("on0", "started1", "waiting1")}
    metas["other1"] = meta("other1", OTHER)
    for rid, m in metas.items():
        m.engine_index = 0 if rid == "on0" else 1
        m.routing_outcome, m.routing_s = "cache_hit", 0.001
    on0 = step(1, metas=[metas["on0"]], tokens=[("on0", ids[0])], pid=70)
    on1 = step(1, metas=[metas[r] for r in ("started1", "waiting1", "other1")], pid=71)
    on1.engine_index, on1.request_ids, on1.token_ids = 1, ["started1"], pack_ids([ids[0]])
    for out in (on0, on1):
        core.on_step_output(out)
    core.on_client_abort(CLIENT, ["on0"])
    out = core.take_output()
    assert out.aborts == [("on0", 0)]  # to the replica running it
    core.on_notice(ClusterNotice(NOTICE_DIED, "engine", 1, pid=71, detail="killed"), now=30.0)
    out = core.take_output()
    (ended,) = out.events[CLIENT][-1:]
    assert ended.request_id == "started1" and ended.error_code == "unavailable"
    assert "engine replica 1 died (killed)" in ended.error
    assert not out.events.get(OTHER)  # other1 produced nothing: its client sends it again
    assert set(core.states) == {"on0"}
    (notice,) = out.notices[CLIENT]
    assert notice.resend_unstarted and notice.alive_ids == ["on0"]
    assert out.notices[OTHER][0].resend_unstarted and out.notices[OTHER][0].alive_ids == []
    late = step(2, tokens=[("waiting1", ids[1])], pid=71)  # the dead replica's last words
    late.engine_index = 1
    core.on_step_output(late)
    assert not core.take_output().events
    core.on_stats_query(CLIENT, "s")
    (report,) = core.take_output().replies[CLIENT]
    assert [r.index for r in report.replicas] == [0, 1] and report.replicas[1].pid == 0
    assert report.routing_decisions == {"cache_hit": 4} and report.routing_policy == "cache_aware"


def runs_of(rid: str, ids: list[int], sizes: list[int], stop=(), finish_last: bool = True):
    """Steps that each carry several tokens of one request (a step that accepted drafts)."""
    steps, first = [], 0
    for n, size in enumerate(sizes, 1):
        chunk = ids[first : first + size]
        first += size
        last = first >= len(ids)
        steps.append(
            step(
                n,
                metas=[meta(rid, stop=stop)] if n == 1 else (),
                tokens=[(rid, t) for t in chunk],
                finished=[(rid, "length")] if last and finish_last else (),
            )
        )
    return steps


@pytest.mark.parametrize("interval", [1, 3])
def test_several_tokens_of_a_request_in_one_step_stream_as_one_token_steps_do(tokenizer, interval):
    ids = tokenizer.encode(
        "one two three four five six seven eight nine", add_special_tokens=False
    ).ids
    sizes = [1, 4, 2, 4, len(ids)]
    got = {}
    for name, plan in (("one a step", [1] * len(ids)), ("runs", sizes)):
        core = core_with_clients(tokenizer, CLIENT, stream_interval_tokens=interval)
        for out in runs_of("r", ids, plan):
            core.on_step_output(out)
        events = core.take_output().events[CLIENT]
        got[name] = [unpack_id_list(e.token_ids) for e in events], "".join(e.text for e in events)
    (plain, plain_text), (runs, runs_text) = got["one a step"], got["runs"]
    assert runs_text == plain_text and sum(runs, []) == sum(plain, []) == ids
    # The first token at once, then a delta every `interval` tokens, whatever the steps carry
    # (only the terminal event, which takes the finishing step's tokens, may differ).
    assert runs[:-2] == plain[: len(runs) - 2]
    assert [len(r) for r in runs[1:-1]] == [interval] * (len(runs) - 2)


def test_a_stop_string_inside_a_run_of_tokens_cuts_the_run_there(tokenizer):
    ids = tokenizer.encode("The answer is Paris. STOP here and more", add_special_tokens=False).ids
    core = core_with_clients(tokenizer, CLIENT)
    for out in runs_of("r", ids, [2, len(ids)], stop=[". ST"], finish_last=False):
        core.on_step_output(out)
    out = core.take_output()
    events = out.events[CLIENT]
    assert "".join(e.text for e in events) == "The answer is Paris"
    assert [e.finished for e in events].count(True) == 1 and events[-1].finish_reason == "stop"
    assert out.aborts == [("r", 0)]
