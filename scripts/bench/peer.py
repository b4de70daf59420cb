"""peer: splitserve against llama.cpp's llama-server, same GGUF, same client, same run.

    scripts/build_llama_server.sh /work/peer/llama.cpp-build     # prints BIN
    python -m scripts.bench peer --llama-server BIN/llama-server --llama-threads 1,2 \\
        --splitserve "" --splitserve "--dtype bfloat16 --engine-threads 2" --json peer.json

llama.cpp is measured through its own binaries, built from the pinned source by
scripts/build_llama_server.sh: llama-server here (served, as a user would run it instead of
splitserve), llama-bench in `engine peer` (its engine alone). llama-server serves the GGUF the
default model ships in (--parallel 32, the GGUF's own chat template), once per --llama-threads
value; splitserve serves it as `splitserve launch --http-port 0 ARGS` would, once per
--splitserve ARGS. One client drives them all (the benchmarks' HTTP client): streamed chat
completions, a distinct real-text prompt of --prompt-tokens templated tokens per request,
--output-tokens tokens out (ignore_eos, greedy), a closed loop of N requests in flight for each
--concurrency N. Runs alternate between servers, the order rotating each repeat, so machine
drift hits all alike; figures are medians over --repeats with their spread, llama.cpp taken at
its best thread count per concurrency. Prints markdown for the docs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import signal
from pathlib import Path

from scripts.bench import peer_report
from scripts.bench.interleave import progress, rotated
from scripts.bench.options import (
    add_shared,
    add_splitserve_cases,
    int_list,
    parse_checked,
    require_positive,
    workload_parser,
)
from scripts.bench.stats import summarize


def build_parser() -> argparse.ArgumentParser:
    p = workload_parser("peer", __doc__)
    g = p.add_argument_group("servers")
    g.add_argument(
        "--llama-server",
        default=None,
        metavar="PATH",
        help="the llama-server binary (scripts/build_llama_server.sh builds one); without "
        "it, only the splitserve launches run, against each other",
    )
    add_shared(g, "gguf")
    g.add_argument(
        "--llama-threads",
        type=int_list,
        default=[1, 2],
        metavar="N[,N...]",
        help="llama-server -t/-tb values, one server each; llama.cpp is compared at "
        "its best per concurrency (default: 1,2)",
    )
    g.add_argument("--parallel", type=int, default=32, help="llama-server slots (default 32)")
    g.add_argument(
        "--ctx-per-slot",
        type=int,
        default=512,
        help="llama-server context per slot in tokens; -c is this x --parallel",
    )
    g.add_argument("--llama-args", default="", help="more llama-server arguments, one string")
    add_splitserve_cases(g, "one default launch")
    _workload_flags(p.add_argument_group("workload"))
    o = p.add_argument_group("output")
    o.add_argument(
        "--statistic",
        choices=peer_report.STATISTICS,
        default="median",
        help="what the comparison tables show per figure: the median over repeats or "
        "the best repeat (on a busy shared machine, what each server can do); "
        "the JSON and the all-servers table keep both (default: median)",
    )
    o.add_argument(
        "--from-json",
        default=None,
        metavar="PATH",
        help="run nothing: print the tables of an earlier --json file again (e.g. "
        "with the other --statistic)",
    )
    add_shared(o, "json")
    return p


def _workload_flags(w) -> None:
    w.add_argument(
        "--concurrency",
        type=int_list,
        default=[1, 8, 32],
        help="requests in flight, one run each (default: 1,8,32)",
    )
    w.add_argument(
        "--requests-per-stream",
        type=int,
        default=2,
        help="requests per run = max(--min-requests, this x concurrency)",
    )
    w.add_argument("--min-requests", type=int, default=8)
    add_shared(w, "prompt_tokens", "output_tokens", "repeats")
    w.add_argument(
        "--warmup-requests",
        type=int,
        default=8,
        help="requests (8 at a time) sent to each server before measuring",
    )
    w.add_argument(
        "--warm-cache",
        action="store_true",
        help="send each run's requests once, unmeasured, just before it: every server's prefix "
        "cache then holds the prompts it is measured on (a chat server's repeated prompts)",
    )
    add_shared(w, "nice")


def validate(args: argparse.Namespace) -> argparse.Namespace:
    """Checks what argparse cannot; returns args with defaults filled in."""
    from scripts.bench.launcher import launch_args

    if args.splitserve is None:
        args.splitserve = [""]
    if len(set(args.splitserve)) != len(args.splitserve):
        raise ValueError("each --splitserve ARGS must differ")
    for flags in args.splitserve:
        launch_args(flags, http=True)  # refused now, not after the other servers started
    require_positive(
        args,
        "parallel",
        "ctx_per_slot",
        "requests_per_stream",
        "min_requests",
        "prompt_tokens",
        "output_tokens",
        "repeats",
    )
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
    return args


def requests_for(args: argparse.Namespace, level: int) -> int:
    return max(args.min_requests, args.requests_per_stream * level)


def start_servers(args: argparse.Namespace, gguf: Path, stack: contextlib.ExitStack) -> dict:
    from scripts.bench.launcher import LlamaServer, SplitserveServer

    servers: dict = {}
    for threads in args.llama_threads if args.llama_server else []:
        s = LlamaServer(
            args.llama_server, gguf, threads, args.parallel, args.ctx_per_slot, args.llama_args
        )
        stack.callback(s.close)
        servers[s.name] = s
    for flags in args.splitserve:
        s = SplitserveServer(flags)
        stack.callback(s.close)
        servers[s.name] = s
    return servers


def measure(args: argparse.Namespace, servers: dict, counter, stack: contextlib.ExitStack):
    """Every repeat, every concurrency, every server (order rotated each repeat): one run each,
    through the serving workload's runner and HTTP client, --concurrency requests in flight."""
    from ipc.messages import SamplingParams
    from scripts.bench.launcher import HeartbeatWarnings
    from scripts.bench.peer_workload import build_chats
    from scripts.bench.runner import EventCollector, RunOptions, run_once
    from scripts.bench.systems import HttpSystem
    from scripts.bench.workloads import ArrivalSpec, BenchRequest

    collector, runs, start = EventCollector(), [], 0
    clients = {}
    for name, server in servers.items():
        clients[name] = HttpSystem(name, collector, endpoint=server.url, keepalive=False)
        stack.callback(clients[name].close)
    sampling = SamplingParams(max_tokens=args.output_tokens, temperature=0.0, ignore_eos=True)

    def send(name: str, chats: list, level: int, warmup: bool = False):
        requests = [
            BenchRequest(index=i, max_tokens=args.output_tokens, messages=chat)
            for i, chat in enumerate(chats)
        ]
        options = RunOptions(max_concurrency=level, progress=False)
        run = run_once(
            clients[name],
            collector,
            requests,
            ArrivalSpec(),
            lambda _: sampling,
            options,
            mode=name,
            run_index=len(runs),
            warmup=warmup,
        )
        return run.records

    if args.warmup_requests:
        chats = build_chats(counter, args.warmup_requests, args.prompt_tokens, 10**6)
        for name in servers:
            send(name, chats, 8, warmup=True)
    for repeat in range(args.repeats):
        for level in args.concurrency:
            chats = build_chats(counter, requests_for(args, level), args.prompt_tokens, start)
            start += len(chats)
            for name in rotated(servers, repeat):
                if args.warm_cache:
                    send(name, chats, level, warmup=True)
                cpu0 = servers[name].cpu_seconds()
                with HeartbeatWarnings() as silent:
                    records = send(name, chats, level)
                summary = summarize(records, {"server": servers[name].cpu_seconds() - cpu0})
                runs.append(
                    {
                        "target": name,
                        "concurrency": level,
                        "repeat": repeat,
                        "heartbeat_warnings": silent.count,
                        "summary": summary,
                        "records": [r.to_json() for r in records],
                    }
                )
                progress(
                    f"repeat {repeat} streams {level:3d} {name:45s} "
                    f"{summary['output_throughput_tps']:7.1f} tok/s, errors {summary['errors']}"
                )
    return runs


