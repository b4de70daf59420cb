"""The one entry point of every worker process:

    python -m procs.run_worker ROLE INDEX CONFIG_PATH

The supervisor sets the thread budget in the environment (OMP_NUM_THREADS, RAYON_NUM_THREADS,
TOKENIZERS_PARALLELISM) before the interpreter starts, so no library reads it too early. This
module sits with the supervisor, above the roles: it is the only place that imports them all.

A worker that cannot start (``StartupError``: a model it cannot serve, ...) logs its one-line
reason, sends it to the supervisor (WorkerFailed) and exits with EXIT_STARTUP_REFUSED; one that
crashes logs its traceback, sends the exception's line and exits with 1.
"""

from __future__ import annotations

import logging
import os
import sys
import time

from ipc.config import ROLES, ClusterConfig
from ipc.messages import EXIT_STARTUP_REFUSED
from procs.thread_budget import engine_cores
from runtime.process import die_with_parent, setup_logging
from runtime.supervisor_link import send_last_words
from runtime.worker import StartupError

logger = logging.getLogger("splitserve.worker")
AWAIT_POLL_S = 0.01  # how often a process started beside the engines looks for their limits


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 3 or args[0] not in ROLES:
        sys.exit(f"usage: python -m procs.run_worker {{{','.join(ROLES)}}} INDEX CONFIG_PATH")
    role, index, config_path = args[0], int(args[1]), args[2]
    die_with_parent()
    setup_logging(role, index if role in ("tokenizer", "http") else None)
    seen, config = _identity(config_path), ClusterConfig.read(config_path)
    if role == "engine" and (cores := engine_cores(config, index)) is not None:
        os.sched_setaffinity(0, cores)  # before torch starts its threads: they inherit it
    try:
        if role == "tokenizer":
            from tokenizer_worker.worker import main as run
        elif role == "engine":
            from engine_worker.worker import main as run
        elif role == "detokenizer":
            from detok_worker.worker import main as run
        else:
            from http_worker.worker import main_from_config as run
        if role != "engine":
            config = await_engines(config_path, config, seen)
        run(config, index)
    except StartupError as exc:
        logger.error("%s[%d] cannot start: %s", role, index, exc)
        send_last_words(config, role, index, str(exc), refused=True)
        sys.exit(EXIT_STARTUP_REFUSED)
    except Exception as exc:
        logger.exception("%s[%d] crashed", role, index)
        send_last_words(config, role, index, f"crashed: {exc!r}", refused=False)
        sys.exit(1)


def await_engines(config_path: str, config: ClusterConfig, seen: tuple[int, int]) -> ClusterConfig:
    """The cluster config once the supervisor has written the engines' limits into it (a
    process started beside the engines has imported its role meanwhile); ``seen``: the file's
    identity when ``config`` was read. The supervisor's start timeout bounds the wait; a
    supervisor that dies takes this process with it."""
    while not config.engines_ready:
        time.sleep(AWAIT_POLL_S)
        if (changed := _identity(config_path)) != seen:
            seen, config = changed, ClusterConfig.read(config_path)
    return config


def _identity(path: str) -> tuple[int, int]:
    stat = os.stat(path)  # the supervisor replaces the file whole: a new inode each write
    return stat.st_ino, stat.st_mtime_ns


if __name__ == "__main__":
    main()
