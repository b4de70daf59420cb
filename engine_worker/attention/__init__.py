"""Attention over the paged KV cache, behind one small interface (``AttentionBackend``).

Per step the model runner hands the chosen backend a ``StepBatch`` (the flat token layout) and
gets back the metadata the forward passes to ``backend.forward`` once per layer. Backends:

* ``PagedCpuBackend`` (``paged_cpu``): CPU with PyTorch's fused CPU flash kernel, one arithmetic
  for every row whatever the path (``flash_rows``); keeps the decode batch's keys between steps;
* ``SdpaBackend`` (``sdpa``): any device or torch build; gathers the decode batch every step and
  attends prefill segments one at a time with SDPA.

The choice is made once, at start-up (``select_backend``); a device-specific backend (CUDA paged
kernels) is one more class and one more line there.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine_worker.attention.backend import AttentionBackend
from engine_worker.attention.batch import AttentionMetadata, StepBatch
from engine_worker.attention.flash_rows import fused_cpu_kernel_available
from engine_worker.attention.kv_cache import PagedKVCache, kv_bytes_per_token
from engine_worker.attention.paged_cpu import PagedCpuBackend
from engine_worker.attention.sdpa import SdpaBackend
from engine_worker.model_config import LayerAttention

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "PagedCpuBackend",
    "PagedKVCache",
    "SdpaBackend",
    "StepBatch",
    "kv_bytes_per_token",
    "select_backend",
]


def select_backend(
    cache: PagedKVCache,
    decode_workspace_max_bytes: int,
    whole_key_blocks: bool = False,
    layers: Sequence[LayerAttention] = (),
) -> AttentionBackend:
    """The fastest backend the cache's device and this torch build can run. ``whole_key_blocks``:
    every row attends whole blocks of the flash kernel's key columns (``flash_rows.key_columns``;
    a deterministic launch). ``layers``: each layer's ``LayerAttention`` (the model config's)."""
    if cache.device.type == "cpu" and fused_cpu_kernel_available():
        return PagedCpuBackend(cache, decode_workspace_max_bytes, whole_key_blocks, layers)
    return SdpaBackend(cache, layers)
