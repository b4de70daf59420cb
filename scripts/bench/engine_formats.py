"""The weight-format workloads of the engine benchmark (scripts/bench/engine.py), and the
bandwidth bound of batch-1 decode (every weight is read once per token) that 'peer' uses too.

kernels  every weight format's linear layers on the model's own shapes (its layers of distinct
         weights, in forward order, so they stream from memory as in a real step) at each
         --kernel-rows: ms per forward, and the rows up to which each quantized format beats
         dense bf16 (the crossover ``weight_format.QUANTIZED_MAX_TOKENS`` holds). torchao's
         CPU formats join when torchao is importable.
formats  the engine in each --formats weight format: prefill tokens/s and decode tokens/s at
         each --decode-batch, interleaved repeats, ratios to the first format.
bandwidth  the read bandwidth at --threads, the weight bytes a batch-1 decode step reads in
         each --formats format, and that format's batch-1 decode against the bound
         (bandwidth / bytes).
"""

from __future__ import annotations

import time
from functools import partial
from pathlib import Path

import numpy as np
import torch

from scripts.bench.engine_runs import (
    decode_prompts,
    decode_rate,
    make_engine,
    prefill_rate,
    random_prompt,
)
from scripts.bench.interleave import best_of


# --- memory bandwidth ---------------------------------------------------------------------------
def read_bandwidth_gbs(threads: int, size_mib: int = 512, repeats: int = 7) -> float:
    """Best-of-``repeats`` read bandwidth (GB/s, 1e9 bytes) of a sum over a buffer far larger
    than any cache, with ``threads`` torch threads: what streaming weights through a matmul can
    at best reach on this machine."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        buf = torch.ones(size_mib * (1 << 20) // 4, dtype=torch.float32)
        buf.sum()  # faults the pages in and wakes the thread pool
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            buf.sum()
            best = min(best, time.perf_counter() - start)
        return buf.numel() * buf.element_size() / best / 1e9
    finally:
        torch.set_num_threads(previous)


def weight_bytes_per_token(model) -> int:
    """Bytes a batch-1 decode step must read: each linear layer's decode copy (the quantized one
    where a layer keeps a dense copy for large steps too), the norms and the lm_head (a tied
    dense head is the embedding table); the embedding alone is only indexed, one row a token."""

    total = model.norm.nbytes + model.lm_head.nbytes
    for layer in model.layers:
        total += sum(
            linear.nbytes for linear in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)
        )
        total += sum(
            0 if norm is None else norm.nbytes
            for norm in (
                layer.input_norm,
                layer.post_attention_norm,
                layer.q_norm,
                layer.k_norm,
                layer.attn_out_norm,
                layer.mlp_out_norm,
            )
        )
    return total


def bound_line(name: str, weight_bytes: int, bandwidth_gbs: float, rate: float | None) -> str:
    bound = bandwidth_gbs * 1e9 / weight_bytes
    share = "" if rate is None else f"; measured {rate:.1f} tok/s = {100 * rate / bound:.0f}% of it"
    return (
        f"  {name}: {weight_bytes / 1e6:.1f} MB of weights per token / {bandwidth_gbs:.1f} "
        f"GB/s = {bound:.0f} tok/s bound{share}"
    )


def gguf_weight_bytes_per_token(gguf: str | Path) -> int:
    """The same count for llama.cpp on a GGUF: every tensor at its stored size, the token
    embedding only when it is also the output matrix (no separate output.weight)."""
    from gguf import GGUFReader

    tensors = {t.name: int(t.n_bytes) for t in GGUFReader(str(gguf)).tensors}
    if "output.weight" in tensors:
        tensors.pop("token_embd.weight", None)
    return sum(tensors.values())


FORMAT_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}  # the others run the auto dtype


def kernel_formats() -> dict:
    """name -> (build(weight float32) -> layer with apply(x), activation dtype)."""
    from engine_worker.linear import DenseLinear, Int4Linear, Int8Linear, quantize_int4

    bf16 = torch.bfloat16
    formats = {
        "fp32": (DenseLinear, torch.float32),
        "bf16": (lambda w: DenseLinear(w.to(bf16)), bf16),
        "int8": (lambda w: Int8Linear.from_weight(w, bf16), bf16),
        "int4": (lambda w: Int4Linear(quantize_int4(w, bf16), bf16), bf16),
    }
    try:  # torchao's CPU weight-only formats (optional; not a dependency)
        from torchao.prototype.quantization.int4.inference_workflow import (
            PrototypeInt4WeightOnlyConfig,
        )
        from torchao.quantization import Int8WeightOnlyConfig, quantize_
    except ImportError as exc:
        print(f"(torchao formats skipped: {exc})")
        return formats

    def torchao(config):
        def build(w):
            layer = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=bf16)
            layer.weight.data = w.to(bf16)
            quantize_(layer, config)
            return type("TorchaoLinear", (), {"apply": lambda self, x: layer(x)})()

        return build

    formats["ao-int8"] = (torchao(Int8WeightOnlyConfig()), bf16)
    formats["ao-int4"] = (torchao(PrototypeInt4WeightOnlyConfig(group_size=32)), bf16)
    return formats


def run_kernels(args) -> None:
    from engine_worker.model_config import ModelConfig

    cfg = ModelConfig.from_dir(args.model)
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes = {
        "qkv": (q + 2 * kv, cfg.hidden_size),
        "o_proj": (cfg.hidden_size, q),
        "gate_up": (2 * cfg.intermediate_size, cfg.hidden_size),
        "down": (cfg.hidden_size, cfg.intermediate_size),
    }
    formats = kernel_formats()
    torch.manual_seed(0)
    models = {}
    for name, (build, dtype) in formats.items():
        layers = [
            {s: build(torch.randn(n, k) * 0.05) for s, (n, k) in shapes.items()}
            for _ in range(cfg.num_layers)
        ]
        models[name] = (layers, build(torch.randn(cfg.vocab_size, cfg.hidden_size) * 0.05), dtype)

    def call_ms(name: str, rows: int) -> dict[str, list[float]]:
        """ms of every call of one forward's worth of linear layers, per shape, in order."""
        layers, head, dtype = models[name]
        inputs = {s: torch.randn(rows, k).to(dtype) for s, (n, k) in shapes.items()}
        spent: dict[str, list[float]] = {s: [] for s in [*shapes, "lm_head"]}
        for layer in layers:
            for s in shapes:
                start = time.perf_counter()
                layer[s].apply(inputs[s])
                spent[s].append((time.perf_counter() - start) * 1e3)
        start = time.perf_counter()
        head.apply(torch.randn(rows, cfg.hidden_size).to(dtype))
        spent["lm_head"].append((time.perf_counter() - start) * 1e3)
        return spent

    print(
        f"\nkernels (threads={torch.get_num_threads()}, {cfg.num_layers} layers of "
        + ", ".join(f"{s} {n}x{k}" for s, (n, k) in shapes.items())
        + f", lm_head {cfg.vocab_size}x{cfg.hidden_size}; ms per forward: each call's best of "
        f"{args.kernel_repeats} interleaved runs, summed)"
    )
    totals: dict[tuple[str, int], float] = {}
    with torch.inference_mode():
        # Warm-up at every size first: torch's bf16 GEMM ran a 60x slower path on the first
        # batch-1 calls of a fresh process, until other sizes had run.
        for rows in args.kernel_rows:
            for name in formats:
                call_ms(name, rows)
        for rows in args.kernel_rows:
            # Each call's minimum over the runs: on a shared machine a single short call often
            # runs undisturbed even when no whole forward does.
            best: dict[str, dict[str, list[float]]] = {}
            for _ in range(args.kernel_repeats):
                for name in formats:
                    for part, times in call_ms(name, rows).items():
                        kept = best.setdefault(name, {}).setdefault(part, times)
                        kept[:] = [min(a, b) for a, b in zip(kept, times)]
            print(f"rows {rows}:")
            for name, parts in best.items():
                sums = {part: sum(times) for part, times in parts.items()}
                layers_ms = sum(v for k, v in sums.items() if k != "lm_head")
                totals[name, rows] = layers_ms + sums["lm_head"]
                print(
                    f"  {name:8s} total {totals[name, rows]:8.2f}   layers {layers_ms:8.2f}   "
                    f"lm_head {sums['lm_head']:7.2f}   | "
                    + "  ".join(f"{k} {sums[k]:.2f}" for k in shapes)
                )
    for name in formats:
        if name in ("fp32", "bf16"):
            continue
        faster = [r for r in args.kernel_rows if totals[name, r] < totals["bf16", r]]
        print(f"{name}: faster than bf16 at rows {faster or 'none'}")


