"""The Ray Serve scenarios, run once per test session inside a private network namespace (see
test_serve_ray.py, which starts this and asserts on what it writes):

    python -m tests.serve_ray.in_namespace RESULTS_JSON TMP_DIR TINY_MODEL_DIR [REAL_MODEL_DIR]

One local Ray (no dashboard, a small object store, its temp dir under TMP_DIR), the application
on the tiny model with 2 engine replicas, then with a prefill and a decode deployment of one
replica each, then (given REAL_MODEL_DIR) on the real model with one.
Each scenario's findings, or the error that stopped it, go under its name in RESULTS_JSON.
"""

from __future__ import annotations

import json
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import ray
from ray import serve

from procs.serve_ray.app import build_app, engine_replica_stats

PORT = 8000
BASE = f"http://127.0.0.1:{PORT}"
OBJECT_STORE_BYTES = 200 * 1024 * 1024
TINY_KNOBS: dict[str, Any] = dict(
    replicas=2,
    engine_threads=1,
    # Not in ipc.config.LOOPBACK_HOSTS, though on the namespace's lo: the replicas publish their
    # KV events as on a multi-node cluster, on a TCP address with CURVE.
    kv_events_host="127.0.0.2",
    kv_cache_tokens=8192,
    max_model_len=1024,
    routing_stats_period_s=0.5,
    max_restarts=1,
    # The prefill/decode scenario's answers against the colocated replicas': alike in dtype
    # (the tiny random model has near-ties) and in the chunks its prompts are computed in (a
    # decode replica computes what follows the imported blocks as one more chunk).
    dtype="float32",
    prefill_chunk_tokens=16,
)


def ids(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 40_000 + 10 for i in range(n)]


def served_by(app: str, send: Callable[[], Any]) -> tuple[int, Any]:
    """(the rank of the replica whose served count moved, what ``send`` returned)."""
    before = {r: s["served"] for r, s in engine_replica_stats(app).items()}
    answer = send()
    after = {r: s["served"] for r, s in engine_replica_stats(app).items()}
    moved = [r for r in after if after[r] > before.get(r, 0)]
    assert len(moved) == 1, f"served counts before {before}, after {after}"
    return moved[0], answer


def complete(oai: openai.OpenAI, prompt: list[int], max_tokens: int = 4) -> dict[str, Any]:
    r = oai.completions.create(model="", prompt=prompt, max_tokens=max_tokens, temperature=0)
    details = r.usage.prompt_tokens_details if r.usage else None
    return {"cached": details.cached_tokens if details else None, "text": r.choices[0].text}


