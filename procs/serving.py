"""Serving a cluster from the command line until SIGINT/SIGTERM (``splitserve launch``,
``splitserve serve``): start-up announced, a failure reported, everything stopped."""

from __future__ import annotations

import signal
import sys
import threading

from procs.cluster_setup import make_config
from procs.launch_cluster import Cluster


def serve_until_stopped(
    model: str | None, run_dir: str | None, kwargs: dict, start_timeout_s: float
) -> int:
    """Start a cluster and serve until SIGINT/SIGTERM (``launch``, ``serve``)."""
    stop = threading.Event()
    started = False

    def on_signal(signum: int, _frame: object) -> None:
        if not started:
            raise KeyboardInterrupt  # unwinds start-up, which stops what it started
        stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    config, owns = make_config(model, run_dir, **kwargs)
    try:
        cluster = Cluster.start(config, owns_run_dir=owns, start_timeout_s=start_timeout_s)
    except KeyboardInterrupt:
        return 130
    started = True
    print(f"splitserve serving {cluster.config.model_name} at {cluster.client_addr}", flush=True)
    print(f"client address: {cluster.client_addr}", flush=True)
    if cluster.curve_public_key:
        print(
            f"curve public key: {cluster.curve_public_key} (also in "
            f"{cluster.config.run_dir}/curve_public.key; clients pass it as "
            "server_public_key=)",
            flush=True,
        )
    if cluster.http_url:
        print(
            f"OpenAI API: {cluster.http_url}/v1 ({cluster.config.http_workers} frontend(s))",
            flush=True,
        )
    try:
        while not stop.wait(0.2) and cluster.failure is None:
            pass
    finally:
        print("splitserve shutting down", flush=True)
        cluster.shutdown()
    if cluster.failure:
        print(f"splitserve stopped: {cluster.failure}", file=sys.stderr)
        return 1
    return 0
