"""startup: how long a launch takes to serve its first token.

    python -m scripts.bench startup --splitserve "" --llama-server BIN/llama-server --repeats 3

Each compared server is started from nothing --repeats times (the cases alternate, the order
rotating each repeat), and for every start this prints the seconds from the launch to the
server answering its health check (ready), and to the first token of one streamed chat request
sent then (a fresh 158-token prompt, greedy). A splitserve launch is `splitserve launch
--http-port 0 ARGS` in this process (the supervisor starts the workers and waits for each to
report ready); llama-server is its binary on --gguf (default: the default model's GGUF; give a
--model of the same file in ARGS to compare one model). The first start of a
case is shown apart from the rest: it is the one that pays for whatever a start leaves behind
(the OS page cache of the model files, anything a launch compiles and keeps on disk).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

from scripts.bench.interleave import progress, rotated
from scripts.bench.options import (
    add_shared,
    add_splitserve_cases,
    parse_checked,
    require_positive,
    workload_parser,
)


def build_parser() -> argparse.ArgumentParser:
    p = workload_parser("startup", __doc__)
    g = p.add_argument_group("servers")
    add_splitserve_cases(g, "one default launch")
    g.add_argument("--llama-server", metavar="PATH", help="also start this llama-server binary")
    g.add_argument("--llama-threads", type=int, default=2, metavar="N")
    add_shared(g, "gguf")
    add_shared(p.add_argument_group("workload"), "repeats", "prompt_tokens", repeats=3)
    add_shared(p.add_argument_group("output"), "json")
    return p


def start(case: str, args: argparse.Namespace) -> tuple[Any, float]:
    """One server of ``case`` started now: (the server, seconds until it answered /health)."""
    from scripts.bench.launcher import LlamaServer, SplitserveServer, default_gguf

    began = time.monotonic()
    if case.startswith("llama.cpp"):
        gguf = Path(args.gguf) if args.gguf else default_gguf()
        server: Any = LlamaServer(args.llama_server, gguf, args.llama_threads, 1)
    else:
        server = SplitserveServer(case)
    return server, time.monotonic() - began


async def first_token_s(url: str, messages: list) -> float:
    """Seconds from sending one streamed chat request to its first token's chunk."""
    from scripts.bench.http_client import make_http, model_id, request_body, stream

    async with make_http(keepalive=False) as http:
        path, body = request_body(await model_id(http, url), max_tokens=4, messages=messages)
        sent = time.monotonic()
        out = await stream(http, url, path, body)
    if out.error or not out.delta_times:
        raise RuntimeError(f"the first request failed: {out.error or 'no token'}")
    return out.delta_times[0] - sent


def measure(args: argparse.Namespace) -> list[dict]:
    from procs.model_store import resolve_model
    from scripts.bench.peer_workload import PromptCounter, build_chats

    cases = (args.splitserve or [""]) + (["llama.cpp"] if args.llama_server else [])
    counter = PromptCounter(resolve_model(None))
    chats = build_chats(counter, len(cases) * args.repeats, args.prompt_tokens, 0)
    runs = []
    for repeat in range(args.repeats):
        for case in rotated({c: None for c in cases}, repeat):
            began = time.monotonic()
            server, ready_s = start(case, args)
            try:
                ttft = asyncio.run(first_token_s(server.url, chats[len(runs)]))
            finally:
                server.close()
            runs.append(
                {
                    "case": server.name,
                    "repeat": repeat,
                    "ready_s": ready_s,
                    "first_token_s": ready_s + ttft,
                    "ttft_s": ttft,
                    "load": os.getloadavg()[0],
                    "wall_s": time.monotonic() - began,
                }
            )
            progress(
                f"repeat {repeat} {server.name}: ready {ready_s:.1f} s, first token +{ttft:.2f} s"
            )
    return runs


def render(runs: list[dict]) -> str:
    lines = [
        "| case | first start: ready / first token (s) | later starts, median: ready / first "
        "token (s) | load |",
        "|---|---|---|---|",
    ]
    for case in dict.fromkeys(r["case"] for r in runs):
        mine = [r for r in runs if r["case"] == case]
        later = mine[1:] or mine
        ready = statistics.median(r["ready_s"] for r in later)
        first = statistics.median(r["first_token_s"] for r in later)
        loads = ", ".join(f"{r['load']:.1f}" for r in mine)
        lines.append(
            f"| {case} | {mine[0]['ready_s']:.1f} / {mine[0]['first_token_s']:.1f} | "
            f"{ready:.1f} / {first:.1f} | {loads} |"
        )
    return "\n".join(lines)


def _validate(args: argparse.Namespace) -> None:
    require_positive(args, "repeats", "prompt_tokens")
    if args.llama_server and not os.access(args.llama_server, os.X_OK):
        raise ValueError(f"--llama-server {args.llama_server!r} is not an executable file")
    if args.gguf and not os.path.isfile(args.gguf):
        raise ValueError(f"--gguf {args.gguf!r} is not a file")


def main(argv: list[str] | None = None) -> dict:
    args = parse_checked(build_parser(), argv, _validate)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    runs = measure(args)
    data = {"runs": runs, "text": render(runs)}
    print(data["text"], flush=True)
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(data, f, indent=1)
    return data
