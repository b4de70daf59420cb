"""peer's part hops: where one stream's time goes between the engine and the client, per hop.

Each server answers streamed chat requests one at a time: fresh prompts (distinct), then each
again (fully cached). splitserve is asked for its path times (the X-Splitserve-Path-Times
header, in SSE comments), so every token's journey splits into hops on the machine's
system-wide monotonic clock: engine step end -> detokenizer wake-up -> its send -> HTTP worker
-> SSE write -> this client; and a cached prompt's first token from this client's send through
the HTTP worker, the tokenizer and the engine. Medians over all runs, with the load average.
(The send time is when httpx reports the body written: the first hop can come out negative.)
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
from typing import Any

from scripts.bench.interleave import load, progress, rotated

# A token's way from the end of its engine step to this client: (label, from, to) over the path
# comment's and the client's times.
PATH_HOPS = (
    ("step end -> detok wakes", "t_step", "t_detok_woke"),
    ("detok decode + send", "t_detok_woke", "t_detok_sent"),
    ("-> HTTP worker receives", "t_detok_sent", "t_http_in"),
    ("HTTP worker -> SSE write", "t_http_in", "t_sse"),
    ("SSE write -> client reads", "t_sse", "t_client"),
)
# Per token after the first: the engine's loop and step, then the path.
TOKEN_HOPS = (
    ("engine loop between steps", "t_prev_step", "t_step_began"),
    ("engine step", "t_step_began", "t_step"),
    *PATH_HOPS,
    ("step end -> client (path)", "t_step", "t_client"),
)
# A cached prompt's first token: the request's stages, then the first token's path.
FIRST_TOKEN_HOPS = (
    ("client send -> HTTP worker", "t_sent", "t_http_arrived"),
    ("HTTP worker -> submit", "t_http_arrived", "t_submit"),
    ("submit -> tokenizer starts", "t_submit", "t_tokenize_start"),
    ("tokenize", "t_tokenize_start", "t_tokenized"),
    ("tokenizer -> engine", "t_tokenized", "t_arrived"),
    ("engine queue", "t_arrived", "t_scheduled"),
    ("scheduled -> first step end", "t_scheduled", "t_step"),
    *PATH_HOPS,
)


async def stream_one(http: Any, url: str, model: str, messages: list, max_tokens: int) -> dict:
    """One streamed chat request: the client's send time, and each token's read time with its
    path times (splitserve only), and the request's stages."""
    from scripts.bench.http_client import chat_body, stream

    body = chat_body(model, messages, max_tokens)
    out = await stream(http, url, body, headers={"X-Splitserve-Path-Times": "1"})
    paths, request = {}, {}
    for index, text in out.comments:
        if text.startswith("path "):
            paths[index] = json.loads(text[len("path ") :])
        elif text.startswith("path-request "):
            request = json.loads(text[len("path-request ") :])
    tokens = [{**paths.get(i, {}), "t_client": t} for i, t in enumerate(out.delta_times)]
    return {"t_sent": out.t_sent, "tokens": tokens, "request": request, "error": out.error}


def hop_values(times: dict[str, float], hops: tuple) -> dict[str, float]:
    """Each hop's milliseconds where both its ends are known."""
    t = dict(times)
    if "t_step" in t and "step_ms" in t:
        t["t_step_began"] = t["t_step"] - t["step_ms"] / 1e3
    return {
        label: (t[b] - t[a]) * 1e3 for label, a, b in hops if t.get(a, 0) > 0 and t.get(b, 0) > 0
    }


