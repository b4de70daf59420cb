"""The engine/scheduler seam (engine_worker/scheduler/): the scheduler alone changes a request's
scheduling state. Driven here without a model: ``schedule`` gives a batch, a hand-made
``StepResult`` stands for the forward, and ``update_from_output`` applies it (drafts rolled
back, blocks trimmed, a late grammar mask's row taken back, finished requests let go)."""

from __future__ import annotations

import ast
from concurrent.futures import Future
from pathlib import Path

import numpy as np

from engine_worker.block_manager import KVBlockManager
from engine_worker.grammar_builder import RequestGrammar
from engine_worker.model_runner import StepResult
from engine_worker.request import EngineRequest
from engine_worker.sampler import RequestSampler
from engine_worker.scheduler import Finished, Scheduler
from ipc.engine_config import EngineConfig
from ipc.messages import ERR_BAD_REQUEST, FINISH_ERROR, FINISH_LENGTH, SamplingParams
from tests.engine_worker.helpers import greedy

ROOT = Path(__file__).resolve().parents[2]
# What the scheduler alone assigns once a request exists (EngineRequest's own methods aside;
# its tokens grow only through ``append_token``, which only the scheduler calls).
SCHEDULING_FIELDS = {
    "num_computed",
    "block_ids",
    "block_keys",
    "prefix_node",
    "cached_tokens",
    "t_scheduled",
    "started_sent",
    "num_generated",
    "prompt_logprobs_from",
    "speculates",
    "draft_ids",
    "lookup",
}


def request(name: str, prompt: list[int], params: SamplingParams) -> EngineRequest:
    sampler = RequestSampler(params, "cpu")
    return EngineRequest(name, list(prompt), params, sampler, frozenset(), 64, 0.0)


def scheduler(num_blocks: int = 32, **knobs) -> Scheduler:
    config = EngineConfig(model_path="unused", block_size=2, **knobs)
    return Scheduler(config, KVBlockManager(num_blocks, 2), None)


def test_nothing_outside_the_scheduler_assigns_a_requests_scheduling_fields():
    wrong = []
    for path in sorted((ROOT / "engine_worker").rglob("*.py")):
        relative = path.relative_to(ROOT).as_posix()
        if relative.startswith("engine_worker/scheduler/") or relative.endswith("/request.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                if node.func.attr == "append_token":
                    wrong.append(f"{relative}:{node.lineno} append_token")
            for target in assigned(targets):
                if target.attr in SCHEDULING_FIELDS:
                    wrong.append(f"{relative}:{node.lineno} .{target.attr}")
    assert wrong == []


def assigned(targets: list) -> list[ast.Attribute]:
    """The attributes (of anything but ``self``) that assignments to ``targets`` change:
    ``x.a = ...``, ``x.a[i] = ...``, ``x.a, y.b = ...``."""
    found = []
    for target in targets:
        while isinstance(target, ast.Subscript):
            target = target.value
        if isinstance(target, (ast.Tuple, ast.List)):
            found += assigned(list(target.elts))
        elif isinstance(target, ast.Attribute):
            if not (isinstance(target.value, ast.Name) and target.value.id == "self"):
                found.append(target)
    return found


def test_the_engine_step_reads_schedule_run_update_emit():
    tree = ast.parse((ROOT / "engine_worker" / "engine.py").read_text())
    [step] = [
        node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef) and node.name == "step"
    ]
    assert step.end_lineno is not None and step.end_lineno - step.lineno + 1 <= 15
    nodes = [
        node
        for node in ast.walk(step)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
    ]
    nodes.sort(key=lambda node: (node.lineno, node.col_offset))
    calls = [node.func.attr for node in nodes]
    order = ["schedule", "_run", "update_from_output", "_emit"]
    assert [c for c in calls if c in order] == order


