"""What same request, same answer costs (docs/determinism.md): decode attention alone, old
against new, and the default launch against --deterministic (``engine determinism``'s parts
``attention`` and ``cost``)."""

from __future__ import annotations

import time
from functools import partial

import numpy as np
import torch

from engine_worker.attention import flash_rows
from engine_worker.engine import Engine
from scripts.bench.engine_determinism import make
from scripts.bench.engine_runs import (
    decode_prompts,
    decode_rate,
    make_engine,
    params,
    prefill_rate,
    random_prompt,
    step_until_done,
)


def run_attention(args) -> None:
    """Decode attention alone: the bf16 batched matmuls decode rows had before the flash rows
    (``kernels.decode_attention``, still the SDPA backend's) against ``PagedCpuBackend._decode``'s
    flash call, the model's shapes, interleaved; best of --repeats x 30 calls (one per layer)."""
    from engine_worker.attention.kernels import decode_attention

    cfg = make(args, "auto").runner.model.config
    kv, group, dim = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads, cfg.head_dim
    print(f"\ndecode attention, us a layer (threads={torch.get_num_threads()})")
    for batch, context in ((1, 64), (1, 200), (1, 1000), (8, 200), (32, 200), (32, 1000)):
        columns = -(-context // 16) * 16
        q = torch.randn(batch, kv * group, dim).bfloat16()
        keys, values = (torch.randn(kv * batch, columns, dim).bfloat16() for _ in range(2))
        mask = torch.zeros(batch, columns, dtype=torch.bfloat16)
        mask[:, context:] = float("-inf")
        rows = torch.cat([q.view(batch, kv, group, dim)] * 2, dim=2)[:, :, : max(4, group)]
        flash_mask = mask[:, None, None, :].expand(-1, 1, rows.shape[2], -1)
        k4, v4 = (t.view(kv, batch, columns, dim).transpose(0, 1) for t in (keys, values))
        cases = {
            "bf16 matmuls": partial(decode_attention, q, keys, values, mask.repeat(kv, 1)[:, None]),
            "flash rows": partial(flash_rows.flash, rows, k4, v4, flash_mask),
        }
        best = dict.fromkeys(cases, float("inf"))
        for _ in range(args.repeats):
            for name, call in cases.items():
                start = time.perf_counter()
                for _ in range(30):
                    call()
                best[name] = min(best[name], (time.perf_counter() - start) / 30 * 1e6)
        old, new = best.values()
        print(f"  batch {batch:2d}, {context:5d} keys: {old:8.1f} -> {new:8.1f} ({new / old:.2f}x)")


# --- cost: what the default launch (and --deterministic) pays -----------------------------------
def after_cached_ms(engine: Engine, prefix: list[int], suffixes: list[list[int]], repeats: int):
    """Best wall time of one request per suffix, ``prefix + suffix``, one token each, with
    ``prefix`` in the prefix cache (their continuations in one step; a suffix
    shorter than a block is never cached)."""
    engine.add(f"prefix{time.perf_counter()}", prefix, params(1))
    step_until_done(engine)
    best = float("inf")
    for _ in range(repeats):
        for i, suffix in enumerate(suffixes):
            engine.add(f"after{time.perf_counter()}.{i}", prefix + suffix, params(1))
        start = time.perf_counter()
        step_until_done(engine)
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def run_cost(args) -> None:
    """Decode tokens/s per --decode-batch, prefill tokens/s and continuation times of the
    default launch (auto weights, bf16) and of --deterministic."""
    rng = np.random.default_rng(0)
    modes: dict[str, dict[str, bool]] = {"default": {}, "deterministic": {"deterministic": True}}
    for name, knobs in modes.items():
        engine = make_engine(
            args, dtype="bfloat16", weights="auto", max_batch_size=max(args.decode_batch), **knobs
        )
        rows = []
        for batch in args.decode_batch:
            prompts = decode_prompts(args, np.random.default_rng(batch), batch)
            rate = max(
                decode_rate(engine, prompts, args.decode_tokens) for _ in range(args.repeats)
            )
            rows.append(f"decode batch {batch}: {rate:.1f} tok/s")
        for length in args.prefill_tokens:
            prompt = random_prompt(rng, length)
            rate = max(prefill_rate(engine, prompt) for _ in range(args.repeats))
            rows.append(f"prefill {length}: {rate:.1f} tok/s")
        alone = after_cached_ms(engine, random_prompt(rng, 32), [[7] * 5], args.repeats)
        rows.append(f"37-token prompt, 32 cached: {alone:.1f} ms")
        prefix = random_prompt(rng, args.shared_prefix_tokens)
        suffixes = [[100 + i] * 15 for i in range(31)]  # no full block: never cached
        shared = after_cached_ms(engine, prefix, suffixes, args.repeats)
        rows.append(f"31 x 15 tokens after a cached {args.shared_prefix_tokens}: {shared:.0f} ms")
        print(f"\n{name} (threads={torch.get_num_threads()}): " + "; ".join(rows), flush=True)
