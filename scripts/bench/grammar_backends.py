"""The two grammar backends compared by scripts/bench_grammar.py, behind one small interface:
worker-side compile (what crosses the process boundary), engine-side build, copies, batched and
single mask fills, accepting a token. Each runs in a process of its own."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def compact_schema_options() -> dict:
    return {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


# --- one backend, in a process of its own ------------------------------------------------------


class Walker:
    """Drives a matcher along a target text: the longest allowed token continuing it."""

    def __init__(self, tokens: list[bytes], special: set[int]) -> None:
        self.lookup = {b: i for i, b in enumerate(tokens) if b and i not in special}
        self.max_len = max(len(b) for b in self.lookup)
        self.tokens = tokens

    def next_token(self, bits: np.ndarray, rest: bytes) -> int:
        for n in range(min(self.max_len, len(rest)), 0, -1):
            token = self.lookup.get(rest[:n])
            if token is not None and bits[token]:
                return token
        raise AssertionError(f"no allowed token continues {rest[:40]!r}")


def unpack(mask_row: np.ndarray, vocab: int) -> np.ndarray:
    return np.unpackbits(mask_row.view(np.uint8), bitorder="little")[:vocab]


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


class Llguidance:
    name = "llguidance"

    def __init__(self, tokens, special, eos, threads):
        import llguidance

        self.llg = llguidance
        self.vocab = len(tokens)

        class VocabularyOnly:  # the engine's view: data only, tokenizing raises
            is_tokenizer_wrapper = True

            def __init__(self):
                self.tokens, self.special_token_ids = tokens, sorted(special)
                self.eos_token_id, self.bos_token_id = eos, None

            def __call__(self, text):
                raise RuntimeError("asked to tokenize")

        self.tokenizer = llguidance.LLTokenizer(VocabularyOnly(), eos_token=eos)
        self.executors = {t: llguidance.LLExecutor(t) for t in threads}

    def lark(self, kind, spec):
        header = '%llguidance {"no_forcing": true}\n'
        if kind in ("json_schema", "json_object"):
            schema = dict(spec, **{"x-guidance": compact_schema_options()})
            return header + "start: %json " + json.dumps(schema)
        if kind == "regex":
            return header + "start: /" + self.llg.regex_to_lark(spec) + "/"
        if kind == "choice":
            return header + "start: " + " | ".join(json.dumps(c) for c in spec)
        from llguidance.gbnf_to_lark import any_to_lark

        return header + any_to_lark(spec)

    def compile_worker(self, kind, spec):
        """Worker side: the grammar text, checked. Returns what crosses the boundary."""
        grammar = self.llg.LLMatcher.grammar_from_lark(self.lark(kind, spec))
        error = self.llg.LLMatcher.validate_grammar(grammar, self.tokenizer)
        assert not error, error
        return grammar

    def build_engine(self, wire):
        m = self.llg.LLMatcher(self.tokenizer, wire, log_level=1)
        assert not m.is_error(), m.get_error()
        return m

    def fork(self, matcher):
        return matcher.deep_copy()

    def new_bitmask(self, rows):
        return np.full((rows, (self.vocab + 31) // 32), -1, dtype=np.int32)

    def fill(self, matchers, bitmask, threads):
        self.executors[threads].unsafe_compute_mask_ptr(
            [(m, i) for i, m in enumerate(matchers)],
            bitmask.ctypes.data,
            bitmask.shape[1] * 4,
            bitmask.shape[0],
        )

    def fill_one(self, matcher, bitmask):
        matcher.unsafe_compute_mask_ptr(bitmask.ctypes.data, bitmask.shape[1] * 4)

    def accept(self, matcher, token):
        assert matcher.consume_token(token), matcher.get_error()


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tokens, special, eos, threads):
        import torch

        try:
            import xgrammar
        except ImportError:
            raise SystemExit(
                "the xgrammar side of the comparison needs `pip install xgrammar` "
                "(not a dependency: the engine uses llguidance)"
            ) from None
        self.xgr, self.torch = xgrammar, torch
        self.vocab = len(tokens)
        # Special tokens as empty strings: xgrammar then never allows them as text.
        encoded = [b"" if i in special else t for i, t in enumerate(tokens)]
        self.info = xgrammar.TokenizerInfo(
            encoded, xgrammar.VocabType.RAW, vocab_size=len(tokens), stop_token_ids=[eos]
        )
        self.compiler = xgrammar.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self.batchers = {t: xgrammar.BatchGrammarMatcher(t) for t in threads}

    def compile_worker(self, kind, spec):
        c = self.compiler
        if kind in ("json_schema", "json_object"):
            compiled = c.compile_json_schema(
                json.dumps(spec), any_whitespace=False, separators=(", ", ": ")
            )
        elif kind == "regex":
            compiled = c.compile_regex(spec)
        elif kind == "choice":
            compiled = c.compile_grammar("root ::= " + " | ".join(json.dumps(s) for s in spec))
        else:
            compiled = c.compile_grammar(spec)
        return compiled.serialize_json()

    def build_engine(self, wire):
        compiled = self.xgr.CompiledGrammar.deserialize_json(wire, self.info)
        return self.xgr.GrammarMatcher(compiled)

    def fork(self, matcher):
        return matcher.fork()

    def new_bitmask(self, rows):
        return self.xgr.allocate_token_bitmask(rows, self.vocab).numpy()

    def fill(self, matchers, bitmask, threads):
        self.batchers[threads].batch_fill_next_token_bitmask(
            matchers, self.torch.from_numpy(bitmask)
        )

    def fill_one(self, matcher, bitmask):
        matcher.fill_next_token_bitmask(self.torch.from_numpy(bitmask))

    def accept(self, matcher, token):
        assert matcher.accept_token(token)
