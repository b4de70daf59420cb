"""Attention kernels both backends use: the grouped decode batch and one prefill segment."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine_worker.attention.kv_cache import gather


def gather_decode(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """A layer's cache at each decode row's blocks [B, blocks] -> [KV * B, columns, D]."""
    kv_heads, head_dim = cache.shape[0], cache.shape[-1]
    return gather(cache, block_tables.view(-1)).view(kv_heads * block_tables.shape[0], -1, head_dim)


def decode_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """q [B, H, D]; keys/values [KV * B, columns, D]; mask [KV * B, 1, columns] -> [B, H, D].

    The query heads that share a kv head become that kv head's query rows, so it is two
    batched matmuls and no kv head is ever repeated (on CPU this beats SDPA, whose fused kernel
    pays per (batch, head) for tiny queries)."""
    batch_size, num_heads, head_dim = q.shape
    num_kv_heads = keys.shape[0] // batch_size
    group = num_heads // num_kv_heads
    # Query heads h*g .. h*g+g-1 share kv head h: make them that kv head's g query rows.
    grouped = q.view(batch_size, num_kv_heads, group, head_dim).transpose(0, 1)
    grouped = grouped.reshape(num_kv_heads * batch_size, group, head_dim)
    scores = torch.baddbmm(mask, grouped, keys.transpose(1, 2), alpha=head_dim**-0.5)
    o = torch.bmm(scores.softmax(dim=-1), values)
    return (
        o.view(num_kv_heads, batch_size, group, head_dim)
        .transpose(0, 1)
        .reshape(batch_size, num_heads, head_dim)
    )


def segment_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None
) -> torch.Tensor:
    """One sequence's queries q [N, H, D] over its keys/values [KV, L, D] -> [N, H, D].

    ``mask`` [N, L] (True = attend) for a continuation; None: a fresh prompt, causal."""
    group = q.shape[1] // keys.shape[0]
    # SDPA's fused CPU kernel does not take enable_gqa (it falls back to the slow math path),
    # so the kv heads are repeated; that costs far less than the fallback.
    keys = keys.repeat_interleave(group, dim=0)
    values = values.repeat_interleave(group, dim=0)
    # 4-D inputs: with 3-D ones SDPA also takes the math path on CPU.
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], keys[None], values[None], attn_mask=mask, is_causal=mask is None
    )[0]
    return o.transpose(0, 1)
