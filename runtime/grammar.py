"""llguidance as the tokenizer workers (which check a grammar) and the engine (which follows it)
both use it: one set of parser limits, one options header, one kind of thread, one way of saying
what went wrong. A grammar a worker accepts is one the engine can build under the same limits.

Limits (``PARSER_LIMITS``) bound the work a grammar may cost. llguidance counts it: lexer fuel
when a grammar is built and again per token (about 50k and 14k units a millisecond), Earley
items per token (~20k a millisecond), lexer states (kept for the life of a built grammar) and
the grammar's size in symbols. With these values one token of one request costs at
most ~15-20 ms of one core on a quiet machine, whatever the grammar; past a limit the matcher
enters an error state and its request ends with an error, alone. ``verbose_errors`` is off:
otherwise messages carry the parser's state and the grammar's text.

Stack: llguidance's grammar compiler recurses once per rule or ``$ref`` it follows (~3 kB each;
a chain of 3,000 overflows the main thread's 8 MB and kills the process). Grammars are built on
``grammar_executor`` threads with a larger stack, and the worker bounds rules and references
(tokenizer_worker.grammar_compiler) so a chain never comes near it.
"""

from __future__ import annotations

import re
import threading
from concurrent.futures import ThreadPoolExecutor

import llguidance

from runtime.priority import lower_this_thread

# no_forcing: the engine has no tokenizer to tokenize forced text with (see
# engine_worker.grammar_builder); the worker checks grammars with the same options.
GRAMMAR_HEADER = '%llguidance {"no_forcing": true}\n'
PARSER_LIMITS = {
    "max_items_in_row": 2_000,  # Earley items in one row (one position of the output)
    "initial_lexer_fuel": 1_000_000,  # building the lexer: ~20 ms
    "step_lexer_fuel": 200_000,  # one token's lexer work: ~15 ms
    "step_max_items": 50_000,  # one token's Earley items: ~2.5 ms
    # States a built grammar keeps (~0.5-2 kB each, shared by its copies): 10-40 MB at most.
    # Typical schemas, regexes and grammars stay under 2,000 in long random walks.
    "max_lexer_states": 20_000,
    "max_grammar_size": 500_000,  # symbols in the grammar's productions
    "verbose_errors": False,
}
GRAMMAR_STACK_BYTES = 256 * 1024 * 1024  # reserved address space; pages are used as touched
MAX_ERROR_CHARS = 300

_STACK_LOCK = threading.Lock()
_LOCATION = re.compile(r"^at \d+\(\d+\): ")
_LISTING = re.compile(r"^\s*\d+ \| |^\s*\^+\s*$")
# llguidance's messages for a grammar that costs more than a limit allows, by their start.
_TOO_COMPLEX = (
    "lexer error: too many expressions",
    "lexer error: too many states",
    "parser error: too many items",
    "parser error: current row has",
)
_NO_CONTINUATION = ("noextension",)


def parser_limits() -> llguidance.LLParserLimits:
    return llguidance.LLParserLimits(**PARSER_LIMITS)  # type: ignore[arg-type]


def new_matcher(tokenizer: llguidance.LLTokenizer, lark: str) -> llguidance.LLMatcher:
    """A matcher for ``lark`` (llguidance's Lark dialect, without the header) under the limits.
    Never raises for a bad grammar: check ``is_error()``. Call it on a grammar_executor thread."""
    grammar = llguidance.LLMatcher.grammar_from_lark(GRAMMAR_HEADER + lark)
    return llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=parser_limits())


def grammar_executor(name: str, background: bool = False) -> ThreadPoolExecutor:
    """One worker thread with GRAMMAR_STACK_BYTES of stack (see the module docstring);
    ``background``: at the process's background niceness (runtime.priority), as a tokenizer
    worker's grammar checks run, so they never take the engine's core away from its step."""
    pool = ThreadPoolExecutor(1, thread_name_prefix=name)
    with _STACK_LOCK:  # threading.stack_size is process-wide: set it only around this start
        previous = threading.stack_size(GRAMMAR_STACK_BYTES)
        try:
            # starts the pool's one thread now, with that stack
            pool.submit(lower_this_thread if background else int).result()
        finally:
            threading.stack_size(previous)
    return pool


def short_error(message: str, at_start: bool = False) -> str:
    """llguidance's message in a line: no location prefix, grammar listing or parser state;
    a limit that was hit, or a grammar that cannot go on, said in plain words (``at_start``:
    it failed before any output)."""
    text = message.split("<non-verbose/>")[0].split("<state>")[0]
    lines = [_LOCATION.sub("", line).strip() for line in text.strip().splitlines()]
    text = " ".join(line for line in lines if line and not _LISTING.match(line))
    lowered = text.lower()
    if lowered.startswith(_TOO_COMPLEX):
        return f"the grammar is too complex to follow ({text[:MAX_ERROR_CHARS]})"
    if lowered.startswith(_NO_CONTINUATION):
        where = "it matches no output at all" if at_start else "no output can continue it here"
        return f"{where} (e.g. a $ref cycle with no base case, or a pattern that matches nothing)"
    return text[:MAX_ERROR_CHARS] or "rejected by the grammar engine"
