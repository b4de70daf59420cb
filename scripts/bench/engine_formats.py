"""The weight-format workloads of scripts/bench_engine.py.

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

import numpy as np
import torch

from scripts.bench import peer_engine as pe
from scripts.bench.engine_runs import (
    decode_prompts,
    engine_decode_rate,
    engine_prefill_rate,
    make_engine,
    random_prompt,
)

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


def format_engine(args, weights: str, **knobs):
    return make_engine(args, weights=weights, dtype=FORMAT_DTYPES.get(weights, "auto"), **knobs)


def run_formats(args) -> dict[str, dict[str, float]]:
    """Prints the table; returns {row name: {format: tokens/s}}."""
    rng = np.random.default_rng(0)
    formats = args.formats.split(",")
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
        engine_decode_rate(engine, [random_prompt(rng, 16)], 2)
    rows: dict[str, dict[str, float]] = {}
    for length in args.prefill_tokens:
        prompt = random_prompt(rng, length)
        rates = dict.fromkeys(formats, 0.0)
        for _ in range(args.repeats):
            for f in formats:
                rates[f] = max(rates[f], engine_prefill_rate(engines[f], prompt, 1))
        rows[f"prefill {length} tokens"] = rates
    for batch in args.decode_batch:
        prompts = decode_prompts(args, rng, batch)
        rates = dict.fromkeys(formats, 0.0)
        for _ in range(args.repeats):
            for f in formats:
                rates[f] = max(
                    rates[f], engine_decode_rate(engines[f], prompts, args.decode_tokens)
                )
        rows[f"decode batch {batch}"] = rates
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
    formats = args.formats.split(",")
    bandwidth = pe.read_bandwidth_gbs(args.threads)
    rng = np.random.default_rng(4)
    prompt = random_prompt(rng, args.decode_prompt_tokens)
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
        engine_decode_rate(engine, [prompt], 2)  # warm-up
    rates = dict.fromkeys(formats, 0.0)
    for _ in range(args.repeats):  # interleaved: load on the machine hits every format alike
        for f in formats:
            rates[f] = max(rates[f], engine_decode_rate(engines[f], [prompt], args.decode_tokens))
    print(
        f"\nbandwidth: read {bandwidth:.1f} GB/s with {args.threads} torch thread(s); batch-1 "
        f"decode after a {args.decode_prompt_tokens}-token prompt, best of {args.repeats}"
    )
    for f in formats:
        model = engines[f].runner.model
        print(
            pe.bound_line(
                f"{f} ({model.weight_format.describe()}, {model.dtype})",
                pe.weight_bytes_per_token(model),
                bandwidth,
                rates[f],
            )
        )
