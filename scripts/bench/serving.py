"""serving: splitserve's cluster against a single-process baseline, one workload (the commands and
figures: docs/benchmarks.md).

Modes (compared in one invocation, runs interleaved so machine drift hits all alike):
  inproc          one process; submit() tokenizes in the caller's thread, an engine thread steps
                  the Engine and detokenizes (the seeds' roseinfer with pretok off)
  inproc-pretok   the same server, prompts tokenized before the timed region
  cluster         splitserve: tokenizer worker processes, one engine process, a detokenizer
                  process, driven through the client SDK; --tokenizer-workers 1,2 sweeps
                  (modes cluster-tw1, cluster-tw2)
A list of --request-rate values sweeps open-loop Poisson arrivals and reports the highest rate
each mode sustains; --fast-engine swaps the model for one whose steps cost milliseconds, so
tokenization weighs in TTFT as it does in front of a GPU (scripts/bench/fast_engine.py).
Every mode keeps one server for all its runs; each run's prompts carry a run tag at their start
so no run is served from the prefix cache of an earlier one.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
from pathlib import Path

from ipc.messages import SamplingParams
from procs.config_flags import ENGINE_KNOBS, knob_values
from scripts.bench import report
from scripts.bench.fast_engine import (
    FAST_ENGINE_HIDDEN_SIZE,
    FAST_ENGINE_LAYERS,
    calibrate,
    fast_engine_model,
)
from scripts.bench.interleave import rotated
from scripts.bench.options import BASE_MODES, CLUSTER_KNOBS, serving_parser
from scripts.bench.runner import EventCollector, RunOptions, run_once
from scripts.bench.stats import median_summary, summarize
from scripts.bench.sweep import parse_rates, requests_at, sweep_lines
from scripts.bench.workloads import ArrivalSpec, WorkloadSpec, build_workload, salt_requests


def build_parser():
    return serving_parser(__doc__)


def expand_modes(modes_text: str, tokenizer_workers: list[int]) -> list[str]:
    modes: list[str] = []
    for mode in (m.strip() for m in modes_text.split(",") if m.strip()):
        if mode == "cluster":
            modes += [f"cluster-tw{n}" for n in tokenizer_workers]
        elif mode in BASE_MODES or (
            mode.startswith("cluster-tw") and mode[10:].isdigit() and int(mode[10:]) >= 1
        ):
            modes.append(mode)
        else:
            raise ValueError(f"unknown mode {mode!r} (known: {', '.join(BASE_MODES)}, cluster-twN)")
    if not modes or len(set(modes)) != len(modes):
        raise ValueError(f"--modes must name each mode once, got {modes}")
    return modes


def engine_knobs(args: argparse.Namespace, tokenizer_workers: int) -> dict:
    """The engine's knobs, the same in every mode but its torch threads: the flag's, else what
    the supervisor budgets an engine beside ``tokenizer_workers``."""
    from procs.thread_budget import thread_budget

    budget = thread_budget(
        tokenizer_workers,
        engine_threads=args.engine_threads,
        tokenizer_threads=args.tokenizer_threads,
    )
    return knob_values(args, ENGINE_KNOBS) | {"engine_threads": budget[0]}


def workload_kv_tokens(args: argparse.Namespace, requests, tokenizer) -> int:
    """A KV pool sized for this workload: every decode slot holding the longest request, twice
    over (room for the prefix cache). The engine's own CPU default sizes from free memory, and
    several engines at once (one per mode) would then take most of the machine."""
    longest_prompt = max(len(tokenizer.encode(r.prompt).ids) for r in requests)
    longest = longest_prompt + 64 + max(r.max_tokens for r in requests)  # 64: run tag, template
    tokens = 2 * min(args.max_batch_size, len(requests)) * longest
    return -(-tokens // args.block_size) * args.block_size


def inproc_engine_config(args: argparse.Namespace, model_path: str):
    from ipc.engine_config import EngineConfig

    return EngineConfig(model_path=model_path, **engine_knobs(args, 1))


def make_systems(
    modes: list[str],
    args: argparse.Namespace,
    model_path: str,
    collector: EventCollector,
    stack: contextlib.ExitStack,
) -> dict:
    """One system under test per mode; the inproc modes share one in-process server."""
    from scripts.bench.systems import ClusterSystem, InprocServer, InprocSystem

    systems, server = {}, None
    for mode in modes:
        if mode.startswith("cluster-tw"):
            workers = int(mode[len("cluster-tw") :])
            knobs = engine_knobs(args, workers) | knob_values(args, CLUSTER_KNOBS)
            poll_s = 0.001 if args.max_concurrency else 0.02
            systems[mode] = ClusterSystem(mode, model_path, workers, knobs, collector, poll_s)
        else:
            if server is None:
                server = InprocServer(
                    inproc_engine_config(args, model_path),
                    collector.deliver,
                    stream_interval_tokens=args.stream_interval_tokens,
                )
                stack.callback(server.close)
            systems[mode] = InprocSystem(mode, server, collector, pretok=mode == "inproc-pretok")
        stack.callback(systems[mode].close)
    return systems


def describe_setup(
    args: argparse.Namespace,
    model_path: str,
    modes: list[str],
    workload: WorkloadSpec,
    arrival: ArrivalSpec,
    systems: dict,
    kv_auto: bool,
) -> dict:
    from procs.thread_budget import available_cpus

    w = workload
    prompts = f"synthetic, ~{w.prompt_tokens} tokens"
    if w.shared_prefix_tokens:
        prompts = f"a shared prefix of ~{w.shared_prefix_tokens} tokens + {prompts} of its own"
    return {
        "Model": model_path,
        "Host CPUs": available_cpus(),
        "Modes": ", ".join(modes),
        "Mode details": {
            m: "; ".join(f"{k} {v}" for k, v in t.describe().items()) for m, t in systems.items()
        },
        "Requests": w.num_requests,
        "Prompts": prompts,
        "Unique prompts": w.unique_prompts or w.shared_prefix_tokens > 0,
        "Max new tokens": w.max_new_tokens,
        "Ignore EOS": args.ignore_eos,
        "Temperature": args.temperature,
        "Arrival": arrival.describe(),
        "Max concurrency": args.max_concurrency or "unlimited",
        # Every engine knob as given (the threads each mode got: in "Mode details").
        "Engine": knob_values(args, ENGINE_KNOBS)
        | {"kv_cache_tokens": f"{args.kv_cache_tokens}" + (" (sized for this workload)" * kv_auto)},
        "Stream interval (tokens)": args.stream_interval_tokens,
        "Runs": f"{args.warmup_runs} warmup (of {min(args.warmup_num_requests, w.num_requests)} "
        f"requests) + {args.repeats} measured per mode, interleaved; "
        "medians reported; a run tag opens every prompt; "
        "driver GC paused while submitting",
    }


def run_benchmark(args: argparse.Namespace) -> dict:
    """Everything but printing; returns the JSON document (also what the tests inspect)."""
    from tokenizers import Tokenizer

    from procs.model_store import resolve_model

    if args.fast_engine and args.model:
        raise ValueError("give either --model or --fast-engine, not both")
    modes = expand_modes(args.modes, args.tokenizer_workers)
    rates = parse_rates(args.request_rate)
    counts = {rate: requests_at(rate, args.duration_s, args.num_requests) for rate in rates}
    workload = WorkloadSpec(
        num_requests=max(counts.values()),
        max_new_tokens=args.max_new_tokens,
        prompt_tokens=args.prompt_tokens,
        unique_prompts=args.unique_prompts,
        shared_prefix_tokens=args.shared_prefix_tokens,
        seed=args.seed,
    )
    arrival = ArrivalSpec(request_rate=rates[0], seed=args.seed)
    if args.warmup_runs < 0 or args.repeats < 1 or args.warmup_num_requests < 1:
        raise ValueError("--warmup-runs must be >= 0, --repeats and --warmup-num-requests >= 1")
    collector = EventCollector()
    with contextlib.ExitStack() as stack:
        model_path = (
            fast_engine_model(stack) if args.fast_engine else str(resolve_model(args.model))
        )
        tokenizer = Tokenizer.from_file(str(Path(model_path) / "tokenizer.json"))
        requests = build_workload(workload, tokenizer)
        kv_auto = args.kv_cache_tokens == 0
        if kv_auto:
            args.kv_cache_tokens = workload_kv_tokens(args, requests, tokenizer)
        calibration = (
            calibrate(inproc_engine_config(args, model_path), requests)
            if args.fast_engine
            else None
        )
        systems = make_systems(modes, args, model_path, collector, stack)
        runs, summaries = _run_rounds(args, modes, systems, collector, requests, arrival, counts)
        setup = describe_setup(args, model_path, modes, workload, arrival, systems, kv_auto)
    if calibration is not None:
        setup["Fast engine"] = (
            f"{FAST_ENGINE_LAYERS} layers, hidden size "
            f"{FAST_ENGINE_HIDDEN_SIZE}, random weights; " + calibration
        )
    return _document(args, modes, counts, setup, runs, summaries, arrival.kind)


def _document(args, modes, counts, setup, runs, summaries, arrival_kind: str) -> dict:
    """The JSON document with its text: each mode's medians, at each rate of a sweep."""
    measured = [(r, s) for r, s in zip(runs, summaries) if not r.warmup]
    sweep = {
        mode: {
            rate: median_summary(
                [s for r, s in measured if (r.mode, r.request_rate) == (mode, rate)]
            )
            for rate in counts
        }
        for mode in modes
    }
    if len(counts) == 1:
        (rate,) = counts
        medians = {mode: by_rate[rate] for mode, by_rate in sweep.items()}
        data = report.to_json(setup, runs, summaries, medians)
        data["text"] = report.render(setup, runs, medians, args.repeats, arrival_kind, modes[0])
        return data
    setup["Arrival"] = f"Poisson at each of {', '.join(f'{r:g}' for r in counts)} req/s"
    setup["Requests"] = ", ".join(f"{n} at {r:g} req/s" for r, n in counts.items())
    data = report.to_json(setup, runs, summaries, {})
    data["sweep"] = {m: {f"{r:g}": s for r, s in by_rate.items()} for m, by_rate in sweep.items()}
    data["text"] = "\n".join(
        report.header_lines(setup) + [""] + sweep_lines(sweep, args.slo_ttft_p99_ms)
    )
    return data


