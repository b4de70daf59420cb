"""The decoder layers of a decode step as one TorchScript function (``scripted_decode`` decides
when it runs and prepares its arguments).

The same aten ops as the eager forward, in the same order, on the same tensors: the eager layer
loop (``model.LlamaFamilyModel.forward``, ``RmsNorm``, ``Int4Linear``/``DenseLinear``,
``PagedCpuBackend._decode``) written once more in the subset of Python TorchScript compiles, so
that the ~60 small ops a layer runs go through the TorchScript interpreter (~1.4 µs an op)
instead of Python and the op dispatcher's Python binding (~2.4 µs). Nothing is fused or reordered
(``scripted_decode`` runs it without the graph executor's optimizations), so every row gets the
eager forward's bits; tests/engine_worker/test_scripted_decode.py holds it to that.

Kept apart from ``scripted_decode`` because TorchScript compiles functions from their source and
reads their annotations at run time: no ``from __future__ import annotations`` here, and only
the types TorchScript knows.
"""

import torch
from torch import Tensor


def _rms_norm(x: Tensor, doubled_weight: Tensor, eps: float) -> Tensor:
    """``rms_norm.RmsNorm`` below float32: layer norm of [x, -x], its first half."""
    n = x.shape[-1]
    both = torch.cat([x, x.neg()], dim=-1)
    return torch.layer_norm(both, [2 * n], doubled_weight, None, eps).narrow(-1, 0, n)


def _linear(x: Tensor, packed: Tensor, scale_zero: Tensor, parts: int, group: int) -> Tensor:
    """``Int4Linear.apply`` (``parts`` > 0) or ``DenseLinear.apply`` of more than one row
    (``parts`` == 0: ``packed`` is the matrix)."""
    if parts == 0:
        return torch.nn.functional.linear(x, packed)
    x = x.contiguous() if parts == 1 else x.repeat(1, parts)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group, scale_zero)


def _attend(
    q: Tensor, keys: Tensor, values: Tensor, mask: Tensor, query_rows: Tensor, kv_heads: int
) -> Tensor:
    """``PagedCpuBackend._decode`` on a kept workspace, after the new keys/values are in it:
    ``keys``/``values`` the layer's workspace viewed [B, KV, columns, D]; ``query_rows`` the
    kernel's query rows per kv head as rows of the group (the last repeated: the eager path's
    padding ``cat``, as one copy)."""
    batch_size, num_heads, head_dim = q.shape[0], q.shape[1], q.shape[2]
    group = num_heads // kv_heads
    rows = q.view(batch_size, kv_heads, group, head_dim)
    if mask.shape[2] > group:
        rows = rows.index_select(2, query_rows)
    o = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        rows, keys, values, attn_mask=mask
    )[0]
    return o.narrow(2, 0, group).reshape(batch_size, num_heads * head_dim)


def decode_layers(
    hidden: Tensor,
    cos: Tensor,
    signed_sin: Tensor,
    mask: Tensor,
    query_rows: Tensor,
    new_slots: Tensor,
    workspace: list[Tensor],
    norms: list[Tensor],
    weights: list[Tensor],
    parts: list[int],
    group: int,
    eps: float,
    heads: int,
    kv_heads: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """Every layer of a decode step on a kept workspace: ``hidden`` [B, hidden] (updated in
    place, as the eager forward does), ``cos``/``signed_sin`` [B, 1, D] the rows' rotary
    rows; per layer ``workspace`` its keys and values as [KV * B * columns, D] (where the new
    token goes) and as [B, KV, columns, D] (what attention reads), ``norms`` its two doubled
    norm weights, ``weights`` its four linears' two tensors each (qkv, o_proj, gate_up, down;
    ``_linear``), ``parts`` their int4 parts (0: dense). Returns hidden and every layer's new
    keys and values stacked [L, B, KV, D] (the cache write after the forward). One function
    for all layers, longer than our usual: every call out of TorchScript costs what the ops it
    saves do."""
    num_tokens = hidden.shape[0]
    head_dim = cos.shape[-1]
    new_keys: list[Tensor] = []
    new_values: list[Tensor] = []
    for i in range(len(norms) // 2):
        w, n = 8 * i, 4 * i
        x = _rms_norm(hidden, norms[2 * i], eps)
        qkv = _linear(x, weights[w], weights[w + 1], parts[n], group)
        v = qkv.narrow(1, (heads + kv_heads) * head_dim, kv_heads * head_dim)
        v = v.view(num_tokens, kv_heads, head_dim)
        qk = qkv.narrow(1, 0, (heads + kv_heads) * head_dim)
        qk = qk.view(num_tokens, heads + kv_heads, head_dim)
        qk = qk * cos + qk.roll(head_dim // 2, -1) * signed_sin
        q, k = qk.narrow(1, 0, heads), qk.narrow(1, heads, kv_heads)
        new_keys.append(k)
        new_values.append(v)
        workspace[4 * i].index_copy_(0, new_slots, k.transpose(0, 1).reshape(-1, head_dim))
        workspace[4 * i + 1].index_copy_(0, new_slots, v.transpose(0, 1).reshape(-1, head_dim))
        attn = _attend(q, workspace[4 * i + 2], workspace[4 * i + 3], mask, query_rows, kv_heads)
        hidden += _linear(attn, weights[w + 2], weights[w + 3], parts[n + 1], group)
        x = _rms_norm(hidden, norms[2 * i + 1], eps)
        gate, up = _linear(x, weights[w + 4], weights[w + 5], parts[n + 2], group).chunk(2, dim=-1)
        mixed = torch.ops.aten.silu(gate) * up
        hidden += _linear(mixed, weights[w + 6], weights[w + 7], parts[n + 3], group)
    return hidden, torch.stack(new_keys), torch.stack(new_values)
