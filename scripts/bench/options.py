"""The benchmark's command line, defined once.

Every flag that more than one workload takes lives in ``SHARED`` (its name, type, unit and help);
a workload's parser picks the ones it needs, with its own default where that differs, and adds
only what is its own. The serving workload's flags are here too (``serving_parser``): the engine
and cluster knobs among them are generated from the config dataclasses, as `splitserve launch`'s
are, so the two can never disagree on a default or a meaning.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from procs.config_flags import add_cluster_flags, add_engine_flags

BASE_MODES = ("inproc", "inproc-pretok", "cluster")
# The cluster knobs the serving workload takes (the engine's: all of them).
CLUSTER_KNOBS = ("tokenizer_threads", "tokenizer_batch_max", "stream_interval_tokens")


def int_list(text: str) -> list[int]:
    """'1,8,32' -> [1, 8, 32]: positive integers separated by commas."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected integers separated by commas, got {text!r}"
        ) from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def text_list(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


# name -> (flag, default, help, more argparse keywords); "%(default)s" shows each workload's own.
SHARED: dict[str, tuple[str, Any, str, dict[str, Any]]] = {
    "model": (
        "--model",
        None,
        "a local Hugging Face model directory (default: SmolLM2-135M-Instruct, provisioned on "
        "first use)",
        dict(metavar="PATH"),
    ),
    "repeats": (
        "--repeats",
        3,
        "measured runs of every compared case, interleaved (the order rotates each repeat, so "
        "machine drift hits all alike) (default: %(default)s)",
        dict(type=int),
    ),
    "json": (
        "--json",
        None,
        "also write every figure (and per-request records where there are) here",
        dict(dest="json_path", metavar="PATH"),
    ),
}


def add_shared(group: Any, *names: str, **defaults: Any) -> None:
    """The named SHARED flags on ``group``; ``defaults`` overrides a flag's default by name."""
    for name in names:
        flag, default, text, more = SHARED[name]
        kwargs = dict(dest=name, default=defaults.get(name, default), help=text) | more
        group.add_argument(flag, **kwargs)


def parse_checked(
    parser: argparse.ArgumentParser, argv: list[str] | None, check: Callable[[Any], None]
) -> argparse.Namespace:
    """``argv`` parsed; a ValueError from ``check(args)`` is a usage error (its message, exit 2)."""
    args = parser.parse_args(argv)
    try:
        check(args)
    except ValueError as exc:
        parser.error(str(exc))
    return args


def workload_parser(workload: str, description: str | None) -> argparse.ArgumentParser:
    return argparse.ArgumentParser(
        prog=f"python -m scripts.bench {workload}",
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def add_parts(p: argparse.ArgumentParser, parts: list[str], default: list[str]) -> None:
    """The positional list of a workload's parts to run (``args.workloads``)."""

    def part(text: str) -> str:
        if text not in parts:
            raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(parts)}")
        return text

    p.add_argument(
        "workloads",
        nargs="*",
        type=part,
        default=default,
        metavar="PART",
        help=f"what to run, any of: {', '.join(parts)} (default: {' '.join(default)})",
    )


def require_positive(args: argparse.Namespace, *names: str) -> None:
    """Counts that argparse takes as plain ints but that must be at least 1."""
    for name in names:
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1")


# --- the serving workload ------------------------------------------------------------------------
def serving_parser(description: str | None = None) -> argparse.ArgumentParser:
    p = workload_parser("serving", description)
    _what_is_compared(p.add_argument_group("what is compared"))
    _workload(p.add_argument_group("workload"))
    _arrival(p.add_argument_group("arrival (default: a burst, every request at once)"))
    add_engine_flags(
        p.add_argument_group("engine (the same for every mode)"),
        help_overrides={
            "engine_threads": "torch threads of the engine in every mode (0: the cluster "
            "supervisor's budget for each cluster mode, and the same count for "
            "inproc)",
            "kv_cache_tokens": "KV cache capacity in tokens of each engine (0: twice what "
            "--max-batch-size requests of the workload's longest length need)",
        },
    )
    _runs(p.add_argument_group("runs and output"))
    return p


def _what_is_compared(g: Any) -> None:
    add_shared(g, "model")
    g.add_argument(
        "--fast-engine",
        action="store_true",
        help="instead of --model, a small random-weight Llama model (2 layers, hidden "
        "size 64) with the default model's tokenizer, whose steps cost "
        "milliseconds: tokenization is then as large a share of TTFT as in front "
        "of a GPU engine; prints the measured tokenize/prefill ratio",
    )
    g.add_argument(
        "--modes",
        default="inproc,inproc-pretok,cluster",
        help="comma-separated modes: inproc, inproc-pretok, cluster (or cluster-twN); the "
        "first is the baseline of the ratios (default: %(default)s)",
    )
    g.add_argument(
        "--tokenizer-workers",
        type=int_list,
        default=[1],
        help="tokenizer worker processes of the cluster; a list (1,2,4) sweeps, one "
        "mode each: cluster-tw1, cluster-tw2, ... (default: 1)",
    )
    add_cluster_flags(g, CLUSTER_KNOBS)


def _workload(g: Any) -> None:
    g.add_argument("--num-requests", type=int, default=256, help="requests per run")
    g.add_argument("--prompt-tokens", type=int, default=256, help="each prompt's length, tokens")
    g.add_argument(
        "--unique-prompts",
        action="store_true",
        help="every request its own prompt (default: all the same one, shared by the cache)",
    )
    g.add_argument(
        "--shared-prefix-tokens",
        type=int,
        default=0,
        help="every prompt starts with the same text this many tokens long (a system prompt), "
        "then --prompt-tokens of its own",
    )
    g.add_argument("--max-new-tokens", type=int, default=16, help="tokens to generate per request")
    g.add_argument("--ignore-eos", action="store_true", help="every request makes them all")
    g.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: 0)")
    g.add_argument("--seed", type=int, default=0, help="seed of prompts and arrival gaps")


def _arrival(g: Any) -> None:
    g.add_argument(
        "--request-rate",
        default="inf",
        metavar="RPS[,RPS...]",
        help="Poisson arrivals at this many requests per second (default: inf, a burst); a "
        "list (2,4,8) sweeps the rates and reports the highest rate each mode sustains",
    )
    g.add_argument(
        "--duration-s",
        type=float,
        default=0.0,
        help="with a finite --request-rate: each run sends rate x this many seconds of requests "
        "(at least 10) instead of --num-requests",
    )
    g.add_argument(
        "--slo-ttft-p99-ms",
        type=float,
        default=500.0,
        help="a rate sweep's SLO: a mode sustains a rate when TTFT p99 (from the planned "
        "arrival) stays within it, every request succeeds and requests complete at >= 95%% of "
        "the rate they arrive (default: %(default)s)",
    )
    g.add_argument(
        "--max-concurrency",
        type=int,
        default=0,
        help="at most this many requests in flight; submit waits for a slot (0: unlimited)",
    )


def _runs(g: Any) -> None:
    g.add_argument(
        "--warmup-runs", type=int, default=1, help="unreported runs per mode first (default: 1)"
    )
    g.add_argument(
        "--warmup-num-requests",
        type=int,
        default=16,
        help="requests in a warmup run: the first this many of the workload; it "
        "warms kernels and caches, it need not be the whole workload (default: 16)",
    )
    add_shared(g, "repeats", repeats=1)
    g.add_argument(
        "--request-timeout-s",
        type=float,
        default=600.0,
        help="after the last submit, give up on unfinished requests after this long",
    )
    add_shared(g, "json")
