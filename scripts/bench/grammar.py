"""grammar: what a grammar costs by itself, without the model, on the default model's vocabulary.

compile   a large schema (--schema-fields properties) through our path: the tokenizer
          worker's check and compile, the engine's matcher build, cold and cached.
mask      the grammar's work per step alone: --batch rows on the nested schema, random logits,
          one batched mask + apply, a greedy pick, every matcher advanced (best-of timings).
backends  llguidance (what the engine uses) against xgrammar, each measured in a fresh process
          of its own (imports, memory): import time and what it drags in, tokenizer info from
          the vocabulary as data (the engine side), and for each kind of spec (a nested JSON
          schema, any JSON object, a regex, a GBNF grammar, a choice) the worker-side compile,
          what crosses the process boundary, the engine-side build, the per-token mask of one
          matcher and of a batch filled in one call (scripts/bench/grammar_backends.py).
          xgrammar is not a dependency: `pip install xgrammar` for it, else it is skipped.

  python -m scripts.bench grammar compile mask backends [--batch 32] [--mask-threads 1,2]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from procs.children import REPO_ROOT
from scripts.bench.grammar_specs import NESTED_SCHEMA, large_schema
from scripts.bench.options import add_parts, add_shared, int_list, text_list, workload_parser


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
        f"mask threads {args.mask_threads}"
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


def run_backends(args) -> None:
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        vocab_path = Path(tmp) / "vocab.msgpack"
        dump_vocabulary(vocab_path, args.model)
        for name in args.backends:
            if importlib.util.find_spec(name) is None:
                print(f"{name} is not installed: skipped (pip install {name})")
                continue
            cmd = [sys.executable, "-m", "scripts.bench", "grammar", "--child", name]
            cmd += ["--vocab", str(vocab_path), "--batch", str(args.batch)]
            cmd += ["--mask-threads", ",".join(map(str, args.mask_threads))]
            cmd += ["--repeats", str(args.repeats)]
            out = subprocess.run(
                cmd,
                check=True,
                capture_output=True,
                text=True,
                cwd=REPO_ROOT,
                env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
            )
            results[name] = json.loads(out.stdout.strip().splitlines()[-1])
    args.vocab_size = json.loads((args.model / "config.json").read_text())["vocab_size"]
    report(results, args)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(results, indent=1))


def ours(model_dir: Path):
    """The tokenizer worker's compiler and the engine's builder, as the cluster makes them."""
    from engine_worker.grammar_builder import GrammarBuilder
    from runtime.model_files import load_tokenizer
    from tokenizer_worker.grammar_compiler import GrammarCompiler
    from tokenizer_worker.vocabulary import grammar_backend

    vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    backend, vocabulary = grammar_backend(load_tokenizer(model_dir), vocab_size)
    return GrammarCompiler(backend), GrammarBuilder(vocabulary), vocab_size


def run_compile(args) -> None:
    from ipc.structured import StructuredOutputSpec

    compiler, builder, _ = ours(args.model)
    spec = StructuredOutputSpec.json_schema(large_schema(args.schema_fields))
    print(f"\ncompile: a {args.schema_fields}-property schema ({len(spec.text)} characters)")
    compiler.compile(StructuredOutputSpec.json_schema({"type": "object"}))  # imports, warm
    worker = {}
    for label in ("cold", "cached"):
        t = time.perf_counter()
        text = compiler.compile(spec)
        worker[label] = time.perf_counter() - t
    built = {}
    for label in ("cold", "cached"):
        t = time.perf_counter()
        grammar = builder.request(text)
        while not grammar.ready():
            time.sleep(0.0002)
        built[label] = time.perf_counter() - t
    builder.close()
    print(
        f"  tokenizer worker: check {worker['cold'] * 1e3:8.2f} ms cold, "
        f"{worker['cached'] * 1e3:6.3f} ms cached; grammar text {len(text)} characters"
    )
    print(
        f"  engine thread:    build {built['cold'] * 1e3:8.2f} ms cold, "
        f"{built['cached'] * 1e3:6.3f} ms cached (a copy of the warm template)"
    )


def run_mask(args) -> None:
    from engine_worker.grammar_builder import advance_matcher
    from engine_worker.grammar_mask import GrammarMasker
    from ipc.structured import StructuredOutputSpec

    compiler, builder, vocab_size = ours(args.model)
    text = compiler.compile(StructuredOutputSpec.json_schema(NESTED_SCHEMA))
    masker, generator = GrammarMasker(vocab_size), torch.Generator().manual_seed(0)
    times = []
    for _ in range(args.repeats):
        grammars = [builder.request(text) for _ in range(args.batch)]
        while not all(g.ready() for g in grammars):
            time.sleep(0.0005)
        for _ in range(args.decode_tokens):
            logits = torch.randn(args.batch, vocab_size, generator=generator)
            t = time.perf_counter()
            masker.apply(logits, grammars)
            for row, token in enumerate(logits.argmax(dim=-1).tolist()):
                grammar = grammars[row]
                if grammar is not None:
                    advance_matcher(grammar, token)  # what the mask thread does, here inline
                    if not grammar.mask_ready():
                        grammars[row] = None  # complete (or failed): unconstrained from here
            times.append(time.perf_counter() - t)
    builder.close()
    ms = np.array(times) * 1e3
    print(
        f"\nmask: batch {args.batch}, nested schema, {len(times)} steps: grammar work per step "
        f"min {ms.min():.2f} / p50 {np.percentile(ms, 50):.2f} / p90 "
        f"{np.percentile(ms, 90):.2f} ms"
    )


WORKLOADS = {"compile": run_compile, "mask": run_mask, "backends": run_backends}


def build_parser():
    p = workload_parser("grammar", __doc__)
    add_parts(p, list(WORKLOADS), list(WORKLOADS))
    add_shared(p, "model", "batch", "repeats", "schema_fields", "json")
    add_shared(p, "decode_tokens", decode_tokens=40)
    p.add_argument(
        "--mask-threads",
        type=int_list,
        default=[1, 2],
        help="backends: threads of a batched mask fill, each tried (default: 1,2)",
    )
    p.add_argument(
        "--backends",
        type=text_list,
        default=["llguidance", "xgrammar"],
        help="backends: which (default: llguidance,xgrammar)",
    )
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--vocab", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.child:  # one backend, in a process of its own (run_backends starts it)
        from scripts.bench.grammar_backends import child

        print(json.dumps(child(args)))
        return
    from procs.model_store import resolve_model

    args.model = resolve_model(args.model)
    for workload in args.workloads:
        WORKLOADS[workload](args)