def run_benchmark(args: argparse.Namespace) -> dict:
    from procs.model_store import resolve_model
    from scripts.bench.launcher import LlamaServer, default_gguf, idle_cpu_percent, renice
    from scripts.bench.peer_workload import PromptCounter

    gguf = Path(args.gguf) if args.gguf else default_gguf()
    counter = PromptCounter(resolve_model(None))
    with contextlib.ExitStack() as stack:
        servers = start_servers(args, gguf, stack)
        peers = [n for n, s in servers.items() if isinstance(s, LlamaServer)]
        ours = [n for n in servers if n not in peers]
        if args.nice is not None:
            renice(servers, args.nice)
        load_before = os.getloadavg()
        idle = idle_cpu_percent(servers)
        progress(f"servers up; idle CPU %: {json.dumps({k: round(v, 1) for k, v in idle.items()})}")
        runs = measure(args, servers, counter, stack)
        described = {name: s.describe() for name, s in servers.items()}
        load_after = os.getloadavg()
    setup = {
        "gguf": str(gguf),
        "servers": described,
        "peers": peers,
        "ours": ours,
        "idle_cpu_percent": idle,
        # A step long enough to starve the engine's heartbeat makes the supervisor warn; only
        # one server is driven at a time, so a warning is the driven one's.
        "heartbeat_warnings": {
            name: sum(r["heartbeat_warnings"] for r in runs if r["target"] == name) for name in ours
        },
        "load_average": {"before": load_before, "after": load_after},
        "niceness": args.nice,
        "host": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
        "workload": f"streamed chat, {args.prompt_tokens}-token prompts (distinct real "
        f"text), {args.output_tokens} output tokens (ignore_eos, greedy), closed loop; "
        f"requests per run max({args.min_requests}, {args.requests_per_stream} x streams); "
        f"{args.repeats} repeats, interleaved"
        + (
            "; each run's prompts sent once just before it (warm caches)" if args.warm_cache else ""
        ),
        "client": "httpx.AsyncClient, a connection per request, SSE, stream_options.include_usage; "
        "closed loop",
    }
    stats = _stats(runs, servers, args.concurrency)
    return tables(dict(setup=setup, runs=runs), stats, args.statistic)