def routing(oai: openai.OpenAI) -> dict[str, Any]:
    """A conversation's prefix (A) sticks to one replica; a new prefix (B) arriving while that
    replica is busy goes to the other, and sticks there."""
    shared_a, shared_b = ids(1, 48), ids(2, 48)
    out: dict[str, Any] = {}
    out["a1"] = served_by("splitserve", lambda: complete(oai, shared_a + ids(11, 16)))
    # A long stream on A's replica keeps it busy while B arrives; closing it early aborts it.
    busy = oai.completions.create(
        model="",
        prompt=shared_a + ids(12, 16),
        max_tokens=600,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    next(iter(busy))
    out["b1"] = served_by("splitserve", lambda: complete(oai, shared_b + ids(21, 16)))
    out["a2"] = served_by("splitserve", lambda: complete(oai, shared_a + ids(13, 16)))
    out["b2"] = served_by("splitserve", lambda: complete(oai, shared_b + ids(22, 16)))
    aborted_before = sum(s["aborted"] for s in engine_replica_stats("splitserve").values())
    busy.close()  # the client goes away mid-stream
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        stats = engine_replica_stats("splitserve")
        if sum(s["aborted"] for s in stats.values()) > aborted_before:
            break
        time.sleep(0.2)
    out["aborted_after_disconnect"] = sum(s["aborted"] for s in stats.values()) - aborted_before
    out["load_after_disconnect"] = {r: s["load"] for r, s in stats.items()}
    out["kv_event_metadata"] = {r: s["kv_event_metadata"] for r, s in stats.items()}
    out["curve"] = {r: bool(s["curve_public_key"]) for r, s in stats.items()}
    return out


def openai_streams(oai: openai.OpenAI) -> dict[str, Any]:
    chat = oai.chat.completions.create(
        model="",
        messages=[{"role": "user", "content": "Hello there"}],
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chat_chunks = list(chat)
    text = oai.completions.create(
        model="", prompt="Once upon a time", max_tokens=8, temperature=0, stream=True
    )
    text_chunks = list(text)
    bad = None
    try:
        oai.completions.create(model="", prompt="x", max_tokens=0)
    except openai.BadRequestError as exc:
        body = exc.body if isinstance(exc.body, dict) else {}
        bad = {"status": exc.status_code, "param": body.get("param")}
    return {
        "chat_deltas": sum(1 for c in chat_chunks if c.choices and c.choices[0].delta.content),
        "chat_finish": [c.choices[0].finish_reason for c in chat_chunks if c.choices][-1],
        "chat_usage": chat_chunks[-1].usage.completion_tokens if chat_chunks[-1].usage else None,
        "text_deltas": sum(1 for c in text_chunks if c.choices and c.choices[0].text),
        "text_finish": text_chunks[-1].choices[0].finish_reason,
        "bad_request": bad,
    }


def sse_terminals(prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """One streamed completion read raw: how many terminal events (a finish_reason or an error
    object) came before [DONE], and which."""
    body: dict[str, Any] = {"model": "", "prompt": prompt, "max_tokens": max_tokens}
    body.update(stream=True, ignore_eos=True)
    terminals: list[str] = []
    done = False
    with httpx.stream("POST", f"{BASE}/v1/completions", json=body, timeout=120) as response:
        if response.status_code != 200:
            return {"status": response.status_code, "terminals": ["http_error"], "done": True}
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                continue
            event = json.loads(line[len("data: ") :])
            if "error" in event:
                terminals.append("error:" + str(event["error"].get("code")))
            for choice in event.get("choices", []):
                if choice.get("finish_reason"):
                    terminals.append(choice["finish_reason"])
    return {"status": 200, "terminals": terminals, "done": done}


def start_streams(
    count: int, seed: int, prompt_tokens: int, max_tokens: int
) -> tuple[list[threading.Thread], list[dict[str, Any] | None]]:
    """``count`` streams at once (prompt i: ``ids(seed + i, prompt_tokens)``), each on a thread
    of its own; what each saw lands in the list as it ends (a request that raised has no
    terminal event: recorded)."""
    results: list[dict[str, Any] | None] = [None] * count

    def one(i: int) -> None:
        try:
            results[i] = sse_terminals(ids(seed + i, prompt_tokens), max_tokens)
        except Exception as exc:
            results[i] = {"status": None, "terminals": [], "done": False, "raised": repr(exc)}

    threads = [threading.Thread(target=one, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    return threads, results


def join(threads: list[threading.Thread], timeout_s: float) -> None:
    for t in threads:
        t.join(timeout=timeout_s)


def replica_killed_under_load() -> dict[str, Any]:
    """Twelve streams over both replicas; one replica's actor is killed while they run."""
    threads, results = start_streams(12, 100, 40, 300)
    time.sleep(1.5)
    before = engine_replica_stats("splitserve")
    victim = max(before.values(), key=lambda s: s["load"])
    ray.kill(ray.get_actor(victim["actor"], namespace="serve"), no_restart=True)
    join(threads, 180)
    deadline = time.monotonic() + 120
    after: dict[int, dict[str, Any]] = {}
    while time.monotonic() < deadline:
        after = engine_replica_stats("splitserve")
        if len(after) == 2 and victim["actor"] not in {s["actor"] for s in after.values()}:
            break
        time.sleep(0.5)
    oai = openai.OpenAI(base_url=f"{BASE}/v1", api_key="unused", max_retries=0)
    afterwards = [complete(oai, ids(200 + i, 40)) for i in range(4)]
    return {
        "victim_load": victim["load"],
        "streams": results,
        "replicas_after": sorted(s["actor"] != victim["actor"] for s in after.values()),
        "served_after": {r: s["served"] for r, s in engine_replica_stats("splitserve").items()},
        "afterwards": afterwards,
    }


PD_PROMPTS = [ids(300 + i, n) for i, n in enumerate((40, 70, 129, 20, 90, 33))]


def greedy_texts(oai: openai.OpenAI) -> list[dict[str, Any]]:
    """Each PD prompt's greedy completion and its cached prompt tokens."""
    return [complete(oai, p, max_tokens=10) for p in PD_PROMPTS]


def prefill_decode(tiny_dir: str, colocated: list[dict[str, Any]]) -> dict[str, Any]:
    """The prefill/decode deployments (one replica each) in place of the engine deployment:
    the same greedy answers as the colocated replicas gave, each stream with one terminal
    event, the KV exported by the prefill replica and imported by the decode replica."""
    knobs = {k: v for k, v in TINY_KNOBS.items() if k != "replicas"}
    app = build_app({"model": tiny_dir, **knobs, "prefill_engines": 1, "decode_engines": 1})
    serve.run(app, name="pd", route_prefix="/")
    oai = openai.OpenAI(base_url=f"{BASE}/v1", api_key="unused", max_retries=0)
    answers = greedy_texts(oai)
    threads, results = start_streams(6, 400, 50, 40)
    join(threads, 180)
    streams = openai_streams(oai)
    return {
        "answers": answers,
        "colocated": colocated,
        "streams": results,
        "openai": streams,
        "prefill": list(engine_replica_stats("pd", "prefill").values()),
        "decode": list(engine_replica_stats("pd", "decode").values()),
        "prefill_killed": prefill_killed_under_load(),
    }


def prefill_killed_under_load() -> dict[str, Any]:
    """Eight long prompts at once; the prefill replica is killed while it computes them: the
    decode replica computes those whose prefill failed, every stream ends once, and Serve
    replaces the prefill replica."""
    threads, results = start_streams(8, 500, 900, 20)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:  # until the prefill replica holds some of them
        (victim,) = engine_replica_stats("pd", "prefill").values()
        if victim["load"] >= 2:
            break
        time.sleep(0.05)
    ray.kill(ray.get_actor(victim["actor"], namespace="serve"), no_restart=True)
    join(threads, 240)
    deadline = time.monotonic() + 120
    after: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        after = list(engine_replica_stats("pd", "prefill").values())
        if after and after[0]["actor"] != victim["actor"]:
            break
        time.sleep(0.5)
    oai = openai.OpenAI(base_url=f"{BASE}/v1", api_key="unused", max_retries=0)
    return {
        "victim_load": victim["load"],
        "streams": results,
        "replaced": bool(after) and after[0]["actor"] != victim["actor"],
        "afterwards": complete(oai, ids(600, 60)),
        "prefill_after": after,
    }


def real_model_answer(model_dir: str) -> dict[str, Any]:
    serve.run(
        build_app({"model": model_dir, "replicas": 1, "kv_events_host": "127.0.0.1"}),
        name="real",
        route_prefix="/",
    )
    oai = openai.OpenAI(base_url=f"{BASE}/v1", api_key="unused", max_retries=0)
    answer = oai.chat.completions.create(
        model="",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=24,
        temperature=0,
    )
    return {"text": answer.choices[0].message.content}


def run(results: dict[str, Any], name: str, scenario: Callable[[], Any]) -> None:
    t_start = time.monotonic()
    try:
        results[name] = {"ok": True, **scenario()}
    except Exception:
        results[name] = {"ok": False, "error": traceback.format_exc()[-4000:]}
    results[name]["seconds"] = round(time.monotonic() - t_start, 1)


def main(out_path: str, tmp_dir: str, tiny_dir: str, real_dir: str | None = None) -> None:
    results: dict[str, Any] = {}
    out = Path(out_path)
    try:
        run(results, "start", lambda: start(tmp_dir, tiny_dir))
        if results["start"]["ok"]:
            oai = openai.OpenAI(base_url=f"{BASE}/v1", api_key="unused", max_retries=0)
            run(results, "routing", lambda: routing(oai))
            run(results, "openai", lambda: openai_streams(oai))
            colocated = greedy_texts(oai)
            run(results, "kill", replica_killed_under_load)
            serve.delete("splitserve")
            run(results, "pd", lambda: prefill_decode(tiny_dir, colocated))
            if real_dir:
                serve.delete("pd")
                run(results, "real", lambda: real_model_answer(real_dir))
    finally:
        out.write_text(json.dumps(results, indent=1))
        serve.shutdown()
        ray.shutdown()


def start(tmp_dir: str, tiny_dir: str) -> dict[str, Any]:
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        object_store_memory=OBJECT_STORE_BYTES,
        _temp_dir=str(Path(tmp_dir) / "ray"),
    )
    serve.start(http_options={"host": "127.0.0.1", "port": PORT})
    serve.run(build_app({"model": tiny_dir, **TINY_KNOBS}), name="splitserve", route_prefix="/")
    return {"node_ip": ray.util.get_node_ip_address()}


if __name__ == "__main__":
    main(*sys.argv[1:])
