"""Every prefill continuation of a step attended together, shared prefixes once ("cascade").

Continuations (chunked prefill, prefix-cache hits) often share leading cache blocks: many
requests behind one system prompt. Attending them one by one gathers that prefix once per
segment; here a prefix group gathers it once and all its queries attend it in one call of
PyTorch's fused CPU flash kernel (a private op, also for its log-sum-exp), the rest of each
segment's context goes through one padded batch, and the two partial softmaxes are merged.
"""

from __future__ import annotations

import numpy as np
import torch

from engine_worker.attention.batch import ContinuationBatch, StepBatch, to_device
from engine_worker.attention.kv_cache import gather


def fused_cpu_kernel_available() -> bool:
    return hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")


def build_continuations(
    step: StepBatch, seqs: np.ndarray, dtype: torch.dtype, device: torch.device
) -> ContinuationBatch:
    """The padded batch of the continuation sequences ``seqs``; sequences whose tables begin
    with the same blocks (all before any of their new tokens) share those."""
    size, tables = step.block_size, step.block_tables
    # Segments with the same first block are adjacent; each such run is a candidate group.
    seqs = seqs[np.argsort(tables[seqs, 0], kind="stable")]
    count = len(seqs)
    seg_starts, seg_lengths = step.starts[seqs], step.lengths[seqs]
    blocks = -(-(seg_starts + seg_lengths) // size)
    shared: np.ndarray = np.zeros(count, dtype=np.int64)  # prefix blocks of each segment
    groups = []
    first = 0
    while first < count:
        end = first + 1
        while end < count and tables[seqs[end], 0] == tables[seqs[first], 0]:
            end += 1
        if end - first > 1:
            limit = int(seg_starts[first:end].min()) // size  # blocks before every query
            rows = tables[seqs[first:end], :limit]
            same = (rows == rows[0]).all(axis=0)
            common = int(limit if same.all() else np.argmin(same))
            if common:
                shared[first:end] = common
                groups.append((first, end, to_device(rows[0, :common].copy(), device)))
        first = end
    rest_blocks = int((blocks - shared).max())
    rest: np.ndarray = np.zeros((count, rest_blocks), dtype=np.int64)  # pads read block 0, masked
    for j, i in enumerate(seqs):
        rest[j, : blocks[j] - shared[j]] = tables[i, shared[j] : blocks[j]]
    max_tokens = int(seg_lengths.max())
    # Query j of segment s sits at position start + j; rest column c holds position
    # shared * size + c. Pad queries (j >= length) see every real key, so no row is empty.
    query_pos = seg_starts[:, None] + np.arange(max_tokens)[None, :]
    key_pos = shared[:, None] * size + np.arange(rest_blocks * size)[None, :]
    hidden = (key_pos[:, None, :] > query_pos[:, :, None]) | (
        key_pos >= (seg_starts + seg_lengths)[:, None]
    )[:, None, :]
    mask = torch.zeros(hidden.shape, dtype=dtype)
    mask.masked_fill_(torch.from_numpy(hidden), float("-inf"))
    within = np.arange(max_tokens)[None, :]
    real = within < seg_lengths[:, None]
    gather_rows = step.row_starts[seqs][:, None] + np.minimum(within, seg_lengths[:, None] - 1)
    return ContinuationBatch(
        max_tokens=max_tokens,
        gather_rows=to_device(gather_rows.reshape(-1), device),
        padded_index=to_device(np.nonzero(real.reshape(-1))[0], device),
        out_rows=to_device(gather_rows[real], device),
        rest_table=to_device(rest.reshape(-1), device),
        rest_mask=mask[:, :, None, :].to(device),
        groups=groups,
    )


def attend_continuations(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cont: ContinuationBatch
) -> torch.Tensor:
    """All continuation queries -> [real tokens, H, D] (rows in ``cont.out_rows`` order)."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = k_cache.shape[0]
    group = num_heads // kv_heads
    segments = cont.gather_rows.shape[0] // cont.max_tokens
    scale = head_dim**-0.5
    # [S, N, KV, g, D] -> [KV, S, N, g, D]: a kv head's query heads become its query rows.
    queries = q.index_select(0, cont.gather_rows).view(
        segments, cont.max_tokens, kv_heads, group, head_dim
    )
    queries = queries.permute(2, 0, 1, 3, 4).contiguous()
    rows_per_segment = cont.max_tokens * group
    # Rest of each segment's context: one padded batch.
    keys = gather(k_cache, cont.rest_table).view(kv_heads * segments, -1, head_dim)
    values = gather(v_cache, cont.rest_table).view(kv_heads * segments, -1, head_dim)
    scores = torch.bmm(
        queries.view(kv_heads * segments, rows_per_segment, head_dim), keys.transpose(1, 2)
    ).mul_(scale)
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
        pk = gather(k_cache, prefix_table)[None]
        pv = gather(v_cache, prefix_table)[None]
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
