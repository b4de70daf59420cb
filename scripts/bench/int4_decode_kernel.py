"""Our int4 decode kernel (engine_worker/int4_decode.py) against aten's int4 kernel on the
default model's own weights and decode inputs.

    python -m scripts.bench.int4_decode_kernel [--repeats 15] [--passes 4] [--only-engine]

Needs the op built (``python -m engine_worker.int4_decode``; scripts/setup_env.sh does it).

Loads the engine (2 threads), records every int4 layer's decode-row inputs over a few steps of
4 greedy requests, then: accuracy of both kernels against float32 of the same weights; whether
our rows depend on the other rows or the thread count; and times, interleaved, of a pass over
all 120 layer linears (cycled, so their 66 MB come from memory) and of the head, at 1, 2, 4 and
8 rows, on 2 and 1 threads (medians; `uptime` beside each table). First the engine's batch-1
decode rate with each kernel (``int4_kernel`` aten / own: scripted step, as served, and eager),
interleaved on one engine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import cast

import torch

from engine_worker import int4_decode
from engine_worker.engine import Engine
from engine_worker.linear import BatchSizeSwitch, Int4Groups, Int4Linear, dequantize
from engine_worker.scripted_decode import ScriptedDecode
from ipc.engine_config import EngineConfig
from procs.model_store import resolve_model
from scripts.bench.engine_runs import decode_run
from tests.engine_worker.int4_ctypes import (
    apply_ctypes,  # the ctypes reference lives with the tests
)

ROWS = (1, 2, 4, 8)
THREADS = (2, 1)


def load_engine() -> Engine:
    config = EngineConfig(
        model_path=str(resolve_model(None)),
        engine_threads=2,
        dtype="auto",
        weights="auto",
        adaptive_threads=False,
    )
    return Engine(config)


def int4_switches(engine: Engine) -> list[BatchSizeSwitch]:
    """The 120 layer linears in forward order, then the head (two int4 planes): each an int4
    copy for decode rows beside a dense one."""
    model = engine.runner.model
    names = ("qkv", "o_proj", "gate_up", "down")
    switches = [getattr(layer, name) for layer in model.layers for name in names]
    switches.append(model.lm_head)
    for switch in switches:
        if not isinstance(switch, BatchSizeSwitch) or not isinstance(switch.quantized, Int4Linear):
            raise TypeError(f"expected an int4 BatchSizeSwitch, got {switch!r}")
    return switches


class Recorder:
    """Stands in for a layer's int4 weights and keeps the rows it is applied to."""

    def __init__(self, layer: Int4Linear) -> None:
        self.layer, self.rows = layer, list[torch.Tensor]()
        self.out_features = layer.out_features

    def apply(self, x, decode_rows=0, decode_batch=None):
        self.rows.append(x.clone())
        return self.layer.apply(x)


def record_inputs(engine: Engine, owners: list, steps: int) -> list:
    """Decode-row inputs [R, K] of each int4 layer over ``steps`` steps of 4 requests
    (the head takes its int4 planes for at most 4)."""
    model = engine.runner.model
    scripted = model.scripted_decode
    model.scripted_decode = None  # the Python forward, so that every apply goes through here
    recorders = [Recorder(owner.quantized) for owner in owners]
    for owner, recorder in zip(owners, recorders):
        owner.quantized = recorder
    prompts = [[1 + 37 * i + j for j in range(24 + 5 * i)] for i in range(4)]
    decode_run(engine, prompts, steps)
    for owner, recorder in zip(owners, recorders):
        owner.quantized = recorder.layer
    model.scripted_decode = scripted
    # the head sees the prompts' last rows too; keep the decode steps' rows alone (the last ones)
    return [torch.cat(r.rows[-steps:]) for r in recorders]


def groups_of(layer: Int4Linear) -> Int4Groups:
    """The q, scale and zero an aten ``Int4Linear`` computes with (its planes side by side along
    K): q read back through the aten kernel itself, with scale 1 and zero 8 on identity rows."""
    scale_zero = layer.scale_zero  # [K / group, N, 2]
    k = scale_zero.shape[0] * layer.group
    unit = torch.empty_like(scale_zero)
    unit[..., 0], unit[..., 1] = 1, 8
    eye = torch.eye(k, dtype=scale_zero.dtype)
    q = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, layer.packed, layer.group, unit)
    scale, zero = scale_zero.float().permute(2, 1, 0)
    return Int4Groups(q.t().to(torch.uint8).contiguous(), scale.contiguous(), zero.contiguous())


