"""How the cluster's processes share the CPU cores.

When the cores are contended the engine's step comes first: the tokenizer workers' and HTTP
frontends' background threads (grammar checks, long prompts' encoding, large bodies' parsing)
run ``background_niceness`` nicer (runtime.priority; the engine is never made nicer).

The engine gets torch intra-op threads, each tokenizer worker gets the tokenizers library's own
(rayon) parallelism, and the detokenizer one thread. The tokenizers, the HTTP frontends and the
detokenizer work in short bursts (a prompt's encoding, a token's text) and sleep while the engine
decodes, so a core kept free for them is idle most of the time: the default reserves them a core
each only up to a quarter of the machine, and gives the engine the rest (on 2 cores, both: the
engine's second thread is worth more than the wait a burst of tokenization adds to one step).

Several engine replicas (``--engines N``) split the engine's share: each gets the floor of an
equal part, at least one thread; with ``--pin-engine-cores`` replica r runs on its own cores.
"""

from __future__ import annotations

import os

from ipc.config import ClusterConfig
from runtime.priority import BACKGROUND_NICENESS_ENV


def available_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def thread_budget(
    tokenizer_workers: int,
    *,
    engine_threads: int = 0,
    tokenizer_threads: int = 0,
    http_workers: int = 0,
    cpus: int | None = None,
    engines: int = 1,
) -> tuple[int, int]:
    """(torch threads per engine replica, threads per tokenizer worker); 0 means decide. HTTP
    frontends (one event-loop thread each) count like tokenizer workers. ``engine_threads``,
    given or decided, is what all the replicas share."""
    cpus = cpus or available_cpus()
    tokenizer_threads = tokenizer_threads or 1
    if not engine_threads:
        reserved = min(tokenizer_workers * tokenizer_threads + http_workers + 1, cpus // 4)
        engine_threads = max(1, cpus - reserved)
    return max(1, engine_threads // engines), tokenizer_threads


def engine_cores(config: ClusterConfig, index: int) -> list[int] | None:
    """The cores replica ``index`` is pinned to with ``pin_engine_cores`` (None: not pinned, or
    the OS cannot pin): its own run of ``engine_threads`` cores of this process's set, replica
    after replica (wrapping around when there are fewer cores than threads in all)."""
    if not config.pin_engine_cores or not hasattr(os, "sched_setaffinity"):
        return None
    cpus = sorted(os.sched_getaffinity(0))
    per_replica = config.engine.engine_threads or 1
    return sorted({cpus[(index * per_replica + j) % len(cpus)] for j in range(per_replica)})


def describe_budget(config: ClusterConfig) -> str:
    engines = (
        f"engine {config.engine.engine_threads} torch thread(s)"
        if config.engines == 1
        else f"{config.engines} engine replicas x {config.engine.engine_threads} torch thread(s)"
    )
    if config.pin_engine_cores:
        pins = [engine_cores(config, r) for r in range(config.engines)]
        engines += " (not pinned: the OS cannot)" if pins[0] is None else f", pinned to {pins}"
    return (
        f"CPU budget on {available_cpus()} cores: {engines}; "
        f"{config.tokenizer_workers} tokenizer worker(s) x "
        f"{config.tokenizer_threads} thread(s); detokenizer 1 thread"
        + (
            f"; {config.http_workers} HTTP frontend(s) x 1 thread"
            if config.http_port is not None
            else ""
        )
        + (
            f"; their background threads at nice +{config.background_niceness}"
            if config.background_niceness
            else ""
        )
    )


def child_env(
    role: str, config: ClusterConfig, env: dict[str, str], index: int = 0
) -> dict[str, str]:
    """The environment a role starts with; set before the interpreter so no library reads a
    different value first. Engine replica r sees only devices[r] when ``devices`` is set."""
    threads = {"engine": config.engine.engine_threads, "tokenizer": config.tokenizer_threads}.get(
        role, 1
    )
    torch_threads = config.engine.engine_threads if role == "engine" else 1
    env.update(
        {
            "OMP_NUM_THREADS": str(torch_threads),
            "MKL_NUM_THREADS": str(torch_threads),
            "RAYON_NUM_THREADS": str(threads if role == "tokenizer" else 1),
            "TOKENIZERS_PARALLELISM": "true" if role == "tokenizer" and threads > 1 else "false",
            "PYTHONUNBUFFERED": "1",
        }
    )
    if role in ("tokenizer", "http"):  # grammar checks, long prompts, large bodies (see DESIGN)
        env[BACKGROUND_NICENESS_ENV] = str(config.background_niceness)
    if role == "engine" and config.devices:
        env["CUDA_VISIBLE_DEVICES"] = config.device_list[index]
    if role == "http":
        # prometheus_client's multiprocess mode: every frontend's /metrics counts them all.
        metrics_dir = os.path.join(config.run_dir, "metrics")
        os.makedirs(metrics_dir, mode=0o700, exist_ok=True)
        env["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    return env
