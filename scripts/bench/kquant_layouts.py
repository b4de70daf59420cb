"""The block layouts of our int4 decode kernel for each GGUF type, timed against each other and
dense bf16: a pass over the default model's 30 layers' linear shapes (qkv 960 x 576, o 576 x 576,
gate_up 3072 x 576, down 576 x 1536; ~100 MB at 6 bits, from memory) at 1 and 4 rows.

    python -m scripts.bench.kquant_layouts [--repeats 9] [--threads 2]

Layouts (random q and scales; a layout's speed does not depend on the values):
  int4 g32     Q4_0, Q4_1, Q4_K: one nibble plane, a (scale, zero) pair per 32
  int4 g16     Q2_K, Q3_K: one nibble plane, pairs per 16
  int5 g32     Q5_0, Q5_1, Q5_K: nibbles + one high-bit plane, one pass
  int4x2 g32   the same 5-bit (or Q8_0's 8-bit) q as two nibble planes, the input twice
  int6 g16     Q6_K: nibbles + two high-bit planes
  int4x2 g16   Q6_K as two nibble planes
  dense bf16   the dense copy (oneDNN-packed), as prompt rows use
Medians of interleaved passes; `uptime` printed beside them (a shared machine is noisy).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from engine_worker import int4_decode
from engine_worker.linear import DenseLinear, Int4Groups, Int4Linear, dequantize

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
LAYERS = 30
LAYOUTS = {  # name -> (bits, group, planes)
    "int4 g32": (4, 32, 1),
    "int4 g16": (4, 16, 1),
    "int5 g32": (5, 32, 1),
    "int4x2 g32": (4, 32, 2),
    "int6 g16": (6, 16, 1),
    "int4x2 g16": (4, 16, 2),
}


def planes_of(n: int, k: int, bits: int, group: int, count: int, seed: int) -> list[Int4Groups]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        q = torch.randint(0, 1 << bits, (n, k), dtype=torch.uint8, generator=g)
        scale = torch.rand(n, k // group, generator=g) * 1e-2
        out.append(Int4Groups(q, scale, torch.randn(n, k // group, generator=g) * 1e-2, bits))
    return out


def build(name: str) -> list:
    layers = []
    for i in range(LAYERS):
        for j, (n, k) in enumerate(SHAPES):
            if name == "dense bf16":
                w = torch.randn(n, k, generator=torch.Generator().manual_seed(i * 4 + j))
                layers.append(DenseLinear(w.bfloat16(), keep_weight=False))
                continue
            bits, group, count = LAYOUTS[name]
            planes = planes_of(n, k, bits, group, count, seed=i * 4 + j)
            layers.append(Int4Linear(planes, torch.bfloat16, None, int4_decode.pack(planes)))
    return layers


def check(name: str, layer: Int4Linear, planes: list[Int4Groups]) -> None:
    x = torch.randn(1, planes[0].q.shape[1]).bfloat16()
    weight = sum(dequantize(p.rounded(torch.bfloat16)) for p in planes)
    error = (layer.apply(x).float() - x.float() @ weight.t()).norm() / (
        x.float() @ weight.t()
    ).norm()
    assert error < 1e-2, (name, error)


def pass_ms(layers: list, inputs: dict) -> float:
    start = time.perf_counter()
    for layer in layers:
        layer.apply(inputs[layer.in_k])
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if not int4_decode.load_op():
        raise SystemExit("the int4 decode op is not built: python -m engine_worker.int4_decode")
    torch.set_num_threads(args.threads)
    names = [*LAYOUTS, "dense bf16"]
    built = {name: build(name) for name in names}
    for name in LAYOUTS:
        bits, group, count = LAYOUTS[name]
        planes = planes_of(64, 576, bits, group, count, seed=0)
        check(name, Int4Linear(planes, torch.bfloat16, None, int4_decode.pack(planes)), planes)
    for layers in built.values():
        for layer, (_, k) in zip(layers, SHAPES * LAYERS):
            layer.in_k = k
    weights = sum(n * k for n, k in SHAPES) * LAYERS
    for rows in (1, 4):
        inputs = {k: torch.randn(rows, k).bfloat16() for _, k in SHAPES}
        times: dict[str, list[float]] = {name: [] for name in names}
        for _ in range(args.repeats):
            for name in names:
                times[name].append(pass_ms(built[name], inputs))
        print(f"{rows} row(s), {args.threads} threads, load {os.getloadavg()[0]:.2f}")
        for name in names:
            layers = built[name]
            nbytes = sum(layer.nbytes for layer in layers)
            ms = statistics.median(times[name])
            print(
                f"  {name:12s} {ms:7.2f} ms  {8 * nbytes / weights:5.2f} bits/weight  "
                f"{nbytes / ms / 1e6:5.1f} GB/s"
            )


if __name__ == "__main__":
    main()
