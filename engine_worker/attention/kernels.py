"""Attention kernels both backends use: the grouped decode batch and one prefill segment."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine_worker.attention.kv_cache import gather
from engine_worker.model_config import PLAIN_ATTENTION, LayerAttention


def gather_decode(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """A layer's cache at each decode row's blocks [B, blocks] -> [KV * B, columns, D]."""
    kv_heads, head_dim = cache.shape[0], cache.shape[-1]
    return gather(cache, block_tables.view(-1)).view(kv_heads * block_tables.shape[0], -1, head_dim)


def decode_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    layer: LayerAttention = PLAIN_ATTENTION,
) -> torch.Tensor:
    """q [B, H, D]; keys/values [KV * B, columns, D]; mask [KV * B, 1, columns] -> [B, H, D];
    ``layer``: the softmax scale and soft-cap.

    The query heads that share a kv head become that kv head's query rows, so it is two
    batched matmuls and no kv head is ever repeated (on CPU this beats SDPA, whose fused kernel
    pays per (batch, head) for tiny queries)."""
    batch_size, num_heads, head_dim = q.shape
    num_kv_heads = keys.shape[0] // batch_size
    group = num_heads // num_kv_heads
    # Query heads h*g .. h*g+g-1 share kv head h: make them that kv head's g query rows.
    grouped = q.view(batch_size, num_kv_heads, group, head_dim).transpose(0, 1)
    grouped = grouped.reshape(num_kv_heads * batch_size, group, head_dim)
    scale = head_dim**-0.5 if layer.scale is None else layer.scale
    if layer.softcap:
        scores = torch.bmm(grouped, keys.transpose(1, 2)).mul_(scale / layer.softcap)
        scores = scores.tanh_().mul_(layer.softcap).add_(mask)
    else:
        scores = torch.baddbmm(mask, grouped, keys.transpose(1, 2), alpha=scale)
    o = torch.bmm(scores.softmax(dim=-1), values)
    return (
        o.view(num_kv_heads, batch_size, group, head_dim)
        .transpose(0, 1)
        .reshape(batch_size, num_heads, head_dim)
    )


def segment_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    layer: LayerAttention = PLAIN_ATTENTION,
) -> torch.Tensor:
    """One sequence's queries q [N, H, D] over its keys/values [KV, L, D] -> [N, H, D].

    ``mask`` [N, L] (True = attend) for a continuation or a window; None: a fresh prompt,
    causal. ``layer``: the softmax scale and soft-cap."""
    group = q.shape[1] // keys.shape[0]
    # SDPA's fused CPU kernel does not take enable_gqa (it falls back to the slow math path),
    # so the kv heads are repeated; that costs far less than the fallback.
    keys = keys.repeat_interleave(group, dim=0)
    values = values.repeat_interleave(group, dim=0)
    queries = q.transpose(0, 1)
    if layer.softcap:
        if mask is None:
            mask = torch.ones(q.shape[0], keys.shape[1], dtype=torch.bool, device=q.device).tril()
        scale = q.shape[-1] ** -0.5 if layer.scale is None else layer.scale
        scores = torch.matmul(queries, keys.transpose(1, 2)).mul_(scale / layer.softcap)
        scores = scores.tanh_().mul_(layer.softcap).masked_fill_(~mask, float("-inf"))
        return torch.matmul(scores.softmax(dim=-1), values).transpose(0, 1)
    # 4-D inputs: with 3-D ones SDPA also takes the math path on CPU.
    o = F.scaled_dot_product_attention(
        queries[None],
        keys[None],
        values[None],
        attn_mask=mask,
        is_causal=mask is None,
        scale=layer.scale,
    )[0]
    return o.transpose(0, 1)
