"""The CPU backend's one attention arithmetic, whatever path computes a query row.

A fresh prompt's rows, a continuation's after cached blocks (a prefix-cache hit, chunked
prefill), a decode row and a recomputed one are all attended the same way: by PyTorch's fused
CPU flash kernel (a private op), over their sequence's keys from position 0, with an explicit
additive mask. The kernel keeps scores, softmax and the weighted sum in float32 (with bf16
inputs, the probabilities are rounded to bf16 before the weighted sum, the output once at the
end). Three rules make a row's result the same bits whatever else the call holds, measured with
bf16 inputs on AVX-512 (docs/determinism.md):

* key columns start at the sequence's position 0 and their count is a multiple of
  ``KEY_COLUMN_MULTIPLE`` (of ``KEY_BLOCK_COLUMNS`` past that many): the kernel walks keys in
  blocks of 512 from column 0 and sums a row in 16-wide lanes, so columns past a row's position
  (masked, exact zeros) change nothing, but a count with a tail rounds that tail differently
  (and past 512 keys a partial last block did too);
* at least ``MIN_QUERY_ROWS`` query rows per (sequence, kv head), and as many in the last of
  the kernel's blocks of rows (``padded_rows``): with fewer, their products round differently
  (measured: prompts prefilled in chunks of 11 positions, 33 rows a kv head, 5 of 32 chat
  prompts decoded other tokens);
* the query heads that share a kv head are that kv head's rows (``grouped``), so no kv head is
  repeated and a row's keys are the same tensor in every layout.

So a token's attention does not depend on how its context was split between cache and new
tokens, on the chunk it was computed in, on padding, on the other sequences of the step or on
the thread count. With float32 inputs the kernel is exact to float32 but not batch-invariant.

A sliding window is one more masked span (the keys before the window, exact zeros too), so a
windowed row keeps these rules; and leading key blocks of 512 that no row of a call sees are
left out of it (``window_start``): measured bitwise, the kernel's rows do not change without
them, so a long context does not read keys its windowed layers will not use. Soft-capped
scores (Gemma 2) are not the kernel's arithmetic: such layers take ``capped_attention``,
float32 matmuls over the same padded layout, which is exact to float32 but promises no bits
across paths.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from engine_worker.model_config import LayerAttention

KEY_COLUMN_MULTIPLE = 16
# Past one of the kernel's key blocks, whole blocks: with a partial last block, the default
# model's decode rows near position 700 got other bits over 704 key columns than over 736
# (measured in the engine; random inputs did not show it), so a decode row's result depended on
# the decode workspace's headroom and on the longest row of its batch.
KEY_BLOCK_COLUMNS = 512
MIN_QUERY_ROWS = 4
QUERY_BLOCK_ROWS = 32
# Prefill queries are attended in chunks of this many positions, each over the keys up to its
# own last position only: a causal mask would otherwise have a long prompt's first queries
# compute all of its keys (the flash kernel skips masked blocks only under is_causal, whose
# ragged block ends break the rules above).
QUERY_CHUNK_POSITIONS = 256


def fused_cpu_kernel_available() -> bool:
    return hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")


def key_columns(tokens: int, block_size: int, whole_key_blocks: bool = False) -> int:
    """Key columns a row at ``tokens`` context attends: whole blocks, a multiple of 16 up to
    ``KEY_BLOCK_COLUMNS``, of it above; of it always with ``whole_key_blocks`` (a deterministic
    launch: below 512 keys a row's bits can still depend on the count, measured in
    docs/determinism.md, and 512 columns for every short row cost 7-13% of a decode step)."""
    step = math.lcm(KEY_COLUMN_MULTIPLE, block_size)
    if whole_key_blocks or tokens > KEY_BLOCK_COLUMNS:
        step = math.lcm(KEY_BLOCK_COLUMNS, block_size)
    return -(-tokens // step) * step


def window_start(first_visible: int, block_size: int) -> int:
    """The first key column a call attends when none of its rows sees a column before
    ``first_visible``: the whole key blocks of the kernel before it are skipped (a multiple of
    the cache's block size too, so a block table can start there)."""
    step = math.lcm(KEY_BLOCK_COLUMNS, block_size)
    return max(0, first_visible) // step * step


def causal_mask(
    positions: np.ndarray, columns: int, group: int, dtype: torch.dtype, window: int = 0
) -> torch.Tensor:
    """[rows, columns] additive mask of the query rows at ``positions`` (each ``group`` rows,
    padded to MIN_QUERY_ROWS with copies of the last one): 0 up to the row's position (from
    the position - ``window`` + 1 on, with a sliding window), -inf elsewhere."""
    rows: np.ndarray = np.repeat(positions, group)
    if padded_rows(len(rows)) > len(rows):
        rows = np.pad(rows, (0, padded_rows(len(rows)) - len(rows)), mode="edge")
    hidden = np.arange(columns)[None, :] > rows[:, None]
    if window:
        hidden |= np.arange(columns)[None, :] <= rows[:, None] - window
    mask = torch.zeros(hidden.shape, dtype=dtype)
    return mask.masked_fill_(torch.from_numpy(hidden), float("-inf"))


def padded_rows(rows: int) -> int:
    """Query rows a call gets for ``rows`` real ones: the kernel takes rows in blocks of
    ``QUERY_BLOCK_ROWS``; no block, the last included, may have fewer than MIN_QUERY_ROWS."""
    tail = rows % QUERY_BLOCK_ROWS
    return rows if tail == 0 or tail >= MIN_QUERY_ROWS else rows + MIN_QUERY_ROWS - tail


def grouped(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """q [N, H, D] -> [KV, rows, D]: row n * g + j is position n's j-th query head of the kv
    head; padded to MIN_QUERY_ROWS rows with copies of the last."""
    count, heads, head_dim = q.shape
    group = heads // kv_heads
    rows = q.view(count, kv_heads, group, head_dim).transpose(0, 1).reshape(kv_heads, -1, head_dim)
    short = padded_rows(rows.shape[1]) - rows.shape[1]
    if short > 0:
        rows = torch.cat([rows, rows[:, -1:].expand(kv_heads, short, head_dim)], dim=1)
    return rows


def ungrouped(o: torch.Tensor, count: int, group: int) -> torch.Tensor:
    """The inverse of ``grouped`` for ``count`` positions: [KV, rows, D] -> [count, H, D]."""
    kv_heads, _, head_dim = o.shape
    real = o[:, : count * group].view(kv_heads, count, group, head_dim)
    return real.transpose(0, 1).reshape(count, kv_heads * group, head_dim)


def flash(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    layer: LayerAttention | None = None,
) -> torch.Tensor:
    """queries [B, KV, R, D], keys/values [B, KV, C, D], mask broadcastable to [B, KV, R, C];
    ``layer``: its softmax scale and soft-cap (None: plain)."""
    if layer is not None and layer.softcap:
        return capped_attention(queries, keys, values, mask, layer)
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    scale = None if layer is None else layer.scale
    return op(queries, keys, values, attn_mask=mask, scale=scale)[0]


def capped_attention(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    layer: LayerAttention,
) -> torch.Tensor:
    """``flash`` with soft-capped scores, which the fused kernel cannot apply
    (``soft_capped_attention``)."""
    scale = layer.scale if layer.scale is not None else queries.shape[-1] ** -0.5
    return soft_capped_attention(queries, keys, values, mask, scale, layer.softcap)


def soft_capped_attention(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float,
) -> torch.Tensor:
    """cap * tanh(scale * q.k / cap) + mask, softmax, weighted sum, in float32; the output in
    the queries' dtype (TorchScript compiles it: scripted_layers)."""
    scores = torch.matmul(queries.float(), keys.float().transpose(-1, -2)).mul_(scale)
    scores = scores.div_(softcap).tanh_().mul_(softcap).add_(mask)
    out = torch.matmul(scores.softmax(dim=-1), values.float())
    return out.to(queries.dtype)
