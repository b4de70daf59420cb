"""The interface between the model and attention over the paged KV cache."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from engine_worker.attention.batch import AttentionMetadata, StepBatch
from engine_worker.attention.kv_cache import PagedKVCache


class AttentionBackend(ABC):
    """Owns how attention reads the paged KV cache: per step, ``prepare`` turns the step's
    layout into this backend's metadata (block tables, masks, whatever it keeps between steps);
    per layer, ``forward`` stores the new keys and values and attends."""

    name: str

    def __init__(self, cache: PagedKVCache) -> None:
        self.cache = cache

    @abstractmethod
    def prepare(self, step: StepBatch) -> AttentionMetadata:
        """Called once per step, before the forward."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: int,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """q [T, H, D], this step's k/v [T, KV, D] -> attention output [T, H, D]."""

    @abstractmethod
    def reset(self) -> None:
        """Drops whatever is kept between steps (the engine is idle, or a forward failed)."""
