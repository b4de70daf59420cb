#!/usr/bin/env python
"""Structured outputs on the engine, the default model, in one process (no sockets).

  decode   batch decode tokens/s with every row constrained by a JSON schema against the same
           batch unconstrained, interleaved repeats (best of --repeats each), per --dtype; and
           the grammar's share of a constrained step (mask fill + apply + advancing matchers).
           The grammar runs the way the engine will run it: the step's logits, one batched
           mask call for the constrained rows, then sampling.
  compile  a large schema (--schema-fields properties): the tokenizer-side compile (check) and
           the engine-side build, cold and cached.
  mask     the grammar's work per step alone, without the model (best-of timings).
  itl      step times of an unconstrained decoding batch while new large schemas build on the
           engine's background thread, against the same batch with nothing building.

    python -m scripts.bench_structured decode compile itl [--dtype float32,bfloat16]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from engine_worker.engine import Engine
from engine_worker.grammar_builder import GrammarBuilder, backend_tokenizer
from engine_worker.grammar_mask import GrammarMasker
from engine_worker.sampler import sample
from ipc.engine_config import EngineConfig
from ipc.messages import SamplingParams
from ipc.structured import StructuredOutputSpec
from procs.model_store import resolve_model
from runtime.model_files import load_tokenizer
from scripts.bench_grammar import NESTED_SCHEMA, large_schema
from tokenizer_worker.chat_template import ChatTemplate
from tokenizer_worker.grammar_compiler import GrammarCompiler
from tokenizer_worker.vocabulary import grammar_vocabulary

PEOPLE = ["Ada", "Bob", "Chen", "Dana", "Emil", "Fay", "Gus", "Hana"]
CITIES = ["Paris", "Lima", "Oslo", "Kyiv"]


class ConstrainedRun:
    """Stands in for ModelRunner.run: logits, grammar masks on the constrained rows, sampling,
    matchers advanced. Times the grammar's part of each step."""

    def __init__(self, runner, grammars: dict) -> None:
        self.runner, self.grammars = runner, grammars
        self.masker = GrammarMasker(runner.model.config.vocab_size)
        self.grammar_s: list[float] = []
        self.finished = 0
        self.outputs: dict[str, list[int]] = {}  # the tokens each row produced under its grammar

    def __call__(self, requests, counts):
        # The rows that sample this step are known before the forward: start their masks, so
        # the fill overlaps the model, then wait for it (the wait is what the step pays).
        rows = [r for r, n in zip(requests, counts) if r.num_computed + n == r.num_tokens]
        grammars = [self.grammars.get(r.request_id) for r in rows]
        t = time.perf_counter()
        self.masker.begin(grammars)
        spent = time.perf_counter() - t
        logits, emitting = self.runner.compute_logits(requests, counts)
        assert [requests[i] for i in emitting] == rows
        result = [None] * len(requests)
        t = time.perf_counter()
        assert not self.masker.finish(logits)
        spent += time.perf_counter() - t
        if not emitting:
            return result
        tokens = sample(logits, [r.sampler for r in rows]).tolist()
        t = time.perf_counter()
        for request, grammar, token in zip(rows, grammars, tokens):
            if grammar is None:
                continue
            self.outputs.setdefault(request.request_id, []).append(token)
            if grammar.accept(token) is not None:
                del self.grammars[request.request_id]  # complete: unconstrained from here
                self.finished += 1
        if any(g is not None for g in grammars):
            self.grammar_s.append(spent + time.perf_counter() - t)
        for i, token in zip(emitting, tokens):
            result[i] = token
        return result


def prompts(args, tokenizer, template) -> list[list[int]]:
    out = []
    for i in range(args.batch):
        ask = (f"Describe a fictional person called {PEOPLE[i % 8]} from {CITIES[i // 8 % 4]} "
               f"as JSON with name, age, address (city, zip), color, tags and active.")
        text = template.render([{"role": "user", "content": ask}])
        out.append(tokenizer.encode(text, add_special_tokens=False).ids)
    return out


def decode_once(engine, batch_prompts, new_tokens, grammar_text, builder, run_id):
    grammars = {}
    for i, ids in enumerate(batch_prompts):
        rid = f"{run_id}.{i}"
        engine.add(rid, ids, SamplingParams(max_tokens=new_tokens + 1, temperature=0.0,
                                            ignore_eos=True))
        if grammar_text is not None:
            grammars[rid] = builder.request(grammar_text)
    for g in grammars.values():
        while not g.ready():
            time.sleep(0.0005)
    plain_run = engine.runner.run
    constrained = ConstrainedRun(engine.runner, grammars)
    engine.runner.run = constrained  # the engine calls runner.run(...) each step
    try:
        while engine.num_waiting or any(not r.num_generated for r in engine.scheduler.running):
            engine.step()  # prefill everyone (and their first token) first
        produced, start = 0, time.perf_counter()
        while engine.has_work():
            produced += len(engine.step().request_ids)
        elapsed = time.perf_counter() - start
    finally:
        engine.runner.run = plain_run
    return produced / elapsed, constrained, elapsed


