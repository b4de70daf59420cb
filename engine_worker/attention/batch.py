"""What attention is told about a step: the host-side layout every backend prepares from, and the
device-side metadata the backends build from it.

A step's tokens are packed into one flat batch of T rows (no padding in the linear layers): the
rows of sequence s are ``row_starts[s] .. row_starts[s] + lengths[s]``, at positions
``starts[s] ..``. A sequence that computes one token is a decode row; any other is a prefill
segment, fresh (nothing cached before it) or a continuation (chunked prefill, a prefix-cache
hit, a recompute after preemption).
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

    @property
    def ends(self) -> np.ndarray:
        """Tokens in the cache after this step."""
        return self.starts + self.lengths


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
    fresh: bool = True


@dataclass(slots=True)
class DecodeBatch:
    """The step's decode rows, attended together as one padded batch of key columns: gathered
    from the cache (``block_tables``) or kept from the last step (``workspace``)."""

    rows: torch.Tensor | None  # [B] their flat rows; None: they are the whole step
    mask: torch.Tensor  # [KV * B, 1, columns] additive 0/-inf: hides columns past each context
    block_tables: torch.Tensor | None = None  # [B, columns / block_size] blocks to gather
    workspace: DecodeWorkspace | None = None  # set by a backend that keeps decode keys


@dataclass(slots=True)
class PrefillSegment:
    """One sequence's prefill rows, attended on their own with SDPA."""

    row_start: int  # first row of this segment in the flat token batch
    num_tokens: int
    start_position: int  # tokens already in the cache before this segment
    block_table: torch.Tensor | None = None  # only for continuations
    mask: torch.Tensor | None = None  # [num_tokens, start_position + num_tokens], True = attend


@dataclass(slots=True)
class ContinuationBatch:
    """Every prefill continuation of a step (a segment after cached tokens), attended together.

    Queries are padded to [segments, max_tokens]. Segments that share leading cache blocks (a
    common system prompt) form a prefix group: the group's shared keys are gathered once and
    attended once by all its queries in one matmul ("cascade" attention); the rest of each
    segment's context (its ``rest`` blocks) is gathered into one padded batch. The two partial
    softmaxes are merged with their log-sum-exp. A segment in no group has an empty prefix."""

    max_tokens: int  # padded query rows per segment
    gather_rows: torch.Tensor  # [S * max_tokens] flat row of each padded query (pads repeat one)
    padded_index: torch.Tensor  # [real tokens] position in the padded layout of each ...
    out_rows: torch.Tensor  # ... real token's flat row
    rest_table: torch.Tensor  # [S * rest_blocks] blocks after each segment's shared prefix
    rest_mask: torch.Tensor  # [S, max_tokens, 1, rest_blocks * block_size] additive 0/-inf
    groups: list = field(default_factory=list)  # (first segment, end segment, prefix blocks)


@dataclass(slots=True)
class AttentionMetadata:
    """What every layer's attention reads in one step (built once per step by ``prepare``)."""

    slot_mapping: torch.Tensor  # [T] cache slot of every new token
    decode: DecodeBatch | None = None
    prefills: list[PrefillSegment] = field(default_factory=list)  # one SDPA call each
    # Set by a backend that batches continuations; ``prefills`` then holds only fresh prompts.
    continuations: ContinuationBatch | None = None
