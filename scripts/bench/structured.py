"""structured: what constraining the output costs, on the default model.

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
  hostile  one stream's largest gap between tokens alone and while requests with unique
           hostile schemas keep arriving (an enum the tokenizer worker compiles for ~0.5 s of
           CPU before refusing it), each with and without --burners CPU-burning processes in a
           session of their own (a compile job on the cores), interleaved; one cluster per
           --background-niceness value (0: the tokenizer's grammar checks as nice as the engine).

A grammar's own cost, without the model (compile, build, the per-step mask), is the `grammar`
workload's. Figures are printed with the machine's load average (a shared machine makes
absolute times noisy: compare the ratios, measured in the same run).

    python -m scripts.bench structured decode ttft itl [--dtypes float32] [--repeats 3]
"""

from __future__ import annotations

import contextlib
import json
import os
import time

import numpy as np
import torch

from engine_worker.engine import Engine
from ipc.engine_config import EngineConfig
from ipc.structured import StructuredOutputSpec
from procs.model_store import resolve_model
from runtime.model_files import load_tokenizer
from scripts.bench.engine_runs import DecodeRun, decode_run
from scripts.bench.grammar_specs import NESTED_SCHEMA, large_schema
from scripts.bench.interleave import interleave
from scripts.bench.options import add_parts, add_shared, text_list, workload_parser
from scripts.bench.stats import describe_ms
from tokenizer_worker.chat_template import ChatTemplate
from tokenizer_worker.grammar_compiler import GrammarCompiler
from tokenizer_worker.vocabulary import grammar_backend

PEOPLE = ["Ada", "Bob", "Chen", "Dana", "Emil", "Fay", "Gus", "Hana"]
CITIES = ["Paris", "Lima", "Oslo", "Kyiv"]
# Many people: no row can finish within the measured window, so every step has every row.
PEOPLE_SCHEMA = {"type": "array", "items": NESTED_SCHEMA, "minItems": 50}


def people_prompts(batch: int, model_dir) -> list[list[int]]:
    tokenizer, template = load_tokenizer(model_dir), ChatTemplate.from_model_dir(model_dir)
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


def run_decode(args, asker: _Asker | None = None) -> None:
    tokenizer = load_tokenizer(args.model)
    vocab_size = json.loads((args.model / "config.json").read_text())["vocab_size"]
    backend, vocabulary = grammar_backend(tokenizer, vocab_size)
    grammar = GrammarCompiler(backend).compile(StructuredOutputSpec.json_schema(PEOPLE_SCHEMA))
    prompts = people_prompts(args.batch, args.model)
    print(
        f"\ndecode: batch {args.batch}, {args.decode_tokens} new tokens, greedy, "
        f"threads {torch.get_num_threads()}, best of {args.repeats}, interleaved"
    )
    print(
        f"{'dtype':10s}{'plain tok/s':>13s}{'json tok/s':>12s}{'ratio':>8s}"
        f"{'grammar ms/step':>17s}{'step ms':>9s}{'rows':>6s}"
    )
    for dtype in args.dtypes:
        print(decode_row(args, dtype, prompts, grammar, vocabulary))
    print(
        "  (grammar ms/step: the step's own grammar work, applying the ready masks and handing "
        "the sampled tokens to the mask thread; rows whose mask was late are deferred, not "
        "waited for)"
    )


def decode_row(args, dtype: str, prompts: list[list[int]], grammar: str, vocabulary) -> str:
    """Plain against constrained on one engine in ``dtype``, interleaved, best of --repeats."""
    # The prefix cache lets every run after the first skip its prefill: only decode is timed,
    # so runs can be short and many (best-of is what survives a busy machine).
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
    engine.set_grammar_vocabulary(vocabulary)
    decode_run(engine, prompts[:2], 2, grammar=grammar)  # warm, and the masker exists
    grammar_times = _time_grammar_work(engine)

    def constrained() -> tuple[DecodeRun, float]:
        grammar_times.clear()
        run = decode_run(engine, prompts, args.decode_tokens, grammar=grammar)
        return run, float(np.mean(grammar_times)) * 1e3 if grammar_times else 0.0

    runs = interleave(
        {
            "plain": lambda: (decode_run(engine, prompts, args.decode_tokens), 0.0),
            "json": constrained,
        },
        args.repeats,
    )
    engine.close()
    plain = max(run.rate for run, _ in runs["plain"])
    best, grammar_ms = max(runs["json"], key=lambda pair: pair[0].rate)
    return (
        f"{dtype:10s}{plain:13.1f}{best.rate:12.1f}{best.rate / plain:7.2f}x"
        f"{grammar_ms:17.2f}{best.seconds / args.decode_tokens * 1e3:9.1f}{best.constrained:>6d}"
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


# --- through a real cluster ---------------------------------------------------------------------
def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "bench", "schema": schema}}