def _stats(runs: list[dict], targets, levels: list[int]) -> dict:
    return {
        name: {
            level: peer_report.aggregate(
                [r["summary"] for r in runs if r["target"] == name and r["concurrency"] == level]
            )
            for level in levels
        }
        for name in targets
    }


def tables(data: dict, stats: dict, statistic: str) -> dict:
    """The document: ``data`` (setup, runs) with the statistics, the comparisons (each of ours
    against llama.cpp at its best, ``statistic``: median or best repeat) and the markdown."""
    setup = data["setup"]
    levels = sorted({level for by_level in stats.values() for level in by_level})
    peers = setup.get("peers") or [t for t in stats if t.startswith("llama.cpp")]
    ours = setup.get("ours") or [t for t in stats if t not in peers]
    comparisons = {
        name: peer_report.comparison_rows(stats, name, peers, levels, statistic) for name in ours
    }
    return dict(
        data, stats=stats, comparisons=comparisons, text=render(setup, stats, comparisons, levels)
    )


def render(setup: dict, stats: dict, comparisons: dict, levels: list[int]) -> str:
    lines = ["## Peer benchmark: splitserve vs llama.cpp", ""]
    lines += [f"- {key}: {setup[key]}" for key in ("gguf", "host", "workload", "client")]
    lines += [f"- `{name}`: `{cmd}`" for name, cmd in setup["servers"].items()]
    lines.append(
        "- idle CPU % before the runs: "
        + ", ".join(f"{k} {v:.1f}" for k, v in setup["idle_cpu_percent"].items())
    )
    if setup.get("heartbeat_warnings") is not None:
        lines.append(
            "- supervisor warnings of a worker silent past heartbeat_timeout_s: "
            + ", ".join(f"{k} {v}" for k, v in setup["heartbeat_warnings"].items())
        )
    if setup.get("niceness") is not None:
        lines.append(f"- servers and client at niceness {setup['niceness']}")
    load = setup.get("load_average") or {"before": (), "after": ()}
    lines.append(
        "- load average (1, 5, 15 min) before: "
        + ", ".join(f"{x:.1f}" for x in load["before"])
        + "; after: "
        + ", ".join(f"{x:.1f}" for x in load["after"])
        + " (other work on the machine slows every server; runs are interleaved)"
    )
    for name, rows in comparisons.items():
        lines += ["", peer_report.markdown_comparison(rows, name)]
    lines += ["", "All servers (median [min-max] over repeats):", ""]
    lines.append(peer_report.markdown_all(stats, levels))
    return "\n".join(lines)


def render_saved(path: str, statistic: str) -> dict:
    """The tables of an earlier run's JSON again, with ``statistic`` in the comparisons."""
    data = json.loads(Path(path).read_text())
    stats = {
        t: {int(level): s for level, s in by_level.items()} for t, by_level in data["stats"].items()
    }
    return tables(data, stats, statistic)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> dict:
    args = parse_checked(build_parser(), argv, validate)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    signal.signal(signal.SIGTERM, _interrupt)  # stop the servers on a plain kill, too
    data = render_saved(args.from_json, args.statistic) if args.from_json else run_benchmark(args)
    print(data["text"], flush=True)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(data, indent=1))
        print(f"wrote {args.json_path}")
    return data
