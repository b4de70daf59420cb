"""Plain attention over the paged cache: what any device and torch build can run.

* decode rows are attended together: each row's blocks are gathered into one padded
  [KV * B, columns, D] batch (``kernels.decode_attention``);
* prefill segments are attended one sequence at a time with SDPA: a fresh prompt uses its own
  k/v with ``is_causal``; a continuation gathers its earlier blocks and uses an explicit
  offset-causal mask; a layer with a sliding window gets an explicit mask either way.

Soft-capped layers take the plain matmul path (``kernels``): SDPA cannot cap scores.
"""

from __future__ import annotations

import numpy as np
import torch

from engine_worker.attention.backend import AttentionBackend
from engine_worker.attention.batch import AttentionMetadata, DecodeBatch, PrefillSegment, StepBatch
from engine_worker.attention.kernels import decode_attention, gather_decode, segment_attention
from engine_worker.attention.kv_cache import gather


class SdpaBackend(AttentionBackend):
    name = "sdpa"

    def reset(self) -> None:
        """Nothing to drop: every step is prepared from scratch."""

    # --- prepare (host side, once per step) ---------------------------------------------------
    def prepare(self, step: StepBatch) -> AttentionMetadata:
        metadata = AttentionMetadata(slot_mapping=self._device(step.slots))
        decoding = step.decode_rows()
        metadata.decode = self._prepare_decode(step, np.nonzero(decoding)[0])
        self._prepare_prefills(step, np.nonzero(~decoding)[0], metadata)
        return metadata

    def _prepare_decode(self, step: StepBatch, seqs: np.ndarray) -> DecodeBatch | None:
        if not len(seqs):
            return None
        blocks = -(-int(step.ends[seqs].max()) // step.block_size)
        return self._decode_batch(step, seqs, blocks * step.block_size, with_tables=True)

    def _decode_batch(
        self, step: StepBatch, seqs: np.ndarray, columns: int, with_tables: bool
    ) -> DecodeBatch:
        """Decode rows ``seqs`` over ``columns`` key columns (a multiple of the block size)."""
        context = step.ends[seqs]
        rows = None if len(seqs) == len(step.sequences) else self._device(step.row_starts[seqs])
        column_index = np.arange(columns)[None, None, :]
        padding = column_index >= context[:, None, None]
        mask = self._additive(padding)
        window_masks = {
            w: self._additive(padding | (column_index < context[:, None, None] - w))
            for w in self.windows
        }
        tables = None
        if with_tables:
            # Rows with fewer blocks read block 0 past their end; the mask zeroes those.
            blocks = columns // step.block_size
            table: np.ndarray = np.zeros((len(seqs), blocks), dtype=np.int64)
            width = min(blocks, step.block_tables.shape[1])
            table[:, :width] = step.block_tables[seqs, :width]
            tables = self._device(table)
        return DecodeBatch(rows=rows, mask=mask, block_tables=tables, window_masks=window_masks)

    def _additive(self, hidden: np.ndarray) -> torch.Tensor:
        """[B, 1, columns] 0 where attended, -inf where ``hidden``, one copy per kv head (built
        once per step rather than in every layer): [KV * B, 1, columns]."""
        mask = torch.zeros(hidden.shape, dtype=self.cache.dtype)
        mask.masked_fill_(torch.from_numpy(hidden), float("-inf"))
        return mask.repeat(self.cache.num_kv_heads, 1, 1).to(self.cache.device)

    def _prepare_prefills(
        self, step: StepBatch, seqs: np.ndarray, metadata: AttentionMetadata
    ) -> None:
        for i in seqs:
            start, n = int(step.starts[i]), int(step.lengths[i])
            seg = PrefillSegment(
                row_start=int(step.row_starts[i]), num_tokens=n, start_position=start
            )
            query_pos = np.arange(start, start + n)[:, None]
            key_pos = np.arange(start + n)[None, :]
            if start > 0:
                blocks = -(-(start + n) // step.block_size)
                seg.block_table = self._device(step.block_tables[i, :blocks].copy())
                seg.mask = self._device(key_pos <= query_pos)
            # A fresh prompt's keys are its own (is_causal), but a window needs its mask.
            seg.window_masks = {
                w: self._device((key_pos <= query_pos) & (key_pos > query_pos - w))
                for w in self.windows
            }
            metadata.prefills.append(seg)

    # --- forward (every layer) ----------------------------------------------------------------
    def _decode(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, decode: DecodeBatch
    ) -> torch.Tensor:
        """q [B, H, D] of the decode rows; their new k/v [B, KV, D] are in the cache already."""
        keys, values = self._gather_decode(layer, decode)
        spec = self.layers[layer]
        return decode_attention(q, keys, values, decode.mask_for(spec.window), spec)

    def _gather_decode(self, layer: int, decode: DecodeBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's keys and values at the decode rows' blocks, [KV * B, columns, D] each."""
        tables = decode.block_tables
        assert tables is not None, "a decode batch without a workspace has block tables"
        return (
            gather_decode(self.cache.layer_keys[layer], tables),
            gather_decode(self.cache.layer_values[layer], tables),
        )

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
        spec = self.layers[layer]
        for seg in metadata.prefills:
            rows = slice(seg.row_start, seg.row_start + seg.num_tokens)
            if seg.block_table is None:  # a fresh prompt: its own new k/v are all it sees
                keys, values = k[rows].transpose(0, 1), v[rows].transpose(0, 1)
            else:
                length = seg.start_position + seg.num_tokens
                keys = gather(self.cache.layer_keys[layer], seg.block_table)[:, :length]
                values = gather(self.cache.layer_values[layer], seg.block_table)[:, :length]
            out[rows] = segment_attention(q[rows], keys, values, seg.mask_for(spec.window), spec)