def valid_outputs(run: ConstrainedRun, tokenizer) -> tuple[int, str]:
    """How many completed rows are schema-valid JSON, and one of them."""
    import jsonschema
    valid, sample_text = 0, ""
    for rid, tokens in run.outputs.items():
        if rid in run.grammars:
            continue  # not complete within the tokens decoded
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        try:
            jsonschema.validate(json.loads(text), NESTED_SCHEMA)
        except (ValueError, jsonschema.ValidationError):
            continue
        valid, sample_text = valid + 1, sample_text or text
    return valid, sample_text


def run_decode(args, tokenizer, template, compiler, builder) -> None:
    grammar = compiler.compile(StructuredOutputSpec.json_schema(NESTED_SCHEMA))
    batch_prompts = prompts(args, tokenizer, template)
    print(f"\ndecode: batch {args.batch}, {args.decode_tokens} new tokens, greedy, "
          f"threads {torch.get_num_threads()}, best of {args.repeats}, interleaved")
    print(f"{'dtype':10s}{'plain tok/s':>13s}{'json tok/s':>12s}{'ratio':>8s}"
          f"{'grammar ms/step':>17s}{'step ms':>9s}{'share':>8s}{'completed':>11s}"
          f"{'(schema-valid)':>15s}")
    for dtype in args.dtype.split(","):
        # The prefix cache makes every run after the first skip its prefill: only decode is
        # timed, so runs can be short and many (best-of is what survives a busy machine).
        engine = Engine(EngineConfig(model_path=str(args.model), dtype=dtype,
                                     num_threads=args.threads, enable_prefix_cache=True,
                                     max_batch_size=args.batch, kv_cache_tokens=65536))
        decode_once(engine, batch_prompts[:2], 2, grammar, builder, "warm")
        plain = constrained = 0.0
        grammar_ms = completed = step_ms = 0.0
        for r in range(args.repeats):
            rate, _, _ = decode_once(engine, batch_prompts, args.decode_tokens, None, builder,
                                     f"p{r}")
            plain = max(plain, rate)
            rate, run, elapsed = decode_once(engine, batch_prompts, args.decode_tokens, grammar,
                                             builder, f"c{r}")
            if rate > constrained:
                constrained, completed = rate, run.finished
                grammar_ms = float(np.mean(run.grammar_s)) * 1e3
                step_ms = elapsed / args.decode_tokens * 1e3
                valid, sample_text = valid_outputs(run, tokenizer)
        print(f"{dtype:10s}{plain:13.1f}{constrained:12.1f}{constrained / plain:7.2f}x"
              f"{grammar_ms:17.2f}{step_ms:9.1f}{grammar_ms / step_ms:7.1%}"
              f"{completed:>8.0f}/{args.batch}{valid:>7d} valid")
        if sample_text:
            print(f"  e.g. {sample_text}")


def run_mask(args, compiler, builder, vocab_size: int) -> None:
    """The grammar's work per step alone (no model): --batch rows on the nested schema, random
    logits, one batched mask + apply, greedy pick, every matcher advanced. Best-of timing, so
    it is the least disturbed by other work on the machine; compare with a measured step."""
    text = compiler.compile(StructuredOutputSpec.json_schema(NESTED_SCHEMA))
    masker, generator = GrammarMasker(vocab_size), torch.Generator().manual_seed(0)
    times = []
    for _ in range(args.repeats):
        grammars = [builder.request(text) for _ in range(args.batch)]
        for g in grammars:
            while not g.ready():
                time.sleep(0.0005)
        for _ in range(args.decode_tokens):
            logits = torch.randn(args.batch, vocab_size, generator=generator)
            t = time.perf_counter()
            masker.apply(logits, grammars)
            for row, token in enumerate(logits.argmax(dim=-1).tolist()):
                if grammars[row] is not None and grammars[row].accept(token) is not None:
                    grammars[row] = None  # complete: unconstrained from here
            times.append(time.perf_counter() - t)
    ms = np.array(times) * 1e3
    print(f"\nmask: batch {args.batch}, nested schema, {len(times)} steps: grammar work per step "
          f"min {ms.min():.2f} / p50 {np.percentile(ms, 50):.2f} / p90 "
          f"{np.percentile(ms, 90):.2f} ms")


