"""data-parallel: engine replicas behind the tokenizer workers' routing (issue 25's benchmark).

Multi-turn chats on --engines replicas under each routing policy (cache_aware, round_robin,
least_loaded), and on one replica given all the cores and KV cache, one mode after another.
Per mode: the prefix-cache hit rate (from the engines' counters), throughput, TTFT, the spread
over replicas and the routing's cost per request; then cache_aware against round_robin beside
the issue's targets. The engine is the cost-model engine (cost_model_engine.py), as the real
model's prefill on these CPUs would decide the comparison instead of the routing; --engine real
runs the real engine code (on the fast engine's tiny model unless --model says otherwise).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from procs.config_flags import add_cluster_flags
from scripts.bench.cost_model_engine import FACTORY, STEP_COST_ENV, StepCost
from scripts.bench.fast_engine import fast_engine_model
from scripts.bench.options import add_shared, require_positive, text_list, workload_parser
from scripts.bench.report import write_json
from scripts.bench.stats import percentiles, ratio

MODES = ("cache_aware", "round_robin", "least_loaded", "one-replica")
# The targets, cache_aware against round_robin: (what, wanted ratio, more is better).
TARGETS = (
    ("prefix-cache hit rate", "hit_rate", 2.0, True),
    ("throughput (requests/s)", "requests_per_s", 1.3, True),
    ("TTFT p50", "ttft_p50_ms", 0.6, False),
)
ROUTING_KNOBS = (
    "routing_balance_abs_threshold",
    "routing_balance_rel_threshold",
    "routing_cache_threshold",
)


def build_parser() -> argparse.ArgumentParser:
    p = workload_parser("data-parallel", __doc__)
    g = p.add_argument_group("what is compared")
    g.add_argument("--modes", type=text_list, default=list(MODES), help="(default: all four)")
    g.add_argument("--engines", type=int, default=2, help="replicas of the routed modes")
    g.add_argument(
        "--engine-cores",
        type=int,
        default=2,
        help="engine threads all replicas share (split equally); one-replica gets them all",
    )
    g.add_argument("--engine", choices=("cost-model", "real"), default="cost-model")
    g.add_argument("--model", default=None, help="--engine real: the model (default: tiny)")
    g.add_argument(
        "--step-cost",
        default=StepCost().to_env(),
        metavar="MS,US,US",
        help="the cost model: a step's base ms, us per prompt token, us per decoding request "
        "(default: %(default)s)",
    )
    for flag, default, what in (
        ("--kv-cache-tokens", 32768, "KV cache (half the histories fit one replica)"),
        ("--max-batch-size", 32, "decode batch"),
    ):
        g.add_argument(flag, type=int, default=default, help=f"each replica's {what}; "
                       "one-replica gets the replicas' total (default: %(default)s)")  # fmt: skip
    g.add_argument("--tokenizer-workers", type=int, default=2)
    add_cluster_flags(
        g,
        ROUTING_KNOBS,
        defaults={"routing_balance_abs_threshold": 8},
        help_overrides={
            "routing_balance_abs_threshold": "cache_aware: imbalanced when the busiest replica "
            "has more than this many requests over the least busy (default: %(default)s for "
            "this workload's few dozen in flight; the cluster's 64 suits hundreds)"
        },
    )
    add_workload_flags(p.add_argument_group("workload"))
    add_shared(p, "json")
    return p


# --- the workload -------------------------------------------------------------------------------
# Conversations arrive as a Poisson process. Each opens with a system prompt every conversation
# shares, and each turn resends its whole history as token ids (the system prompt, every earlier
# user message and reply, a new user message); the next turn follows when the reply has ended
# (after an optional think time). Token ids rather than chat text: the history is then exactly
# what the engine saw, and no re-tokenization of a reply can move a block boundary.
@dataclass(frozen=True, slots=True)
class ChatWorkload:
    conversations: int = 32
    turns: int = 6
    system_tokens: int = 256
    user_tokens: int = 160
    reply_tokens: int = 96
    conversation_rate: float = 4.0  # conversations starting per second (Poisson)
    think_time_ms: float = 0.0  # between a reply's end and the next turn (exponential mean)
    seed: int = 0

    @property
    def longest_prompt(self) -> int:
        return (
            self.system_tokens
            + self.turns * self.user_tokens
            + (self.turns - 1) * self.reply_tokens
        )

    def describe(self) -> str:
        return (
            f"{self.conversations} conversations x {self.turns} turns arriving at "
            f"{self.conversation_rate:g}/s (Poisson), a shared {self.system_tokens}-token system "
            f"prompt, {self.user_tokens}-token user turns, {self.reply_tokens}-token replies "
            f"(histories up to {self.longest_prompt} tokens)"
        )


def add_workload_flags(group: argparse._ArgumentGroup) -> None:
    """One flag per ChatWorkload field (``--conversation-rate``...), its default the field's."""
    defaults = ChatWorkload()
    for name in ChatWorkload.__dataclass_fields__:
        default = getattr(defaults, name)
        group.add_argument(f"--{name.replace('_', '-')}", type=type(default), default=default)


