"""Attention over the paged KV cache, for one flat batch of tokens from many sequences.

A step's tokens are packed into one flat sequence (no padding in the linear layers). Attention is
then done per group:

* decode rows (one new token per sequence) are attended together. The cache is laid out
  head-major, [kv_heads, blocks, block_size, head_dim], so ``index_select`` over the block axis
  gathers a padded [kv_heads, batch, length, head_dim] batch in one contiguous copy of
  block_size*head_dim runs (8x faster on CPU than advanced indexing), and the query heads that
  share a kv head become that kv head's query rows in two batched matmuls (no kv head is ever
  repeated; on CPU this beats SDPA, whose fused kernel pays per (batch, head) for tiny queries);
* prefill segments are attended one sequence at a time with SDPA: a fresh prompt uses its own
  k/v with ``is_causal``; a continuation (chunked prefill, prefix-cache hit) gathers its earlier
  blocks and uses an explicit offset-causal mask.

While the set of decoding sequences stays the same from one step to the next, the gather is
skipped: a ``DecodeWorkspace`` keeps every layer's padded [kv_heads * batch, capacity, head_dim]
copy of the decode batch's keys and values from the step that built it, and each later step only
writes its one new token per sequence into it (re-gathering nearly all the KV in every layer of
every step is a real share of a decode step; the README has the figure).

Every layer writes all new k/v into the cache before any attention reads it, so a sequence may
read blocks another sequence of the same step is computing (in-batch prefix dedup relies on it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class PrefillSegment:
    row_start: int  # first row of this segment in the flat token batch
    num_tokens: int
    start_position: int  # tokens already in the cache before this segment
    block_table: torch.Tensor | None = None  # only for continuations
    mask: torch.Tensor | None = None  # [num_tokens, start_position + num_tokens], True = attend


@dataclass(slots=True)
class DecodeWorkspace:
    """Contiguous decode keys/values per layer, valid for one fixed, ordered set of sequences.

    ``fresh``: this step builds the copies (gather from the paged cache); otherwise it appends
    the new tokens at ``new_positions``. Attention reads all ``capacity`` columns (the mask
    hides the unused ones): a column slice is strided, and batched matmuls copy it (bf16)
    or run slower (fp32) than over the few spare columns."""
    capacity: int  # columns per row (a multiple of the block size)
    keys: list  # per layer: [KV * B, capacity, D] (filled by the first step's forward)
    values: list
    new_positions: torch.Tensor | None = None  # [B] column of this step's token per sequence
    fresh: bool = True


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
class AttentionBatch:
    slot_mapping: torch.Tensor  # [T] cache slot of every new token
    decode_rows: torch.Tensor | None = None  # [B] flat rows of decode tokens (None: no decode)
    decode_block_tables: torch.Tensor | None = None  # [B, blocks]
    decode_mask: torch.Tensor | None = None  # [KV*B, 1, blocks*block_size] additive 0/-inf
    decode_is_whole_batch: bool = False  # rows are exactly 0..T-1: skip the row gathers
    decode_workspace: DecodeWorkspace | None = None  # persistent copies instead of a gather
    prefills: list[PrefillSegment] = field(default_factory=list)
    continuations: ContinuationBatch | None = None  # set: prefills hold only fresh prompts


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, batch: AttentionBatch, layer: int = 0) -> torch.Tensor:
    """q [T, H, D], k/v [T, KV, D]; caches [KV, blocks, block_size, D]. Returns [T, H, D]."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    k_cache.view(num_kv_heads, -1, head_dim).index_copy_(1, batch.slot_mapping, k.transpose(0, 1))
    v_cache.view(num_kv_heads, -1, head_dim).index_copy_(1, batch.slot_mapping, v.transpose(0, 1))
    if batch.decode_is_whole_batch:
        return _decode(q, k, v, k_cache, v_cache, batch, layer)
    out = torch.empty_like(q)
    if batch.decode_rows is not None:
        rows = batch.decode_rows
        out[rows] = _decode(q[rows], k[rows], v[rows], k_cache, v_cache, batch, layer)
    group = num_heads // num_kv_heads
    if batch.continuations is not None:
        cont = batch.continuations
        out[cont.out_rows] = _continuations(q, k_cache, v_cache, cont)
    for seg in batch.prefills:
        rows = slice(seg.row_start, seg.row_start + seg.num_tokens)
        if seg.block_table is None:
            keys, values = k[rows].transpose(0, 1), v[rows].transpose(0, 1)
        else:
            length = seg.start_position + seg.num_tokens
            keys = _gather(k_cache, seg.block_table)[:, :length]
            values = _gather(v_cache, seg.block_table)[:, :length]
        # SDPA's fused CPU kernel does not take enable_gqa (it falls back to the slow math
        # path), so the kv heads are repeated; that costs far less than the fallback.
        keys = keys.repeat_interleave(group, dim=0)
        values = values.repeat_interleave(group, dim=0)
        # 4-D inputs: with 3-D ones SDPA also takes the math path on CPU.
        o = F.scaled_dot_product_attention(q[rows].transpose(0, 1)[None], keys[None],
                                           values[None], attn_mask=seg.mask,
                                           is_causal=seg.mask is None)[0]
        out[rows] = o.transpose(0, 1)
    return out