def run_compile(args, compiler, builder) -> None:
    schema = large_schema(args.schema_fields)
    spec = StructuredOutputSpec.json_schema(schema)
    print(f"\ncompile: a {args.schema_fields}-property schema ({len(spec.text)} characters)")
    compiler.compile(StructuredOutputSpec.json_schema({"type": "object"}))  # imports, warm
    t = time.perf_counter()
    text = compiler.compile(spec)
    worker_cold = time.perf_counter() - t
    t = time.perf_counter()
    compiler.compile(spec)
    worker_cached = time.perf_counter() - t
    for label in ("cold", "cached"):
        t = time.perf_counter()
        grammar = builder.request(text)
        while not grammar.ready():
            time.sleep(0.0002)
        built = time.perf_counter() - t
        if label == "cold":
            engine_cold = built
    print(f"  tokenizer worker: check {worker_cold * 1e3:8.2f} ms cold, "
          f"{worker_cached * 1e3:6.3f} ms cached; grammar text {len(text)} characters")
    print(f"  engine thread:    build {engine_cold * 1e3:8.2f} ms cold, "
          f"{built * 1e3:6.3f} ms cached (a copy of the warm template)")


def run_itl(args, tokenizer, template, compiler, builder) -> None:
    """Unconstrained decode step times, alone and while fresh large schemas keep building."""
    engine = Engine(EngineConfig(model_path=str(args.model), dtype=args.dtype.split(",")[0],
                                 num_threads=args.threads, enable_prefix_cache=False,
                                 max_batch_size=args.batch, kv_cache_tokens=65536))
    batch_prompts = prompts(args, tokenizer, template)
    texts = [compiler.compile(StructuredOutputSpec.json_schema(
        {**large_schema(args.schema_fields), "title": f"variant {i}"})) for i in range(200)]
    results = {}
    for r in range(args.repeats):
        for mode in ("quiet", "building"):
            for i, ids in enumerate(batch_prompts):
                engine.add(f"{mode}{r}.{i}", ids, SamplingParams(
                    max_tokens=args.decode_tokens + 1, temperature=0.0, ignore_eos=True))
            while engine.num_waiting or any(not q.num_generated
                                            for q in engine.scheduler.running):
                engine.step()
            pending, built = [], 0
            steps = []
            while engine.has_work():
                if mode == "building" and not any(not g.ready() for g in pending):
                    pending = [builder.request(texts[(built + k) % len(texts)]) for k in range(2)]
                    built += 2  # always something building: new schemas, never cached
                t = time.perf_counter()
                engine.step()
                steps.append(time.perf_counter() - t)
            results.setdefault(mode, []).extend(steps)
            if mode == "building":
                results.setdefault("built", []).append(built)
    print(f"\nitl: batch {args.batch} unconstrained decode, {args.dtype.split(',')[0]}, while "
          f"{args.schema_fields}-property schemas build in the background ({sum(results['built'])}"
          f" started over {args.repeats} runs)")
    for mode in ("quiet", "building"):
        ms = np.array(results[mode]) * 1e3
        print(f"  {mode:9s} step p50 {np.percentile(ms, 50):7.1f} ms   p99 "
              f"{np.percentile(ms, 99):7.1f} ms")
    ratio = np.percentile(results["building"], 99) / np.percentile(results["quiet"], 99)
    print(f"  p99 building / quiet: {ratio:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("workloads", nargs="*", default=["decode", "compile"],
                        choices=["decode", "compile", "itl", "mask"])
    parser.add_argument("--model", default=None, help="HF checkpoint dir (default model if unset)")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("--dtype", default="float32,bfloat16", help="comma-separated")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--decode-tokens", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--schema-fields", type=int, default=120)
    args = parser.parse_args()
    args.model = resolve_model(args.model)
    torch.set_num_threads(args.threads)
    tokenizer = load_tokenizer(args.model)
    template = ChatTemplate.from_model_dir(args.model)
    config = json.loads((args.model / "config.json").read_text())
    vocabulary = grammar_vocabulary(tokenizer, config["vocab_size"], [config["eos_token_id"]])
    compiler = GrammarCompiler(backend_tokenizer(vocabulary))
    builder = GrammarBuilder(vocabulary)
    for workload in args.workloads:
        if workload == "decode":
            run_decode(args, tokenizer, template, compiler, builder)
        elif workload == "compile":
            run_compile(args, compiler, builder)
        elif workload == "mask":
            run_mask(args, compiler, builder, config["vocab_size"])
        else:
            run_itl(args, tokenizer, template, compiler, builder)
    builder.close()


if __name__ == "__main__":
    main()
