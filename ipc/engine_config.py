"""The engine's knobs. Defined here, below every role, because they cross a process boundary:
the supervisor writes them (nested in the ClusterConfig) and the engine process reads them;
in-process users (tests, benchmarks) build an EngineConfig directly."""

from __future__ import annotations

from dataclasses import dataclass

from ipc.knobs import check_knobs, knob
from ipc.kv_events import parse_kv_events_config

DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16", "float16")
SPECULATIVE_METHODS = ("off", "ngram")
INT4_KERNELS = ("aten", "own")  # engine_worker/int4_decode.py
PROMPT_KERNELS = ("dense", "int8")  # engine_worker/weight_format.py
WEIGHTS = ("auto", "bf16", "fp32", "int8", "int4", "int4-exact")  # engine_worker/weight_format.py
WEIGHTS_HELP = (
    "the linear layers' weights. auto: on a CPU with bf16 activations, a GGUF's Q4_0/Q4_1 "
    "and Q8_0 layers on torch's int4 kernel as int4 below, everything else dense in --dtype "
    "(nothing re-quantized); bf16, fp32: dense in that dtype (quantized blocks dequantized; "
    "needs that --dtype or auto); int8: int8 per output channel; int4: int4 in groups of 32, "
    "scales and zeros rounded to the activation dtype, Q8_0 blocks as two 4-bit planes, other "
    "layers quantized (a dense lm_head stays dense); int4-exact: as int4 with each scale and "
    "zero held as two bf16 parts, so a GGUF's fp16 values are kept exactly (reads the 4-bit "
    "weights twice). Quantized layers serve small steps (decode, reading 2-4x fewer bytes "
    "than bf16) and, where memory allows, keep a dense copy for larger ones (prefill, big "
    "decode batches); they run on CPU only"
)