def ask(k: int, what: str = "as a JSON object") -> list[dict]:
    # Distinct prompts of one length: no request is served from another's prefix cache blocks.
    return [{"role": "user", "content": f"Describe the fictional person number {1000 + k} {what}."}]


class _Asker:
    """A cluster on the model and an SDK client; each submit asks a prompt of its own."""

    def __init__(self, args, **knobs) -> None:
        from ipc.client import Client
        from scripts.bench.launcher import splitserve

        self._stack = contextlib.ExitStack()
        cluster = self._stack.enter_context(splitserve(args.model, max_model_len=2048, **knobs))
        self.client = self._stack.enter_context(Client(cluster.client_addr, deadline_s=600))
        self.k = 0

    def submit(self, what: str = "as a JSON object", **options):
        self.k += 1
        return self.client.submit(messages=ask(self.k, what), temperature=0, **options)

    def __enter__(self) -> _Asker:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()


def run_ttft(args, asker: _Asker) -> None:
    """One request at a time, plain and constrained alternating (which goes first alternates
    too); the constrained one's grammar is cached in the tokenizer and in the engine."""
    fmt = schema_format(NESTED_SCHEMA)
    asker.submit(max_tokens=4).result()
    asker.submit(max_tokens=4, response_format=fmt).result()  # compiled, built, cached
    ttft = interleave(
        {
            "plain": lambda: asker.submit(max_tokens=2).result().ttft_s,
            "cached grammar": lambda: (
                asker.submit(max_tokens=2, response_format=fmt).result().ttft_s
            ),
        },
        args.requests,
    )
    print(f"\nttft: {args.requests} requests each, one at a time, interleaved")
    for mode, values in ttft.items():
        print(f"  {mode:15s} {describe_ms(values)}")
    plain, cached = (np.percentile(ttft[m], 50) for m in ttft)
    print(
        f"  cached grammar / plain, p50: {cached / plain:.3f}x  (mean "
        f"{np.mean(ttft['cached grammar']) / np.mean(ttft['plain']):.3f}x)"
    )


def itl_run(args, asker: _Asker, new_schemas: bool) -> tuple[list[float], int]:
    """--streams unconstrained requests decode; meanwhile a request arrives every
    --arrival-interval-ms, with a new large schema (never cached: compiled in the tokenizer,
    built on the engine's grammar thread) or none. Returns the streams' gaps after the arrivals
    began, and the arrivals."""
    streams = [
        asker.submit("in detail", max_tokens=args.stream_tokens, ignore_eos=True)
        for _ in range(args.streams)
    ]
    for h in streams:  # every stream is decoding before the arrivals start
        next(iter(h.stream()))
    t_start, arrivals = time.monotonic(), []
    while not all(h.done for h in streams):
        options = {}
        if new_schemas:
            schema = {**large_schema(args.schema_fields), "title": f"variant {asker.k}"}
            options["response_format"] = schema_format(schema)
        arrivals.append(asker.submit(max_tokens=1, **options))
        time.sleep(args.arrival_interval_ms / 1000)
    gaps = []
    for h in streams:
        result = h.result()
        gaps += [g for g, t in zip(result.inter_token_s, result.t_received[1:]) if t >= t_start]
    for h in arrivals:
        h.result()
    return gaps, len(arrivals)


def run_itl(args, asker: _Asker) -> None:
    asker.submit(max_tokens=4).result()
    big = schema_format(large_schema(args.schema_fields))
    asker.submit(max_tokens=1, response_format=big).result()  # imports, first compile
    runs = interleave(
        {
            "no schema": lambda: itl_run(args, asker, False),
            "new schemas": lambda: itl_run(args, asker, True),
        },
        args.repeats,
    )
    print(
        f"\nitl: {args.streams} unconstrained streams of {args.stream_tokens} tokens, a "
        f"request every {args.arrival_interval_ms:g} ms, {args.repeats} runs per mode, "
        f"interleaved"
    )
    gaps = {mode: [g for run, _ in rs for g in run] for mode, rs in runs.items()}
    for mode, rs in runs.items():
        arrivals = sum(n for _, n in rs)
        print(f"  {mode:12s} ({arrivals:3d} arrivals) {describe_ms(gaps[mode])}")
    p99 = {mode: np.percentile(values, 99) for mode, values in gaps.items()}
    p50 = {mode: np.percentile(values, 50) for mode, values in gaps.items()}
    print(
        f"  new schemas / no schema: p99 {p99['new schemas'] / p99['no schema']:.3f}x, "
        f"p50 {p50['new schemas'] / p50['no schema']:.3f}x"
    )


