"""The ``splitserve`` command.

    splitserve chat "What is the capital of France?"   # start, stream one answer, stop
    splitserve launch --tokenizer-workers 2             # serve until SIGINT/SIGTERM
    splitserve generate "Once upon a time" "The sky"    # raw prompts, one answer each
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from pathlib import Path

from ipc.config import RESTART_POLICIES, TRANSPORTS, WEIGHTS
from procs.launch_cluster import Cluster, launch_cluster, make_config

logger = logging.getLogger("splitserve.cli")


def add_cluster_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("cluster")
    g.add_argument("--model", default=None, metavar="PATH",
                   help="a local Hugging Face checkpoint directory (Llama family); default: "
                        "SmolLM2-135M-Instruct, provisioned automatically on first use")
    g.add_argument("--tokenizer-workers", type=int, default=1, metavar="N",
                   help="tokenizer processes; clients spread submits over them (default 1)")
    g.add_argument("--engine-threads", type=int, default=0, metavar="N",
                   help="torch intra-op threads in the engine; 0 = decide from the cores, "
                        "leaving room for tokenizers and the detokenizer (default 0)")
    g.add_argument("--tokenizer-threads", type=int, default=0, metavar="N",
                   help="threads of the tokenizers library per tokenizer worker; 0 = 1")
    g.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="where the engine runs (auto: CUDA when present)")
    g.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                   help="activations and KV cache; auto: bf16 on CUDA, and on a CPU with native "
                        "bf16 (AVX512-BF16 or AMX), float32 on other CPUs (default auto)")
    g.add_argument("--weights", default="auto", choices=WEIGHTS,
                   help="linear layers' weights. auto: the checkpoint's own precision (a GGUF's "
                        "Q4_0/Q4_1 blocks on the int4 kernel, Q8_0 as int8, dense tensors in "
                        "--dtype); bf16, fp32: dense; int8: per-channel int8; int4: group-32 "
                        "int4 (lm_head included). Quantized layers serve small steps (decode, "
                        "reading 2-4x fewer bytes) and keep a dense copy for large ones "
                        "(prefill) when memory allows; int8/int4 run on CPU only (default auto)")
    g.add_argument("--max-batch-size", type=int, default=32, metavar="REQUESTS",
                   help="most requests decoded together in one engine step (default 32)")
    g.add_argument("--prefill-max-batch-size", type=int, default=32, metavar="REQUESTS",
                   help="most requests admitted to prefill in one step (default 32)")
    g.add_argument("--prefill-max-tokens", type=int, default=4096, metavar="TOKENS",
                   help="most prompt tokens computed in one step (default 4096)")
    g.add_argument("--prefill-chunk-tokens", type=int, default=2048, metavar="TOKENS",
                   help="long prompts are prefilled in chunks of this many tokens (default 2048)")
    g.add_argument("--kv-cache-tokens", type=int, default=0, metavar="TOKENS",
                   help="KV cache capacity in tokens; 0 = derive from memory (default 0)")
    g.add_argument("--block-size", type=int, default=16, metavar="TOKENS",
                   help="tokens per KV cache block (default 16)")
    g.add_argument("--max-model-len", type=int, default=0, metavar="TOKENS",
                   help="context length (prompt + output); 0 = the model's own (default 0)")
    g.add_argument("--no-prefix-cache", action="store_true",
                   help="disable sharing KV blocks between requests with equal prompt prefixes")
    g.add_argument("--max-waiting-requests", type=int, default=4096, metavar="REQUESTS",
                   help="engine queue bound; beyond it requests fail with 'overloaded'")
    g.add_argument("--stream-interval-tokens", type=int, default=1, metavar="TOKENS",
                   help="send a text delta every this many tokens (the first at once)")
    g.add_argument("--transport", default="ipc", choices=TRANSPORTS,
                   help="ipc: unix sockets in the run dir; tcp: loopback ports from --port")
    g.add_argument("--port", type=int, default=0, metavar="PORT",
                   help="with --transport tcp: the client port; internal ports follow it")
    g.add_argument("--listen", default=None, metavar="HOST",
                   help="serve clients over tcp on HOST (e.g. 0.0.0.0; needs --port). Beyond "
                        "loopback, ZeroMQ CURVE is switched on: the supervisor generates a key "
                        "pair and prints the public key clients must pass (server_public_key=); "
                        "internal sockets stay on loopback. Default: ipc/loopback only")
    g.add_argument("--require-curve", action="store_true",
                   help="use CURVE even on loopback/ipc (the public key is printed the same way)")
    g.add_argument("--run-dir", default=None, metavar="DIR",
                   help="where sockets and cluster.json live (default: a fresh private temp dir)")
    h = p.add_argument_group("OpenAI-compatible HTTP frontend")
    h.add_argument("--http-port", type=int, default=None, metavar="PORT",
                   help="serve the OpenAI API on this port (0: any free port); default: no "
                        "HTTP frontend")
    h.add_argument("--http-host", default="127.0.0.1", metavar="HOST",
                   help="address the frontend listens on; anything but loopback needs "
                        "--api-key (default 127.0.0.1)")
    h.add_argument("--http-workers", type=int, default=1, metavar="N",
                   help="frontend processes sharing the port (default 1)")
    h.add_argument("--api-key", default=os.environ.get("SPLITSERVE_API_KEY", ""), metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: "
                        "$SPLITSERVE_API_KEY, or none)")
    g.add_argument("--start-timeout-s", type=float, default=180.0, metavar="SECONDS",
                   help="give up if the processes are not ready within this (default 180)")
    f = p.add_argument_group("faults")
    f.add_argument("--restart-policy", choices=RESTART_POLICIES, default="restart",
                   help="when a worker process dies: restart it (its in-flight requests end with "
                        "an 'unavailable' error) or shut the cluster down (default restart)")
    f.add_argument("--max-restarts", type=int, default=5, metavar="N",
                   help="restarts per worker before the cluster shuts down instead (default 5)")
    f.add_argument("--hang-timeout-s", type=float, default=0.0, metavar="SECONDS",
                   help="kill and handle as dead a worker silent this long; keep it above the "
                        "longest prefill step (default 0: never)")


def cluster_kwargs(args: argparse.Namespace) -> dict:
    return dict(
        tokenizer_workers=args.tokenizer_workers, engine_threads=args.engine_threads,
        tokenizer_threads=args.tokenizer_threads, device=args.device, dtype=args.dtype,
        weights=args.weights,
        max_batch_size=args.max_batch_size, prefill_max_batch_size=args.prefill_max_batch_size,
        prefill_max_tokens=args.prefill_max_tokens, prefill_chunk_tokens=args.prefill_chunk_tokens,
        kv_cache_tokens=args.kv_cache_tokens, block_size=args.block_size,
        max_model_len=args.max_model_len, enable_prefix_cache=not args.no_prefix_cache,
        max_waiting_requests=args.max_waiting_requests,
        stream_interval_tokens=args.stream_interval_tokens, base_port=args.port,
        require_curve=args.require_curve, restart_policy=args.restart_policy,
        max_restarts=args.max_restarts, hang_timeout_s=args.hang_timeout_s,
        **listen_kwargs(args), **http_kwargs(args))


def listen_kwargs(args: argparse.Namespace) -> dict:
    if args.listen is None:
        return dict(transport=args.transport)
    if not args.port:
        raise SystemExit("--listen needs --port (the client port; the others follow it)")
    return dict(transport="tcp", host=args.listen)


def http_kwargs(args: argparse.Namespace) -> dict:
    if getattr(args, "http_port", None) is None:
        return {}
    return dict(http_port=args.http_port, http_host=args.http_host,
                http_workers=args.http_workers, http_api_key=args.api_key)


def cmd_launch(args: argparse.Namespace) -> int:
    stop = threading.Event()
    started = False

    def on_signal(signum: int, _frame: object) -> None:
        if not started:
            raise KeyboardInterrupt  # unwinds start-up, which stops what it started
        stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    config, owns = make_config(args.model, args.run_dir, **cluster_kwargs(args))
    try:
        cluster = Cluster.start(config, owns_run_dir=owns, start_timeout_s=args.start_timeout_s)
    except KeyboardInterrupt:
        return 130
    started = True
    print(f"splitserve serving {cluster.config.model_name} at {cluster.client_addr}", flush=True)
    print(f"client address: {cluster.client_addr}", flush=True)
    if cluster.curve_public_key:
        print(f"curve public key: {cluster.curve_public_key} (also in "
              f"{cluster.config.run_dir}/curve_public.key; clients pass it as "
              "server_public_key=)", flush=True)
    if cluster.http_url:
        print(f"OpenAI API: {cluster.http_url}/v1 ({cluster.config.http_workers} frontend(s))",
              flush=True)
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


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=256, metavar="TOKENS",
                   help="most tokens to generate (default 256)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy (default 0)")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="a stop string (repeatable)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (default 1: off)")
    p.add_argument("--top-k", type=int, default=0, help="top-k sampling (default 0: off)")
    p.add_argument("--seed", type=int, default=None, help="seed for a reproducible sample")
    p.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="penalize tokens already in the prompt or output (default 1: off)")


def _sampling_kwargs(args: argparse.Namespace) -> dict:
    return {"max_tokens": args.max_tokens, "temperature": args.temperature, "stop": args.stop,
            "top_p": args.top_p, "top_k": args.top_k, "seed": args.seed,
            "repetition_penalty": args.repetition_penalty}


def cmd_chat(args: argparse.Namespace) -> int:
    from ipc.client import Client, SplitserveError

    messages = ([{"role": "system", "content": args.system}] if args.system else [])
    messages.append({"role": "user", "content": args.prompt})
    with launch_cluster(args.model, run_dir=args.run_dir, start_timeout_s=args.start_timeout_s,
                        **cluster_kwargs(args)) as cluster, Client(
            cluster.client_addr, server_public_key=cluster.curve_public_key) as client:
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
    from ipc.client import Client, SplitserveError

    with launch_cluster(args.model, run_dir=args.run_dir, start_timeout_s=args.start_timeout_s,
                        **cluster_kwargs(args)) as cluster, Client(
            cluster.client_addr, server_public_key=cluster.curve_public_key) as client:
        try:
            results = client.generate(args.prompts, check=False, **_sampling_kwargs(args))
        except SplitserveError as exc:  # bad sampling values, refused before anything is sent
            print(f"error: {exc}", file=sys.stderr)
            return 1
        for prompt, r in zip(args.prompts, results):
            tail = f" [{r.finish_reason}{': ' + r.error if r.error else ''}]"
            print(f"{prompt!r} -> {r.text!r}{tail}", flush=True)
    return 0 if all(r.ok for r in results) else 1


def run_bench(argv: list[str]) -> int:
    """``splitserve bench ...`` is scripts/bench_serving.py (it lives with the other benchmarks
    in a source checkout, which an editable install keeps at hand)."""
    scripts = Path(__file__).resolve().parents[1] / "scripts"
    if not (scripts / "bench_serving.py").is_file():
        print(f"splitserve bench needs a source checkout: {scripts}/bench_serving.py is missing",
              file=sys.stderr)
        return 2
    if str(scripts) not in sys.path:
        sys.path.insert(0, str(scripts))
    import bench_serving

    bench_serving.main(argv)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="splitserve", description="LLM serving with tokenization and detokenization in "
        "their own processes.")
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
    sub.add_parser("bench", add_help=False,
                   help="the serving benchmark: inproc vs cluster, submit wall and TTFT "
                        "(splitserve bench --help for its options)")
    return parser


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:
        sys.exit(run_bench(argv[1:]))
    args = build_parser().parse_args(argv)
    quiet = args.command in ("chat", "generate")
    os.environ.setdefault("SPLITSERVE_LOG_LEVEL", "WARNING" if quiet else "INFO")
    logging.basicConfig(level=os.environ["SPLITSERVE_LOG_LEVEL"],
                        format="%(asctime)s supervisor %(levelname)s %(name)s: %(message)s")
    sys.exit(args.run(args))


if __name__ == "__main__":
    main()