def measure_run(url: str, chats: list, args: argparse.Namespace) -> dict:
    """One run at one stream: every chat fresh, then every chat again (cached)."""
    from scripts.bench.http_client import make_http, model_id

    # threads: the torch threads of each decode step; first_threads: of each cached prompt's first
    keys = ("itl", "ttft", "ttft_cached", "hops", "first", "threads", "first_threads")
    run: dict[str, list] = {key: [] for key in keys}

    async def go() -> None:
        async with make_http() as http:
            model = await model_id(http, url)
            for phase, chat in itertools.product(("fresh", "cached"), chats):
                r = await stream_one(http, url, model, chat, args.output_tokens)
                if r["error"] or not r["tokens"]:
                    raise RuntimeError(f"{url}: {r['error'] or 'no tokens'}")
                times = [tok["t_client"] for tok in r["tokens"]]
                key = "ttft" if phase == "fresh" else "ttft_cached"
                run[key].append((times[0] - r["t_sent"]) * 1e3)
                if phase == "fresh":
                    run["itl"] += [(b - a) * 1e3 for a, b in zip(times, times[1:])]
                    run["hops"] += [
                        hop_values({**tok, "t_prev_step": prev.get("t_step", 0.0)}, TOKEN_HOPS)
                        for prev, tok in zip(r["tokens"], r["tokens"][1:])
                    ]
                    run["threads"] += [t["threads"] for t in r["tokens"][1:] if t.get("threads")]
                else:
                    first = {**r["request"], **r["tokens"][0], "t_sent": r["t_sent"]}
                    run["first"].append(hop_values(first, FIRST_TOKEN_HOPS))
                    run["first_threads"] += [first["threads"]] if first.get("threads") else []

    asyncio.run(go())
    return run


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summarize(runs: list[dict]) -> dict[str, Any]:
    pooled = {k: [v for r in runs for v in r[k]] for k in ("itl", "ttft", "ttft_cached")}
    hops = [h for r in runs for h in r["hops"]]
    first = [h for r in runs for h in r["first"]]
    cpu = [r.get("cpu_ms_per_token", {}) for r in runs]

    def one_thread_pct(key: str) -> float | None:  # a server without path times: None
        threads = [t for r in runs for t in r.get(key, ())]
        return 100 * threads.count(1) / len(threads) if threads else None

    return {
        "cpu_ms_per_token": {k: _median([c[k] for c in cpu if k in c]) for k in cpu[0]},
        "itl_p50_ms": _median(pooled["itl"]),
        "ttft_p50_ms": _median(pooled["ttft"]),
        "ttft_cached_p50_ms": _median(pooled["ttft_cached"]),
        "one_thread_steps_pct": one_thread_pct("threads"),
        "one_thread_first_steps_pct": one_thread_pct("first_threads"),
        "token_hops_p50_ms": {
            label: _median([h[label] for h in hops if label in h]) for label, _, _ in TOKEN_HOPS
        },
        "first_token_hops_p50_ms": {
            label: _median([h[label] for h in first if label in h])
            for label, _, _ in FIRST_TOKEN_HOPS
        },
    }


def render(stats: dict[str, dict], loads: list[str]) -> str:
    names = list(stats)
    lines = ["## Per-hop latency at one stream", "", f"- load (uptime) per run: {'; '.join(loads)}"]
    lines += ["", "| figure (p50, ms) | " + " | ".join(names) + " |"]
    lines.append("| --- |" + " ---: |" * len(names))

    def row(label: str, get) -> None:
        cells = [get(stats[n]) for n in names]
        lines.append(f"| {label} | " + " | ".join("" if c is None else f"{c:.2f}" for c in cells))

    row("ITL (client)", lambda s: s["itl_p50_ms"])
    row("TTFT, fresh prompt", lambda s: s["ttft_p50_ms"])
    row("TTFT, cached prompt", lambda s: s["ttft_cached_p50_ms"])
    row("decode steps on one thread (%)", lambda s: s["one_thread_steps_pct"])
    row("cached prompts' steps on one thread (%)", lambda s: s["one_thread_first_steps_pct"])
    lines.append("| *CPU ms per output token (median run)* |" + " |" * len(names))
    for role in ("engine", "detokenizer", "http", "tokenizer", "client"):
        row(role, lambda s, k=role: s.get("cpu_ms_per_token", {}).get(k))
    lines.append("| *per token after the first* |" + " |" * len(names))
    for label, _, _ in TOKEN_HOPS:
        row(label, lambda s, k=label: s["token_hops_p50_ms"][k])
    lines.append("| *a cached prompt's first token* |" + " |" * len(names))
    for label, _, _ in FIRST_TOKEN_HOPS:
        row(label, lambda s, k=label: s["first_token_hops_p50_ms"][k])
    return "\n".join(lines)


def run(args: argparse.Namespace, servers: dict) -> dict:
    """The hops of every server started (``servers``, by name) and of every --url."""
    from scripts.bench.launcher import SplitserveServer, cpu_by_role
    from scripts.bench.peer_workload import PromptCounter, build_chats

    urls = {f"url {u}": u for u in args.url} | {name: s.url for name, s in servers.items()}
    clusters = {n: s.cluster for n, s in servers.items() if isinstance(s, SplitserveServer)}
    counter = PromptCounter()
    runs: dict[str, list] = {}
    loads: list[str] = []
    start = 0
    for repeat in range(args.repeats):
        chats = build_chats(counter, args.requests, args.prompt_tokens, 10**6 + start)
        start += len(chats)
        for name in rotated(urls, repeat):
            loaded = load()
            cpu0 = cpu_by_role(clusters.get(name))
            run = measure_run(urls[name], chats, args)
            tokens = args.output_tokens * len(chats) * 2
            used = {k: v - cpu0[k] for k, v in cpu_by_role(clusters.get(name)).items()}
            run["cpu_ms_per_token"] = {k: 1e3 * v / tokens for k, v in used.items()}
            runs.setdefault(name, []).append(run)
            loads.append(f"{name} r{repeat}: {loaded}")
            progress(f"repeat {repeat} {name}: load {loaded}")
    stats = {name: summarize(r) for name, r in runs.items()}
    return {"stats": stats, "loads": loads, "runs": runs, "text": render(stats, loads)}
