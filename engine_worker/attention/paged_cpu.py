"""The CPU backend: every row through one arithmetic (``flash_rows``), and a decode workspace
kept between steps.

* decode rows (one new token each) are attended together, one flash call for the batch, over
  their keys padded to the widest row; a row far longer than the others is attended apart, as
  a one-row segment (``_apart``), so the batch is not padded to it;
* a prefill segment (a fresh prompt, or a continuation after cached tokens) is attended in
  chunks of ``QUERY_CHUNK_POSITIONS`` positions, each over its sequence's cached keys from
  position 0 to the chunk's last one (its own new keys are in the cache by then).

Both read keys from position 0 with the same masks and padding rules, so a token gets the same
attention output whichever of the two computes it (``flash_rows`` says why).

While the set of decoding sequences stays the same from one step to the next, the decode
gather is skipped: a ``DecodeWorkspace`` keeps every layer's padded [kv_heads * batch, capacity,
head_dim] copy of the decode batch's keys and values from the step that built it, and each
later step only writes its one new token per sequence into it (re-gathering ~all the KV every
layer every step was 13 ms of a 105 ms batch-32 step in fp32, 12 ms of 51 ms in bf16, on 2 CPU
cores). A batch whose copy would exceed ``workspace_max_bytes`` gathers every step instead.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from engine_worker.attention.backend import AttentionBackend
from engine_worker.attention.batch import (
    AttentionMetadata,
    DecodeBatch,
    DecodeWorkspace,
    PrefillSegment,
    StepBatch,
)
from engine_worker.attention.flash_rows import (
    MIN_QUERY_ROWS,
    QUERY_CHUNK_POSITIONS,
    causal_mask,
    flash,
    grouped,
    key_columns,
    ungrouped,
    window_start,
)
from engine_worker.attention.kernels import gather_decode
from engine_worker.attention.kv_cache import PagedKVCache, gather
from engine_worker.model_config import LayerAttention

# A decode row attends apart from the batch (``_apart``) only past this context, and is charged
# this many key columns for attending alone (its own gather and flash calls).
APART_MIN_COLUMNS = 1024
APART_ROW_COLUMNS = 256


class PagedCpuBackend(AttentionBackend):
    name = "paged_cpu"
    # Spare columns a new decode workspace gets, so it serves this many steps before a rebuild.
    WORKSPACE_HEADROOM = 32

    def __init__(
        self,
        cache: PagedKVCache,
        workspace_max_bytes: int,
        whole_key_blocks: bool = False,
        layers: Sequence[LayerAttention] = (),
    ) -> None:
        super().__init__(cache, layers)
        self.workspace_max_bytes = workspace_max_bytes
        self.whole_key_blocks = whole_key_blocks  # flash_rows.key_columns
        self._workspace: DecodeWorkspace | None = None  # the last step's

    def reset(self) -> None:
        """Frees the decode workspace."""
        self._workspace = None

    # --- prepare (host side, once per step) ---------------------------------------------------
    def prepare(self, step: StepBatch) -> AttentionMetadata:
        metadata = AttentionMetadata(slot_mapping=self._device(step.slots))
        decoding = step.decode_rows()
        decoding[_apart(step.ends, decoding)] = False  # attended as one-row segments
        metadata.decode = self._prepare_decode(step, np.nonzero(decoding)[0])
        for i in np.nonzero(~decoding)[0]:
            metadata.prefills += self._query_chunks(step, int(i))
        workspace = metadata.decode.workspace if metadata.decode is not None else None
        if workspace is not None and not workspace.fresh and not metadata.prefills:
            metadata.deferred_kv = []  # attention reads the workspace alone
        return metadata

    def _prepare_decode(self, step: StepBatch, seqs: np.ndarray) -> DecodeBatch | None:
        if not len(seqs):
            self.reset()
            return None
        context = step.ends[seqs]
        rows = None if len(seqs) == len(step.sequences) else self._device(step.row_starts[seqs])
        ws = self._decode_workspace([step.sequences[i] for i in seqs], context)
        if ws is not None and not ws.fresh:
            decode = DecodeBatch(rows=rows, mask=_advance(ws), workspace=ws)
            decode.window_masks, decode.window_starts = ws.window_masks, self._starts(context)
            return decode
        columns = self._columns(int(context.max())) if ws is None else ws.capacity
        column_index = np.arange(columns)[None, :]
        hidden = column_index >= context[:, None]
        mask = self._additive(hidden)
        window_rows = {
            w: self._additive(hidden | (column_index < context[:, None] - w)) for w in self.windows
        }
        rows_per_head = max(MIN_QUERY_ROWS, self.cache.query_group)

        def per_query_row(m: torch.Tensor) -> torch.Tensor:
            # [B, 1, rows, columns]: every query row of a sequence sees the same columns.
            return m[:, None, None, :].expand(-1, 1, rows_per_head, -1)

        decode = DecodeBatch(
            rows=rows,
            mask=per_query_row(mask),
            window_masks={w: per_query_row(m) for w, m in window_rows.items()},
            window_starts=self._starts(context),
        )
        if ws is not None:
            # Where each layer writes the next step's keys/values (one index_copy_ each), and
            # the column each row's next token unmasks: the kept steps advance them (_advance).
            flat: np.ndarray = np.arange(self.cache.num_kv_heads * len(seqs)) * ws.capacity
            ws.new_slots = self._device(flat + np.tile(context - 1, self.cache.num_kv_heads))
            ws.last_columns = self._device(context[:, None] - 1)
            ws.mask_rows, ws.mask = mask, decode.mask
            ws.window_rows, ws.window_masks = window_rows, decode.window_masks
            if self.windows:
                ws.column_index = self._device(column_index)
            decode.workspace = ws
        decode.block_tables = self._device(_padded_tables(step, seqs, columns // step.block_size))
        return decode

    def _decode_workspace(self, decoding: list, context: np.ndarray) -> DecodeWorkspace | None:
        """The workspace for this step's decode rows: last step's when the same requests (same
        order) each grew by exactly one token and still fit, else a fresh one (None: too big)."""
        ws = self._workspace
        longest = int(context.max())
        if (
            ws is not None
            and longest <= ws.capacity
            and len(decoding) == len(ws.sequences)
            and all(a is b for a, b in zip(decoding, ws.sequences))
            and np.array_equal(ws.context + 1, context)
        ):
            ws.fresh = False
            ws.context = context
            return ws
        self.reset()
        # With whole key blocks the capacity is already rounded to 512: it needs no headroom.
        headroom = 0 if self.whole_key_blocks else self.WORKSPACE_HEADROOM
        capacity = self._columns(longest + headroom)
        if capacity * len(decoding) * self.cache.bytes_per_token > self.workspace_max_bytes:
            return None
        self._workspace = DecodeWorkspace(capacity=capacity, sequences=decoding, context=context)
        return self._workspace

    def _starts(self, context: np.ndarray) -> dict[int, int]:
        """Per window, the first key column the decode rows at ``context`` attend."""
        first = int(context.min())
        return {w: window_start(first - w, self.cache.block_size) for w in self.windows}

    def _additive(self, hidden: np.ndarray) -> torch.Tensor:
        """0 where attended, -inf where ``hidden``, on the cache's device."""
        mask = torch.zeros(hidden.shape, dtype=self.cache.dtype)
        mask.masked_fill_(torch.from_numpy(hidden), float("-inf"))
        return mask.to(self.cache.device)

    def _columns(self, tokens: int) -> int:
        return key_columns(tokens, self.cache.block_size, self.whole_key_blocks)

    def _query_chunks(self, step: StepBatch, seq: int) -> list[PrefillSegment]:
        """One prefill sequence as query chunks, each over the keys up to its last position."""
        start, count = int(step.starts[seq]), int(step.lengths[seq])
        chunks = []
        for first in range(0, count, QUERY_CHUNK_POSITIONS):
            n = min(QUERY_CHUNK_POSITIONS, count - first)
            columns = self._columns(start + first + n)
            positions = np.arange(start + first, start + first + n)
            group, dtype, device = self.cache.query_group, self.cache.dtype, self.cache.device
            chunk = PrefillSegment(
                row_start=int(step.row_starts[seq]) + first,
                num_tokens=n,
                start_position=start + first,
                block_table=self._device(
                    _padded_tables(step, np.array([seq]), columns // step.block_size)[0]
                ),
                mask=causal_mask(positions, columns, group, dtype).to(device),
                window_masks={
                    w: causal_mask(positions, columns, group, dtype, w).to(device)
                    for w in self.windows
                },
                window_starts={
                    w: window_start(start + first - w + 1, step.block_size) for w in self.windows
                },
            )
            chunks.append(chunk)
        return chunks

    # --- forward (every layer) ----------------------------------------------------------------
    def _prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: int,
        metadata: AttentionMetadata,
        out: torch.Tensor,
    ) -> None:
        keys, values = self.cache.layer_keys[layer], self.cache.layer_values[layer]
        group = self.cache.query_group
        spec = self.layers[layer]
        for chunk in metadata.prefills:
            mask, table = chunk.mask_for(spec.window), chunk.block_table
            assert table is not None and mask is not None
            first = chunk.window_starts.get(spec.window, 0)  # whole key blocks it does not see
            if first:
                mask, table = mask[:, first:], table[first // self.cache.block_size :]
            rows_slice = slice(chunk.row_start, chunk.row_start + chunk.num_tokens)
            o = flash(
                grouped(q[rows_slice], self.cache.num_kv_heads)[None],
                gather(keys, table)[None],
                gather(values, table)[None],
                mask,
                spec,
            )
            out[rows_slice] = ungrouped(o[0], chunk.num_tokens, group)

    def _decode(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, decode: DecodeBatch
    ) -> torch.Tensor:
        """q [B, H, D] of the decode rows; their new k/v [B, KV, D] are in the cache already."""
        ws = decode.workspace
        if ws is not None and not ws.fresh:
            keys, values = ws.keys[layer], ws.values[layer]
            head_dim = k.shape[2]
            keys.view(-1, head_dim).index_copy_(
                0, ws.new_slots, k.transpose(0, 1).reshape(-1, head_dim)
            )
            values.view(-1, head_dim).index_copy_(
                0, ws.new_slots, v.transpose(0, 1).reshape(-1, head_dim)
            )
        else:
            tables = decode.block_tables
            assert tables is not None, "a decode batch without a kept workspace has block tables"
            keys = gather_decode(self.cache.layer_keys[layer], tables)
            values = gather_decode(self.cache.layer_values[layer], tables)
            if ws is not None:
                ws.keys.append(keys)
                ws.values.append(values)
        batch_size, num_heads, head_dim = q.shape
        kv_heads = self.cache.num_kv_heads
        group = num_heads // kv_heads
        rows = q.view(batch_size, kv_heads, group, head_dim)
        short = decode.mask.shape[2] - group
        if short > 0:
            rows = torch.cat([rows, rows[:, :, -1:].expand(-1, -1, short, -1)], dim=2)
        # The workspace is [KV * B, columns, D]: viewed [B, KV, columns, D], strided.
        columns = keys.shape[1]
        spec = self.layers[layer]
        keys = keys.view(kv_heads, batch_size, columns, head_dim).transpose(0, 1)
        values = values.view(kv_heads, batch_size, columns, head_dim).transpose(0, 1)
        mask = decode.mask_for(spec.window)
        first = decode.window_starts.get(spec.window, 0)  # whole key blocks no row sees
        if first:
            keys, values, mask = keys[:, :, first:], values[:, :, first:], mask[..., first:]
        o = flash(rows, keys, values, mask, spec)
        return o[:, :, :group].reshape(batch_size, num_heads, head_dim)


def _apart(ends: np.ndarray, decoding: np.ndarray) -> np.ndarray:
    """The decode rows whose context is so much longer than the others' that padding the batch
    to them costs more than attending them alone (as one-row prefill segments, which give a row
    the same bits: flash_rows): the k longest rows, for the k with the fewest key columns read
    (padded batch + each row apart, APART_ROW_COLUMNS apiece for its own calls), when that
    halves them. A 7k-token row joining three short ones made every row read 7k keys: its
    first decode step took 0.6-0.8 s (the gather of 4 x 7k columns a layer), the next ones
    ~150 ms of padded attention."""
    rows = np.nonzero(decoding)[0]
    if len(rows) < 2:
        return rows[:0]
    order = rows[np.argsort(-ends[rows], kind="stable")]
    context = ends[order]
    apart = np.concatenate([[0], np.cumsum(context + APART_ROW_COLUMNS)])[:-1]
    cost = apart + context * (len(order) - np.arange(len(order)))
    k = int(np.argmin(cost))
    if k == 0 or cost[k] * 2 > cost[0] or context[k - 1] < APART_MIN_COLUMNS:
        return rows[:0]
    return order[:k]


def _advance(ws: DecodeWorkspace) -> torch.Tensor:
    """The kept step's mask and new-token slots, in place: every row grew by one token
    (``_decode_workspace`` checked it), so each shows one more column and writes one further."""
    assert ws.new_slots is not None and ws.last_columns is not None
    assert ws.mask_rows is not None and ws.mask is not None, "set by the step that built it"
    ws.new_slots += 1
    ws.last_columns += 1
    ws.mask_rows.scatter_(1, ws.last_columns, 0.0)
    for window, rows in ws.window_rows.items():  # the column the window left, hidden again
        assert ws.column_index is not None
        leaving = ws.column_index <= ws.last_columns - window
        rows.copy_(ws.mask_rows).masked_fill_(leaving, float("-inf"))
    return ws.mask


def _padded_tables(step: StepBatch, seqs: np.ndarray, blocks: int) -> np.ndarray:
    """[len(seqs), blocks] block tables; columns past a sequence's table read block 0 (masked)."""
    table: np.ndarray = np.zeros((len(seqs), blocks), dtype=np.int64)
    width = min(blocks, step.block_tables.shape[1])
    table[:, :width] = step.block_tables[seqs, :width]
    return table
