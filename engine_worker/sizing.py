"""What the engine decides once, at start, from its config, the model and the device: the
context it offers, the weight format, and how many KV blocks it allocates."""

from __future__ import annotations

import logging

import torch

from engine_worker.attention import kv_bytes_per_token
from engine_worker.device import available_memory_bytes, resolve_dtype, weight_copy_budget_bytes
from engine_worker.model_config import ModelConfig
from engine_worker.weight_format import WeightFormat, dense_copy_fits
from ipc.engine_config import EngineConfig

logger = logging.getLogger("splitserve.engine")


def resolve_max_model_len(config: EngineConfig, model_config: ModelConfig) -> int:
    """The context the engine offers: the knob, else the model's own (a sliding-window model's
    too: its windowed layers attend their window, whatever the context)."""
    max_len = config.max_model_len or model_config.max_position_embeddings
    if max_len > model_config.max_position_embeddings:
        logger.warning(
            "max_model_len %d exceeds the model's max_position_embeddings %d",
            max_len,
            model_config.max_position_embeddings,
        )
    return max_len


def default_weight_format(
    config: EngineConfig, model_config: ModelConfig, device: torch.device
) -> WeightFormat:
    """What ``config.weights`` and ``config.dtype`` mean on this device for this model."""
    dtype = resolve_dtype(config.dtype, device, config.weights)
    return WeightFormat(
        config.weights,
        dtype,
        device,
        config.quantized_max_tokens,
        dense_copy=dense_copy_fits(model_config, dtype, weight_copy_budget_bytes(device), device),
        deterministic=config.deterministic,
        int4_kernel=config.int4_kernel,
        prompt_kernel=config.prompt_kernel,
    )


def kv_cache_blocks(
    config: EngineConfig,
    model_config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    max_model_len: int,
) -> int:
    """KV blocks to allocate: ``kv_cache_tokens`` if set; on CUDA a fraction of free memory; on
    CPU enough for max_batch_size full contexts, within a quarter of available memory and the
    CPU cap."""
    per_token = kv_bytes_per_token(model_config, dtype)
    if config.kv_cache_tokens:
        tokens = config.kv_cache_tokens
    elif device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        tokens = int(free * config.kv_cache_memory_fraction) // per_token
    else:
        budget = min(config.cpu_kv_cache_max_bytes, available_memory_bytes() // 4)
        tokens = min(config.max_batch_size * max_model_len, budget // per_token)
    return max(1, tokens // config.block_size)


def fit_to_kv_cache(max_model_len: int, capacity: int) -> int:
    """One request must always fit: the context the server offers is what its KV cache can hold
    (tokenizer workers keep max_tokens within it, so no request fails half-way)."""
    if max_model_len <= capacity:
        return max_model_len
    logger.warning(
        "capping max_model_len %d to the KV cache's capacity of %d tokens "
        "(raise kv_cache_tokens for longer contexts)",
        max_model_len,
        capacity,
    )
    return capacity
