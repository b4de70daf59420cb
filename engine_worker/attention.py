"""Attention over the paged KV cache, for one flat batch of tokens from many sequences.

A step's tokens are packed into one flat sequence (no padding in the linear layers). Attention is
then done per group:

* decode rows (one new token per sequence) are attended together: their blocks are gathered
  whole (``k_cache[block_tables]`` copies block_size*kv_heads*head_dim contiguous floats at a
  time, which is the cheap way to gather on CPU) into a padded batch, and the query heads that
  share a kv head are laid out as that kv head's query rows, so no kv head is ever repeated;
* prefill segments are attended one sequence at a time with SDPA: a fresh prompt uses its own
  k/v with ``is_causal``; a continuation (chunked prefill, prefix-cache hit) gathers its earlier
  blocks and uses an explicit offset-causal mask.

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
class AttentionBatch:
    slot_mapping: torch.Tensor  # [T] cache slot of every new token
    decode_rows: torch.Tensor | None = None  # [B] flat rows of decode tokens (None: no decode)
    decode_block_tables: torch.Tensor | None = None  # [B, blocks]
    decode_mask: torch.Tensor | None = None  # [B, 1, 1, blocks*block_size]
    decode_is_whole_batch: bool = False  # rows are exactly 0..T-1: skip the row gathers
    prefills: list[PrefillSegment] = field(default_factory=list)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
    """q [T, H, D], k/v [T, KV, D]; caches [blocks, block_size, KV, D]. Returns [T, H, D]."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, batch.slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, batch.slot_mapping, v)
    if batch.decode_is_whole_batch:
        return _decode(q, k_cache, v_cache, batch)
    out = torch.empty_like(q)
    if batch.decode_rows is not None:
        out[batch.decode_rows] = _decode(q[batch.decode_rows], k_cache, v_cache, batch)
    for seg in batch.prefills:
        rows = slice(seg.row_start, seg.row_start + seg.num_tokens)
        query = q[rows].transpose(0, 1)
        if seg.block_table is None:
            o = F.scaled_dot_product_attention(query, k[rows].transpose(0, 1),
                                               v[rows].transpose(0, 1), is_causal=True,
                                               enable_gqa=True)
        else:
            length = seg.start_position + seg.num_tokens
            keys = k_cache[seg.block_table].view(-1, num_kv_heads, head_dim)[:length]
            values = v_cache[seg.block_table].view(-1, num_kv_heads, head_dim)[:length]
            o = F.scaled_dot_product_attention(query, keys.transpose(0, 1),
                                               values.transpose(0, 1), attn_mask=seg.mask,
                                               enable_gqa=True)
        out[rows] = o.transpose(0, 1)
    return out


def _decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            batch: AttentionBatch) -> torch.Tensor:
    batch_size, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    tables = batch.decode_block_tables
    keys = k_cache[tables].view(batch_size, -1, num_kv_heads, head_dim).transpose(1, 2)
    values = v_cache[tables].view(batch_size, -1, num_kv_heads, head_dim).transpose(1, 2)
    # Query heads h*g .. h*g+g-1 share kv head h: make them that kv head's g query rows.
    grouped = q.view(batch_size, num_kv_heads, num_heads // num_kv_heads, head_dim)
    o = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=batch.decode_mask)
    return o.reshape(batch_size, num_heads, head_dim)
