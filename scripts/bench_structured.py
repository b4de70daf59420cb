"""Structured outputs: what constraining the output costs, on the default model.

  decode   batch decode tokens/s with every row constrained by a JSON schema against the same
           batch unconstrained (the engine in this process, its real grammar path: matchers
           built off the step, the batched mask started before the forward and applied after,
           every matcher advanced), interleaved, best of --repeats; and the grammar's share of
           a constrained step. Every row stays constrained for the whole window (an array of
           objects longer than --decode-tokens), so the batch never shrinks.
  ttft     time to first token of a request whose grammar is cached (tokenizer and engine)
           against the same request unconstrained, through a real cluster, one at a time,
           interleaved.
  itl      inter-token latency of unconstrained requests already decoding in a real cluster
           while requests with new large schemas keep arriving (each compiled in the tokenizer
           worker, built on the engine's grammar thread), against the same arrivals without a
           schema (the same prompts and max_tokens 1: only the grammar differs).
  compile  a large schema (--schema-fields properties): the tokenizer-side check and compile,
           the engine-side build, cold and cached.
  mask     the grammar's work per step alone, without the model (best-of timings).

    python -m scripts.bench_structured decode ttft itl [--dtype float32] [--repeats 3]

Figures are printed; the machine's load average is printed with them (a shared machine makes
absolute times noisy: compare the ratios, measured in the same run).
"""

from __future__ import annotations

import argparse
import json
import os
import select
import time

import numpy as np
import torch

from engine_worker.engine import Engine
from engine_worker.grammar_builder import GrammarBuilder, advance_matcher
from engine_worker.grammar_mask import GrammarMasker
from ipc.engine_config import EngineConfig
from ipc.messages import SamplingParams
from ipc.structured import StructuredOutputSpec
from procs.model_store import resolve_model
from runtime.model_files import load_tokenizer
from scripts.bench.grammar_specs import NESTED_SCHEMA, large_schema
from scripts.bench.structured_cluster import run_itl, run_ttft
from tokenizer_worker.chat_template import ChatTemplate
from tokenizer_worker.grammar_compiler import GrammarCompiler
from tokenizer_worker.vocabulary import grammar_backend

PEOPLE = ["Ada", "Bob", "Chen", "Dana", "Emil", "Fay", "Gus", "Hana"]
CITIES = ["Paris", "Lima", "Oslo", "Kyiv"]
# Many people: no row can finish within the measured window, so every step has every row.
PEOPLE_SCHEMA = {"type": "array", "items": NESTED_SCHEMA, "minItems": 50}


def prompts(batch: int, tokenizer, template) -> list[list[int]]:
    out = []
    for i in range(batch):
        ask = (
            f"Describe fictional people from {CITIES[i // 8 % 4]}, starting with "
            f"{PEOPLE[i % 8]}, as JSON with name, age, address (city, zip), color, tags "
            f"and active."
        )
        text = template.render([{"role": "user", "content": ask}])
        out.append(tokenizer.encode(text, add_special_tokens=False).ids)
    return out


def decode_once(
    engine: Engine, batch_prompts, new_tokens: int, grammar: str, run_id: str
) -> tuple[float, float, int]:
    """(tokens/s, seconds, rows still constrained at the end) over the decode steps only."""
    names = []
    for i, ids in enumerate(batch_prompts):
        names.append(f"{run_id}.{i}")
        engine.add(
            names[-1],
            ids,
            SamplingParams(max_tokens=new_tokens + 1, temperature=0.0),
            grammar=grammar,
        )
    while engine.num_waiting or any(not r.num_generated for r in engine.scheduler.running):
        if engine.has_work():
            engine.step()  # grammars ready, prompts prefilled, first tokens out
        else:
            time.sleep(0.0005)
    constrained = sum(engine.requests[n].grammar is not None for n in names if n in engine.requests)
    produced, start = 0, time.perf_counter()
    while engine.requests:
        if engine.has_work():
            produced += len(engine.step().request_ids)
        else:  # only late grammar masks left: sleep until one is there, as the engine does
            select.select([engine.wakeup_fd], [], [], 1.0)
    elapsed = time.perf_counter() - start
    return produced / elapsed, elapsed, constrained


def run_decode(args, tokenizer, template, compiler) -> None:
    grammar = compiler.compile(StructuredOutputSpec.json_schema(PEOPLE_SCHEMA))
    batch_prompts = prompts(args.batch, tokenizer, template)
    print(
        f"\ndecode: batch {args.batch}, {args.decode_tokens} new tokens, greedy, "
        f"threads {torch.get_num_threads()}, best of {args.repeats}, interleaved"
    )
    print(
        f"{'dtype':10s}{'plain tok/s':>13s}{'json tok/s':>12s}{'ratio':>8s}"
        f"{'grammar ms/step':>17s}{'step ms':>9s}{'rows':>6s}"
    )
    for dtype in args.dtype.split(","):
        # The prefix cache lets every run after the first skip its prefill: only decode is
        # timed, so runs can be short and many (best-of is what survives a busy machine).
        engine = Engine(
            EngineConfig(
                model_path=str(args.model),
                dtype=dtype,
                engine_threads=args.threads,
                enable_prefix_cache=True,
                max_batch_size=args.batch,
                kv_cache_tokens=65536,
            )
        )
        engine.set_grammar_vocabulary(args.vocabulary)
        decode_once(engine, batch_prompts[:2], 2, grammar, "warm")
        masker_time = _time_grammar_work(engine)
        plain = constrained = 0.0
        grammar_ms = step_ms = 0.0
        rows = 0
        for r in range(args.repeats):
            rate, _, _ = decode_once(engine, batch_prompts, args.decode_tokens, "", f"p{r}")
            plain = max(plain, rate)
            masker_time.clear()
            rate, elapsed, alive = decode_once(
                engine, batch_prompts, args.decode_tokens, grammar, f"c{r}"
            )
            if rate > constrained:
                constrained, rows = rate, alive
                grammar_ms = float(np.mean(masker_time)) * 1e3 if masker_time else 0.0
                step_ms = elapsed / args.decode_tokens * 1e3
        print(
            f"{dtype:10s}{plain:13.1f}{constrained:12.1f}{constrained / plain:7.2f}x"
            f"{grammar_ms:17.2f}{step_ms:9.1f}{rows:>6d}"
        )
        engine.close()
    print(
        "  (grammar ms/step: the step's own grammar work, applying the ready masks and handing "
        "the sampled tokens to the mask thread; rows whose mask was late are deferred, not "
        "waited for)"
    )


