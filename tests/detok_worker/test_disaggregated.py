"""DetokenizerCore with a prefill engine (0) and a decode engine (1), without sockets: a request's
first token comes from the prefill engine, the rest from the decode engine after its arrival;
aborts reach both engines; a dead decode engine ends the requests on their way to it."""

from __future__ import annotations

from detok_worker.core import DetokenizerCore
from ipc.codec import pack_ids
from ipc.messages import NOTICE_DIED, ClusterNotice, KVArrival, RequestMeta, StepOutput
from tests.detok_worker.test_core import CLIENT, core_with_clients, step, tokenizer  # noqa: F401

PREFILL, DECODE = 0, 1


def pd_meta(rid: str) -> RequestMeta:
    return RequestMeta(rid, CLIENT, prompt_tokens=3, decode_index=DECODE, t_submit=1.0)


def from_decode(n: int, tokens=(), arrivals=(), finished=()) -> StepOutput:
    out = step(n, tokens=tokens, finished=finished)
    out.engine_index = DECODE
    out.kv_arrivals = list(arrivals)
    return out


def pd_core(tokenizer) -> DetokenizerCore:  # noqa: F811
    return core_with_clients(
        tokenizer, CLIENT, engines=2, routing_policy="cache_aware", roles=["prefill", "decode"]
    )


def test_the_stream_moves_to_the_decode_engine_with_its_transfer_time(tokenizer):  # noqa: F811
    core = pd_core(tokenizer)
    core.on_step_output(step(1, metas=[pd_meta("r")], tokens=[("r", 504)]))
    first = core.take_output().events[CLIENT]
    assert first[0].engine_index == PREFILL
    arrival = KVArrival("r", PREFILL, kv_transfer_s=0.004, kv_bytes=4096)
    core.on_step_output(from_decode(2, [("r", 314)], [arrival], [("r", "length")]))
    (last,) = core.take_output().events[CLIENT]
    assert last.finished and last.engine_index == DECODE
    assert last.timings.kv_transfer_s == 0.004 and last.timings.kv_transfer_bytes == 4096
    assert last.usage.completion_tokens == 2


def test_an_abort_goes_to_both_engines_until_the_request_arrived(tokenizer):  # noqa: F811
    core = pd_core(tokenizer)
    core.on_step_output(step(1, metas=[pd_meta("r"), pd_meta("s")], tokens=[("r", 5), ("s", 6)]))
    core.on_step_output(from_decode(2, arrivals=[KVArrival("s", PREFILL, 0.001, 10)]))
    core.take_output()
    core.on_client_abort(CLIENT, ["r", "s"])
    assert core.take_output().aborts == [("r", PREFILL), ("r", DECODE), ("s", DECODE)]


def test_a_dead_decode_engine_ends_the_requests_on_their_way_to_it(tokenizer):  # noqa: F811
    core = pd_core(tokenizer)
    metas = [pd_meta("moving"), pd_meta("prompt")]
    core.on_step_output(step(1, metas=metas, tokens=[("moving", 5)]))  # "prompt": no token yet
    core.take_output()
    core.on_notice(ClusterNotice(NOTICE_DIED, "engine", DECODE, pid=9), 20.0)
    (ended,) = core.take_output().events[CLIENT]
    assert ended.request_id == "moving" and ended.error_code == "unavailable"
    assert "prompt" in core.states  # still on its prefill engine, which deals with it


def test_an_arrival_of_a_request_ended_here_is_aborted_there(tokenizer):  # noqa: F811
    core = pd_core(tokenizer)
    core.on_step_output(step(1, metas=[pd_meta("r")], tokens=[("r", 5)]))
    core.on_notice(ClusterNotice(NOTICE_DIED, "engine", PREFILL, pid=8), 20.0)
    core.take_output()  # ended: its prefill engine died past its first token
    late = StepOutput(step=3, t_step=30.0, token_ids=pack_ids([]), engine_index=DECODE)
    late.kv_arrivals = [KVArrival("r", PREFILL, 0.001, 10)]
    core.on_step_output(late)
    assert core.take_output().aborts == [("r", DECODE)]


def test_a_decode_output_read_before_the_prefill_one_waits_for_it(tokenizer):  # noqa: F811
    core = pd_core(tokenizer)
    arrival = KVArrival("r", PREFILL, 0.001, 10)
    core.on_step_output(from_decode(1, [("r", 314)], [arrival], [("r", "length")]))
    assert core.take_output().events == {}  # held: its meta has not been read yet
    core.on_step_output(step(1, metas=[pd_meta("r")], tokens=[("r", 504)]))
    events = core.take_output().events[CLIENT]
    assert events[-1].finished and events[-1].usage.completion_tokens == 2
    assert core.handovers.waits == 1 and not any(core.handovers.held.values())
