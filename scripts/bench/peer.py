"""peer: splitserve against llama.cpp's llama-server, same GGUF, same HTTP client, same run (the
build of llama-server, the commands and figures: docs/benchmarks.md).

llama-server serves the default model's GGUF (its own chat template), once per --llama-threads
value; splitserve as `splitserve launch --http-port 0 ARGS` would, once per --splitserve ARGS.
One client drives them all (streamed chat, a distinct real-text prompt of --prompt-tokens
templated tokens, --output-tokens out, greedy, ignore_eos); servers alternate, the order rotating
each repeat. Parts:

  serve    a closed loop of N requests in flight for each --concurrency N: medians over
           --repeats with their spread, llama.cpp at its best thread count per concurrency.
  hops     one stream, --requests fresh prompts then each again (fully cached): each token's
           way from its engine step to this client, hop by hop, from splitserve's path times
           (scripts/bench/hops.py); --url adds a server already running as a compared case.
  startup  each server started from nothing --repeats times: seconds to ready and to the first
           token; the first start is shown apart (it pays for what a start leaves behind).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import signal
import statistics
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from scripts.bench import hops, report
from scripts.bench.interleave import load, progress, rotated
from scripts.bench.options import (
    add_parts,
    add_shared,
    int_list,
    parse_checked,
    require_positive,
    workload_parser,
)
from scripts.bench.stats import summarize


def build_parser() -> argparse.ArgumentParser:
    p = workload_parser("peer", __doc__)
    add_parts(p, list(PARTS), ["serve"])
    g = p.add_argument_group("servers")
    g.add_argument(
        "--llama-server",
        metavar="PATH",
        help="the llama-server binary (scripts/build_llama_server.sh builds one); without it "
        "only the splitserve launches run",
    )
    g.add_argument(
        "--gguf",
        metavar="PATH",
        help="the GGUF llama-server serves (default: the default model's; give splitserve the "
        "same file with --model in its ARGS)",
    )
    g.add_argument(
        "--llama-threads",
        type=int_list,
        default=[1, 2],
        metavar="N[,N...]",
        help="llama-server -t/-tb values, one server each (default: 1,2)",
    )
    g.add_argument("--parallel", type=int, default=32, help="llama-server slots (default 32)")
    g.add_argument("--ctx-per-slot", type=int, default=512, help="tokens; -c is x --parallel")
    g.add_argument("--llama-args", default="", help="more llama-server arguments, one string")
    g.add_argument(
        "--splitserve",
        action="append",
        metavar="ARGS",
        help='`splitserve launch` arguments of one cluster (repeatable, one cluster each; "" is '
        "the default launch, which runs without any)",
    )
    g.add_argument("--url", action="append", default=[], help="hops: a server already running")
    w = p.add_argument_group("workload")
    w.add_argument(
        "--concurrency",
        type=int_list,
        default=[1, 8, 32],
        help="serve: requests in flight, one run each (default: 1,8,32)",
    )
    w.add_argument(
        "--requests-per-stream",
        type=int,
        default=2,
        help="serve: requests per run = max(--min-requests, this x concurrency)",
    )
    w.add_argument("--min-requests", type=int, default=8)
    w.add_argument("--requests", type=int, default=8, help="hops: fresh and cached requests")
    w.add_argument("--prompt-tokens", type=int, default=158, help="templated chat prompt tokens")
    w.add_argument("--output-tokens", type=int, default=32, help="max_tokens, with ignore_eos")
    add_shared(w, "repeats")
    w.add_argument("--warmup-requests", type=int, default=8, help="serve: first, 8 at a time")
    w.add_argument(
        "--warm-cache",
        action="store_true",
        help="serve: send each run's requests once, unmeasured, just before it (prefix caches "
        "then hold the prompts measured)",
    )
    w.add_argument(
        "--nice",
        type=int,
        metavar="N",
        help="every server and this client at this niceness (negative needs root): on a shared "
        "machine every server gets the CPU first, alike",
    )
    add_shared(p.add_argument_group("output"), "json")
    return p


def validate(args: argparse.Namespace) -> argparse.Namespace:
    """Checks what argparse cannot; returns args with defaults filled in."""
    from scripts.bench.launcher import launch_args

    if args.splitserve is None:
        args.splitserve = [] if args.url else [""]
    if len(set(args.splitserve)) != len(args.splitserve):
        raise ValueError("each --splitserve ARGS must differ")
    for flags in args.splitserve:
        launch_args(flags, http=True)  # refused now, not after the other servers started
    counts = ("parallel", "ctx_per_slot", "requests_per_stream", "min_requests", "requests")
    require_positive(args, *counts, "prompt_tokens", "output_tokens", "repeats")
    if args.warmup_requests < 0:
        raise ValueError("--warmup-requests must be >= 0")
    if max(args.concurrency) > args.parallel:
        raise ValueError(
            f"--concurrency {max(args.concurrency)} exceeds llama-server's "
            f"--parallel {args.parallel}: its extra requests would queue"
        )
    if args.prompt_tokens + args.output_tokens + 16 > args.ctx_per_slot:
        raise ValueError("--ctx-per-slot is too small for --prompt-tokens + --output-tokens")
    if args.llama_server is not None and not os.access(args.llama_server, os.X_OK):
        raise ValueError(f"--llama-server {args.llama_server!r} is not an executable file")
    if args.gguf and not os.path.isfile(args.gguf):
        raise ValueError(f"--gguf {args.gguf!r} is not a file")
    return args


def gguf_of(args: argparse.Namespace) -> Path:
    from scripts.bench.launcher import default_gguf

    return Path(args.gguf) if args.gguf else default_gguf()


def llama_server(args: argparse.Namespace, threads: int, parallel: int | None = None) -> Any:
    from scripts.bench.launcher import LlamaServer

    slots = parallel or args.parallel
    return LlamaServer(
        args.llama_server, gguf_of(args), threads, slots, args.ctx_per_slot, args.llama_args
    )


def start_servers(args: argparse.Namespace, stack: contextlib.ExitStack) -> dict:
    """Every compared server, started here, by name (llama.cpp first), at --nice."""
    from scripts.bench.launcher import SplitserveServer, renice

    servers: dict = {}
    for threads in args.llama_threads if args.llama_server else []:
        s = stack.enter_context(contextlib.closing(llama_server(args, threads)))
        servers[s.name] = s
    for flags in args.splitserve:
        s = stack.enter_context(contextlib.closing(SplitserveServer(flags)))
        servers[s.name] = s
    if args.nice is not None:
        renice(servers, args.nice)
    return servers


def requests_for(args: argparse.Namespace, level: int) -> int:
    return max(args.min_requests, args.requests_per_stream * level)


# --- serve ---------------------------------------------------------------------------------------
async def closed_loop(url: str, chats: list, level: int, output_tokens: int) -> list:
    """The chats through one server, ``level`` requests in flight (the next as soon as one ends),
    a connection each: every request's RequestRecord, on this client's clock."""
    from scripts.bench.http_client import chat_body, make_http, model_id, stream
    from scripts.bench.stats import RequestRecord

    async with make_http() as http:
        model, slots, t0 = await model_id(http, url), asyncio.Semaphore(level), time.monotonic()

        async def one(index: int, chat: list) -> RequestRecord:
            async with slots:
                rec = RequestRecord(index, str(index), t_planned=t0, t_submit=time.monotonic())
                (await stream(http, url, chat_body(model, chat, output_tokens))).fill(rec)
                return rec

        return list(await asyncio.gather(*(one(i, chat) for i, chat in enumerate(chats))))


def measure(args: argparse.Namespace, servers: dict, counter) -> list[dict]:
    """Every repeat, every concurrency, every server (order rotated each repeat): one closed loop
    each, --concurrency requests in flight."""
    from scripts.bench.peer_workload import build_chats

    def send(name: str, chats: list, level: int) -> list:
        return asyncio.run(closed_loop(servers[name].url, chats, level, args.output_tokens))

    runs, start = [], 0
    if args.warmup_requests:
        chats = build_chats(counter, args.warmup_requests, args.prompt_tokens, 10**6)
        for name in servers:
            send(name, chats, 8)
    for repeat in range(args.repeats):
        for level in args.concurrency:
            chats = build_chats(counter, requests_for(args, level), args.prompt_tokens, start)
            start += len(chats)
            for name in rotated(servers, repeat):
                if args.warm_cache:
                    send(name, chats, level)
                cpu0 = servers[name].cpu_seconds()
                records = send(name, chats, level)
                summary = summarize(records, {"server": servers[name].cpu_seconds() - cpu0})
                runs.append(
                    {
                        "target": name,
                        "concurrency": level,
                        "repeat": repeat,
                        "summary": summary,
                        "records": [asdict(r) for r in records],
                    }
                )
                progress(
                    f"repeat {repeat} streams {level:3d} {name:45s} "
                    f"{summary['output_throughput_tps']:7.1f} tok/s, errors {summary['errors']}"
                )
    return runs


def run_serve(args: argparse.Namespace) -> dict:
    from scripts.bench.launcher import LlamaServer
    from scripts.bench.peer_workload import PromptCounter

    counter = PromptCounter()
    with contextlib.ExitStack() as stack:
        servers = start_servers(args, stack)
        peers = [n for n, s in servers.items() if isinstance(s, LlamaServer)]
        ours = [n for n in servers if n not in peers]
        load_before = load()
        runs = measure(args, servers, counter)
        described = {name: s.describe() for name, s in servers.items()}
        load_after = load()
    setup = {
        "gguf": str(gguf_of(args)),
        "servers": described,
        "peers": peers,
        "ours": ours,
        "load_average": {"before": load_before, "after": load_after},
        "niceness": args.nice,
        "host": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
        "workload": f"streamed chat, {args.prompt_tokens}-token prompts (distinct real "
        f"text), {args.output_tokens} output tokens (ignore_eos, greedy), closed loop; "
        f"requests per run max({args.min_requests}, {args.requests_per_stream} x streams); "
        f"{args.repeats} repeats, interleaved"
        + ("; each run's prompts sent once just before it (warm caches)" * args.warm_cache),
        "client": "httpx.AsyncClient, a connection per request, SSE, stream_options.include_usage; "
        "closed loop",
    }
    levels = args.concurrency
    stats = {
        name: {
            level: report.aggregate(
                [r["summary"] for r in runs if r["target"] == name and r["concurrency"] == level]
            )
            for level in levels
        }
        for name in servers
    }
    comparisons = {name: report.comparison_rows(stats, name, peers, levels) for name in ours}
    text = render_serve(setup, stats, comparisons, levels)
    return dict(setup=setup, runs=runs, stats=stats, comparisons=comparisons, text=text)


def render_serve(setup: dict, stats: dict, comparisons: dict, levels: list[int]) -> str:
    lines = ["## Peer benchmark: splitserve vs llama.cpp", ""]
    lines += [f"- {key}: {setup[key]}" for key in ("gguf", "host", "workload", "client")]
    lines += [f"- `{name}`: `{cmd}`" for name, cmd in setup["servers"].items()]
    if setup.get("niceness") is not None:
        lines.append(f"- servers and client at niceness {setup['niceness']}")
    loads = setup["load_average"]
    lines.append(
        f"- load average (1, 5, 15 min) before: {loads['before']}; after: {loads['after']} "
        "(other work on the machine slows every server; runs are interleaved)"
    )
    for name, rows in comparisons.items():
        lines += ["", report.markdown_comparison(rows, name)]
    lines += ["", "All servers (median [min-max] over repeats):", ""]
    lines.append(report.markdown_all(stats, levels))
    return "\n".join(lines)


# --- startup -------------------------------------------------------------------------------------
def run_startup(args: argparse.Namespace) -> dict:
    from scripts.bench.launcher import SplitserveServer
    from scripts.bench.peer_workload import PromptCounter, build_chats

    cases: list[Any] = list(args.splitserve)
    cases += [threads for threads in args.llama_threads if args.llama_server]
    counter = PromptCounter()
    chats = build_chats(counter, len(cases) * args.repeats, args.prompt_tokens, 0)
    runs: list[dict] = []
    for repeat in range(args.repeats):
        for case in rotated({c: None for c in cases}, repeat):
            began = time.monotonic()
            server = (
                llama_server(args, case, 1) if isinstance(case, int) else SplitserveServer(case)
            )
            ready_s = time.monotonic() - began
            with contextlib.closing(server):
                (first,) = asyncio.run(closed_loop(server.url, [chats[len(runs)]], 1, 4))
            if not first.ok or not first.delta_times:
                raise RuntimeError(f"the first request failed: {first.error or 'no token'}")
            ttft = first.ttft
            runs.append(
                {
                    "case": server.name,
                    "repeat": repeat,
                    "ready_s": ready_s,
                    "first_token_s": ready_s + ttft,
                    "load": os.getloadavg()[0],
                    "wall_s": time.monotonic() - began,
                }
            )
            progress(f"repeat {repeat} {server.name}: ready {ready_s:.1f} s, first +{ttft:.2f} s")
    return {"runs": runs, "text": render_startup(runs)}


def render_startup(runs: list[dict]) -> str:
    head = ["case", "first start: ready / first token (s)"]
    head += ["later starts, median: ready / first token (s)", "load"]
    rows = []
    for case in dict.fromkeys(r["case"] for r in runs):
        mine = [r for r in runs if r["case"] == case]
        later = mine[1:] or mine
        ready = statistics.median(r["ready_s"] for r in later)
        first = statistics.median(r["first_token_s"] for r in later)
        loads = ", ".join(f"{r['load']:.1f}" for r in mine)
        first_start = f"{mine[0]['ready_s']:.1f} / {mine[0]['first_token_s']:.1f}"
        rows.append([case, first_start, f"{ready:.1f} / {first:.1f}", loads])
    return report.markdown_table(head, rows)


def run_hops(args: argparse.Namespace) -> dict:
    with contextlib.ExitStack() as stack:
        return hops.run(args, start_servers(args, stack))


PARTS = {"serve": run_serve, "hops": run_hops, "startup": run_startup}


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> dict:
    args = parse_checked(build_parser(), argv, validate)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    signal.signal(signal.SIGTERM, _interrupt)  # stop the servers on a plain kill, too
    data = {}
    for part in args.workloads:
        data[part] = PARTS[part](args)
        print(data[part]["text"], flush=True)
    if args.json_path:
        report.write_json(args.json_path, data)
        print(f"wrote {args.json_path}")
    return data
