"""The two grammar backends the grammar workload compares (scripts/bench/grammar.py), behind one
small interface: worker-side compile (what crosses the process boundary), engine-side build,
copies, batched and single mask fills, accepting a token; and what is measured of each, in a
process of its own (``child``).

Every matcher is driven through the same target texts: at each step the longest allowed token
that continues the target is taken, so both backends see the same token sequences."""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path

import numpy as np

from scripts.bench.grammar_specs import CHOICES, GBNF, NESTED_SCHEMA, REGEX, WORDS, large_schema
from scripts.bench.interleave import best_ms


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


# --- what is measured of one backend ----------------------------------------------------------
def targets(kind: str, count: int, seed: int = 0) -> list[bytes]:
    """``count`` texts that the spec of ``kind`` accepts, all different."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        if kind in ("json_schema", "json_object"):
            doc = {
                "name": f"{rng.choice(WORDS).title()} {rng.choice(WORDS).title()}",
                "age": rng.randrange(150),
                "address": {"city": rng.choice(WORDS), "zip": f"{rng.randrange(10**5):05d}"},
                "color": rng.choice(["red", "green", "blue"]),
                "tags": rng.sample(WORDS, rng.randint(1, 3)),
                "active": rng.random() < 0.5,
            }
            out.append(json.dumps(doc).encode())
        elif kind == "regex":
            out.append(
                f"{rng.choice(WORDS)}@{rng.choice(WORDS)}.{rng.choice(['com', 'org'])}".encode()
            )
        elif kind == "grammar":
            items = [
                rng.choice(WORDS) if rng.random() < 0.7 else str(rng.randrange(999))
                for _ in range(rng.randint(2, 8))
            ]
            out.append(", ".join(items).encode())
        else:
            out.append(rng.choice(CHOICES).encode())
    return out


SPECS = {
    "json_schema": NESTED_SCHEMA,
    "json_object": {"type": "object"},
    "regex": REGEX,
    "grammar": GBNF,
    "choice": CHOICES,
}


def walk_one(backend, template, texts, walker, eos) -> tuple[list[float], list[float]]:
    mask_s, accept_s = [], []
    for text in texts:
        matcher, bitmask, pos = backend.fork(template), backend.new_bitmask(1), 0
        while True:
            t = time.perf_counter()
            backend.fill_one(matcher, bitmask)
            mask_s.append(time.perf_counter() - t)
            bits = unpack(bitmask[0], backend.vocab)
            if pos == len(text):
                assert bits[eos], "the end of the target does not allow eos"
                break
            token = walker.next_token(bits, text[pos:])
            t = time.perf_counter()
            backend.accept(matcher, token)
            accept_s.append(time.perf_counter() - t)
            pos += len(walker.tokens[token])
    return mask_s, accept_s


def walk_batch(backend, template, texts, walker, eos, threads) -> tuple[float, float]:
    """(ms per fill call with every row active, us per row-step over the whole walk)."""
    matchers = [backend.fork(template) for _ in texts]
    positions = [0] * len(texts)
    active = list(range(len(texts)))
    bitmask = backend.new_bitmask(len(texts))
    full, total_s, row_steps = [], 0.0, 0
    while active:
        t = time.perf_counter()
        backend.fill([matchers[i] for i in active], bitmask[: len(active)], threads)
        elapsed = time.perf_counter() - t
        total_s += elapsed
        row_steps += len(active)
        if len(active) == len(texts):
            full.append(elapsed)
        still = []
        for row, i in enumerate(active):
            bits = unpack(bitmask[row], backend.vocab)
            rest = texts[i][positions[i] :]
            if not rest:
                assert bits[eos]
                continue
            token = walker.next_token(bits, rest)
            backend.accept(matchers[i], token)
            positions[i] += len(walker.tokens[token])
            still.append(i)
        active = still
    return float(np.mean(full)) * 1e3, total_s / row_steps * 1e6


def child(args) -> dict:
    """Everything measured of one backend, in this process (a fresh one per backend)."""
    import msgpack

    data = msgpack.unpackb(Path(args.vocab).read_bytes())
    tokens, special, eos = data["tokens"], set(data["special"]), data["eos"]
    threads = args.mask_threads
    result: dict = {}
    rss0 = rss_mib()
    t = time.perf_counter()
    module = __import__(args.child)
    result["import_ms"] = (time.perf_counter() - t) * 1e3
    loaded = set(sys.modules)
    result["imports tokenizers/transformers"] = any(
        m.split(".")[0] in ("tokenizers", "transformers") for m in loaded
    )
    result["imports torch"] = "torch" in loaded
    del module
    cls = Llguidance if args.child == "llguidance" else Xgrammar
    result["tokenizer_info_ms"], backend = best_ms(lambda: cls(tokens, special, eos, threads), 2)
    result["rss_after_tokenizer_info_mib"] = rss_mib() - rss0
    walker = Walker(tokens, special)
    for kind, spec in SPECS.items():
        r = result.setdefault(kind, {})
        r["worker_compile_ms"], wire = best_ms(
            lambda kind=kind, spec=spec: backend.compile_worker(kind, spec), args.repeats
        )
        r["wire_bytes"] = len(wire)
        r["engine_build_ms"], template = best_ms(
            lambda wire=wire: backend.build_engine(wire), args.repeats
        )
        r["fork_ms"], _ = best_ms(lambda template=template: backend.fork(template), args.repeats)
        mask_s, accept_s = walk_one(backend, template, targets(kind, 8), walker, eos)
        r["mask_us_mean"] = float(np.mean(mask_s)) * 1e6
        r["mask_us_p99"] = float(np.percentile(mask_s, 99)) * 1e6
        r["accept_us_mean"] = float(np.mean(accept_s)) * 1e6
        for n in threads:
            best = min(
                (
                    walk_batch(
                        backend, template, targets(kind, args.batch, seed=rep), walker, eos, n
                    )
                    for rep in range(args.repeats)
                ),
                key=lambda x: x[0],
            )
            r[f"batch_fill_ms_t{n}"], r[f"batch_us_per_row_t{n}"] = best
    big = large_schema()
    r = result.setdefault("large_schema", {})
    r["worker_compile_ms"], wire = best_ms(
        lambda: backend.compile_worker("json_schema", big), args.repeats
    )
    r["wire_bytes"] = len(wire)
    r["engine_build_ms"], _ = best_ms(lambda: backend.build_engine(wire), args.repeats)
    result["rss_total_mib"] = rss_mib() - rss0
    return result