def hostile_schema(k: int, values: int) -> dict:
    """Unique by ``k`` (never cached); refused as too large after its compile."""
    return {"type": "string", "enum": [f"{k}v{i}" for i in range(values)]}


@contextlib.contextmanager
def burning(processes: int):
    """``processes`` busy loops at nice 0, each in a session of its own (as a compile job
    started from another shell), ended when the block ends (and after 600 s regardless)."""
    import subprocess
    import sys

    loop = "import time\nend = time.monotonic() + 600\nwhile time.monotonic() < end: pass"
    burners = [
        subprocess.Popen([sys.executable, "-c", loop], start_new_session=True)
        for _ in range(processes)
    ]
    try:
        yield
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()


def hostile_run(args, asker: _Asker, hostile: bool, burners: int) -> list[float]:
    """One stream of --stream-tokens; a request with a hostile schema every
    --arrival-interval-ms while it decodes (or none). Its gaps after the stream's first token."""
    with burning(burners):
        stream = asker.submit("in detail", max_tokens=args.stream_tokens, ignore_eos=True)
        next(iter(stream.stream()))
        arrivals = []
        while hostile and not stream.done:
            fmt = schema_format(hostile_schema(asker.k, args.hostile_values))
            arrivals.append(asker.submit(max_tokens=1, response_format=fmt))
            time.sleep(args.arrival_interval_ms / 1000)
        result = stream.result()
        for h in arrivals:
            h.result(check=False)
    return list(result.inter_token_s)


def run_hostile(args, _asker: _Asker | None) -> None:
    cases = [(h, b) for b in sorted({0, args.burners}) for h in (False, True)]
    print(
        f"\nhostile: one stream of {args.stream_tokens} tokens; a schema of a "
        f"{args.hostile_values}-value enum every {args.arrival_interval_ms:g} ms or none; "
        f"{args.burners} CPU burner(s) or none; {args.repeats} runs per case, interleaved"
    )
    for niceness in args.background_niceness:
        with _Asker(args, background_niceness=niceness) as asker:
            asker.submit(max_tokens=4).result()
            runs = interleave(
                {c: lambda c=c: hostile_run(args, asker, *c) for c in cases}, args.repeats
            )
        print(f"  background_niceness {niceness} (load {os.getloadavg()[0]:.1f} after)")
        for (hostile, burners), gaps in runs.items():
            largest = [max(g) * 1000 for g in gaps]
            every = [x for g in gaps for x in g]
            print(
                f"    {'hostile' if hostile else 'alone':8s} burners {burners}: largest gap "
                f"per run {', '.join(f'{x:.0f}' for x in largest)} ms; "
                f"{describe_ms(every)}"
            )


WORKLOADS = {"decode": run_decode, "ttft": run_ttft, "itl": run_itl, "hostile": run_hostile}


def build_parser():
    p = workload_parser("structured", __doc__)
    add_parts(p, list(WORKLOADS), ["decode", "ttft", "itl"])
    add_shared(p, "model", "threads", "batch", "repeats", "schema_fields")
    add_shared(p, "decode_tokens", decode_tokens=40)
    p.add_argument(
        "--dtypes",
        type=text_list,
        default=["float32"],
        help="decode: the engine's activations, each compared in turn (default: float32)",
    )
    p.add_argument("--requests", type=int, default=20, help="ttft: requests per mode")
    p.add_argument("--streams", type=int, default=8, help="itl: decoding requests")
    p.add_argument("--stream-tokens", type=int, default=160, help="itl: their length")
    p.add_argument(
        "--arrival-interval-ms",
        type=float,
        default=500.0,
        help="itl: a new request (a new schema, or none) every this often",
    )
    p.add_argument("--burners", type=int, default=2, help="hostile: CPU-burning processes")
    p.add_argument("--hostile-values", type=int, default=60_000, help="hostile: the enum's size")
    p.add_argument(
        "--background-niceness",
        type=lambda text: [int(x) for x in text.split(",")],
        default=[0, 10],
        help="hostile: one cluster per value, in turn (default: 0,10)",
    )
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    args.model = resolve_model(args.model)
    torch.set_num_threads(args.threads)
    print(f"load average before: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    with contextlib.ExitStack() as stack:
        # One cluster for every workload that needs one.
        asker = stack.enter_context(_Asker(args)) if {"ttft", "itl"} & set(args.workloads) else None
        for workload in args.workloads:
            WORKLOADS[workload](args, asker)
    print(f"load average after: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
