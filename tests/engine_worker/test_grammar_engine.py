"""Constrained requests in the engine (tiny random model, the default vocabulary): their output
follows the grammar and the grammar's end stops them, unconstrained neighbours are untouched, a
request whose grammar is not ready waits without holding up the batch or keeping the engine
busy, and a grammar that fails ends only its own request."""

from __future__ import annotations

import json
import select
import time

import jsonschema
import pytest

from engine_worker.engine import Engine
from ipc.engine_config import EngineConfig
from ipc.messages import FINISH_ABORT, FINISH_ERROR, FINISH_STOP
from ipc.structured import StructuredOutputSpec
from runtime.model_files import load_tokenizer
from tests.engine_worker.helpers import collect, greedy
from tokenizer_worker.grammar_compiler import GrammarCompiler
from tokenizer_worker.vocabulary import grammar_backend

SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["color", "ok", "n"],
    "additionalProperties": False,
}
PROMPTS = [[5, 9, 300, 41], [77, 12, 9, 1000, 3, 8], [400, 401, 402], [9, 9, 9, 9, 9]]


@pytest.fixture(scope="module")
def parts(tiny_model_dir):
    tokenizer = load_tokenizer(tiny_model_dir)
    backend, vocabulary = grammar_backend(tokenizer, 49152, [2])
    compiler = GrammarCompiler(backend)
    grammars = {
        "schema": compiler.compile(StructuredOutputSpec.json_schema(SCHEMA)),
        "choice": compiler.compile(StructuredOutputSpec("choice", choices=["yes", "no way"])),
    }
    return tokenizer, vocabulary, grammars


def engine_for(tiny_model_dir) -> Engine:
    return Engine(
        EngineConfig(
            model_path=str(tiny_model_dir),
            dtype="float32",
            device="cpu",
            kv_cache_tokens=4096,
            enable_prefix_cache=False,
        )
    )


def test_constrained_rows_follow_their_grammar_and_leave_the_others_alone(tiny_model_dir, parts):
    tokenizer, vocabulary, grammars = parts
    alone = {}
    engine = engine_for(tiny_model_dir)
    for i in (0, 1):
        engine.add(f"plain{i}", PROMPTS[i], greedy(24))
        alone[f"plain{i}"] = collect(engine)[f"plain{i}"]["tokens"]
    engine.set_grammar_vocabulary(vocabulary)
    for i in (0, 1):
        engine.add(f"plain{i}", PROMPTS[i], greedy(24))
    engine.add("json", PROMPTS[2], greedy(60), grammar=grammars["schema"])
    engine.add("choice", PROMPTS[3], greedy(60, ignore_eos=True), grammar=grammars["choice"])
    mixed = collect(engine)
    for name, tokens in alone.items():
        assert mixed[name]["tokens"] == tokens  # greedy: exactly as alone
    assert mixed["json"]["reason"] == FINISH_STOP  # the grammar's end, well before 60 tokens
    jsonschema.validate(json.loads(tokenizer.decode(mixed["json"]["tokens"])), SCHEMA)
    assert mixed["choice"]["reason"] == FINISH_STOP
    assert tokenizer.decode(mixed["choice"]["tokens"]) in ("yes", "no way")
    engine.close()


def test_a_request_waits_for_its_grammar_without_holding_up_or_spinning(tiny_model_dir, parts):
    tokenizer, vocabulary, grammars = parts
    engine = engine_for(tiny_model_dir)
    # No vocabulary yet (an engine restarted before its tokenizers re-sent it): it waits.
    engine.add("json", PROMPTS[0], greedy(60), grammar=grammars["schema"])
    engine.add("plain", PROMPTS[1], greedy(5))
    results = collect(engine)
    assert results["plain"]["reason"] == "length" and "json" not in results
    assert engine.num_waiting == 1 and not engine.has_work()  # idle: nothing to step
    assert select.select([engine.wakeup_fd], [], [], 0.2)[0] == []  # and nothing to wake it
    engine.set_grammar_vocabulary(vocabulary)
    assert select.select([engine.wakeup_fd], [], [], 30)[0] == [engine.wakeup_fd]
    assert engine.has_work()
    assert select.select([engine.wakeup_fd], [], [], 0)[0] == []  # has_work emptied the pipe
    results = collect(engine)
    assert results["json"]["reason"] == FINISH_STOP
    jsonschema.validate(json.loads(tokenizer.decode(results["json"]["tokens"])), SCHEMA)
    engine.close()


def test_failures_end_only_their_own_request(tiny_model_dir, parts):
    _, vocabulary, grammars = parts
    engine = engine_for(tiny_model_dir)
    engine.grammars.wait_s = 0.3
    engine.add("no-vocabulary", PROMPTS[0], greedy(8), grammar=grammars["choice"])
    engine.add("aborted", PROMPTS[2], greedy(8), grammar=grammars["schema"])
    engine.abort("aborted")
    time.sleep(0.4)
    results = collect(engine)
    assert results["no-vocabulary"]["reason"] == FINISH_ERROR
    assert "was not started (no vocabulary) within 0.3 s" in results["no-vocabulary"]["error"]
    assert results["aborted"]["reason"] == FINISH_ABORT
    engine.set_grammar_vocabulary(vocabulary)
    engine.add("broken", PROMPTS[0], greedy(8), grammar="start: undefined_rule")
    engine.add("plain", PROMPTS[1], greedy(4))
    deadline = time.monotonic() + 30
    results = {}
    while "broken" not in results or "plain" not in results:
        assert time.monotonic() < deadline
        results.update(collect(engine))
        time.sleep(0.01)
    assert results["broken"]["reason"] == FINISH_ERROR and results["broken"]["tokens"] == []
    assert "could not be built" in results["broken"]["error"]
    assert results["plain"]["reason"] == "length" and len(results["plain"]["tokens"]) == 4
    assert not engine.grammars.building and not engine.requests
    engine.close()