def workload_of(args: argparse.Namespace) -> ChatWorkload:
    return ChatWorkload(**{name: getattr(args, name) for name in ChatWorkload.__dataclass_fields__})


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 40_000) for _ in range(n)]


async def run_conversations(client, workload: ChatWorkload, timeout_s: float = 600) -> dict:
    """Drives every conversation to its end on ``client`` (an AsyncClient): each turn's result,
    and the run's start and end."""
    rng = random.Random(workload.seed)
    system = _ids(rng, workload.system_tokens)
    gap = random.Random(workload.seed + 1)
    starts, t = [], 0.0
    for _ in range(workload.conversations):
        starts.append(t)
        t += gap.expovariate(workload.conversation_rate)
    record: dict = {"turns": [], "t_start": time.monotonic()}

    async def converse(index: int, delay: float) -> None:
        await asyncio.sleep(delay)
        talk = random.Random(workload.seed * 7919 + index)
        history = list(system)
        for _ in range(workload.turns):
            history += _ids(talk, workload.user_tokens)
            handle = client.submit(
                prompt_token_ids=history,
                max_tokens=workload.reply_tokens,
                ignore_eos=True,
                temperature=0.0,
            )
            result = await handle.result(timeout=timeout_s, check=False)
            record["turns"].append(result)
            if result.error:
                return
            history += result.token_ids
            if workload.think_time_ms:
                await asyncio.sleep(talk.expovariate(1e3 / workload.think_time_ms))

    await asyncio.gather(*(converse(i, s) for i, s in enumerate(starts)))
    record["t_end"] = time.monotonic()
    return record


def mode_knobs(mode: str, args: argparse.Namespace, workload: ChatWorkload) -> dict[str, Any]:
    engines = 1 if mode == "one-replica" else args.engines
    share = args.engines if engines == 1 else 1  # one replica: all the replicas' resources
    knobs: dict[str, Any] = dict(
        engines=engines,
        engine_threads=args.engine_cores,
        kv_cache_tokens=args.kv_cache_tokens * share,
        max_batch_size=args.max_batch_size * share,
        max_model_len=workload.longest_prompt + workload.reply_tokens + 64,
        tokenizer_workers=args.tokenizer_workers,
        heartbeat_interval_s=0.2,
    )
    if engines > 1:
        knobs["routing_policy"] = mode
        knobs.update({name: getattr(args, name) for name in ROUTING_KNOBS})
    if args.engine == "cost-model":
        # Modelled as an accelerator: whole prompts in one step (the CPU default is 512).
        knobs.update(engine_factory=FACTORY, prefill_max_tokens=4096)
    return knobs


def run_mode(model: str, mode: str, args: argparse.Namespace, workload: ChatWorkload) -> dict:
    from ipc.client import AsyncClient
    from procs.launch_cluster import launch_cluster

    with launch_cluster(model, **mode_knobs(mode, args, workload)) as cluster:

        async def drive() -> tuple[Any, dict, Any]:
            async with AsyncClient(cluster.client_addr) as client:
                before = await client.engine_stats()
                record = await run_conversations(client, workload)
                return before, record, await client.engine_stats()

        before, record, after = asyncio.run(drive())
    return summarize(record, before, after)