# Prompt tokens one step may compute when prefill_max_tokens is 0. A step holds up the decode of
# every running request, so on a CPU (a few hundred to a few thousand prompt tokens/s for a small
# model) a smaller budget keeps each step, and the gap between two tokens of a stream, short; a
# GPU computes thousands of tokens in milliseconds and wants large steps.
PREFILL_TOKENS_CUDA = 4096
PREFILL_TOKENS_CPU = 512
# Token-keys (engine_worker/prefill_budget.py) one step may compute when prefill_max_token_keys
# is 0: on a CPU, attention deep into a long context costs more than the rest of a token's work,
# so a token budget alone let a step deep into an 8k context take 2-4 s. At ~0.6 us a token-key
# (the default model, 2 cores: docs/benchmarks.md) this keeps a step's prompt work near 0.4 s at
# any depth. A GPU's prefill is not bounded by it.
PREFILL_TOKEN_KEYS_CPU = 640 << 10
PREFILL_TOKEN_KEYS_CUDA = 1 << 40
# What a step with prompt work is sized to take on a CPU when neither prefill_step_target_ms nor
# prefill_max_token_keys is given (engine_worker/prefill_budget.py's StepPace). A step is every
# running stream's gap between two tokens: at 640Ki token-keys steps took ~0.45 s and the
# largest gaps 1.1-1.3 s beside two 7k-token prompts (load 2); at 250 ms the gaps stay near it.
PREFILL_STEP_TARGET_MS_CPU = 250


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Knobs of one engine. Token counts are in tokens, memory in bytes."""

    model_path: str = knob("", "the model directory", cli=False)
    served_model_name: str = knob(
        "",
        "the model's name in the API (/v1/models, each response's model); default: the "
        "--model file's stem, or its directory's name",
        unit="NAME",
    )
    device: str = knob("auto", "where the engine runs (auto: CUDA when present)", choices=DEVICES)
    dtype: str = knob(
        "auto",
        "activations and KV cache (auto: bf16 on CUDA, fp16 there "
        "without bf16; on CPU bf16 where it is native (AVX512-BF16 or AMX), else "
        "float32; a dense --weights format sets it)",
        choices=DTYPES,
    )
    weights: str = knob("auto", WEIGHTS_HELP, choices=WEIGHTS)
    int4_kernel: str = knob(
        "own",
        "which kernel runs int4 layers' decode rows (bf16 activations): own (ours, AVX-512 "
        "BF16, built once for this torch at the first start that finds none; where it "
        "cannot be built or run, aten's serves, logged) or aten (torch's int4 kernel)",
        choices=INT4_KERNELS,
    )
    prompt_kernel: str = knob(
        "dense",
        "what multiplies prompt rows by a 4-bit layer (and the decode rows of a step past "
        "the quantized crossover): dense (a bf16 copy of the layer, oneDNN) or int8 (our "
        "kernel on the layer's own blocks, each row's groups of 32 rounded to int8: "
        "1.25-1.4x faster per core, no dense copy in memory, activations rounded as "
        "llama.cpp rounds them); int8 needs --int4-kernel own",
        choices=PROMPT_KERNELS,
    )
    quantized_max_tokens: int = knob(
        0,
        "a step's decode rows run on quantized weights while "
        "there are at most this many, on their dense copy above "
        "(prompt rows always run on the dense copy); 0 = the "
        "format's measured crossover",
        unit="TOKENS",
        minimum=0,
    )
    deterministic: bool = knob(
        False,
        "an identical request gets identical tokens at temperature 0 "
        "or with a seed whatever the load: decode rows always run on "
        "quantized weights and the lm_head on one kernel whatever the "
        "batch size (costs decode speed above the crossover; "
        "docs/determinism.md)",
    )
    max_batch_size: int = knob(
        32, "most requests decoded together in one engine step", unit="REQUESTS", minimum=1
    )
    prefill_max_batch_size: int = knob(
        32,
        "most requests that may start (or continue) prefill in one step",
        unit="REQUESTS",
        minimum=1,
    )
    prefill_max_tokens: int = knob(
        0,
        "most prompt tokens computed in one step, all requests "
        "together; 0 = 4096 on CUDA, 512 on CPU (a CPU computes "
        "~1-2k prompt tokens/s, so a step, and the decode of every "
        "running request waiting on it, stays well under a second)",
        unit="TOKENS",
        minimum=0,
    )
    prefill_max_token_keys: int = knob(
        0,
        "most token-keys of prompt work in one step, all requests together: a prompt token "
        "costs the keys it attends (its position + 1) plus 1,280 for its own layers, so chunks "
        "deep into a long context shrink and a step stays short; 0 = 640Ki on CPU (~0.4 s of "
        "prompt work on 2 cores for the default model, measured), no bound on CUDA",
        unit="TOKEN_KEYS",
        minimum=0,
    )
    prefill_step_target_ms: int = knob(
        0,
        "a step with prompt work is sized to take about this long: the engine measures its "
        "steps' seconds per token-key as it runs and bounds a step's prompt work to match "
        "(within prefill_max_token_keys when that is given); 0 = 250 ms on CPU unless "
        "prefill_max_token_keys is given, off on CUDA",
        unit="MS",
        minimum=0,
    )
    prefill_chunk_tokens: int = knob(
        2048,
        "long prompts are prefilled in chunks of this many tokens per step",
        unit="TOKENS",
        minimum=1,
    )
    block_size: int = knob(16, "tokens per KV cache block", unit="TOKENS", minimum=1)
    kv_cache_tokens: int = knob(
        0,
        "KV cache capacity; 0 = derive from memory (CPU: at most cpu_kv_cache_max_bytes)",
        unit="TOKENS",
        minimum=0,
    )
    max_model_len: int = knob(
        0,
        "context length (prompt + output); 0 = the model's own, capped to what the KV cache holds",
        unit="TOKENS",
        minimum=0,
    )
    enable_prefix_cache: bool = knob(
        True,
        "share KV blocks between requests whose prompts start with the same tokens",
        flag="--no-prefix-cache",
    )
    max_waiting_requests: int = knob(
        4096,
        "engine queue bound; beyond it requests fail with 'overloaded'",
        unit="REQUESTS",
        minimum=1,
    )
    engine_threads: int = knob(
        0,
        "torch intra-op threads in the engine; 0 = leave torch's "
        "setting (the supervisor decides it from the cores). With several engine "
        "replicas the launcher's value is what they share: each gets an equal part",
        unit="N",
        minimum=0,
    )
    adaptive_threads: bool = knob(
        True,
        "CPU: the engine times a few steps now and then on one "
        "thread and on engine_threads, and runs each kind of step "
        "(decode, prefill) on the faster (on a machine busy with "
        "other work one thread can be several times faster)",
        flag="--no-adaptive-threads",
    )
    kv_cache_memory_fraction: float = knob(
        0.8,
        "CUDA only: share of the free memory after the weights that the KV cache takes",
        minimum=0.01,
        maximum=1.0,
    )
    cpu_kv_cache_max_bytes: int = knob(
        2 << 30, "CPU only: cap on the derived KV cache", unit="BYTES", minimum=1
    )
    # Speculative decoding (docs/speculative.md): drafts looked up in the request's own context,
    # verified in the ordinary step; greedy output is the same tokens as without it.
    speculative: str = knob(
        "off",
        "speculative decoding: ngram = drafts from the request's own prompt and output (prompt "
        "lookup), verified in one step; off = none",
        choices=SPECULATIVE_METHODS,
    )
    num_speculative_tokens: int = knob(
        3,
        "most draft tokens a request verifies in one step (--speculative ngram)",
        unit="TOKENS",
        minimum=1,
        maximum=64,
    )
    prompt_lookup_min: int = knob(
        2, "shortest n-gram the ngram proposer matches", unit="TOKENS", minimum=1, maximum=64
    )
    prompt_lookup_max: int = knob(
        4, "longest n-gram the ngram proposer matches", unit="TOKENS", minimum=1, maximum=64
    )
    speculative_max_batch: int = knob(
        2,
        "a step proposes drafts only while at most this many requests decode in it (measured: "
        "above 2, verifying drafts cost more than they saved; docs/speculative.md)",
        unit="REQUESTS",
        minimum=1,
    )

    # Decode keeps a contiguous copy of the decode batch's KV (all layers) while the batch is
    # unchanged, instead of gathering it from the paged cache every layer of every step.
    decode_workspace_max_bytes: int = knob(
        1 << 30,
        "cap on the decode batch's contiguous KV "
        "copy (a larger batch gathers from the paged cache "
        "each step); 0 disables it",
        unit="BYTES",
        minimum=0,
    )
    scripted_decode: bool = knob(
        True,
        "CPU, bf16/fp16: a step that only decodes, on the kept decode "
        "copy, runs its layers as one TorchScript call (the same ops, "
        "the same bits, less Python); models it does not cover run eagerly",
        flag="--no-scripted-decode",
    )

    # An idle engine that gets a request waits a little for more before its first step, so the
    # rest of a burst (still being tokenized elsewhere) joins that step instead of queueing
    # behind it; a busy engine never waits (engine_worker/idle_window.py).
    idle_batch_window_ms: float = knob(
        1000.0,
        "longest an idle engine waits after a request "
        "arrives, for more to join its first step (0: never "
        "waits); a busy engine never waits",
        unit="MS",
        minimum=0.0,
        maximum=10_000.0,
    )
    idle_batch_window_step_fraction: float = knob(
        0.05,
        "...and at most this fraction of the "
        "time that first step is expected to take "
        "(0: the fixed --idle-batch-window-ms)",
        unit="FRACTION",
        minimum=0.0,
        maximum=1.0,
    )

    seed: int | None = knob(
        None,
        "seeds the draws that give each unseeded sampling request its seed, so a run "
        "replays the same samples for the same requests in the same order (None: random)",
        minimum=0,
        cli=False,
    )
    kv_events_config: str = knob(
        "",
        "publish KV-cache events in vLLM's format, configured with vLLM's JSON keys: "
        'enable_kv_cache_events, publisher ("zmq"), endpoint (default tcp://*:5557; replica r '
        "uses port + r; a wildcard stays on loopback unless CURVE is on), replay_endpoint, "
        "topic, buffer_steps, hwm, max_queue_size",
        unit="JSON",
    )

    def __post_init__(self) -> None:
        object.__setattr__(self, "model_path", str(self.model_path))
        if not self.model_path:
            raise ValueError("model_path is required")
        check_knobs(self)
        parse_kv_events_config(self.kv_events_config)  # fails fast, naming the key
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min ({self.prompt_lookup_min}) must not exceed "
                f"prompt_lookup_max ({self.prompt_lookup_max})"
            )
