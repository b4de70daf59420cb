"""edges: legal but large work beside an unrelated stream (issue 38), through a real cluster.

  long-context  two --long-tokens prompts (max_tokens 4) arrive together; an unrelated stream
                arrives every --interval-s until both have ended: its TTFT and largest gap, the
                long requests' end. Random token ids, distinct per request (no cache hits).
  long-prompts  short requests one at a time for --seconds, alone, then while another client
                sends 7.2 MB text prompts (refused from their length before tokenizing) one
                after another, --pace-s apart: their TTFT. The tiny random model with an
                8,192-token context, one tokenizer worker.
  hostile       one stream's gaps alone and while requests with unique hostile schemas (a
                --hostile-values enum compiled, then refused) arrive every --interval-s, with
                and without --burners CPU-burning processes; a cluster per --background-niceness.

Every figure is printed with the load average; the commands and figures: docs/benchmarks.md.
"""

from __future__ import annotations

import contextlib
import itertools
import random
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

from scripts.bench.interleave import interleave, load
from scripts.bench.options import add_parts, add_shared, workload_parser
from scripts.bench.stats import describe_ms

UNIQUE = itertools.count(1000)  # makes prompts and schemas unique (never cached)


def ids(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(3, 40000, size=n).tolist()


@contextlib.contextmanager
def client_of(model, flags: str = "", **knobs):
    """A cluster on ``model`` (`splitserve launch` ``flags``, then config fields ``knobs``):
    (an SDK client, the cluster's address)."""
    from ipc.client import Client
    from scripts.bench.launcher import splitserve

    with splitserve(model, flags=flags, **knobs) as cluster:
        with Client(cluster.client_addr, deadline_s=1200) as c:
            yield c, cluster.client_addr


def long_context_run(client, args, rng: np.random.Generator) -> None:
    long = [
        client.submit(prompt_token_ids=ids(rng, args.long_tokens), max_tokens=4, ignore_eos=True)
        for _ in range(2)
    ]
    t_start, streams = time.monotonic(), []
    while not all(h.done for h in long) and len(streams) < args.streams:
        prompt, n = ids(rng, args.short_tokens), args.stream_tokens
        streams.append(
            client.submit(prompt_token_ids=prompt, max_tokens=n, ignore_eos=True, temperature=0)
        )
        time.sleep(args.interval_s)
    results = [h.result() for h in streams]
    ends = ", ".join(f"{h.result().t_received[-1] - t_start:.1f}" for h in long)
    gaps = [g for r in results for g in r.inter_token_s]
    print(
        f"  {len(results)} unrelated streams; TTFT {describe_ms([r.ttft_s for r in results])}; "
        f"gaps p50 {np.percentile(gaps, 50) * 1e3:.0f}, p99 {np.percentile(gaps, 99) * 1e3:.0f}, "
        f"max {max(gaps) * 1e3:.0f} ms; long prompts end at {ends} s; load {load()}"
    )


def run_long_context(args) -> None:
    rng = np.random.default_rng(0)
    print(f"\nlong-context: two {args.long_tokens}-token prompts beside unrelated streams")
    knobs = {"max_model_len": args.max_model_len}
    with client_of(args.model, args.launch_flags, **knobs) as (client, _):
        client.submit(prompt_token_ids=ids(rng, args.short_tokens), max_tokens=4).result()
        for _ in range(args.repeats):
            long_context_run(client, args, rng)


def shorts(client, seconds: float) -> list[float]:
    """TTFTs (s) of short requests sent one after another for ``seconds``."""
    out, end = [], time.monotonic() + seconds
    while time.monotonic() < end:
        prompt = f"Tell me about the number {len(out)}"
        out.append(client.submit(prompt, max_tokens=2).result(timeout=300).ttft_s)
    return out


def run_long_prompts(args) -> None:
    from ipc.client import Client
    from tests.tiny_model import make_tiny_model

    words = "the quick brown fox jumps over a lazy dog and then some 12345".split()
    rng = random.Random(0)
    huge = " ".join(rng.choice(words) for _ in range(1_800_000))[:7_200_000]
    refused: list[tuple[float, str | None]] = []
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(tmp, max_position_embeddings=8192)
        with client_of(model, tokenizer_workers=1, max_model_len=8192) as (client, address):
            shorts(client, 2)
            alone = shorts(client, args.seconds)
            stop = threading.Event()

            def flood() -> None:
                with Client(address) as other:
                    while not stop.is_set():
                        t_start = time.monotonic()
                        result = other.submit(huge, max_tokens=1).result(timeout=300, check=False)
                        refused.append((time.monotonic() - t_start, result.error_code))
                        time.sleep(args.pace_s)

            thread = threading.Thread(target=flood)
            thread.start()
            beside = shorts(client, args.seconds)
            stop.set()
            thread.join()
    print(f"\nlong-prompts (load {load()})")
    for what, ttfts in (("alone", alone), ("beside 7.2 MB prompts", beside)):
        print(f"  TTFT {what:22s} ({len(ttfts)}) {describe_ms(ttfts)}, max {max(ttfts) * 1e3:.0f}")
    codes = sorted({str(c) for _, c in refused})
    waits = describe_ms([s for s, _ in refused])
    print(f"  7.2 MB prompts: {len(refused)}, answered {codes}, {waits} each")


@contextlib.contextmanager
def burning(processes: int):
    """Busy loops at nice 0, each in a session of its own (a compile job started from another
    shell), ended with the block (and after 600 s regardless)."""
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


def hostile_run(args, client, hostile: bool, burners: int) -> list[float]:
    """One stream; a request with a unique hostile schema every --interval-s while it decodes
    (or none). The stream's gaps after its first token."""

    def ask(k: int) -> list[dict]:  # distinct prompts: none served from another's cache
        return [{"role": "user", "content": f"Describe the fictional person number {k}."}]

    with burning(burners):
        stream = client.submit(messages=ask(next(UNIQUE)), max_tokens=args.stream_tokens,
                               ignore_eos=True)  # fmt: skip
        next(iter(stream.stream()))
        arrivals = []
        while hostile and not stream.done:
            k = next(UNIQUE)
            enum = {"type": "string", "enum": [f"{k}v{i}" for i in range(args.hostile_values)]}
            fmt = {"type": "json_schema", "json_schema": {"name": "hostile", "schema": enum}}
            arrivals.append(client.submit(messages=ask(k), max_tokens=1, response_format=fmt))
            time.sleep(args.interval_s)
        result = stream.result()
        for h in arrivals:
            h.result(check=False)
    return list(result.inter_token_s)


def run_hostile(args) -> None:
    cases = [(h, b) for b in sorted({0, args.burners}) for h in (False, True)]
    print(
        f"\nhostile: one stream of {args.stream_tokens} tokens; a {args.hostile_values}-value "
        f"enum schema every {args.interval_s:g} s or none; {args.burners} burner(s) or none"
    )
    for niceness in args.background_niceness:
        knobs = {"max_model_len": 2048, "background_niceness": niceness}
        with client_of(args.model, **knobs) as (client, _):
            client.submit("Hello", max_tokens=4).result()
            runs = interleave(
                {c: lambda c=c: hostile_run(args, client, *c) for c in cases}, args.repeats
            )
        print(f"  background_niceness {niceness} (load {load()} after)")
        for (hostile, burners), gaps in runs.items():
            largest = ", ".join(f"{max(g) * 1e3:.0f}" for g in gaps)
            every = describe_ms([x for g in gaps for x in g])
            label = "hostile" if hostile else "alone"
            print(f"    {label:8s} burners {burners}: largest gap per run {largest} ms; {every}")


PARTS = {"long-context": run_long_context, "long-prompts": run_long_prompts, "hostile": run_hostile}


def build_parser():
    p = workload_parser("edges", __doc__)
    add_parts(p, list(PARTS), ["long-context"])
    add_shared(p, "model")
    add_shared(p, "repeats", repeats=1)
    p.add_argument("--max-model-len", type=int, default=8192, help="long-context's cluster's")
    p.add_argument("--launch-flags", default="", help="long-context: `splitserve launch` flags")
    p.add_argument("--long-tokens", type=int, default=7030, help="long prompts' length")
    p.add_argument("--short-tokens", type=int, default=32, help="unrelated prompts' length")
    p.add_argument("--stream-tokens", type=int, default=16, help="the unrelated streams' tokens")
    p.add_argument("--interval-s", type=float, default=1.5, help="an arrival every this often")
    p.add_argument("--streams", type=int, default=24, help="most unrelated streams in a run")
    p.add_argument("--seconds", type=float, default=30.0, help="long-prompts: each phase's length")
    p.add_argument("--pace-s", type=float, default=0.0, help="long-prompts: between huge prompts")
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
    from procs.model_store import resolve_model

    args = build_parser().parse_args(argv)
    args.model = resolve_model(args.model)
    print(f"load average before: {load()}")
    for part in args.workloads:
        PARTS[part](args)
