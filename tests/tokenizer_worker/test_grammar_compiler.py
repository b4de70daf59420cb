"""Specs become checked grammar text, bad specs a message that names the problem; both cached."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from engine_worker.grammar_builder import backend_tokenizer
from ipc.structured import StructuredOutputSpec
from runtime.grammar import short_error
from tests.engine_worker.grammar_helpers import tiny_vocabulary
from tokenizer_worker.grammar_compiler import GrammarCompiler, GrammarSpecError

S = StructuredOutputSpec


@pytest.fixture(scope="module")
def compiler():
    return GrammarCompiler(backend_tokenizer(tiny_vocabulary()))


@pytest.mark.parametrize(
    "spec, fragment",
    [
        (
            S.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}}),
            '%json {"type": "object"',
        ),
        (S("json_object"), '%json {"type": "object"'),
        (S("regex", r"\d{3}-[a-z]+"), r"/\d{3}-[a-z]+/"),
        (S("regex", "a/b"), r"/a\/b/"),  # a slash cannot end the Lark regex early
        (S("choice", choices=['say "hi"', "bye"]), r'"say \"hi\"" | "bye"'),
        (S("grammar", 'root ::= "yes" | "no"'), '"yes"'),  # GBNF, converted
        (S("grammar", 'start: "a" b\nb: "c"'), 'start: "a" b'),  # Lark, as is
    ],
)
def test_each_kind_compiles(compiler, spec, fragment):
    assert fragment in compiler.compile(spec)


def test_json_layout_is_compact_and_the_servers(compiler):
    schema = {"type": "object", "x-guidance": {"whitespace_flexible": True, "coerce_one_of": True}}
    text = compiler.compile(S.json_schema(schema))
    options = json.loads(text.removeprefix("start: %json "))["x-guidance"]
    assert options == {
        "whitespace_flexible": False,
        "item_separator": ", ",
        "key_separator": ": ",
        "coerce_one_of": True,
    }
    flexible = GrammarCompiler(compact_json=False).compile(S("json_object"))
    assert '"whitespace_flexible": true' in flexible


@pytest.mark.parametrize(
    "spec, message",
    [
        (
            S.json_schema({"type": "array", "uniqueItems": True, "contains": {}}),
            "unsupported JSON schema keyword(s): contains, uniqueItems",
        ),
        (
            S.json_schema({"type": "object", "properties": {"a": {"type": "strin"}}}),
            "invalid JSON schema: 'strin' is not valid under any of the given schemas "
            "(at properties/a/type)",
        ),
        (S("json_schema", "{not json"), "the JSON schema is not valid JSON"),
        (S.json_schema([1, 2]), "a JSON schema must be an object or a boolean, got list"),
        (S.json_schema(False), "the JSON schema is false"),
        (
            S.json_schema({"type": "integer", "minimum": 5, "maximum": 1}),
            "minimum (5) is greater than maximum (1)",
        ),
        (S.json_schema({"$ref": "#/$defs/missing"}), "/$defs/missing' does not exist"),
        (S.json_schema({"type": "string", "pattern": "(?=a)b"}), "look-around"),
        (S("regex", "a(b"), 'the regex cannot be used: invalid regex "a(b"'),
        (S("grammar", 'root ::= "a" ('), "the grammar does not parse"),
        (S("grammar", "root ::= missing"), "Rule 'missing' not found"),
        (S("grammar", "start: <|no_such_token|>"), "the grammar cannot be used"),
    ],
)
def test_bad_specs_name_the_problem(compiler, spec, message):
    with pytest.raises(GrammarSpecError) as caught:
        compiler.compile(spec)
    assert message in str(caught.value)
    assert "\n" not in str(caught.value) and " | " not in str(caught.value)  # no source listing


def test_results_and_errors_are_cached_within_bounds():
    compiler = GrammarCompiler(max_cached=2, max_cached_chars=10_000)
    good, bad = S("regex", "[a-z]+"), S("regex", "(")
    first = compiler.compile(good)
    assert compiler.compile(good) is first
    for _ in range(2):
        with pytest.raises(GrammarSpecError):
            compiler.compile(bad)
    assert (compiler.hits, compiler.misses) == (2, 2)
    compiler.compile(S("regex", "[0-9]+"))  # a third entry evicts the oldest (good)
    compiler.compile(good)
    assert compiler.misses == 4 and len(compiler._cache) == 2
    huge = S("choice", choices=["x" * 4000, "y" * 4000, "z" * 4000])
    compiler.compile(huge)  # larger than the whole cache: compiled, not kept
    assert huge.cache_key() not in compiler._cache
    assert compiler._cached_chars == sum(len(k[1]) + len(v[0]) for k, v in compiler._cache.items())


def nested_schema(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def ref_chain(length: int) -> dict:
    defs: dict = {f"A{i}": {"$ref": f"#/$defs/A{i + 1}"} for i in range(length)}
    defs[f"A{length}"] = {"type": "string"}
    return {"$defs": defs, "$ref": "#/$defs/A0"}


def rule_chain(length: int) -> str:
    return "start: a0\n" + "".join(f"a{i}: a{i + 1}\n" for i in range(length)) + f'a{length}: "x"'


@pytest.mark.parametrize(
    "spec, message",
    [
        (
            S.json_schema(
                {"$defs": {"A": {"$ref": "#/$defs/B"}, "B": {"$ref": "#/$defs/A"}}}
                | {"$ref": "#/$defs/A"}
            ),
            "the JSON schema cannot be used: it matches no output at all (e.g. a $ref cycle",
        ),
        (S("regex", r"[^\s\S]"), "the regex cannot be used: it matches no output at all"),
        (S.json_schema(nested_schema(300)), "nests 601 levels deep; at most 100 are accepted"),
        (S("json_schema", "[" * 5000 + "]" * 5000), "nests more than 100 levels deep"),
        # Chains llguidance's compiler would recurse along until the stack ran out.
        (S.json_schema(ref_chain(4000)), "the JSON schema has 4001 $refs; at most 1000"),
        (S("grammar", rule_chain(3000)), "the grammar has 3002 rules; at most 2000"),
        (S("grammar", f"start: %json {json.dumps(ref_chain(1500))}"), "the grammar has 1501 $refs"),
        (
            S("grammar", '%llguidance {"no_forcing": false}\nstart: "x"'),
            "%llguidance options are not accepted",
        ),
    ],
)
def test_specs_the_engine_could_not_follow_are_refused_in_a_line(compiler, spec, message):
    with pytest.raises(GrammarSpecError) as caught:
        compiler.compile(spec)
    text = str(caught.value)
    assert message in text
    assert "\n" not in text and "<" not in text and len(text) < 400  # no state, no listing


def test_long_chains_within_the_bounds_compile():
    """Checked in a child process: a stack overflow there would end the process, not fail."""
    code = (
        "import json\n"
        "from engine_worker.grammar_builder import backend_tokenizer\n"
        "from ipc.structured import StructuredOutputSpec as S\n"
        "from tests.engine_worker.grammar_helpers import tiny_vocabulary\n"
        "from tests.tokenizer_worker.test_grammar_compiler import ref_chain, rule_chain\n"
        "from tokenizer_worker.grammar_compiler import GrammarCompiler\n"
        "c = GrammarCompiler(backend_tokenizer(tiny_vocabulary()))\n"
        "c.compile(S.json_schema(ref_chain(999)))\n"
        "c.compile(S('grammar', rule_chain(1998)))\n"
        "print('COMPILED')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and "COMPILED" in out.stdout, out.stderr[-2000:]


@pytest.mark.parametrize(
    "message, expected",
    [
        (
            "lexer error: too many expressions constructed\n<non-verbose/>",
            "the grammar is too complex to follow (lexer error: too many expressions constructed)",
        ),
        (
            "parser error: Too many items (limit 50000; mask); try avoiding single-byte/short "
            "lexemes\n<state>\nTokens: ...",
            "the grammar is too complex to follow (parser error: Too many items (limit 50000; "
            "mask); try avoiding single-byte/short lexemes)",
        ),
        ("NoExtensionBias\n<non-verbose/>", "no output can continue it here (e.g. a $ref cycle"),
        (
            'at 2(8): unknown name: "b"\n   1 | %llguidance {}\n   2 | start: b\n      ^\n',
            'unknown name: "b"',
        ),
    ],
)
def test_grammar_engine_messages_are_said_in_a_line(message, expected):
    assert short_error(message).startswith(expected)
