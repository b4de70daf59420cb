"""One HTTP frontend process: uvicorn on uvloop serving ``http_worker.app`` over a socket bound
before start-up.

    python -m http_worker.worker --client-addr ipc:///tmp/splitserve-x/client.sock --port 8000

Each frontend process owns one AsyncClient (its own DEALER identity at the detokenizer), so
several frontends can serve one port (``--reuse-port``, SO_REUSEPORT) or one port each. The
frontend never tokenizes: prompts, chat messages or token ids go to the cluster as they came.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import socket
import sys
from typing import Any

from http_worker.app import build_app
from http_worker.frontend import FrontendSettings
from ipc.config import API_KEY_HELP, LOOPBACK_HOSTS, ClusterConfig
from ipc.knobs import add_knob_flags, knob_fields, knob_values
from runtime.process import die_with_parent, setup_logging, under_supervisor


class _Server:
    """uvicorn's Server, except that under the supervisor SIGINT is ignored (as every worker
    does): a terminal's Ctrl-C reaches the supervisor, which stops us in order with SIGTERM."""

    @staticmethod
    def make(config: Any, under_supervisor: bool) -> Any:
        import uvicorn

        class Server(uvicorn.Server):
            def handle_exit(self, sig: int, frame: Any) -> None:
                if under_supervisor and sig == signal.SIGINT:
                    return
                super().handle_exit(sig, frame)

        return Server(config)


def listening_socket(host: str, port: int, reuse_port: bool) -> socket.socket:
    """Bound and listening before the app starts, so the port (even 0) is known up front and
    connections made once the supervisor hears WorkerReady wait in the backlog, never refused.
    With ``reuse_port`` several frontends bind the same port; the kernel spreads connections."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(2048)
    return sock


# Process options, not frontend settings: where to listen and how to run.
SETTINGS_FLAGS = tuple(f.name for f in knob_fields(FrontendSettings) if f.metadata["cli"])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m http_worker.worker",
        description="OpenAI-compatible HTTP frontend of a splitserve "
        "cluster (one process; start several for more).",
    )
    add_knob_flags(
        p,
        FrontendSettings,
        SETTINGS_FLAGS,
        defaults={
            "api_key": os.environ.get("SPLITSERVE_API_KEY", ""),
            "server_public_key": os.environ.get("SPLITSERVE_SERVER_PUBLIC_KEY", ""),
        },
        help_overrides={
            "api_key": f"{API_KEY_HELP}; $SPLITSERVE_API_KEY gives the default",
            "server_public_key": "the cluster's CURVE public key, when it uses CURVE "
            "(--listen); $SPLITSERVE_SERVER_PUBLIC_KEY gives the default",
        },
    )
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on; anything but loopback needs --api-key",
    )
    p.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    p.add_argument(
        "--reuse-port",
        action="store_true",
        help="bind with SO_REUSEPORT so several frontends share --port",
    )
    p.add_argument(
        "--graceful-shutdown-s",
        type=int,
        default=10,
        metavar="SECONDS",
        help="on SIGTERM, wait this long for open responses before closing them",
    )
    p.add_argument("--log-level", default=os.environ.get("SPLITSERVE_LOG_LEVEL", "INFO"))
    return p


def serve(
    settings: FrontendSettings,
    host: str,
    port: int,
    *,
    reuse_port: bool = False,
    log_level: str = "info",
    graceful_shutdown_s: int = 10,
) -> None:
    """Binds, then runs the app until SIGTERM (SIGINT too, unless under the supervisor)."""
    import uvicorn

    sock = listening_socket(host, port, reuse_port)
    shown = f"[{host}]" if ":" in host else host
    settings = dataclasses.replace(settings, url=f"http://{shown}:{sock.getsockname()[1]}")
    config = uvicorn.Config(
        build_app(settings),
        host=host,
        port=port,
        loop="uvloop",
        http="auto",
        lifespan="on",
        access_log=False,
        log_config=None,
        log_level=log_level.lower(),
        timeout_graceful_shutdown=graceful_shutdown_s,
    )
    server = _Server.make(config, under_supervisor())
    server.run(sockets=[sock])
    if not server.started:
        sys.exit(3)  # start-up failed (no cluster answered): the log above says why


def main(argv: list[str] | None = None) -> None:
    """A frontend started by hand (or by a test) for a cluster that is already running."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.host not in LOOPBACK_HOSTS and not args.api_key:
        parser.error(f"listening on {args.host} (not loopback) requires --api-key")
    try:
        settings = FrontendSettings(**knob_values(args, SETTINGS_FLAGS))
    except ValueError as exc:
        parser.error(str(exc))
    if under_supervisor():
        die_with_parent()
    setup_logging("http", args.index, args.log_level)
    serve(
        settings,
        args.host,
        args.port,
        reuse_port=args.reuse_port,
        log_level=args.log_level,
        graceful_shutdown_s=args.graceful_shutdown_s,
    )


def main_from_config(config: ClusterConfig, index: int) -> None:
    """The supervisor's way in (its worker entry point, role "http"): one frontend of the
    cluster, reporting to the supervisor like every other worker."""
    serve(
        FrontendSettings.from_cluster(config, index),
        config.http_host,
        config.http_port or 0,
        reuse_port=config.http_workers > 1,
        log_level=os.environ.get("SPLITSERVE_LOG_LEVEL", "INFO"),
    )


if __name__ == "__main__":
    main()
