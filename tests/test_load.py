"""Back-pressure under a flood, a bounded soak and phases of mixed traffic on the tiny model
(issue 7 items 2 and 6, issue 23 item 11, DESIGN.md properties 3 and 5).

Flood: SPLITSERVE_FLOOD_N (default 10,000) requests submitted as fast as one client can. Every
submit either raises OverloadedError at once (every tokenizer's pipe is full) or is accepted; every
accepted request ends with exactly one terminal event (finished, or an "overloaded" error from the
engine's bounded waiting queue). None is lost, and no process's memory grows beyond a bound.

Soak: SPLITSERVE_SOAK_S (default 20) seconds of a mixed workload from several threads: short and
long prompts, chat, token ids, streaming, aborts mid-stream, stop strings, bad requests and clients
that leave with requests in flight. Every process's RSS once idle (past its idle trim) is the same
after the soak as after a warm-up, its peak within a looser bound, and at the end the engine holds
no request and every KV block is back in the pool.
"""

from __future__ import annotations

import functools
import os
import random
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest

from ipc.client import BadRequestError, Client, OverloadedError, SplitserveError
from procs.launch_cluster import launch_cluster

FLOOD_N = int(os.environ.get("SPLITSERVE_FLOOD_N", "10000"))
SOAK_S = float(os.environ.get("SPLITSERVE_SOAK_S", "20"))
DEADLINE_S = 120.0
MB = 1024 * 1024
# Bounds past allocator noise: a leak of 20 KB a request crosses the flood's (10,000 requests),
# of ~20 KB the soak's idle level (~1,300 requests), a bounded cache's growth the phases'.
# The flood's peak is malloc's high-water mark of a step's buffers (and the module's first
# traffic after its warm-up), which grows with how full the batches get: 15-135 MB above the
# level before it, the most beside the rest of the suite.
FLOOD_RSS_GROWTH_MB = 200
SOAK_RSS_GROWTH_MB = 24  # once idle and trimmed
SOAK_PEAK_GROWTH_MB = 100  # malloc's high-water mark of transient buffers, within the soak
LATE_PHASE_SLACK_MB = 16  # allocator noise between phases

WORDS = "the quick brown fox jumps over lazy dog paris london tokyo river mountain".split()


@pytest.fixture(scope="module")
def cluster(tiny_model_dir):
    # Small bounds so that a flood reaches every one of them quickly: the clients' pipes
    # (submit_hwm), the tokenizers' queues and the engine's waiting queue.
    with launch_cluster(
        str(tiny_model_dir),
        tokenizer_workers=2,
        max_model_len=256,
        kv_cache_tokens=4096,
        max_batch_size=32,
        max_waiting_requests=64,
        tokenizer_queue_max=256,
        # float32 pinned: in bf16 the engine's RSS rose ~110 MiB after the warm-up in one run
        # (not yet explained; oneDNN's per-shape bf16 primitives are the suspect).
        dtype="float32",
    ) as c:
        yield c


def rss_mb(cluster) -> dict[str, float]:
    out = {}
    for name, pid in cluster.pids.items():
        try:
            out[name] = psutil.Process(pid).memory_info().rss / MB
        except psutil.NoSuchProcess:
            out[name] = float("nan")
    return out


class RssSampler:
    """Samples every process's RSS in the background (peaks matter, not just the end)."""

    def __init__(self, cluster, every_s: float = 0.25) -> None:
        self.cluster, self.every_s = cluster, every_s
        self.samples: list[tuple[float, dict[str, float]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.monotonic(), rss_mb(self.cluster)))
            self._stop.wait(self.every_s)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def peak(self, since: float = 0.0) -> dict[str, float]:
        rows = [s for t, s in self.samples if t >= since]
        return {name: max(r[name] for r in rows) for name in rows[0]}


def wait_engine_idle(cluster, timeout_s: float = 60.0) -> dict[str, float]:
    """The engine's heartbeat once it runs nothing, queues nothing and holds no KV block."""
    deadline = time.monotonic() + timeout_s
    stats: dict[str, float] = {}
    while time.monotonic() < deadline:
        stats = cluster.worker_stats("engine")
        if (
            stats
            and stats["live"] == stats["running"] == stats["waiting"] == 0
            and stats.get("kv_blocks_used", 0) == 0
        ):
            return stats
        time.sleep(0.1)
    raise AssertionError(f"the engine did not become idle: {stats}")


