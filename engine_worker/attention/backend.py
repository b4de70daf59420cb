"""The interface between the model and attention over the paged KV cache."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import numpy as np
import torch

from engine_worker.attention.batch import AttentionMetadata, DecodeBatch, StepBatch, to_device
from engine_worker.attention.kv_cache import PagedKVCache
from engine_worker.model_config import PLAIN_ATTENTION, LayerAttention


class AttentionBackend(ABC):
    """Owns how attention reads the paged KV cache: per step, ``prepare`` turns the step's
    layout into this backend's metadata (block tables, masks, whatever it keeps between steps);
    per layer, ``forward`` stores the new keys and values and attends.

    ``layers``: each layer's ``LayerAttention`` (sliding window, soft-cap, scale), given once
    here (empty: every layer plain). ``prepare`` builds one mask per distinct window
    (``windows``) and ``forward`` picks the layer's."""

    name: str

    def __init__(self, cache: PagedKVCache, layers: Sequence[LayerAttention] = ()) -> None:
        self.cache = cache
        self.layers = tuple(layers) or (PLAIN_ATTENTION,) * cache.num_layers
        if len(self.layers) != cache.num_layers:
            raise ValueError(f"{len(self.layers)} layer specs for {cache.num_layers} layers")
        self.windows = sorted({layer.window for layer in self.layers if layer.window})

    @abstractmethod
    def prepare(self, step: StepBatch) -> AttentionMetadata:
        """Called once per step, before the forward."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: int,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """q [T, H, D], this step's k/v [T, KV, D] -> attention output [T, H, D]: the new keys
        and values go into the cache (or wait for ``finish``), then the decode rows and the
        prefill rows are attended."""
        if metadata.deferred_kv is None:
            self.cache.write(layer, metadata.slot_mapping, k, v)
        else:
            metadata.deferred_kv.append((k, v))
        decode = metadata.decode
        if decode is not None and decode.rows is None:  # decode rows only: no row gathers
            return self._decode(q, k, v, layer, decode)
        out = torch.empty_like(q)
        if decode is not None:
            rows = decode.rows
            out[rows] = self._decode(q[rows], k[rows], v[rows], layer, decode)
        self._prefill(q, k, v, layer, metadata, out)
        return out

    def finish(self, metadata: AttentionMetadata) -> None:
        """Called once per step, after the last layer: writes the keys and values whose write
        was deferred."""
        stacked = metadata.stacked_kv
        if stacked is None and metadata.deferred_kv:
            keys, values = zip(*metadata.deferred_kv)
            stacked = torch.stack(keys), torch.stack(values)
        if stacked is not None:
            self.cache.write_layers(metadata.slot_mapping, *stacked)

    @abstractmethod
    def _decode(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, decode: DecodeBatch
    ) -> torch.Tensor:
        """q [B, H, D] of the decode rows; their new k/v [B, KV, D] are in the cache already."""

    @abstractmethod
    def _prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: int,
        metadata: AttentionMetadata,
        out: torch.Tensor,
    ) -> None:
        """Writes each prefill segment's rows of ``out``."""

    def _device(self, array: np.ndarray) -> torch.Tensor:
        return to_device(array, self.cache.device)

    @abstractmethod
    def reset(self) -> None:
        """Drops whatever is kept between steps (the engine is idle, or a forward failed)."""
