"""The engine's grammar side: matchers built off the step from vocabulary data, masks computed on
the mask thread and applied to the constrained rows only, termination, errors. Tiny vocabulary
except where named."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from concurrent.futures import Future

import jsonschema
import numpy as np
import pytest
import torch

from engine_worker.grammar_builder import (
    GrammarBuilder,
    RequestGrammar,
    advance_matcher,
    backend_tokenizer,
)
from engine_worker.grammar_mask import GrammarMasker, unpack_bitmask, unpack_bitmask_on
from ipc.messages import FINISH_STOP
from ipc.structured import StructuredOutputSpec
from tests.engine_worker.grammar_helpers import (
    EOS,
    SPECIAL,
    sample_constrained,
    text_of,
    tiny_vocabulary,
    wait_ready,
)
from tokenizer_worker.grammar_compiler import GrammarCompiler

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "color": {"enum": ["red", "green"]},
        "tags": {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": 99},
            "minItems": 1,
            "maxItems": 3,
        },
        "ok": {"type": "boolean"},
    },
    "required": ["name", "color", "tags", "ok"],
    "additionalProperties": False,
}
STRINGS = re.compile(rb'"(?:[^"\\]|\\.)*"')


@pytest.fixture(scope="module")
def vocabulary():
    return tiny_vocabulary()


@pytest.fixture(scope="module")
def compiler(vocabulary):
    return GrammarCompiler(backend_tokenizer(vocabulary))


@pytest.fixture()
def builder(vocabulary):
    b = GrammarBuilder(vocabulary)
    yield b
    b.close()


def build(builder, compiler, spec):
    return wait_ready(builder.request(compiler.compile(spec)))


def test_json_schema_rows_always_give_valid_json_and_stop_when_complete(
    builder, compiler, vocabulary
):
    spec = StructuredOutputSpec.json_schema(SCHEMA)
    grammars = [build(builder, compiler, spec) for _ in range(6)]
    tokens, ended = sample_constrained(grammars, vocabulary.vocab_size, steps=300)
    assert ended == [FINISH_STOP] * 6  # the closing brace completes the grammar: no eos needed
    for row in tokens:
        doc = json.loads(text_of(vocabulary, row))
        jsonschema.validate(doc, SCHEMA)
        assert list(doc) == list(SCHEMA["properties"])  # in the schema's order
        # The compact layout: outside strings, exactly what json.dumps writes.
        assert STRINGS.sub(b'""', text_of(vocabulary, row)) == STRINGS.sub(
            b'""', json.dumps(doc).encode()
        )
    assert builder.built == 1  # one build, five copies from the cache


def test_regex_choice_and_grammar_match_in_full(builder, compiler, vocabulary):
    cases = [
        (StructuredOutputSpec("regex", r"(ab|12){2,4}!"), rb"(ab|12){2,4}!"),
        (StructuredOutputSpec("choice", choices=["red", "green", 'na"me']), rb'red|green|na"me'),
        (
            StructuredOutputSpec("grammar", 'root ::= item (", " item)*\nitem ::= "true" | "null"'),
            rb"(true|null)(, (true|null))*",
        ),
    ]
    for seed, (spec, pattern) in enumerate(cases):
        grammars = [build(builder, compiler, spec) for _ in range(4)]
        tokens, ended = sample_constrained(grammars, vocabulary.vocab_size, steps=200, seed=seed)
        for row, how in zip(tokens, ended):
            assert how in (FINISH_STOP, "eos"), how
            assert re.fullmatch(pattern, text_of(vocabulary, row)), text_of(vocabulary, row)


def test_unconstrained_rows_are_untouched_and_constrained_rows_allow_only_grammar_tokens(
    builder, compiler, vocabulary
):
    grammar = build(builder, compiler, StructuredOutputSpec("choice", choices=["true", "null"]))
    logits = torch.randn(3, vocabulary.vocab_size, generator=torch.Generator().manual_seed(1))
    before = logits.clone()
    GrammarMasker(vocabulary.vocab_size).apply(logits, [None, grammar, None])
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    allowed = torch.isfinite(logits[1]).nonzero().flatten().tolist()
    table = vocabulary.token_table()
    assert allowed and all(
        b"true".startswith(table[t]) or b"null".startswith(table[t]) for t in allowed
    )
    assert torch.equal(logits[1][allowed], before[1][allowed])
    # No row constrained: nothing is touched (and no mask is computed).
    same = before.clone()
    GrammarMasker(vocabulary.vocab_size).apply(same, [None, None, None])
    assert torch.equal(same, before)


def test_special_padding_and_eos_tokens(builder, compiler, vocabulary):
    grammar = build(builder, compiler, StructuredOutputSpec("regex", "a[a-z]*"))
    masker = GrammarMasker(vocabulary.vocab_size)
    first = torch.zeros(1, vocabulary.vocab_size)
    masker.apply(first, [grammar])
    open_ids = set(torch.isfinite(first[0]).nonzero().flatten().tolist())
    assert EOS not in open_ids  # nothing matched yet: eos would end with no match
    assert not open_ids & set(SPECIAL)
    padding = set(range(len(vocabulary.token_table()) - 40, vocabulary.vocab_size))
    assert not open_ids & padding
    # After "a" the grammar may stop: eos is allowed, and so are more letters.
    grammar2 = build(builder, compiler, StructuredOutputSpec("regex", "a[a-z]*"))
    a = vocabulary.token_table().index(b"a")
    advance_matcher(grammar2, a)
    assert grammar2.mask_ready() and grammar2.tokens == 1
    logits = torch.zeros(1, vocabulary.vocab_size)
    masker.apply(logits, [grammar2])
    assert torch.isfinite(logits[0, EOS]) and torch.isfinite(logits[0, a])
    advance_matcher(grammar2, EOS)
    assert grammar2.stopped and not grammar2.mask_ready()


def test_a_refused_token_and_a_bad_grammar_end_the_request_with_a_short_error(
    builder, compiler, vocabulary
):
    grammar = build(builder, compiler, StructuredOutputSpec("regex", "ab"))
    advance_matcher(grammar, vocabulary.token_table().index(b"z"))
    assert grammar.error.startswith("the output could not follow the grammar after 0 tokens")
    assert not grammar.mask_ready()
    broken = wait_ready(builder.request("start: undefined_rule"))
    assert broken.matcher is None and broken.error == (
        'the grammar could not be built: unknown name: "undefined_rule"'
    )
    empty = wait_ready(builder.request(r"start: /[^\s\S]/"))  # builds, but cannot start
    assert empty.error.startswith("the grammar could not be built: it matches no output at all")
    for failed in (grammar, broken, empty):
        assert "\n" not in failed.error and "<" not in failed.error  # no state, no listing
        with pytest.raises(RuntimeError, match="not ready"):
            GrammarMasker(vocabulary.vocab_size).apply(
                torch.zeros(1, vocabulary.vocab_size), [failed]
            )


def test_ready_waits_for_the_build_and_the_vocabulary_is_required(vocabulary):
    future: Future = Future()
    grammar = RequestGrammar("g", future)
    assert not grammar.ready() and not grammar.mask_ready() and not grammar.schedulable()
    future.set_result(("matcher", np.zeros(3, dtype=np.int32)))
    assert grammar.ready() and grammar.matcher == "matcher" and grammar.mask_ready()

    empty = GrammarBuilder()
    early = empty.request('start: "x"')  # before any vocabulary: it waits for one
    time.sleep(0.05)
    assert not early.ready()
    assert empty.set_vocabulary(vocabulary) and empty.has_vocabulary
    assert wait_ready(early).matcher is not None and not early.error
    assert empty.set_vocabulary(tiny_vocabulary())  # an identical copy from another worker
    assert not empty.set_vocabulary(tiny_vocabulary(padding=8))  # a different one is refused
    empty.close()


def test_template_cache_is_bounded(vocabulary, compiler):
    builder = GrammarBuilder(vocabulary, max_cached=2)
    texts = [
        compiler.compile(StructuredOutputSpec("choice", choices=[w]))
        for w in ("red", "green", "true")
    ]
    for text in texts + texts[-1:]:
        wait_ready(builder.request(text))
    assert builder.built == 3 and len(builder._templates) == 2
    cached = builder.request(texts[2])
    assert cached.ready() and cached.matcher is not None  # a copy on the spot, no waiting
    wait_ready(builder.request(texts[0]))  # evicted: built again
    assert builder.built == 4
    builder.close()


def test_unpack_bitmask_matches_bit_order():
    vocab = 70
    rng = np.random.default_rng(0)
    allowed = rng.random((3, vocab)) < 0.5
    padded = np.zeros((3, 96), dtype=bool)
    padded[:, :vocab] = allowed
    words = np.packbits(padded, axis=1, bitorder="little").view(np.int32)
    assert np.array_equal(unpack_bitmask(words, vocab, torch.device("cpu")).numpy(), allowed)
    # The accelerator path (shifts on the device), run here on the CPU.
    assert np.array_equal(unpack_bitmask_on(words, vocab, torch.device("cpu")).numpy(), allowed)


def test_masker_checks_and_the_torch_path(builder, compiler, vocabulary):
    masker = GrammarMasker(vocabulary.vocab_size)
    grammar = build(builder, compiler, StructuredOutputSpec("regex", "ab"))
    wide = torch.zeros(1, vocabulary.vocab_size + 1)
    with pytest.raises(ValueError, match="wide"):
        masker.apply(wide, [grammar])
    # float64 logits take the torch path (as a GPU's would): same result as the numpy path.
    for dtype in (torch.float64, torch.float32):
        logits = torch.zeros(2, vocabulary.vocab_size, dtype=dtype)
        masker.apply(logits, [None, grammar])
        assert torch.isfinite(logits[0]).all() and torch.isfinite(logits[1]).sum() == 2


def test_engine_side_needs_no_tokenizer_library(tmp_path, vocabulary):
    """Built from the vocabulary's wire form in a fresh process: no tokenizers/transformers."""
    from ipc.codec import encode

    frame = tmp_path / "vocabulary.msgpack"
    frame.write_bytes(encode(vocabulary))
    code = (
        "import sys, torch; from ipc.codec import decode\n"
        "from engine_worker.grammar_builder import GrammarBuilder\n"
        "from engine_worker.grammar_mask import GrammarMasker\n"
        f"v = decode(open({str(frame)!r}, 'rb').read()); b = GrammarBuilder(v)\n"
        'g = b.request(\'start: %json {"type": "object"}\')\n'
        "import time\n"
        "while not g.ready(): time.sleep(0.001)\n"
        "logits = torch.zeros(1, v.vocab_size)\n"
        "GrammarMasker(v.vocab_size).apply(logits, [g])\n"
        "assert torch.isfinite(logits).sum() > 0\n"
        "print('LOADED', [m for m in sys.modules if m.startswith(('tokenizers', 'transformers'))])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and "LOADED []" in out.stdout, out.stdout + out.stderr


def test_default_vocabulary_nested_schema(default_model_dir):
    """The real 49k vocabulary as data, end to end: worker compile, engine build, masked greedy
    decoding over random logits gives schema-valid JSON in every row."""
    from tokenizers import Tokenizer

    from tokenizer_worker.vocabulary import grammar_vocabulary

    tokenizer = Tokenizer.from_file(str(default_model_dir / "tokenizer.json"))
    vocabulary = grammar_vocabulary(tokenizer, 49152, [2])
    compiler = GrammarCompiler(backend_tokenizer(vocabulary))
    builder = GrammarBuilder(vocabulary)
    text = compiler.compile(StructuredOutputSpec.json_schema(SCHEMA))
    grammars = [wait_ready(builder.request(text), timeout_s=30) for _ in range(4)]
    tokens, ended = sample_constrained(grammars, vocabulary.vocab_size, steps=200)
    assert ended == [FINISH_STOP] * 4
    for row in tokens:
        jsonschema.validate(json.loads(text_of(vocabulary, row)), SCHEMA)
    builder.close()