def _run_rounds(args, modes, systems, collector, requests, arrival, counts):
    """Warmup rounds (the first rate), then measured rounds: each round every rate, each rate
    every mode, interleaved so machine drift hits all alike (the modes' order rotates each
    measured round)."""
    options = RunOptions(args.max_concurrency, args.request_timeout_s)

    def sampling_for(request) -> SamplingParams:
        return SamplingParams(
            max_tokens=request.max_tokens,
            temperature=args.temperature,
            ignore_eos=args.ignore_eos,
            seed=args.seed,
        )

    runs, summaries = [], []
    rates = sorted(counts)
    for round_index in range(args.warmup_runs + args.repeats):
        warmup = round_index < args.warmup_runs
        order = modes if warmup else rotated(modes, round_index - args.warmup_runs)
        for rate in rates[:1] if warmup else rates:
            batch = requests[: args.warmup_num_requests] if warmup else requests[: counts[rate]]
            for mode in order:
                run_index = len(runs)
                # The same tag length in every run keeps prompt lengths identical across modes.
                tagged = salt_requests(batch, f"run {run_index:04d}")
                result = run_once(
                    systems[mode],
                    collector,
                    tagged,
                    dataclasses.replace(arrival, request_rate=rate),
                    sampling_for,
                    options,
                    mode=mode,
                    run_index=run_index,
                    warmup=warmup,
                )
                runs.append(result)
                summaries.append(summarize(result.records, result.cpu_seconds))
    return runs, summaries


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    data = run_benchmark(args)
    print(data["text"], flush=True)
    if args.json_path:
        report.write_json(args.json_path, data)
        print(f"wrote {args.json_path}")
    return data