def _prompt(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def _assert_alive(cluster) -> None:
    assert cluster.failure is None
    assert all(c.popen.poll() is None for c in cluster.children)
    restarts = getattr(cluster, "restarts", {})
    assert not any(restarts.values()), f"processes were replaced: {restarts}"


# --- flood ----------------------------------------------------------------------------------------


def test_flood_every_request_ends_and_memory_stays_bounded(cluster):
    rng = random.Random(1)
    with Client(cluster.client_addr, submit_hwm=64) as client:
        client.generate(["warm up"] * 8, max_tokens=2)  # first allocations are not growth
        wait_engine_idle(cluster)
        before = rss_mb(cluster)
        sampler = RssSampler(cluster)
        outcomes: Counter[str] = Counter()
        handles = []
        t0 = time.monotonic()
        for i in range(FLOOD_N):
            try:
                handles.append(
                    client.submit(
                        _prompt(rng, 1 + i % 12), max_tokens=2, temperature=0, ignore_eos=True
                    )
                )
            except OverloadedError:
                outcomes["overloaded at submit"] += 1
        submit_wall = time.monotonic() - t0
        deadline = time.monotonic() + DEADLINE_S
        lost = 0
        for h in handles:
            try:
                r = h.result(timeout=max(0.0, deadline - time.monotonic()), check=False)
            except SplitserveError:  # RequestTimeoutError: no terminal event in time
                lost += 1
                continue
            outcomes[r.finish_reason if r.ok else f"error {r.error_code}"] += 1
        sampler.stop()
        after = rss_mb(cluster)
        peak = sampler.peak()
    print(
        f"\nflood: {FLOOD_N} submits in {submit_wall:.2f} s, {len(handles)} accepted; "
        f"outcomes {dict(outcomes)}; lost {lost}"
    )
    print(
        "flood RSS MB (before / peak / after): "
        + ", ".join(f"{n} {before[n]:.0f}/{peak[n]:.0f}/{after[n]:.0f}" for n in before)
    )
    assert lost == 0
    assert sum(outcomes.values()) == FLOOD_N
    assert set(outcomes) <= {"length", "overloaded at submit", "error overloaded"}, outcomes
    assert outcomes["length"] > 0
    assert outcomes["overloaded at submit"] + outcomes["error overloaded"] > 0, (
        "the flood never reached a bound: make it bigger or the bounds smaller"
    )
    for name in before:
        assert peak[name] - before[name] < FLOOD_RSS_GROWTH_MB, (name, before[name], peak[name])
    stats = wait_engine_idle(cluster)
    assert stats["kv_blocks_available"] == stats["kv_blocks_total"]
    _assert_alive(cluster)
    with Client(cluster.client_addr) as client:
        assert client.submit("after the flood", max_tokens=2).result(timeout=DEADLINE_S).ok


def _trim_counts(cluster, names: list[str]) -> dict[str, float]:
    """How often each process that trims (engine, tokenizers) has trimmed, by its heartbeat."""
    out = {}
    for name in names:
        role, index = name.rstrip("]").split("[")
        if role in ("engine", "tokenizer"):
            out[name] = cluster.worker_stats(role, int(index)).get("memory_trims", 0)
    return out


def _idle_trimmed_level(cluster, names: list[str], trims: dict[str, float]) -> dict[str, float]:
    """Every process's RSS once the engine is idle and each process that trims has trimmed
    since its count was ``trims`` (each trims once it has been idle a moment)."""
    wait_engine_idle(cluster)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(
        now <= trims[n] for n, now in _trim_counts(cluster, names).items()
    ):
        time.sleep(0.1)
    return rss_mb(cluster)


# --- soak -----------------------------------------------------------------------------------------


class Worker(threading.Thread):
    """One user of the cluster, running a random mix of request kinds until told to stop."""

    def __init__(self, cluster, seed: int, stop: threading.Event) -> None:
        super().__init__(daemon=True)
        self.cluster, self.rng, self.stop = cluster, random.Random(seed), stop
        self.outcomes: Counter[str] = Counter()
        self.problems: list[str] = []

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                with Client(self.cluster.client_addr, deadline_s=DEADLINE_S) as client:
                    for _ in range(self.rng.randint(5, 30)):
                        if self.stop.is_set():
                            break
                        self.one(client)
                    if self.rng.random() < 0.3:  # leave with requests in flight
                        for _ in range(3):
                            client.submit(_prompt(self.rng, 8), max_tokens=64, ignore_eos=True)
                        self.outcomes["left in flight"] += 3
        except Exception as exc:  # noqa: BLE001 - reported by the test
            self.problems.append(f"{type(exc).__name__}: {exc}")

    def one(self, client: Client) -> None:
        rng = self.rng
        kind = rng.choice(
            ["short", "long", "chat", "ids", "stream", "abort", "stop", "bad", "sampled"]
        )
        try:
            if kind == "bad":
                with pytest.raises(BadRequestError):
                    client.submit(prompt_token_ids=[1, 2, 10**6], max_tokens=2).result(60)
                self.outcomes["bad_request"] += 1
                return
            if kind in ("stream", "abort"):
                h = client.submit(
                    _prompt(rng, rng.randint(1, 40)), max_tokens=48, ignore_eos=True, temperature=0
                )
                deltas = []
                for d in h.stream(timeout=60):
                    deltas.append(d)
                    if kind == "abort" and len(deltas) == 3:
                        h.abort()
                finals = [d for d in deltas if d.finished]
                if len(finals) != 1:
                    self.problems.append(f"{kind}: {len(finals)} terminal deltas")
                self.outcomes[f"{kind}:{finals[-1].finish_reason}"] += 1
                return
            sampling = dict(max_tokens=rng.randint(1, 24), temperature=0)
            if kind == "short":
                h = client.submit(_prompt(rng, rng.randint(1, 5)), **sampling)
            elif kind == "long":
                h = client.submit(_prompt(rng, rng.randint(60, 180)), **sampling)
            elif kind == "chat":
                h = client.submit(
                    messages=[{"role": "user", "content": _prompt(rng, 6)}], **sampling
                )
            elif kind == "ids":
                h = client.submit(
                    prompt_token_ids=[rng.randrange(49152) for _ in range(20)], **sampling
                )
            elif kind == "stop":
                h = client.submit(_prompt(rng, 10), max_tokens=32, stop=[rng.choice(WORDS), "e"])
            else:
                h = client.submit(
                    _prompt(rng, 10),
                    max_tokens=16,
                    temperature=0.8,
                    top_p=0.9,
                    top_k=50,
                    seed=rng.randrange(1000),
                )
            r = h.result(timeout=60, check=False)
            self.outcomes[
                f"{kind}:{r.finish_reason}" + (f" {r.error_code}" if not r.ok else "")
            ] += 1
            if not r.ok:
                self.problems.append(f"{kind}: {r.error_code}: {r.error}")
        except OverloadedError:
            self.outcomes["overloaded at submit"] += 1
        except SplitserveError as exc:
            self.problems.append(f"{kind}: {type(exc).__name__}: {exc}")


def _run_workers(cluster, seeds: range, seconds: float) -> tuple[Counter[str], list[str]]:
    stop = threading.Event()
    workers = [Worker(cluster, seed, stop) for seed in seeds]
    for w in workers:
        w.start()
    time.sleep(seconds)
    stop.set()
    for w in workers:
        w.join(timeout=DEADLINE_S)
    assert not any(w.is_alive() for w in workers), "a soak worker hung"
    outcomes = sum((w.outcomes for w in workers), Counter())
    return outcomes, [p for w in workers for p in w.problems]


def test_soak_mixed_workload_rss_flat_and_kv_returns(cluster):
    """A warm-up third, then the soak. A leak stays when the work stops; freed memory that
    malloc keeps (the high-water mark of a step's transient buffers, which a rare mix of rows
    sets: 0-45 MB above the warm-up's on the tiny model) goes back at the engine's idle trim.
    So the level once idle and trimmed must not grow, and the peak only within a looser bound."""
    names = list(rss_mb(cluster))
    trims = _trim_counts(cluster, names)
    warm_outcomes, problems = _run_workers(cluster, range(4), SOAK_S / 3)
    first = _idle_trimmed_level(cluster, names, trims)
    trims = _trim_counts(cluster, names)
    sampler = RssSampler(cluster, every_s=0.5)
    outcomes, soak_problems = _run_workers(cluster, range(4, 8), SOAK_S * 2 / 3)
    sampler.stop()
    problems += soak_problems
    outcomes += warm_outcomes
    peak = sampler.peak()
    last = _idle_trimmed_level(cluster, names, trims)
    print(f"\nsoak {SOAK_S:.0f} s: {sum(outcomes.values())} requests; {dict(outcomes)}")
    print(
        "soak RSS MB (idle after warm-up / peak / idle after): "
        + ", ".join(f"{n} {first[n]:.0f}/{peak[n]:.0f}/{last[n]:.0f}" for n in names)
    )
    assert not problems, problems[:10]
    assert outcomes["abort:abort"] > 0 and outcomes["bad_request"] > 0
    for name in names:
        assert last[name] - first[name] < SOAK_RSS_GROWTH_MB, (name, first[name], last[name])
        assert peak[name] - first[name] < SOAK_PEAK_GROWTH_MB, (name, first[name], peak[name])
    stats = wait_engine_idle(cluster)
    assert stats["kv_blocks_available"] == stats["kv_blocks_total"]
    deadline = time.monotonic() + 30  # heartbeats lag: poll, then require the quiet state
    while time.monotonic() < deadline and any(
        cluster.worker_stats("detokenizer").get(key, 1) for key in ("open_requests", "clients")
    ):
        time.sleep(0.1)
    detok = cluster.worker_stats("detokenizer")
    assert detok["open_requests"] == 0 and detok["clients"] == 0, detok
    _assert_alive(cluster)


# --- phases of mixed traffic ----------------------------------------------------------------------

PHASES = 4
PHASE_REQUESTS = 60


def _mixed_request(client: Client, phase: int, i: int) -> None:
    """Plain, structured (a schema of its own: more than the engine keeps templates of) or
    with logprobs (and prompt logprobs); each must end well."""
    rng = random.Random(phase * 1000 + i)
    prompt = _prompt(rng, rng.randint(3, 60))
    kind = i % 3
    if kind == 0:
        handle = client.submit(prompt, max_tokens=24, temperature=0.8, seed=i)
    elif kind == 1:
        fields = {f"p{phase}_{i}_{j}": {"type": ["integer", "boolean"][j % 2]} for j in range(3)}
        schema = {
            "type": "object",
            "properties": fields,
            "required": list(fields),
            "additionalProperties": False,
        }
        handle = client.submit(
            messages=[{"role": "user", "content": prompt}],
            max_tokens=40,
            temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
        )
    else:
        handle = client.submit(
            prompt, max_tokens=16, logprobs=5, prompt_logprobs=2 if i % 2 else None
        )
    result = handle.result(timeout=DEADLINE_S, check=False)
    assert result.ok, (kind, result.error_code, result.error)


def test_phases_of_mixed_traffic_rss_flattens(cluster):
    """The same mixed traffic in phases; every process's RSS once idle after each (past its
    idle trim). A leak grows alike in every phase, a bounded cache fills once: the growth from
    the second phase to the last must be small against the first phase's."""
    names = list(rss_mb(cluster))
    levels = [rss_mb(cluster)]
    with Client(cluster.client_addr, deadline_s=DEADLINE_S) as client:
        for phase in range(PHASES):
            trims = _trim_counts(cluster, names)
            with ThreadPoolExecutor(8) as pool:
                list(
                    pool.map(
                        functools.partial(_mixed_request, client, phase), range(PHASE_REQUESTS)
                    )
                )
            levels.append(_idle_trimmed_level(cluster, names, trims))
    print(
        "\nRSS MB after each phase: "
        + "; ".join(f"{n} " + " ".join(f"{level[n]:.0f}" for level in levels) for n in names)
    )
    for n in names:
        first = levels[1][n] - levels[0][n]
        late = levels[-1][n] - levels[2][n]
        assert late <= max(first, 0.0) / 2 + LATE_PHASE_SLACK_MB, (n, [lv[n] for lv in levels])
    _assert_alive(cluster)