def ours_of(layer: Int4Linear) -> Int4Linear:
    """The layer on our kernel (``int4_kernel="own"`` builds it from the checkpoint; here from
    the loaded aten layer, so that one engine holds both)."""
    whole, parts = groups_of(layer), layer.parts
    k, groups = whole.q.shape[1] // parts, whole.scale.shape[1] // parts
    planes = [
        Int4Groups(
            whole.q[:, i * k : (i + 1) * k],
            whole.scale[:, i * groups : (i + 1) * groups],
            whole.zero[:, i * groups : (i + 1) * groups],
        )
        for i in range(parts)
    ]
    return Int4Linear(planes, torch.bfloat16, layer.bias, int4_decode.pack(planes))


def error_of(y: torch.Tensor, reference: torch.Tensor) -> tuple[float, float]:
    diff = y.float() - reference
    return diff.abs().max().item(), (diff.norm() / reference.norm()).item()


def accuracy(layers: list[Int4Linear], ours: list[Int4Linear], inputs: list) -> None:
    """Worst max-abs and relative (Frobenius) error over all layers, each kernel's output
    against float32 of the same weights and the same bf16 inputs."""
    worst: dict[str, list[float]] = {}
    for i, (layer, x) in enumerate(zip(layers, inputs)):
        weight = dequantize(groups_of(layer))
        xs = x if layer.parts == 1 else x.repeat(1, layer.parts)
        reference = xs.float() @ weight.t()
        outputs = {
            "aten (bf16 out)": layer.apply(x),
            "float32 rounded to bf16": reference.bfloat16(),
        }
        outputs["ours (bf16 out)"] = ours[i].apply(x)
        outputs["ours (fp32 sums)"] = apply_ctypes(ours[i].packed, x, layer.parts, True)
        for name, y in outputs.items():
            err = error_of(y, reference)
            prev = worst.setdefault(name, [0.0, 0.0])
            worst[name] = [max(prev[0], err[0]), max(prev[1], err[1])]
    for name, (max_abs, rel) in worst.items():
        print(f"  {name:26s} max abs {max_abs:.3g}  worst relative {rel:.3g}")


def check_rows_alone(ours: list[Int4Linear], inputs: list) -> bool:
    """A row's output is bitwise the same alone, among 8 rows, and on 1 or 2 threads."""
    same = True
    for mine, x in zip(ours, inputs):
        x = x[:8]
        for threads in THREADS:
            torch.set_num_threads(threads)
            together = mine.apply(x)
            alone = torch.cat([mine.apply(x[i : i + 1]) for i in range(len(x))])
            three = torch.cat([mine.apply(x[:3]), mine.apply(x[3:])])
            same &= torch.equal(together, alone) and torch.equal(together, three)
            if threads == THREADS[0]:
                first = together
            same &= torch.equal(first, together)
    torch.set_num_threads(THREADS[0])
    return same


def pass_seconds(apply_fns: list, inputs: list, rows: int, passes: int) -> float:
    xs = [x[:rows].contiguous() for x in inputs]
    start = time.perf_counter()
    for _ in range(passes):
        for apply, x in zip(apply_fns, xs):
            apply(x)
    return (time.perf_counter() - start) / passes


def uptime() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load {one:.2f} {five:.2f} {fifteen:.2f}"


def token_pass(kernels: list, inputs: list, rows: int, passes: int) -> tuple[float, float]:
    """Seconds per pass of the 120 layer linears and of the head after them (the head's
    weights thus come from memory too)."""
    xs = [x[:rows].contiguous() for x in inputs]
    layers, head = 0.0, 0.0
    for _ in range(passes):
        start = time.perf_counter()
        for kernel, x in zip(kernels[:-1], xs):
            kernel(x)
        middle = time.perf_counter()
        kernels[-1](xs[-1])
        head += time.perf_counter() - middle
        layers += middle - start
    return layers / passes, head / passes


def timings(kernels: dict[str, list], inputs: list, repeats: int, passes: int) -> dict:
    """Seconds of ``repeats`` runs of each (threads, rows, kernel, part), kernels interleaved."""
    samples: dict[tuple, list[float]] = {}
    for repeat in range(repeats):
        for threads in THREADS:
            torch.set_num_threads(threads)
            for rows in ROWS:
                names = list(kernels) if repeat % 2 else list(kernels)[::-1]
                for name in names:
                    layers, head = token_pass(kernels[name], inputs, rows, passes)
                    samples.setdefault((threads, rows, name, "layers"), []).append(layers)
                    samples.setdefault((threads, rows, name, "head"), []).append(head)
    torch.set_num_threads(THREADS[0])
    return samples