def test_rejected_drafts_are_rolled_back_and_their_blocks_given_back():
    sched = scheduler(speculative="ngram", num_speculative_tokens=3)
    r = request("r", [1, 2, 3, 1, 2, 3, 1, 2], greedy(8, ignore_eos=True))
    sched.add(r)
    assert r.speculates
    batch = sched.schedule()
    assert batch.num_new_tokens == [8]
    update = sched.update_from_output(batch, StepResult([3], {}, []))
    assert update.tokens == [3] and update.started == [r] and r.num_computed == 8
    batch = sched.schedule()  # decodes 3 and verifies the drafts 1, 2, 3 (the n-gram's sequel)
    assert r.draft_ids == [1, 2, 3] and batch.num_new_tokens == [4]
    assert len(r.block_ids) == sched.blocks.blocks_for(12)
    # Draft 1 rejected: the row of 3 sampled 5 instead; the rows of the drafts are discarded.
    update = sched.update_from_output(batch, StepResult([5], {}, [], accepted={0: []}))
    assert update.tokens == [5] and update.request_ids == ["r"]
    assert r.token_ids[8:] == [3, 5] and r.draft_ids == []
    assert r.num_computed == 9 == r.num_tokens - 1  # the KV of 3; 5 is computed next
    assert len(r.block_ids) == sched.blocks.blocks_for(10) < sched.blocks.blocks_for(12)
    counters = sched.speculation
    assert (counters.drafts, counters.draft_tokens, counters.accepted_tokens) == (1, 3, 0)
    batch = sched.schedule()  # drafts again: 5 1 2 3? no n-gram ends in 5: a plain decode
    assert batch.num_new_tokens == [1] and r.draft_ids == []
    update = sched.update_from_output(batch, StepResult([1], {}, []))
    assert r.num_computed == 10 and r.token_ids[-1] == 1


def test_a_late_mask_takes_its_row_back_and_a_finished_request_lets_go():
    sched = scheduler()
    built: Future = Future()
    built.set_result((object(), np.zeros(4, dtype=np.int32)))
    constrained = request("json", [5, 6, 7], greedy(4))
    constrained.grammar = RequestGrammar("g", built)
    short = request("short", [5, 6, 7, 8, 9], greedy(1))
    for r in (constrained, short):
        sched.add(r)
    batch = sched.schedule()
    assert batch.num_new_tokens == [3, 5]
    update = sched.update_from_output(batch, StepResult([None, 4], {}, [], deferred=[0]))
    assert update.deferred == [constrained] and update.tokens == [4]
    assert constrained.num_computed == 2 and constrained.num_generated == 0  # its last again
    assert update.finished == [Finished(short, FINISH_LENGTH)] and update.constrained == []
    assert sched.num_running == 1 and not short.block_ids
    assert sched.blocks.num_available == 32 - len(constrained.block_ids)
    batch = sched.schedule()  # the deferred row computes its prompt's last token again
    assert batch.requests == [constrained] and batch.num_new_tokens == [1]
    update = sched.update_from_output(batch, StepResult([9], {}, []))
    assert update.constrained == [(constrained, 9)] and update.started == [constrained]
    sched.remove(constrained)
    assert sched.is_idle() and sched.blocks.num_available == 32


def test_a_request_the_kv_cache_cannot_hold_ends_with_an_error():
    sched = scheduler(num_blocks=3)  # 6 tokens of KV cache in all
    r = request("big", [1, 2, 3, 4, 5], greedy(4, ignore_eos=True))
    sched.add(r)
    for token in (6, 7):
        batch = sched.schedule()
        assert batch.requests == [r] and not batch.failed
        sched.update_from_output(batch, StepResult([token], {}, []))
    batch = sched.schedule()  # its 7th token needs a 4th block: nobody else to preempt
    assert batch.requests == [] and sched.is_idle()
    [(request_, reason, error, code)] = sched.update_from_output(batch, None).finished
    assert (request_, reason, code) == (r, FINISH_ERROR, ERR_BAD_REQUEST) and "6 tokens" in error
    assert sched.blocks.num_available == 3 and not r.block_ids