def _time_grammar_work(engine: Engine) -> list[float]:
    """Times, per constrained step, the step's own grammar work: applying the ready masks and
    handing the sampled tokens to the mask thread (the masker exists once a constrained step
    has run)."""
    times: list[float] = []
    masker, grammars, spent = engine.runner.grammar_masker, engine.grammars, [0.0]
    assert masker is not None

    def timed(original):
        def call(*args):
            t = time.perf_counter()
            result = original(*args)
            spent[0] += time.perf_counter() - t
            return result

        return call

    def step(original=engine.step):
        spent[0] = 0.0
        out = original()
        if spent[0]:
            times.append(spent[0])
        return out

    masker.apply = timed(masker.apply)  # type: ignore[method-assign]
    grammars.advance = timed(grammars.advance)  # type: ignore[method-assign]
    engine.step = step  # type: ignore[method-assign]
    return times


def run_mask(args, compiler, builder, vocab_size: int) -> None:
    """The grammar's work per step alone (no model): --batch rows on the nested schema, random
    logits, one batched mask + apply, greedy pick, every matcher advanced."""
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
    ms = np.array(times) * 1e3
    print(
        f"\nmask: batch {args.batch}, nested schema, {len(times)} steps: grammar work per step "
        f"min {ms.min():.2f} / p50 {np.percentile(ms, 50):.2f} / p90 "
        f"{np.percentile(ms, 90):.2f} ms"
    )


def run_compile(args, compiler, builder) -> None:
    spec = StructuredOutputSpec.json_schema(large_schema(args.schema_fields))
    print(f"\ncompile: a {args.schema_fields}-property schema ({len(spec.text)} characters)")
    compiler.compile(StructuredOutputSpec.json_schema({"type": "object"}))  # imports, warm
    t = time.perf_counter()
    text = compiler.compile(spec)
    worker_cold = time.perf_counter() - t
    t = time.perf_counter()
    compiler.compile(spec)
    worker_cached = time.perf_counter() - t
    built = {}
    for label in ("cold", "cached"):
        t = time.perf_counter()
        grammar = builder.request(text)
        while not grammar.ready():
            time.sleep(0.0002)
        built[label] = time.perf_counter() - t
    print(
        f"  tokenizer worker: check {worker_cold * 1e3:8.2f} ms cold, "
        f"{worker_cached * 1e3:6.3f} ms cached; grammar text {len(text)} characters"
    )
    print(
        f"  engine thread:    build {built['cold'] * 1e3:8.2f} ms cold, "
        f"{built['cached'] * 1e3:6.3f} ms cached (a copy of the warm template)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "workloads",
        nargs="*",
        default=["decode", "ttft", "itl"],
        choices=["decode", "ttft", "itl", "compile", "mask"],
    )
    parser.add_argument("--model", default=None, help="HF checkpoint dir (default model if unset)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (decode, mask)")
    parser.add_argument("--dtype", default="float32", help="decode: comma-separated dtypes")
    parser.add_argument("--batch", type=int, default=32, help="decode / mask: rows")
    parser.add_argument("--decode-tokens", type=int, default=40, help="decode: tokens per run")
    parser.add_argument("--repeats", type=int, default=3, help="decode / mask / compile: runs")
    parser.add_argument("--schema-fields", type=int, default=120, help="the large schema")
    parser.add_argument("--requests", type=int, default=20, help="ttft: requests per mode")
    parser.add_argument("--streams", type=int, default=8, help="itl: decoding requests")
    parser.add_argument("--stream-tokens", type=int, default=160, help="itl: their length")
    parser.add_argument(
        "--arrival-interval-ms",
        type=float,
        default=500.0,
        help="itl: a new request (a new schema, or none) every this often",
    )
    args = parser.parse_args()
    args.model = resolve_model(args.model)
    torch.set_num_threads(args.threads)
    print(f"load average before: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    tokenizer = load_tokenizer(args.model)
    template = ChatTemplate.from_model_dir(args.model)
    vocab_size = json.loads((args.model / "config.json").read_text())["vocab_size"]
    backend, args.vocabulary = grammar_backend(tokenizer, vocab_size)
    compiler = GrammarCompiler(backend)
    builder = GrammarBuilder(args.vocabulary)
    for workload in args.workloads:
        if workload == "decode":
            run_decode(args, tokenizer, template, compiler)
        elif workload == "compile":
            run_compile(args, compiler, builder)
        elif workload == "mask":
            run_mask(args, compiler, builder, vocab_size)
        elif workload == "ttft":
            run_ttft(args)
        else:
            run_itl(args)
    builder.close()
    print(f"load average after: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
