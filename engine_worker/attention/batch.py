"""What attention is told about a step: the host-side layout every backend prepares from, and the
device-side metadata the backends build from it.

A step's tokens are packed into one flat batch of T rows (no padding in the linear layers): the
rows of sequence s are ``row_starts[s] .. row_starts[s] + lengths[s]``, at positions
``starts[s] ..``. A sequence that computes one decoded token is a decode row; any other is a
prefill segment, fresh (nothing cached before it) or a continuation (chunked prefill, a
prefix-cache hit, a recompute after preemption).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(array).to(device, non_blocking=True)


@dataclass(slots=True)
class StepBatch:
    """One step's layout on the host (numpy int64 arrays, one entry per sequence unless noted)."""

    sequences: list  # the scheduled requests in batch order (backends compare them by identity)
    starts: np.ndarray  # tokens already in the cache
    lengths: np.ndarray  # tokens computed in this step
    row_starts: np.ndarray  # first flat row
    block_tables: np.ndarray  # [S, widest table] cache blocks, padded with block 0
    slots: np.ndarray  # [T] the cache slot each new token's key and value go to
    block_size: int
    # Whether the sequence's rows follow its prompt (None: unknown, any one-row sequence is a
    # decode row)
    decoded: np.ndarray | None = None

    @property
    def ends(self) -> np.ndarray:
        """Tokens in the cache after this step."""
        return self.starts + self.lengths

    def decode_rows(self) -> np.ndarray:
        """[S] which sequences are decode rows: one decoded token each. A prompt's last token
        computed alone (after a cached prompt tail) is a prefill segment of one row, attended
        over the key columns a cold prefill gives it, not the decode batch's."""
        one = self.lengths == 1
        return one if self.decoded is None else one & self.decoded


@dataclass(slots=True)
class DecodeWorkspace:
    """Contiguous decode keys/values per layer, valid for one fixed, ordered set of sequences.

    ``fresh``: this step builds the copies (gather from the paged cache); otherwise it writes
    the new tokens at ``new_slots``. Attention reads all ``capacity`` columns (the mask
    hides the unused ones): a column slice is strided, and batched matmuls copy it (bf16)
    or run slower (fp32) than over the few spare columns."""

    capacity: int  # columns per row (a multiple of the block size)
    sequences: list  # the decoding requests it holds, in row order
    context: np.ndarray  # [B] their context lengths in the step that last used it
    keys: list = field(default_factory=list)  # per layer: [KV * B, capacity, D], filled by
    values: list = field(default_factory=list)  # the forward of the step that builds it
    # [KV * B] this step's token's row in a layer's keys/values viewed as [KV * B * capacity, D]
    new_slots: torch.Tensor | None = None
    # The decode mask, kept and advanced by one column a step: [B, columns] additive (its
    # rows), [B, 1, query rows, columns] (the view attention reads), and [B, 1] each row's
    # last visible column
    mask_rows: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    last_columns: torch.Tensor | None = None
    # Sliding windows (``AttentionBackend.windows``): per window, its [B, columns] additive
    # rows and the [B, 1, query rows, columns] view attention reads, and [1, columns] the
    # column numbers, to hide what each step's window leaves behind
    window_rows: dict[int, torch.Tensor] = field(default_factory=dict)
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict)
    column_index: torch.Tensor | None = None
    fresh: bool = True
    # what engine_worker.scripted_decode hands its compiled layers (the new tokens' slots, the
    # masks, views of the keys/values), listed once per workspace
    scripted_views: list = field(default_factory=list)


@dataclass(slots=True)
class DecodeBatch:
    """The step's decode rows, attended together as one padded batch of key columns: gathered
    from the cache (``block_tables``) or kept from the last step (``workspace``)."""

    rows: torch.Tensor | None  # [B] their flat rows; None: they are the whole step
    # Additive 0/-inf, hides columns past each context: [KV * B, 1, columns] (SDPA backend),
    # [B, 1, query rows, columns] (CPU backend)
    mask: torch.Tensor
    block_tables: torch.Tensor | None = None  # [B, columns / block_size] blocks to gather
    workspace: DecodeWorkspace | None = None  # set by a backend that keeps decode keys
    # Per sliding window W: ``mask`` also hiding the keys at positions <= row's position - W,
    # and the first key column a windowed layer attends (flash_rows.window_start; CPU backend)
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict)
    window_starts: dict[int, int] = field(default_factory=dict)

    def mask_for(self, window: int) -> torch.Tensor:
        return self.window_masks[window] if window else self.mask


@dataclass(slots=True)
class PrefillSegment:
    """Prefill rows of one sequence (all of them, or a chunk of them), attended on their own."""

    row_start: int  # first row of this segment in the flat token batch
    num_tokens: int
    start_position: int  # tokens already in the cache before this segment
    block_table: torch.Tensor | None = None  # the cache blocks the segment reads
    # SDPA backend, continuations only: [num_tokens, start_position + num_tokens], True = attend;
    # CPU backend: [query rows, key columns] additive (flash_rows.causal_mask)
    mask: torch.Tensor | None = None
    # Per sliding window W: the same, also hiding keys at positions <= the row's - W (the SDPA
    # backend's fresh prompts get one too), and the CPU backend's first key column
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict)
    window_starts: dict[int, int] = field(default_factory=dict)

    def mask_for(self, window: int) -> torch.Tensor | None:
        return self.window_masks[window] if window else self.mask


@dataclass(slots=True)
class AttentionMetadata:
    """What every layer's attention reads in one step (built once per step by ``prepare``)."""

    slot_mapping: torch.Tensor  # [T] cache slot of every new token
    decode: DecodeBatch | None = None
    prefills: list[PrefillSegment] = field(default_factory=list)  # one attention call each
    # Set where no layer's attention reads the paged cache in this step (decode rows only, on
    # a kept workspace): each layer's new (k, v) wait here and go into the cache in one copy
    # per tensor when the forward ends (``AttentionBackend.finish``), not two copies a layer.
    deferred_kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    # The same for a forward that returns them stacked, [L, T, KV, D] each (scripted_decode)
    stacked_kv: tuple[torch.Tensor, torch.Tensor] | None = None
