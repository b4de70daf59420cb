"""Turns a request's StructuredOutputSpec into the grammar the engine builds its matcher from.

Runs in the tokenizer workers, so a bad schema is answered (400) before the engine ever sees
the request, and the engine gets plain text: a grammar in llguidance's Lark dialect (JSON
schemas inline as ``%json {...}``), which llguidance has checked here with the same vocabulary,
options and limits as the engine's (runtime.grammar). The check builds the grammar and computes
its first mask (about a millisecond for a typical schema): a spec that cannot be built, that
matches nothing (a ``$ref`` cycle with no base case, an empty regex) or whose first token costs
more than the limits allow is refused here, not in the engine. Before llguidance sees it, the
grammar's shape is bounded (rules, ``$ref``s, nesting): its compiler recurses along them.
Results, errors included, are cached by spec in a bounded LRU.

JSON is laid out compactly by default (``", "`` and ``": "``, no other whitespace): a grammar
that allows free whitespace lets a small model pad forever and never close the object.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from typing import Any

import llguidance
from llguidance.gbnf_to_lark import any_to_lark

from ipc.structured import (
    STRUCTURED_CHOICE,
    STRUCTURED_GRAMMAR,
    STRUCTURED_JSON_OBJECT,
    STRUCTURED_JSON_SCHEMA,
    STRUCTURED_REGEX,
    StructuredOutputSpec,
)
from runtime.grammar import (
    GRAMMAR_HEADER,
    grammar_executor,
    new_matcher,
    parser_limits,
    short_error,
)

COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
FLEXIBLE_JSON = {"whitespace_flexible": True}
MAX_CACHED_SPECS = 512
MAX_CACHED_CHARS = 32 * 1024 * 1024
# The grammar's shape, bounded before llguidance's compiler recurses along it (runtime.grammar):
MAX_GRAMMAR_RULES = 2_000  # rule and terminal definitions (a language's grammar has hundreds)
MAX_SCHEMA_REFS = 1_000  # "$ref"s in the schemas, inline ones of a grammar included
MAX_SCHEMA_DEPTH = 100  # JSON nesting of a schema document (llguidance stops at 128)

_UNIMPLEMENTED = re.compile(r"Unimplemented keys: \[(.*)\]")
_RULE = re.compile(r"^[ \t]*[?!]?[A-Za-z_][A-Za-z0-9_]*(?:\.-?\d+)?[ \t]*:", re.MULTILINE)
_REF = re.compile(r'"(?:\$|\\u0024)ref"', re.IGNORECASE)
_OPTIONS = re.compile(r"^[ \t]*%llguidance\b(?![ \t]*\{[ \t]*\}[ \t]*$)", re.MULTILINE)  # but {}
# The process's grammar-check thread, started on first use, at the background niceness: a
# hostile grammar's compile must not take the engine's core (runtime.priority).
_CHECK_THREAD: list = []


class GrammarSpecError(ValueError):
    """The spec cannot be compiled; the message names the problem (a 400 for the client)."""


class GrammarCompiler:
    def __init__(
        self,
        tokenizer: llguidance.LLTokenizer | None = None,
        *,
        compact_json: bool = True,
        max_cached: int = MAX_CACHED_SPECS,
        max_cached_chars: int = MAX_CACHED_CHARS,
    ) -> None:
        """``tokenizer``: llguidance's tokenizer for the model's vocabulary (checks references
        to special tokens; None skips that check)."""
        self.tokenizer = tokenizer
        self.json_layout = COMPACT_JSON if compact_json else FLEXIBLE_JSON
        self.max_cached, self.max_cached_chars = max_cached, max_cached_chars
        self._cache: OrderedDict[tuple, tuple[str, bool]] = OrderedDict()  # -> (text, is_error)
        self._cached_chars = 0
        self.hits = self.misses = 0

    def compile(self, spec: StructuredOutputSpec) -> str:
        """The grammar text for ``spec``; raises GrammarSpecError naming what is wrong."""
        key = spec.cache_key()
        entry = self._cache.get(key)
        if entry is not None:
            self.hits += 1
            self._cache.move_to_end(key)
        else:
            self.misses += 1
            try:
                entry = (self._compile(spec), False)
            except GrammarSpecError as exc:
                entry = (str(exc), True)
            self._remember(key, entry, len(spec.text) + sum(map(len, spec.choices)))
        text, is_error = entry
        if is_error:
            raise GrammarSpecError(text)
        return text

    def _compile(self, spec: StructuredOutputSpec) -> str:
        if spec.kind == STRUCTURED_JSON_SCHEMA:
            lark, what = "start: %json " + json.dumps(self._schema(spec.text)), "JSON schema"
        elif spec.kind == STRUCTURED_JSON_OBJECT:
            lark, what = "start: %json " + json.dumps(self._layout({"type": "object"})), "JSON"
        elif spec.kind == STRUCTURED_REGEX:
            lark, what = "start: /" + llguidance.regex_to_lark(spec.text) + "/", "regex"
        elif spec.kind == STRUCTURED_CHOICE:
            lark, what = "start: " + " | ".join(json.dumps(c) for c in spec.choices), "choice"
        elif spec.kind == STRUCTURED_GRAMMAR:
            try:  # GBNF/EBNF (llama.cpp's syntax) or Lark: llguidance tells them apart
                lark = any_to_lark(spec.text)
            except Exception as exc:
                raise GrammarSpecError(f"the grammar does not parse: {exc}") from None
            what = "grammar"
        else:  # StructuredOutputSpec validates kind; this guards a new kind left unhandled
            raise GrammarSpecError(f"unknown structured output kind {spec.kind!r}")
        self._check(lark, what)
        return lark

    def _schema(self, text: str) -> Any:
        try:
            schema = json.loads(text)
        except json.JSONDecodeError as exc:
            raise GrammarSpecError(f"the JSON schema is not valid JSON: {exc}") from None
        except RecursionError:
            raise GrammarSpecError(
                f"the JSON schema nests more than {MAX_SCHEMA_DEPTH} levels deep"
            ) from None
        if schema is False:
            raise GrammarSpecError("the JSON schema is false: no output can match it")
        if schema is True:
            schema = {}
        if not isinstance(schema, dict):
            raise GrammarSpecError(
                f"a JSON schema must be an object or a boolean, got {type(schema).__name__}"
            )
        check_schema(schema)
        return self._layout(schema)

    def _layout(self, schema: dict) -> dict:
        # llguidance reads its options from a top-level "x-guidance" key; ours win over a
        # client's (layout is the server's policy), other keys of the client's are kept.
        options = schema.get("x-guidance")
        options = dict(options) if isinstance(options, dict) else {}
        options.update(self.json_layout)
        return {**schema, "x-guidance": options}

    def _check(self, lark: str, what: str) -> None:
        check_shape(lark, what)
        if not _CHECK_THREAD:
            _CHECK_THREAD.append(grammar_executor("grammar-check", background=True))
        error, at_start = _CHECK_THREAD[0].submit(first_mask_error, self.tokenizer, lark).result()
        if error:
            raise GrammarSpecError(describe_error(error, what, at_start))

    def _remember(self, key: tuple, entry: tuple[str, bool], key_chars: int) -> None:
        size = key_chars + len(entry[0])
        if size > self.max_cached_chars:
            return
        self._cache[key] = entry
        self._cached_chars += size
        while len(self._cache) > self.max_cached or self._cached_chars > self.max_cached_chars:
            (kind, text, choices), (value, _) = self._cache.popitem(last=False)
            self._cached_chars -= len(text) + sum(map(len, choices)) + len(value)


def check_schema(schema: dict) -> None:
    """Checks the schema against the metaschema its ``$schema`` names, draft 7 when it names
    none: its structural rules (type names, the shape of properties, items, enum ...) are those
    of later drafts, and checking against it is ~5x faster than against 2020-12's dynamic refs
    (13 vs 76 ms for a 120-property schema here)."""
    from jsonschema import Draft7Validator, SchemaError, validators

    depth = json_depth(schema)
    if depth > MAX_SCHEMA_DEPTH:  # the check below recurses (and so does llguidance)
        raise GrammarSpecError(
            f"the JSON schema nests {depth} levels deep; at most {MAX_SCHEMA_DEPTH} are accepted"
        )
    try:
        validators.validator_for(schema, default=Draft7Validator).check_schema(schema)
    except SchemaError as exc:
        where = "/".join(str(p) for p in exc.path)
        raise GrammarSpecError(
            f"invalid JSON schema: {exc.message}" + (f" (at {where})" if where else "")
        ) from None


def first_mask_error(tokenizer: llguidance.LLTokenizer | None, lark: str) -> tuple[str, bool]:
    """(llguidance's error, whether it came at the first mask) for ``lark`` built as the engine
    builds it; ("", False) when it is usable. Without a tokenizer only the build is checked."""
    if tokenizer is None:
        grammar = llguidance.LLMatcher.grammar_from_lark(GRAMMAR_HEADER + lark)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            grammar, None, limits=parser_limits()
        )
        return (messages[0] if is_error and messages else "", False)
    matcher = new_matcher(tokenizer, lark)
    if matcher.is_error():
        return matcher.get_error(), False
    matcher.compute_bitmask()
    return matcher.get_error(), True


def check_shape(lark: str, what: str) -> None:
    """Bounds what llguidance's compiler recurses along, and keeps the server's options the
    server's (the engine cannot follow a grammar that turns forcing back on)."""
    if _OPTIONS.search(lark):
        raise GrammarSpecError(
            f"the {what} cannot be used: %llguidance options are not accepted "
            "(the server sets the grammar engine's options)"
        )
    rules = len(_RULE.findall(lark))
    if rules > MAX_GRAMMAR_RULES:
        raise GrammarSpecError(
            f"the {what} has {rules} rules; at most {MAX_GRAMMAR_RULES} are accepted"
        )
    refs = len(_REF.findall(lark))
    if refs > MAX_SCHEMA_REFS:
        raise GrammarSpecError(
            f"the {what} has {refs} $refs; at most {MAX_SCHEMA_REFS} are accepted"
        )


def json_depth(value: Any) -> int:
    """How deep a parsed JSON document nests (a scalar: 0), without recursing."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            node = node.values()
        elif not isinstance(node, list):
            continue
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in node)
    return deepest


def describe_error(message: str, what: str, at_start: bool = False) -> str:
    """llguidance's message in a line (runtime.grammar.short_error), led by what failed
    (unimplemented keywords named as such)."""
    text = short_error(message, at_start).replace("failed to compile JSON schema: ", "")
    found = _UNIMPLEMENTED.search(text)
    if found:
        names = ", ".join(json.loads(f"[{found.group(1)}]"))
        return f"unsupported JSON schema keyword(s): {names}"
    return f"the {what} cannot be used: {text}"
