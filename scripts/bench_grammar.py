"""Grammar backends compared on this machine with the default model's vocabulary: xgrammar and
llguidance, each measured in a fresh process of its own (imports, memory).

For each backend: import time and what the import drags in, tokenizer-info construction from
the vocabulary as data (the engine side), and for each kind of spec (a nested JSON schema, any
JSON object, a regex, a GBNF grammar, a choice): the worker-side compile, what crosses the
process boundary (bytes, and whether it is plain data), the engine-side build from it, the
per-token mask time of one matcher and of a batch of matchers filled in one call. Every matcher
is driven through the same target texts: at each step the longest allowed token that continues
the target is taken, so both backends see the same token sequences.

    python -m scripts.bench_grammar [--batch 32] [--threads 1,2] [--repeats 3]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from scripts.bench.grammar_backends import Llguidance, Walker, Xgrammar, rss_mib, unpack
from scripts.bench.grammar_specs import CHOICES, GBNF, NESTED_SCHEMA, REGEX, WORDS, large_schema

ROOT = Path(__file__).resolve().parents[1]


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


def best_ms(fn, repeats: int) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e3, out


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
    import msgpack

    data = msgpack.unpackb(Path(args.vocab).read_bytes())
    tokens, special, eos = data["tokens"], set(data["special"]), data["eos"]
    threads = [int(t) for t in args.threads.split(",")]
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


def dump_vocabulary(path: Path, model_dir: Path) -> None:
    import msgpack
    from tokenizers import Tokenizer

    from tokenizer_worker.vocabulary import grammar_vocabulary

    config = json.loads((model_dir / "config.json").read_text())
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    eos = config["eos_token_id"]
    eos = eos[0] if isinstance(eos, list) else eos
    vocabulary = grammar_vocabulary(tokenizer, int(config["vocab_size"]), [eos])
    path.write_bytes(
        msgpack.packb(
            {
                "tokens": vocabulary.token_table(),
                "eos": eos,
                "special": vocabulary.special_id_list(),
            }
        )
    )


def report(results: dict[str, dict], args) -> None:
    names = list(results)
    print(
        f"\nvocabulary {args.vocab_size} tokens; batch {args.batch}; best of {args.repeats}; "
        f"threads {args.threads}"
    )
    header = f"{'metric':44s}" + "".join(f"{n:>14s}" for n in names) + f"{'ratio':>9s}"
    print(header)
    print("-" * len(header))

    def row(label, values):
        cells = "".join(f"{v:>14.3f}" if isinstance(v, float) else f"{str(v):>14s}" for v in values)
        ratio = ""
        if len(values) == 2 and all(isinstance(v, float) for v in values) and values[0] > 0:
            ratio = f"{values[1] / values[0]:>8.2f}x"
        print(f"{label:44s}{cells}{ratio:>9s}")

    first = results[names[0]]
    for key, value in first.items():
        if isinstance(value, dict):
            for sub in value:
                row(f"{key}: {sub}", [results[n][key].get(sub, "") for n in names])
        else:
            row(key, [results[n].get(key, "") for n in names])
    print("ratio = second column / first column")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model",
        type=Path,
        default=None,
        help="HF model directory (default: the provisioned default model)",
    )
    parser.add_argument("--batch", type=int, default=32, help="matchers filled in one call")
    parser.add_argument("--threads", default="1,2", help="mask threads to try, comma-separated")
    parser.add_argument("--repeats", type=int, default=3, help="best of this many")
    parser.add_argument("--backends", default="llguidance,xgrammar")
    parser.add_argument("--json", type=Path, help="also write the raw figures here")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--vocab", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    if args.model is None:
        from procs.model_store import ensure_default_model

        args.model = ensure_default_model()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        vocab_path = Path(tmp) / "vocab.msgpack"
        dump_vocabulary(vocab_path, args.model)
        for name in args.backends.split(","):
            if importlib.util.find_spec(name) is None:
                print(f"{name} is not installed: skipped (pip install {name})")
                continue
            cmd = [
                sys.executable,
                "-m",
                "scripts.bench_grammar",
                "--child",
                name,
                "--vocab",
                str(vocab_path),
                "--batch",
                str(args.batch),
                "--threads",
                args.threads,
                "--repeats",
                str(args.repeats),
            ]
            out = subprocess.run(
                cmd,
                check=True,
                capture_output=True,
                text=True,
                cwd=ROOT,
                env={**os.environ, "PYTHONPATH": str(ROOT)},
            )
            results[name] = json.loads(out.stdout.strip().splitlines()[-1])
    args.vocab_size = json.loads((args.model / "config.json").read_text())["vocab_size"]
    report(results, args)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
