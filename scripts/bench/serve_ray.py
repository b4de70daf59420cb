"""serve-ray: the data-parallel benchmark's multi-turn chats through the Ray Serve ingress
(issue 26), under three request routers, and what the Serve path adds to a request.

    python -m scripts.bench serve-ray                   # routers, then the overhead
    python -m scripts.bench serve-ray routers           # one part only

routers: the workload of ``data-parallel`` (conversations.py: each turn resends its whole
history as token ids) over HTTP to the Serve ingress, on 2 engine replicas, once per router:
``splitserve`` (ours: the token-id prefix score of ipc.replica_router over the replicas' KV events),
Ray's ``prefix_cache_affinity`` (PrefixCacheAffinityRouter: character prefixes of the prompt's
text, which the ingress then gives it) and ``power_of_two`` (Ray's default). Printed per router:
the prefix-cache hit rate (cached / prompt tokens, from the responses' usage), TTFT p50 / p95,
requests/s and each replica's requests.

overhead: one stream of requests (unique prompts) through the Serve ingress to one replica,
and through a plain cluster's HTTP frontend to its one engine, one after the other in one run:
TTFT p50 of each and their difference.

The engine is the cost-model engine (cost_model_engine.py), as in data-parallel; its replies are
a known function of the position, so a client that gets only text back still resends each
reply's exact ids. Ray binds to the host's routable address even when told loopback, so the
benchmark re-runs itself inside a private network namespace (``unshare -rn``, loopback only).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

from ipc.messages import Usage
from scripts.bench.conversations import (
    ChatWorkload,
    RunRecord,
    add_workload_flags,
    run_conversations,
    workload_of,
)
from scripts.bench.cost_model_engine import FACTORY, STEP_COST_ENV, StepCost, output_ids
from scripts.bench.http_client import make_http, request_body, stream
from scripts.bench.options import add_parts, workload_parser
from scripts.bench.stats import percentiles

ROUTERS = ("splitserve", "prefix_cache_affinity", "power_of_two")
PARTS = ["routers", "overhead"]
IN_NAMESPACE_ENV = "SPLITSERVE_BENCH_IN_NETNS"
NICENESS = "RAY_worker_niceness"
PORT = 8000
OBJECT_STORE_BYTES = 200 * 1024 * 1024
# Serve's access log writes a line per request in every replica, on the cores being measured.
QUIET_LOGS = {"log_level": "WARNING", "enable_access_log": False}


def build_parser() -> argparse.ArgumentParser:
    p = workload_parser("serve-ray", __doc__)
    add_parts(p, PARTS, PARTS)
    g = p.add_argument_group("what is compared")
    g.add_argument("--routers", type=lambda t: t.split(","), default=list(ROUTERS))
    g.add_argument("--kv-cache-tokens", type=int, default=32768, help="per replica")
    g.add_argument("--max-batch-size", type=int, default=32, help="per replica")
    g.add_argument("--balance-abs-threshold", type=int, default=8, help="as data-parallel's")
    g.add_argument("--step-cost", default=StepCost().to_env(), metavar="MS,US,US")
    g.add_argument("--overhead-requests", type=int, default=40)
    g.add_argument("--overhead-prompt-tokens", type=int, default=512)
    add_workload_flags(p.add_argument_group("workload (data-parallel's)"))
    p.add_argument("--json", default=None, metavar="PATH", help="also write the figures here")
    return p


# --- the HTTP client the conversations run on ----------------------------------------------------
@dataclass(slots=True)
class TurnResult:
    """What run_conversations reads of a turn's result (as of the SDK's GenerationResult)."""

    t_submit: float
    ttft_s: float | None
    error: str | None
    usage: Usage | None
    token_ids: list[int]
    engine_index: int = -1


class HttpTurn:
    def __init__(self, client: HttpChats, prompt: list[int], max_tokens: int) -> None:
        self.client, self.prompt, self.max_tokens = client, prompt, max_tokens

    async def result(self, timeout: float | None = None, check: bool = False) -> TurnResult:
        path, body = request_body("", max_tokens=self.max_tokens, ignore_eos=True)
        body["prompt"] = self.prompt
        t_submit = time.monotonic()
        out = await stream(self.client.http, self.client.url, path, body)
        usage = out.usage or {}
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        done = int(usage.get("completion_tokens") or 0)
        return TurnResult(
            t_submit,
            out.delta_times[0] - t_submit if out.delta_times else None,
            out.error,
            Usage(int(usage.get("prompt_tokens") or 0), done, int(cached)) if usage else None,
            output_ids(len(self.prompt), done),
        )


class HttpChats:
    """``submit`` as run_conversations calls it, over HTTP (completions with token-id prompts)."""

    def __init__(self, url: str) -> None:
        self.url, self.http = url, make_http(keepalive=True)

    def submit(self, *, prompt_token_ids: list[int], max_tokens: int, **_: Any) -> HttpTurn:
        return HttpTurn(self, list(prompt_token_ids), max_tokens)


def summarize(record: RunRecord, spread: list[int]) -> dict[str, Any]:
    turns = [t for t in record.turns if not t.error]
    prompt = sum(t.prompt_tokens for t in turns)
    ttft = percentiles([t.ttft_s for t in turns if t.ttft_s is not None], scale=1e3)
    duration = record.t_end - record.t_start
    return {
        "requests": len(turns),
        "errors": len(record.turns) - len(turns),
        "hit_rate": sum(t.cached_tokens for t in turns) / prompt if prompt else 0.0,
        "ttft_p50_ms": ttft["p50"],
        "ttft_p95_ms": ttft["p95"],
        "requests_per_s": len(turns) / duration,
        "spread": spread,
    }


# --- the parts -----------------------------------------------------------------------------------
def engine_knobs(args: argparse.Namespace, workload: ChatWorkload) -> dict[str, Any]:
    return dict(
        engine_threads=1,
        kv_cache_tokens=args.kv_cache_tokens,
        max_batch_size=args.max_batch_size,
        max_model_len=workload.longest_prompt + workload.reply_tokens + 64,
        # Modelled as an accelerator: whole prompts in one step (the CPU default is 512).
        engine_factory=FACTORY,
        prefill_max_tokens=4096,
    )


def serve_app(model: str, router: str, replicas: int, knobs: dict[str, Any], args: Any) -> Any:
    from procs.serve_ray.app import build_app

    return build_app(
        {
            "model": model,
            "replicas": replicas,
            "request_router": router,
            "kv_events_host": "127.0.0.1",
            "routing_stats_period_s": 0.5,
            "routing_balance_abs_threshold": args.balance_abs_threshold,
            **knobs,
        }
    )


def run_router(model: str, router: str, args: Any, workload: ChatWorkload) -> dict[str, Any]:
    from ray import serve

    from procs.serve_ray.app import engine_replica_stats

    serve.run(
        serve_app(model, router, 2, engine_knobs(args, workload), args),
        name="bench",
        logging_config=QUIET_LOGS,
    )
    try:
        record = asyncio.run(run_conversations(HttpChats(f"http://127.0.0.1:{PORT}"), workload))
        served = engine_replica_stats("bench")
        return summarize(record, [served[r]["served"] for r in sorted(served)])
    finally:
        serve.delete("bench")


async def one_stream(url: str, args: Any) -> list[float]:
    """TTFT of each of --overhead-requests requests, one at a time, unique prompts."""
    client = HttpChats(url)
    ttfts = []
    for i in range(args.overhead_requests):
        prompt = [100 + (i * 7919 + j * 31) % 39_000 for j in range(args.overhead_prompt_tokens)]
        result = await client.submit(prompt_token_ids=prompt, max_tokens=8).result()
        if result.error or result.ttft_s is None:
            raise RuntimeError(f"an overhead request failed: {result.error}")
        ttfts.append(result.ttft_s * 1e3)
    return ttfts


def run_overhead(model: str, args: Any, workload: ChatWorkload) -> dict[str, Any]:
    from ray import serve

    from procs.launch_cluster import launch_cluster

    knobs = engine_knobs(args, workload)
    serve.run(
        serve_app(model, "splitserve", 1, knobs, args), name="bench", logging_config=QUIET_LOGS
    )
    try:
        serve_ttft = asyncio.run(one_stream(f"http://127.0.0.1:{PORT}", args))
    finally:
        serve.delete("bench")
    with launch_cluster(model, http_port=0, **knobs) as cluster:
        assert cluster.http_url is not None
        plain_ttft = asyncio.run(one_stream(cluster.http_url, args))
    serve_p50 = percentiles(serve_ttft)["p50"] or 0.0
    plain_p50 = percentiles(plain_ttft)["p50"] or 0.0
    return {"serve_ttft_p50_ms": serve_p50, "cluster_ttft_p50_ms": plain_p50}


def report(results: dict[str, dict[str, Any]]) -> list[str]:
    rows = (
        ("prefix-cache hit rate", "hit_rate", "{:.1%}"),
        ("TTFT p50 ms", "ttft_p50_ms", "{:.0f}"),
        ("TTFT p95 ms", "ttft_p95_ms", "{:.0f}"),
        ("requests/s", "requests_per_s", "{:.2f}"),
        ("requests per replica", "spread", "{}"),
        ("errors", "errors", "{}"),
    )
    routers = [r for r in results if r != "overhead"]
    lines = ["".ljust(24) + "".join(r.rjust(24) for r in routers)] if routers else []
    for label, key, fmt in rows if routers else ():
        cells = [fmt.format(results[r][key]) for r in routers]
        lines.append(label.ljust(24) + "".join(c.rjust(24) for c in cells))
    if "overhead" in results:
        o = results["overhead"]
        lines.append(
            f"TTFT p50 at 1 stream: Serve {o['serve_ttft_p50_ms']:.1f} ms, plain cluster "
            f"{o['cluster_ttft_p50_ms']:.1f} ms: the Serve path adds "
            f"{o['serve_ttft_p50_ms'] - o['cluster_ttft_p50_ms']:.1f} ms"
        )
    return lines


def in_namespace(argv: list[str]) -> int:
    """Runs this workload again inside a private network namespace (loopback only)."""
    script = 'ip link set lo up && exec "$0" -m scripts.bench serve-ray "$@"'
    # Ray starts its workers at nice 15; the plain cluster it is compared with runs at 0.
    env = {**os.environ, IN_NAMESPACE_ENV: "1", "RAY_AUTH_MODE": "disabled", NICENESS: "0"}
    cmd = ["unshare", "-rn", "sh", "-c", script, sys.executable, *argv]
    return subprocess.run(cmd, env=env).returncode


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    if not os.environ.get(IN_NAMESPACE_ENV):
        sys.exit(in_namespace(argv))
    import ray
    from ray import serve

    from scripts.bench.fast_engine import fast_engine_model

    workload = workload_of(args)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request otherwise
    os.environ[STEP_COST_ENV] = StepCost(*map(float, args.step_cost.split(","))).to_env()
    print(f"load average {os.getloadavg()[0]:.2f}; {workload.describe()}", flush=True)
    results: dict[str, dict[str, Any]] = {}
    with contextlib.ExitStack() as stack:
        model = fast_engine_model(stack)
        temp = stack.enter_context(tempfile.TemporaryDirectory(prefix="ray-"))
        ray.init(
            num_cpus=2,
            include_dashboard=False,
            object_store_memory=OBJECT_STORE_BYTES,
            _temp_dir=temp,
            logging_level="WARNING",
        )
        stack.callback(ray.shutdown)
        serve.start(http_options={"host": "127.0.0.1", "port": PORT})
        stack.callback(serve.shutdown)
        if "routers" in args.workloads:
            for router in args.routers:
                results[router] = run_router(model, router, args, workload)
                print(f"  {router}: {results[router]}", flush=True)
        if "overhead" in args.workloads:
            results["overhead"] = run_overhead(model, args, workload)
    print("\n".join(report(results)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"workload": workload.describe(), "results": results}, f, indent=2)
