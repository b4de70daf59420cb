"""Engine configuration: every knob the scheduler, KV cache and model runner read."""

from __future__ import annotations

from dataclasses import dataclass

from ipc.config import WEIGHTS  # one list of weight formats for the cluster and engine configs

DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass(slots=True)
class EngineConfig:
    """Knobs of one engine. Token counts are in tokens, memory in bytes.

    ``kv_cache_tokens=0`` sizes the KV pool from memory; ``max_model_len=0`` takes the model's
    ``max_position_embeddings``.
    """

    model_path: str
    device: str = "auto"
    # Activations and KV cache. auto: CUDA bf16 (fp16 without bf16); CPU bf16 where the CPU has
    # native bf16 (AVX512-BF16 or AMX), else float32; a dense ``weights`` format sets it.
    dtype: str = "auto"
    weights: str = "auto"  # linear layers' format: auto, bf16, fp32, int8, int4
    # Steps of more tokens than this run on a dense copy of quantized weights (kept when memory
    # allows); 0 = the measured crossover of the format.
    quantized_max_tokens: int = 0
    max_batch_size: int = 32  # requests decoded together in one step
    prefill_max_batch_size: int = 32  # requests that may start (or continue) prefill in one step
    prefill_max_tokens: int = 4096  # prompt tokens computed per step, all requests together
    prefill_chunk_tokens: int = 2048  # prompt tokens one request computes per step
    block_size: int = 16
    kv_cache_tokens: int = 0
    max_model_len: int = 0
    enable_prefix_cache: bool = True
    max_waiting_requests: int = 4096
    num_threads: int | None = None  # torch intra-op threads; None leaves torch's setting
    kv_cache_memory_fraction: float = 0.8  # CUDA only: share of free memory after weights
    cpu_kv_cache_max_bytes: int = 2 << 30  # CPU only: cap on the derived KV pool
    # Decode keeps a contiguous copy of the decode batch's KV (all layers) while the batch is
    # unchanged, instead of gathering it from the paged cache every layer of every step; this
    # caps that copy's size (a larger batch falls back to the gather). 0 disables it.
    decode_workspace_max_bytes: int = 1 << 30

    def __post_init__(self) -> None:
        if not self.model_path:
            raise ValueError("model_path is required")
        self.model_path = str(self.model_path)
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.weights not in WEIGHTS:
            raise ValueError(f"weights must be one of {WEIGHTS}, got {self.weights!r}")
        for name in ("max_batch_size", "prefill_max_batch_size", "prefill_max_tokens",
                     "prefill_chunk_tokens", "block_size", "max_waiting_requests"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("kv_cache_tokens", "max_model_len", "quantized_max_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0 (0 = derive), got {value!r}")
        if self.num_threads is not None and (not isinstance(self.num_threads, int)
                                             or self.num_threads < 1):
            raise ValueError(f"num_threads must be a positive integer or None, got {self.num_threads!r}")
        if not (0.0 < self.kv_cache_memory_fraction <= 1.0):
            raise ValueError("kv_cache_memory_fraction must be in (0, 1]")
        if not isinstance(self.decode_workspace_max_bytes, int) or self.decode_workspace_max_bytes < 0:
            raise ValueError("decode_workspace_max_bytes must be an integer >= 0")
        if self.cpu_kv_cache_max_bytes < 1:
            raise ValueError("cpu_kv_cache_max_bytes must be positive")
