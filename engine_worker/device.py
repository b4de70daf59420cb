"""Where the engine runs and in what precision: the device, the activation dtype ``auto``
resolves to, the memory that extra copies (KV cache, dense weight copies) may take, and how many
prompt tokens one step computes there."""

from __future__ import annotations

import dataclasses
import os

import torch

from engine_worker.weight_format import dtype_for_weights
from ipc.engine_config import (
    PREFILL_STEP_TARGET_MS_CPU,
    PREFILL_TOKEN_KEYS_CPU,
    PREFILL_TOKEN_KEYS_CUDA,
    PREFILL_TOKENS_CPU,
    PREFILL_TOKENS_CUDA,
    EngineConfig,
)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was asked for but CUDA is not available")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device, weights: str = "auto") -> torch.dtype:
    """auto: what a dense ``weights`` format names; else bf16 on CUDA (fp16 without bf16) and on
    a CPU with native bf16, float32 on other CPUs."""
    if name != "auto":
        return getattr(torch, name)
    implied = dtype_for_weights(weights)
    if implied is not None:
        return implied
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32


def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX-BF16 in /proc/cpuinfo: bf16 matmuls run natively (2x fp32 here);
    without them torch emulates bf16 and fp32 is the faster choice."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"avx512_bf16", "amx_bf16"})
    except OSError:
        pass
    return False


def available_memory_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def weight_copy_budget_bytes(device: torch.device) -> int:
    """What extra weight copies may take: a quarter of free memory (the KV pool's rule)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0] // 4
    return available_memory_bytes() // 4


def resolve_prefill_budget(config: EngineConfig, device: torch.device) -> EngineConfig:
    """``config`` with its prefill budgets' 0 ("the device's") resolved for ``device``."""
    cuda = device.type == "cuda"
    paced = config.prefill_step_target_ms > 0 or not (cuda or config.prefill_max_token_keys)
    return dataclasses.replace(
        config,
        prefill_step_target_ms=config.prefill_step_target_ms
        or (PREFILL_STEP_TARGET_MS_CPU if paced else 0),
        prefill_max_tokens=config.prefill_max_tokens
        or (PREFILL_TOKENS_CUDA if cuda else PREFILL_TOKENS_CPU),
        # Paced steps are bounded by their measured time alone unless a bound is given
        prefill_max_token_keys=config.prefill_max_token_keys
        or (PREFILL_TOKEN_KEYS_CUDA if cuda or paced else PREFILL_TOKEN_KEYS_CPU),
    )
