"""Batch-1 decode tokens/s of several model directories (e.g. one model's GGUF files of different
types), each in the default launch's engine (auto weights, bf16, our int4 kernel), interleaved.

    python -m scripts.bench.engine_models DIR [DIR ...] [--tokens 64] [--repeats 5] [--threads 2]

Each directory holds config.json, the tokenizer and one .gguf. One engine per directory is built
first (the weight formats it chose are printed), then each repeat runs one greedy request of
--tokens new tokens on every engine in turn; medians, with the load average beside them.
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch

from engine_worker.engine import Engine
from ipc.engine_config import EngineConfig
from scripts.bench.engine_runs import decode_rate

PROMPT = [1, 9690, 198, 2683, 314, 253, 5356, 30, 2, 504, 3458, 282, 4649, 314]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("models", nargs="+")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    engines = {}
    for model in args.models:
        config = EngineConfig(
            model_path=model,
            kv_cache_tokens=1024,
            adaptive_threads=False,
            engine_threads=args.threads,
        )
        engines[model] = Engine(config)
        print(f"{model}: {engines[model].runner.model.weight_format.describe()}")
    rates: dict[str, list[float]] = {m: [] for m in args.models}
    for engine in engines.values():  # warm-up
        decode_rate(engine, [PROMPT], 4)
    for _ in range(args.repeats):
        for model, engine in engines.items():
            rates[model].append(decode_rate(engine, [PROMPT], args.tokens))
    print(f"batch-1 decode tok/s, {args.threads} threads, load {os.getloadavg()[0]:.2f}")
    for model in args.models:
        values = ", ".join(f"{r:.1f}" for r in rates[model])
        print(f"  {statistics.median(rates[model]):6.1f}  {model}  ({values})")


if __name__ == "__main__":
    main()
