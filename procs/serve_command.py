"""``splitserve serve``: vLLM's flags translated (procs.serve_flags), checked against the config
before anything starts, then the cluster served as ``splitserve launch`` serves it."""

from __future__ import annotations

import logging
import os
import sys

from ipc.config import ClusterConfig
from procs.launch_cluster import ClusterStartError
from procs.model_store import ModelError
from procs.serve_flags import ServeFlagError, build_parser, translate
from procs.serving import serve_until_stopped

logger = logging.getLogger("splitserve.serve")


def fail(message: str) -> int:
    print(f"splitserve serve: error: {' '.join(message.split())}", file=sys.stderr, flush=True)
    return 2


def main(argv: list[str]) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        model, knobs, notes = translate(args)
        # Every knob's type and bounds, and the pairings the config checks (a non-loopback
        # host needs an API key...), before a run directory or a process exists.
        ClusterConfig.build("model", "run-dir", **knobs)
    except ServeFlagError as exc:
        return fail(str(exc))
    except (ValueError, TypeError) as exc:
        return fail(_flag_names(str(exc)))
    os.environ.setdefault("SPLITSERVE_LOG_LEVEL", "INFO")
    logging.basicConfig(
        level=os.environ["SPLITSERVE_LOG_LEVEL"],
        format="%(asctime)s supervisor %(levelname)s %(name)s: %(message)s",
    )
    for note in notes:
        logger.warning("%s", note)
    try:
        return serve_until_stopped(model, None, knobs, args.start_timeout_s)
    except (ModelError, ClusterStartError) as exc:
        return fail(str(exc))


# The config names a knob; the user typed a vLLM flag.
_KNOB_FLAGS = {
    "max_batch_size": "--max-num-seqs",
    "prefill_max_tokens": "--max-num-batched-tokens",
    "engines": "--data-parallel-size",
    "engine_threads": "--threads",
    "http_port": "--port",
    "kv_cache_memory_fraction": "--gpu-memory-utilization",
    "an HTTP frontend on": "--host",
}


def _flag_names(message: str) -> str:
    for knob, flag in _KNOB_FLAGS.items():
        if message.startswith(knob):
            return f"{flag}: {message}"
    return message