def per_format(engines: dict, measure, repeats: int) -> dict[str, float]:
    """``measure(engine)``'s best over interleaved repeats, per format."""
    return best_of({f: partial(measure, engine) for f, engine in engines.items()}, repeats)


def format_engine(args, weights: str, **knobs):
    return make_engine(args, weights=weights, dtype=FORMAT_DTYPES.get(weights, "auto"), **knobs)


def run_formats(args) -> dict[str, dict[str, float]]:
    """Prints the table; returns {row name: {format: tokens/s}}."""
    rng = np.random.default_rng(0)
    formats = args.formats
    # KV for the largest decode batch only: several engines share the machine's memory.
    kv_tokens = (
        max(
            max(args.prefill_tokens),
            max(args.decode_batch)
            * (args.decode_prompt_tokens * 3 // 2 + args.decode_tokens + 2 * 16),
        )
        + 64
    )
    engines = {
        f: format_engine(
            args,
            f,
            enable_prefix_cache=False,
            max_batch_size=max(args.decode_batch),
            kv_cache_tokens=kv_tokens,
        )
        for f in formats
    }
    for engine in engines.values():  # warm-up: first-call allocations, thread pool wake-up
        decode_rate(engine, [random_prompt(rng, 16)], 2)
    rows: dict[str, dict[str, float]] = {}
    for length in args.prefill_tokens:
        prompt = random_prompt(rng, length)
        rows[f"prefill {length} tokens"] = per_format(
            engines, partial(prefill_rate, prompt=prompt), args.repeats
        )
    for batch in args.decode_batch:
        prompts = decode_prompts(args, rng, batch)
        rows[f"decode batch {batch}"] = per_format(
            engines,
            partial(decode_rate, prompts=prompts, new_tokens=args.decode_tokens),
            args.repeats,
        )
    base = formats[0]
    print(
        f"\nformats (threads={torch.get_num_threads()}, tokens/s, best of {args.repeats} "
        f"interleaved; ratio to {base}; {args.decode_tokens} new tokens)"
    )
    for f in formats:
        print(
            f"  {f}: {engines[f].runner.model.weight_format.describe()}, "
            f"dtype {engines[f].runner.model.dtype}"
        )
    print(f"{'':24s}" + "".join(f"{f:>16s}" for f in formats))
    for name, rates in rows.items():
        print(
            f"{name:24s}"
            + "".join(f"{rates[f]:9.1f} {rates[f] / rates[base]:5.2f}x" for f in formats)
        )
    return rows


def run_bandwidth(args) -> None:
    formats = args.formats
    bandwidth = read_bandwidth_gbs(args.threads)
    prompt = random_prompt(np.random.default_rng(4), args.decode_prompt_tokens)
    engines = {
        f: format_engine(
            args,
            f,
            enable_prefix_cache=False,
            max_batch_size=1,
            kv_cache_tokens=args.decode_prompt_tokens + args.decode_tokens + 64,
        )
        for f in formats
    }
    for engine in engines.values():
        decode_rate(engine, [prompt], 2)  # warm-up
    rates = per_format(
        engines, partial(decode_rate, prompts=[prompt], new_tokens=args.decode_tokens), args.repeats
    )
    print(
        f"\nbandwidth: read {bandwidth:.1f} GB/s with {args.threads} torch thread(s); batch-1 "
        f"decode after a {args.decode_prompt_tokens}-token prompt, best of {args.repeats}"
    )
    for f in formats:
        model = engines[f].runner.model
        print(
            bound_line(
                f"{f} ({model.weight_format.describe()}, {model.dtype})",
                weight_bytes_per_token(model),
                bandwidth,
                rates[f],
            )
        )
