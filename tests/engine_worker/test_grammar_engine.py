"""Constrained requests in the engine (tiny random model, the default vocabulary): their output
follows the grammar and the grammar's end stops them, unconstrained neighbours are untouched, a
request whose grammar or next mask is not ready waits without holding up the batch or keeping
the engine busy, and a grammar that fails (built or half-way) ends only its own request."""

from __future__ import annotations

import json
import select
import threading
import time

import jsonschema
import pytest

from engine_worker.engine import Engine
from ipc.engine_config import EngineConfig
from ipc.messages import ERR_BAD_REQUEST, FINISH_ABORT, FINISH_ERROR, FINISH_STOP
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
        # Starts fine, then nothing can follow "x" (the rule has no base case).
        "dead_end": compiler.compile(StructuredOutputSpec("grammar", 'start: "x" a\na: a "y"')),
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
    engine.grammars.wait_s = 60.0  # the build below waits for the vocabulary's reading
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


def test_a_late_mask_holds_up_only_its_own_row(tiny_model_dir, parts):
    tokenizer, vocabulary, grammars = parts
    engine = engine_for(tiny_model_dir)
    engine.add("plain", PROMPTS[1], greedy(24))
    alone = collect(engine)["plain"]["tokens"]
    engine.set_grammar_vocabulary(vocabulary)
    engine.add("warm", PROMPTS[0], greedy(60), grammar=grammars["schema"])  # builds the template
    assert collect(engine)["warm"]["reason"] == FINISH_STOP
    deferred = engine.grammars.deferred_rows  # the warm-up's own, if the machine is busy
    release = threading.Event()
    engine.grammars.builder._mask_thread.submit(release.wait)  # every mask from now on is late
    try:
        engine.add("json", PROMPTS[2], greedy(60), grammar=grammars["schema"])
        engine.add("plain", PROMPTS[1], greedy(24))
        results = collect(engine, mask_wait_s=0)  # returns when only the late row is left
        assert results["plain"]["tokens"] == alone and results["plain"]["reason"] == "length"
        # Its first token came from the template's mask; the next one waits for its mask.
        assert len(results["json"]["tokens"]) == 1 and "reason" not in results["json"]
        assert engine.grammars.deferred_rows == deferred + 1  # then passed over
        assert not engine.has_work()  # nothing to step until the mask is there
    finally:
        release.set()
    assert select.select([engine.wakeup_fd], [], [], 30)[0] == [engine.wakeup_fd]
    rest = collect(engine)["json"]
    assert rest["reason"] == FINISH_STOP
    text = tokenizer.decode(results["json"]["tokens"] + rest["tokens"])
    jsonschema.validate(json.loads(text), SCHEMA)
    engine.close()


def test_a_grammar_that_fails_half_way_ends_its_request_alone(tiny_model_dir, parts):
    tokenizer, vocabulary, grammars = parts
    engine = engine_for(tiny_model_dir)
    engine.set_grammar_vocabulary(vocabulary)
    engine.add("dead", PROMPTS[0], greedy(8), grammar=grammars["dead_end"])
    engine.add("plain", PROMPTS[1], greedy(6))
    results = collect(engine)
    dead = results["dead"]
    assert tokenizer.decode(dead["tokens"]) == "x"
    assert dead["reason"] == FINISH_ERROR and dead["code"] == ERR_BAD_REQUEST
    assert dead["error"].startswith(
        "the output could not follow the grammar after 1 token: no output can continue it here"
    )
    assert results["plain"]["reason"] == "length" and len(results["plain"]["tokens"]) == 6
    # A failed grammar's template is dropped (its shared lexer may be what failed).
    assert grammars["dead_end"] not in engine.grammars.builder._templates
    assert not engine.requests and not engine.grammars.active
    engine.close()


def test_a_constrained_request_computes_its_cached_prompts_last_token(tiny_model_dir, parts):
    """A prompt the prefix cache holds whole samples from its tail's kept end, but a constrained
    one computes its last token (a late mask defers its sample to a step that computes it)."""
    tokenizer, vocabulary, grammars = parts
    engine = Engine(
        EngineConfig(model_path=str(tiny_model_dir), dtype="float32", kv_cache_tokens=4096)
    )
    engine.set_grammar_vocabulary(vocabulary)
    prompt = list(range(100, 121))  # a full block and a tail of 5
    runs = {}
    for name, grammar in (("cold", ""), ("choice", grammars["choice"]), ("warm", "")):
        engine.add(name, prompt, greedy(8, ignore_eos=True), grammar=grammar)
        totals: dict = {}
        runs[name] = (collect(engine, totals=totals)[name], totals["prefill_tokens"])
    assert [rows for _, rows in runs.values()] == [21, 1, 0]
    assert tokenizer.decode(runs["choice"][0]["tokens"]) in ("yes", "no way")
    assert runs["warm"][0]["tokens"] == runs["cold"][0]["tokens"]
    engine.close()