def print_timings(medians: dict, names: list[str]) -> None:
    print(f"  {'threads':>7} {'rows':>4} {'part':>6} " + " ".join(f"{n:>10}" for n in names))
    for threads in THREADS:
        for rows in ROWS:
            for part in ("layers", "head"):
                ms = [medians[(threads, rows, name, part)] * 1e3 for name in names]
                cells = " ".join(f"{v:8.3f}ms" for v in ms)
                ratios = " ".join(f"{ms[0] / v:.2f}x" for v in ms[1:])
                print(f"  {threads:>7} {rows:>4} {part:>6} {cells}  aten/each {ratios}")


def call_overhead(calls: int = 20000) -> None:
    """Microseconds per call of a 16 x 32 layer (one tile, one group), weights in L1."""
    from engine_worker.linear import quantize_int4

    layer = Int4Linear(quantize_int4(torch.randn(16, 32), torch.bfloat16), torch.bfloat16)
    x = torch.randn(1, 32).bfloat16()
    applies = {"aten": layer.apply, "ours": ours_of(layer).apply}
    for name, apply in applies.items():
        for threads in THREADS:
            torch.set_num_threads(threads)
            start = time.perf_counter()
            for _ in range(calls):
                apply(x)
            us = (time.perf_counter() - start) / calls * 1e6
            print(f"  call overhead {name} {threads} thread(s): {us:.2f} us")
    torch.set_num_threads(THREADS[0])


def engine_rates(engine: Engine, switches: list, ours: list, tokens: int, repeats: int) -> None:
    """Batch-1 greedy decode tokens/s of the engine with aten's kernel and with ours, each on
    the scripted step (as served) and eager, interleaved."""
    model = engine.runner.model
    scripted, atens = model.scripted_decode, [switch.quantized for switch in switches]
    for switch, mine in zip(switches, ours):
        switch.quantized = mine
    scripted_ours = ScriptedDecode.build(model)
    if scripted is None or scripted_ours is None:
        raise RuntimeError("the scripted decode step is off for this model (logged)")
    setups = {"aten scripted": (scripted, atens), "ours scripted": (scripted_ours, ours)}
    setups |= {"aten eager": (None, atens), "ours eager": (None, ours)}
    prompt = [[1 + 7 * j for j in range(40)]]
    for threads in THREADS:
        torch.set_num_threads(threads)
        rates: dict[str, list[float]] = {name: [] for name in setups}
        for _ in range(repeats):
            for name, (script, layers) in setups.items():
                model.scripted_decode = script
                for switch, layer in zip(switches, layers):
                    switch.quantized = layer
                rates[name].append(decode_run(engine, prompt, tokens).rate)
        cells = "  ".join(
            f"{n} {statistics.median(r):.1f} (max {max(r):.1f})" for n, r in rates.items()
        )
        print(f"  {threads} thread(s), tok/s median: {cells}  [{uptime()}]")
    model.scripted_decode = scripted
    for switch, layer in zip(switches, atens):
        switch.quantized = layer
    torch.set_num_threads(THREADS[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--passes", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4, help="decode steps recorded")
    parser.add_argument("--engine-tokens", type=int, default=64, help="0: no engine rates")
    parser.add_argument("--only-engine", action="store_true", help="engine rates alone")
    args = parser.parse_args()
    if not int4_decode.load_op():
        raise SystemExit("the int4 decode op is not built: python -m engine_worker.int4_decode")
    engine = load_engine()
    switches = int4_switches(engine)
    inputs = record_inputs(engine, switches, args.steps)
    layers = [cast(Int4Linear, switch.quantized) for switch in switches]
    torch.set_num_threads(1)  # repacking is not what is measured; it fights no one on 1
    start = time.perf_counter()
    ours = [ours_of(layer) for layer in layers]
    print(f"repacking {len(layers)} layers: {time.perf_counter() - start:.2f} s")
    torch.set_num_threads(THREADS[0])
    if args.engine_tokens:
        print(f"engine decode, batch 1, {args.engine_tokens} tokens:")
        engine_rates(engine, switches, ours, args.engine_tokens, max(3, args.repeats // 3))
    if args.only_engine:
        return
    print("accuracy against float32 of the same weights, real decode inputs:")
    accuracy(layers, ours, inputs)
    same = check_rows_alone(ours, inputs)
    print(f"  ours: rows independent of the call's other rows and of 1/2 threads: {same}")
    call_overhead()
    kernels: dict[str, list] = {"aten": [layer.apply for layer in layers]}
    kernels["ours"] = [mine.apply for mine in ours]
    print(f"timings, {uptime()} before")
    samples = timings(kernels, inputs, args.repeats, args.passes)
    print("medians:")
    print_timings({key: statistics.median(v) for key, v in samples.items()}, list(kernels))
    print("minimums (the runs another process left alone):")
    print_timings({key: min(v) for key, v in samples.items()}, list(kernels))
    print(f"  {uptime()} after")


if __name__ == "__main__":
    main()
