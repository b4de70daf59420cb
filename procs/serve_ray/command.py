"""``splitserve serve-ray``: the Serve application on a local Ray (started here) or on a Ray
cluster (``--address``), serving until SIGINT/SIGTERM.

    splitserve serve-ray --replicas 2 --http-port 8000
    splitserve serve-ray --address auto --replicas 4 --http-host 0.0.0.0 --api-key KEY
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
import threading
from typing import Any

from ipc.engine_config import EngineConfig
from ipc.knobs import add_knob_flags, knob_fields
from procs.config_flags import (
    ENGINE_KNOBS,
    FAULT_KNOBS,
    TESTING_KNOBS,
    TOKENIZER_KNOBS,
    add_cluster_flags,
)
from procs.serve_ray.settings import APP_NAME, NOT_PER_REPLICA, ServeSettings

SERVE_KNOBS = tuple(f.name for f in knob_fields(ServeSettings) if f.metadata["cli"])
REPLICA_ENGINE_KNOBS = tuple(k for k in ENGINE_KNOBS if k not in NOT_PER_REPLICA)
REPLICA_KNOBS = (
    TOKENIZER_KNOBS
    + FAULT_KNOBS
    + TESTING_KNOBS
    + ("routing_balance_abs_threshold", "routing_balance_rel_threshold", "routing_cache_threshold")
    # the prefill/decode mode's transfer (--prefill-engines/--decode-engines are the app's)
    + ("kv_transfer_buffer_tokens", "kv_transfer_timeout_s", "kv_transport", "kv_net_host")
)
LOCAL_RAY_OBJECT_STORE_BYTES = 0  # 0: Ray's own choice (about 30% of memory, in /dev/shm)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="splitserve serve-ray",
        description="splitserve as a Ray Serve application (docs/ray.md)",
    )
    g = p.add_argument_group("Ray")
    g.add_argument(
        "--address",
        default=None,
        metavar="ADDR",
        help="a running Ray cluster ('auto': the one this node belongs to); default: start a "
        "local Ray for this command",
    )
    g.add_argument("--num-cpus", type=int, default=None, help="a local Ray's CPUs")
    g.add_argument(
        "--object-store-bytes",
        type=int,
        default=LOCAL_RAY_OBJECT_STORE_BYTES,
        metavar="BYTES",
        help="a local Ray's object store (default: Ray's choice)",
    )
    g.add_argument("--ray-temp-dir", default=None, metavar="DIR", help="a local Ray's temp dir")
    g.add_argument(
        "--dashboard", action="store_true", help="start a local Ray's dashboard (default: off)"
    )
    add_knob_flags(p.add_argument_group("the application"), ServeSettings, SERVE_KNOBS)
    add_knob_flags(
        p.add_argument_group("each engine replica's engine"), EngineConfig, REPLICA_ENGINE_KNOBS
    )
    add_cluster_flags(p.add_argument_group("each engine replica's cluster"), REPLICA_KNOBS)
    return p


def settings_of(args: argparse.Namespace) -> ServeSettings:
    cluster = {name: getattr(args, name) for name in REPLICA_ENGINE_KNOBS + REPLICA_KNOBS}
    return ServeSettings(**{name: getattr(args, name) for name in SERVE_KNOBS}, cluster=cluster)


def start_ray(args: argparse.Namespace) -> None:
    import ray

    if args.address:
        ray.init(address=args.address)
        return
    local: dict[str, Any] = {"include_dashboard": args.dashboard}
    if args.num_cpus is not None:
        local["num_cpus"] = args.num_cpus
    if args.object_store_bytes:
        local["object_store_memory"] = args.object_store_bytes
    if args.ray_temp_dir:
        local["_temp_dir"] = os.path.abspath(args.ray_temp_dir)
    ray.init(**local)


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        settings = settings_of(args)
    except ValueError as exc:
        print(f"splitserve serve-ray: {exc}", file=sys.stderr)
        return 2
    try:
        import ray
        from ray import serve

        from procs.serve_ray.app import application
    except ImportError as exc:
        print(
            f"splitserve serve-ray needs Ray Serve ({exc}): pip install -e '.[ray]'",
            file=sys.stderr,
        )
        return 2
    start_ray(args)
    # After ray.init, whose own SIGTERM handler would abort the process with no clean-up.
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    serve.start(http_options={"host": settings.http_host, "port": settings.http_port})
    try:
        serve.run(application(settings), name=APP_NAME, route_prefix="/")
        where = f"http://{settings.http_host}:{settings.http_port}"
        print(f"splitserve on Ray Serve: OpenAI API at {where}/v1", flush=True)
        print(f"settings: {dataclasses.asdict(settings)}", file=sys.stderr, flush=True)
        stop.wait()
    finally:
        print("splitserve serve-ray shutting down", flush=True)
        serve.delete(APP_NAME)
        if not args.address:  # the local Ray started here stops with it
            serve.shutdown()
            ray.shutdown()
    return 0