def _gather(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """[KV, blocks, block_size, D] at the table's blocks -> [KV, len(table) * block_size, D]."""
    kv_heads, _, block_size, head_dim = cache.shape
    return cache.index_select(1, block_table).view(kv_heads, -1, head_dim)


def _continuations(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   cont: ContinuationBatch) -> torch.Tensor:
    """All continuation queries -> [real tokens, H, D] (rows in ``cont.out_rows`` order)."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = k_cache.shape[0]
    group = num_heads // kv_heads
    segments = cont.gather_rows.shape[0] // cont.max_tokens
    scale = head_dim ** -0.5
    # [S, N, KV, g, D] -> [KV, S, N, g, D]: a kv head's query heads become its query rows.
    queries = q.index_select(0, cont.gather_rows).view(segments, cont.max_tokens, kv_heads,
                                                        group, head_dim)
    queries = queries.permute(2, 0, 1, 3, 4).contiguous()
    rows_per_segment = cont.max_tokens * group
    # Rest of each segment's context: one padded batch.
    keys = _gather(k_cache, cont.rest_table).view(kv_heads * segments, -1, head_dim)
    values = _gather(v_cache, cont.rest_table).view(kv_heads * segments, -1, head_dim)
    scores = torch.bmm(queries.view(kv_heads * segments, rows_per_segment, head_dim),
                       keys.transpose(1, 2)).mul_(scale)
    columns = scores.shape[-1]
    scores.view(kv_heads, segments, cont.max_tokens, group, columns).add_(cont.rest_mask)
    rest_max = scores.amax(dim=-1, keepdim=True)
    weights = scores.sub_(rest_max).exp_()
    rest_sum = weights.sum(dim=-1, keepdim=True)
    o = torch.bmm(weights, values)  # [KV*S, N*g, D], unnormalised
    o = o.view(kv_heads, segments, rows_per_segment, head_dim)
    rest_max = rest_max.view(kv_heads, segments, rows_per_segment, 1)
    rest_sum = rest_sum.view(kv_heads, segments, rows_per_segment, 1)
    for first, end, prefix_table in cont.groups:
        # The group's shared prefix: gathered once, attended by all its queries at once, with
        # the fused CPU kernel (2x faster than bmm/softmax here), which also gives the LSE.
        pk = _gather(k_cache, prefix_table)[None]
        pv = _gather(v_cache, prefix_table)[None]
        grouped = queries[:, first:end].reshape(1, kv_heads, -1, head_dim)
        po, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(grouped, pk, pv)
        shape = (kv_heads, end - first, rows_per_segment, -1)
        po, p_max = po.view(shape), lse.to(po.dtype).view(shape)
        p_sum = 1.0
        r_max = rest_max[:, first:end]
        both = torch.maximum(p_max, r_max)
        p_scale = (p_max - both).exp_()
        r_scale = (r_max - both).exp_()
        o[:, first:end] = o[:, first:end] * r_scale + po * p_scale
        rest_sum[:, first:end] = rest_sum[:, first:end] * r_scale + p_sum * p_scale
    o = o.div_(rest_sum).view(kv_heads, segments, cont.max_tokens, group, head_dim)
    o = o.permute(1, 2, 0, 3, 4).reshape(segments * cont.max_tokens, num_heads, head_dim)
    return o.index_select(0, cont.padded_index)


def _decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
            v_cache: torch.Tensor, batch: AttentionBatch, layer: int) -> torch.Tensor:
    """q [B, H, D], this step's k/v [B, KV, D] (already in the paged cache)."""
    batch_size, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[0]
    group = num_heads // num_kv_heads
    ws = batch.decode_workspace
    if ws is None or ws.fresh:
        tables = batch.decode_block_tables.view(-1)
        keys = _gather(k_cache, tables).view(num_kv_heads * batch_size, -1, head_dim)
        values = _gather(v_cache, tables).view(num_kv_heads * batch_size, -1, head_dim)
        if ws is not None:
            ws.keys.append(keys)
            ws.values.append(values)
    else:
        keys, values = ws.keys[layer], ws.values[layer]
        rows = torch.arange(batch_size, device=q.device)
        keys.view(num_kv_heads, batch_size, -1, head_dim)[:, rows, ws.new_positions] = \
            k.transpose(0, 1)
        values.view(num_kv_heads, batch_size, -1, head_dim)[:, rows, ws.new_positions] = \
            v.transpose(0, 1)
    # Query heads h*g .. h*g+g-1 share kv head h: make them that kv head's g query rows.
    grouped = q.view(batch_size, num_kv_heads, group, head_dim).transpose(0, 1)
    grouped = grouped.reshape(num_kv_heads * batch_size, group, head_dim)
    scores = torch.baddbmm(batch.decode_mask, grouped,
                           keys.transpose(1, 2), alpha=head_dim ** -0.5)
    o = torch.bmm(scores.softmax(dim=-1), values)
    return o.view(num_kv_heads, batch_size, num_heads // num_kv_heads, head_dim) \
        .transpose(0, 1).reshape(batch_size, num_heads, head_dim)
