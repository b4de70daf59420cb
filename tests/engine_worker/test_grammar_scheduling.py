"""A request whose grammar is still being built waits in the queue, and a running one whose late
grammar mask is still being computed sits steps out, without holding up others."""

from __future__ import annotations

from concurrent.futures import Future

import numpy as np

from engine_worker.block_manager import KVBlockManager
from engine_worker.grammar_builder import RequestGrammar
from engine_worker.model_runner import StepResult
from engine_worker.request import EngineRequest
from engine_worker.sampler import RequestSampler
from engine_worker.scheduler import Scheduler
from ipc.engine_config import EngineConfig
from tests.engine_worker.helpers import greedy

BUILT = (object(), np.zeros(4, dtype=np.int32))  # (matcher, first mask): never called here


def request(name: str, grammar: RequestGrammar | None = None) -> EngineRequest:
    params = greedy(4)
    r = EngineRequest(name, [5, 6, 7], params, RequestSampler(params, "cpu"), frozenset(), 64, 0.0)
    r.grammar = grammar
    return r


def test_unbuilt_grammar_is_passed_over_then_admitted():
    scheduler = Scheduler(
        EngineConfig(model_path="unused", block_size=4), KVBlockManager(16, 4), None
    )
    building: Future = Future()
    constrained, plain = request("json", RequestGrammar("g", building)), request("plain")
    for r in (constrained, plain):
        scheduler.add(r)
    batch = scheduler.schedule()
    assert [r.request_id for r in batch.requests] == ["plain"]
    assert list(scheduler.waiting) == [constrained] and not constrained.block_ids
    batch = scheduler.schedule()  # still building: the running request decodes on
    assert [r.request_id for r in batch.requests] == ["plain"]
    building.set_result(BUILT)
    batch = scheduler.schedule()
    assert [r.request_id for r in batch.requests] == ["plain", "json"]
    assert not scheduler.waiting


def test_ready_requests_keep_their_order():
    scheduler = Scheduler(
        EngineConfig(model_path="unused", block_size=4, max_batch_size=2),
        KVBlockManager(16, 4),
        None,
    )
    done: Future = Future()
    done.set_result(BUILT)
    first, second, third = request("a", RequestGrammar("g", done)), request("b"), request("c")
    for r in (first, second, third):
        scheduler.add(r)
    assert [r.request_id for r in scheduler.schedule().requests] == ["a", "b"]
    assert list(scheduler.waiting) == [third]


def test_a_running_request_with_a_late_mask_sits_out_until_the_mask_is_there():
    scheduler = Scheduler(
        EngineConfig(model_path="unused", block_size=4), KVBlockManager(16, 4), None
    )
    done: Future = Future()
    done.set_result(BUILT)
    grammar = RequestGrammar("g", done)
    constrained, plain = request("json", grammar), request("plain")
    for r in (constrained, plain):
        scheduler.add(r)
    batch = scheduler.schedule()
    assert [r.request_id for r in batch.requests] == ["json", "plain"]
    update = scheduler.update_from_output(batch, StepResult([9, 9], {}, []))  # the prompt's step
    assert update.tokens == [9, 9] and update.constrained == [(constrained, 9)]
    assert constrained.num_computed == constrained.prompt_len == 3
    grammar.pending = True  # its next mask is being computed
    assert [r.request_id for r in scheduler.schedule().requests] == ["json", "plain"]
    grammar.late = True  # ... and the step above had to defer it
    assert [r.request_id for r in scheduler.schedule().requests] == ["plain"]
    assert scheduler.running == [constrained, plain]  # still running, blocks kept
    grammar.pending = False
    assert [r.request_id for r in scheduler.schedule().requests] == ["json", "plain"]
