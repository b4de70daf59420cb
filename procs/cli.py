"""The ``splitserve`` command.

splitserve chat "What is the capital of France?"   # start, stream one answer, stop
splitserve launch --tokenizer-workers 2             # serve until SIGINT/SIGTERM
splitserve serve model.gguf --port 8000             # the same, with vLLM's flag names
splitserve generate "Once upon a time" "The sky"    # raw prompts, one answer each
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from typing import Any

from ipc.client import Client, SplitserveError
from ipc.config import API_KEY_HELP, TRANSPORTS
from ipc.engine_roles import engine_mode_error
from procs.config_flags import (
    DATA_PARALLEL_KNOBS,
    DISAGGREGATION_KNOBS,
    ENGINE_KNOBS,
    FAULT_KNOBS,
    TESTING_KNOBS,
    TOKENIZER_KNOBS,
    add_cluster_flags,
    add_engine_flags,
    knob_values,
)
from procs.launch_cluster import ClusterStartError, launch_cluster
from procs.model_store import ModelError
from procs.serving import serve_until_stopped

logger = logging.getLogger("splitserve.cli")


def add_cluster_args(p: argparse.ArgumentParser) -> None:
    """Every flag of a cluster launch, in the groups --help shows."""
    _add_cluster_group(p.add_argument_group("cluster"))
    add_engine_flags(p.add_argument_group("engine"))
    add_cluster_flags(
        p.add_argument_group("data-parallel engines (docs/data-parallel.md)"), DATA_PARALLEL_KNOBS
    )
    add_cluster_flags(
        p.add_argument_group("prefill/decode disaggregation (docs/disaggregation.md)"),
        DISAGGREGATION_KNOBS,
    )
    _add_http_group(p.add_argument_group("OpenAI-compatible HTTP frontend"))
    add_cluster_flags(p.add_argument_group("faults"), FAULT_KNOBS)
    add_cluster_flags(p.add_argument_group("testing (stand-ins for a role's core)"), TESTING_KNOBS)


def _add_cluster_group(g: Any) -> None:
    g.add_argument(
        "--model",
        default=None,
        metavar="PATH",
        help="a GGUF file (the first part of a split one), a directory holding one, or a "
        "Hugging Face checkpoint directory (Llama, Qwen2/3, Mistral); default: "
        "SmolLM2-135M-Instruct, provisioned automatically on first use",
    )
    add_cluster_flags(g, TOKENIZER_KNOBS)
    g.add_argument(
        "--transport",
        default="ipc",
        choices=TRANSPORTS,
        help="ipc: unix sockets in the run dir; tcp: loopback ports from --port",
    )
    g.add_argument(
        "--port",
        type=int,
        default=0,
        metavar="PORT",
        help="with --transport tcp: the client port; internal ports follow it",
    )
    g.add_argument(
        "--listen",
        default=None,
        metavar="HOST",
        help="serve clients over tcp on HOST (e.g. 0.0.0.0; needs --port). Beyond "
        "loopback, ZeroMQ CURVE is switched on: the supervisor generates a key "
        "pair and prints the public key clients must pass (server_public_key=); "
        "internal sockets stay on loopback. Default: ipc/loopback only",
    )
    add_cluster_flags(g, ("require_curve",))
    g.add_argument(
        "--run-dir",
        default=None,
        metavar="DIR",
        help="where sockets and cluster.json live (default: a fresh private temp dir)",
    )
    g.add_argument(
        "--start-timeout-s",
        type=float,
        default=180.0,
        metavar="SECONDS",
        help="give up on a starting process silent this long (default 180)",
    )


def _add_http_group(h: Any) -> None:
    h.add_argument(
        "--http-port",
        type=int,
        default=None,
        metavar="PORT",
        help="serve the OpenAI API on this port (0: any free port); default: no HTTP frontend",
    )
    h.add_argument(
        "--http-host",
        default="127.0.0.1",
        metavar="HOST",
        help="address the frontend listens on; anything but loopback needs "
        "--api-key (default 127.0.0.1)",
    )
    add_cluster_flags(h, ("http_workers", "lenient_fields", "http_max_body_bytes"))
    h.add_argument(
        "--api-key",
        default=os.environ.get("SPLITSERVE_API_KEY", ""),
        metavar="KEY",
        help=f"{API_KEY_HELP} (default: $SPLITSERVE_API_KEY, or none)",
    )


def cluster_kwargs(args: argparse.Namespace) -> dict:
    return dict(
        base_port=args.port,
        **knob_values(
            args,
            ENGINE_KNOBS
            + TOKENIZER_KNOBS
            + DATA_PARALLEL_KNOBS
            + DISAGGREGATION_KNOBS
            + FAULT_KNOBS
            + TESTING_KNOBS
            + ("require_curve",),
        ),
        **listen_kwargs(args),
        **http_kwargs(args),
    )


def listen_kwargs(args: argparse.Namespace) -> dict:
    if args.listen is None:
        return dict(transport=args.transport)
    if not args.port:
        raise SystemExit("--listen needs --port (the client port; the others follow it)")
    return dict(transport="tcp", host=args.listen)


def http_kwargs(args: argparse.Namespace) -> dict:
    if getattr(args, "http_port", None) is None:
        return {}
    return dict(
        http_port=args.http_port,
        http_host=args.http_host,
        http_workers=args.http_workers,
        http_api_key=args.api_key,
        lenient_fields=args.lenient_fields,
        http_max_body_bytes=args.http_max_body_bytes,
    )


def cmd_launch(args: argparse.Namespace) -> int:
    return serve_until_stopped(args.model, args.run_dir, cluster_kwargs(args), args.start_timeout_s)


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--max-tokens",
        type=int,
        default=256,
        metavar="TOKENS",
        help="most tokens to generate (default 256)",
    )
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default 0)")
    p.add_argument(
        "--stop", action="append", default=[], metavar="TEXT", help="a stop string (repeatable)"
    )
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (default 1: off)")
    p.add_argument("--top-k", type=int, default=0, help="top-k sampling (default 0: off)")
    p.add_argument("--seed", type=int, default=None, help="seed for a reproducible sample")
    p.add_argument(
        "--repetition-penalty",
        type=float,
        default=1.0,
        help="penalize tokens already in the prompt or output (default 1: off)",
    )


def _sampling_kwargs(args: argparse.Namespace) -> dict:
    return {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "stop": args.stop,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "seed": args.seed,
        "repetition_penalty": args.repetition_penalty,
    }


@contextlib.contextmanager
def _cluster_client(args: argparse.Namespace) -> Iterator[Client]:
    """A cluster for one command (chat, generate) and a client connected to it."""
    with (
        launch_cluster(
            args.model,
            run_dir=args.run_dir,
            start_timeout_s=args.start_timeout_s,
            **cluster_kwargs(args),
        ) as cluster,
        Client(cluster.client_addr, server_public_key=cluster.curve_public_key) as client,
    ):
        yield client


def cmd_chat(args: argparse.Namespace) -> int:
    messages = [{"role": "system", "content": args.system}] if args.system else []
    messages.append({"role": "user", "content": args.prompt})
    with _cluster_client(args) as client:
        try:
            handle = client.submit(messages=messages, **_sampling_kwargs(args))
            for delta in handle.stream():
                print(delta.text, end="", flush=True)
        except SplitserveError as exc:
            print(f"\nerror: {exc}", file=sys.stderr)
            return 1
        print(flush=True)
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    with _cluster_client(args) as client:
        try:
            results = client.generate(args.prompts, check=False, **_sampling_kwargs(args))
        except SplitserveError as exc:  # bad sampling values, refused before anything is sent
            print(f"error: {exc}", file=sys.stderr)
            return 1
        for prompt, r in zip(args.prompts, results):
            tail = f" [{r.finish_reason}{': ' + r.error if r.error else ''}]"
            print(f"{prompt!r} -> {r.text!r}{tail}", flush=True)
    return 0 if all(r.ok for r in results) else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="splitserve",
        description="LLM serving with tokenization and detokenization in their own processes.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("launch", help="start a cluster and serve until SIGINT/SIGTERM")
    add_cluster_args(p)
    p.set_defaults(run=cmd_launch)
    p = sub.add_parser("chat", help="start a cluster, stream the answer to one chat prompt, stop")
    p.add_argument("prompt", help="the user's message")
    p.add_argument("--system", default=None, help="an optional system message")
    _sampling_args(p)
    add_cluster_args(p)
    p.set_defaults(run=cmd_chat)
    p = sub.add_parser("generate", help="start a cluster, complete raw prompts, stop")
    p.add_argument("prompts", nargs="+", help="raw text prompts (no chat template)")
    _sampling_args(p)
    add_cluster_args(p)
    p.set_defaults(run=cmd_generate)
    sub.add_parser(
        "serve",
        add_help=False,
        help="serve MODEL over HTTP with vLLM's flag names (splitserve serve --help; "
        "docs/migrating.md)",
    )
    sub.add_parser(
        "serve-ray",
        add_help=False,
        help="serve on Ray Serve, one node or many (needs the ray extra; splitserve serve-ray "
        "--help for its options; docs/ray.md)",
    )
    return parser


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:
        from procs.serve_command import main as serve

        sys.exit(serve(argv[1:]))
    if argv[:1] == ["serve-ray"]:
        # Deferred: the Ray launcher is an optional extra, and nothing else needs it.
        from procs.serve_ray.command import main as serve_ray

        logging.basicConfig(level=os.environ.get("SPLITSERVE_LOG_LEVEL", "INFO"))
        sys.exit(serve_ray(argv[1:]))
    args = build_parser().parse_args(argv)
    if hasattr(args, "prefill_engines"):  # one mode of engines or the other, said in one line
        mode_error = engine_mode_error(args.engines, args.prefill_engines, args.decode_engines)
        if mode_error:
            print(f"splitserve: error: {mode_error}", file=sys.stderr, flush=True)
            sys.exit(2)
    quiet = args.command in ("chat", "generate")
    os.environ.setdefault("SPLITSERVE_LOG_LEVEL", "WARNING" if quiet else "INFO")
    logging.basicConfig(
        level=os.environ["SPLITSERVE_LOG_LEVEL"],
        format="%(asctime)s supervisor %(levelname)s %(name)s: %(message)s",
    )
    try:
        code = args.run(args)
    except (ModelError, ClusterStartError) as exc:
        # A model we cannot serve, a worker that could not start: its one line, no traceback.
        print(f"splitserve: error: {' '.join(str(exc).split())}", file=sys.stderr, flush=True)
        code = 2
    sys.exit(code)


if __name__ == "__main__":
    main()