def summarize(record: dict, before: Any, after: Any) -> dict:
    turns = [t for t in record["turns"] if not t.error]
    duration = record["t_end"] - record["t_start"]
    queried = after.stats.prefix_queried_tokens_total - before.stats.prefix_queried_tokens_total
    hits = after.stats.prefix_hit_tokens_total - before.stats.prefix_hit_tokens_total
    decisions = sum(after.routing_decisions.values()) - sum(before.routing_decisions.values())
    routing_s = after.routing_seconds_total - before.routing_seconds_total
    ttft = percentiles([t.ttft_s for t in turns if t.ttft_s is not None], scale=1e3)
    spread = Counter(t.engine_index for t in turns)
    return {
        "requests": len(turns),
        "errors": len(record["turns"]) - len(turns),
        "duration_s": duration,
        "requests_per_s": len(turns) / duration,
        "output_tokens_per_s": sum(t.usage.completion_tokens for t in turns if t.usage) / duration,
        "ttft_p50_ms": ttft["p50"],
        "ttft_p95_ms": ttft["p95"],
        "hit_rate": hits / queried if queried else 0.0,
        "spread": [spread.get(r, 0) for r in range(max(spread, default=-1) + 1)],
        "routing_us_per_request": routing_s / decisions * 1e6 if decisions else None,
        "outcomes": {
            k: v - before.routing_decisions.get(k, 0) for k, v in after.routing_decisions.items()
        },
    }


ROWS = (
    ("prefix-cache hit rate", "hit_rate", "{:.1%}"),
    ("requests/s", "requests_per_s", "{:.2f}"),
    ("output tokens/s", "output_tokens_per_s", "{:.0f}"),
    ("TTFT p50 ms", "ttft_p50_ms", "{:.0f}"),
    ("TTFT p95 ms", "ttft_p95_ms", "{:.0f}"),
    ("run s", "duration_s", "{:.1f}"),
    ("requests per replica", "spread", "{}"),
    ("routing us/request", "routing_us_per_request", "{:.1f}"),
    ("errors", "errors", "{}"),
)


def report(results: dict[str, dict]) -> list[str]:
    modes = list(results)
    width = max(14, *(len(m) + 2 for m in modes))
    lines = ["".ljust(24) + "".join(m.rjust(width) for m in modes)]
    for label, key, fmt in ROWS:
        cells = [results[m][key] for m in modes]
        shown = ["-" if c is None else fmt.format(c) for c in cells]
        lines.append(label.ljust(24) + "".join(s.rjust(width) for s in shown))
    if {"cache_aware", "round_robin"} <= set(results):
        ca, rr = results["cache_aware"], results["round_robin"]
        lines.append("cache_aware / round_robin (the issue's target):")
        for label, key, target, more in TARGETS:
            value = ratio(ca[key], rr[key])
            met = value is not None and (value >= target if more else value <= target)
            wanted = f"{'>=' if more else '<='} {target:g}x: {'met' if met else 'MISSED'}"
            lines.append(f"  {label:26s} {value or 0:.2f}x (target {wanted})")
    return lines


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    require_positive(args, "engines", "engine_cores", "tokenizer_workers", "conversations")
    workload = workload_of(args)
    os.environ[STEP_COST_ENV] = StepCost(*map(float, args.step_cost.split(","))).to_env()
    print(f"load average {os.getloadavg()[0]:.2f}; {workload.describe()}")
    results: dict[str, dict] = {}
    with contextlib.ExitStack() as stack:
        model = args.model or fast_engine_model(stack)
        cost = f"the cost model {args.step_cost} (ms, us, us)"
        engine = cost if args.engine == "cost-model" else f"the real engine on {model}"
        print(f"engine: {engine}; KV cache {args.kv_cache_tokens} tokens per replica")
        for mode in args.modes:
            results[mode] = run_mode(model, mode, args, workload)
            print(f"  {mode}: done in {results[mode]['duration_s']:.1f} s", flush=True)
        print("\n".join(report(results)))
    if args.json_path:
        write_json(args.json_path, {"workload": workload.describe(), "modes": results})
