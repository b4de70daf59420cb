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
    return torch.layer_norm(both, [2 * n], doubled_weight, None, eps)[..., :n]


def _linear(x: Tensor, weights: list[Tensor], index: int, parts: int, group: int) -> Tensor:
    """``Int4Linear.apply`` (``parts`` > 0: ``weights[2 * index]`` packed, ``[2 * index + 1]``
    its scales and zeros) or ``DenseLinear.apply`` of more than one row (``parts`` == 0:
    ``weights[2 * index]`` the matrix)."""
    if parts == 0:
        return torch.nn.functional.linear(x, weights[2 * index])
    x = x.contiguous() if parts == 1 else x.repeat(1, parts)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(
        x, weights[2 * index], group, weights[2 * index + 1]
    )


def _attend(
    q: Tensor, keys: Tensor, values: Tensor, mask: Tensor, kv_heads: int, head_dim: int
) -> Tensor:
    """``PagedCpuBackend._decode`` on a kept workspace, after the new keys/values are in it."""
    batch_size, num_heads = q.shape[0], q.shape[1]
    group = num_heads // kv_heads
    rows = q.view(batch_size, kv_heads, group, head_dim)
    short = mask.shape[2] - group
    if short > 0:
        rows = torch.cat([rows, rows[:, :, -1:].expand(-1, -1, short, -1)], dim=2)
    columns = keys.shape[1]
    o = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        rows,
        keys.view(kv_heads, batch_size, columns, head_dim).transpose(0, 1),
        values.view(kv_heads, batch_size, columns, head_dim).transpose(0, 1),
        attn_mask=mask,
    )[0]
    return o[:, :, :group].reshape(batch_size, num_heads, head_dim)


def decode_layers(
    hidden: Tensor,
    cos: Tensor,
    signed_sin: Tensor,
    mask: Tensor,
    new_slots: Tensor,
    workspace_keys: list[Tensor],
    workspace_values: list[Tensor],
    norms: list[Tensor],
    weights: list[Tensor],
    parts: list[int],
    group: int,
    eps: float,
    heads: int,
    kv_heads: int,
    head_dim: int,
) -> tuple[Tensor, list[Tensor], list[Tensor]]:
    """Every layer of a decode step on a kept workspace: ``hidden`` [B, hidden] (updated in
    place, as the eager forward does), ``cos``/``signed_sin`` [B, 1, D] the rows' rotary
    rows; per layer ``norms`` its two doubled norm weights, ``weights`` its four linears' (qkv,
    o_proj, gate_up, down; ``_linear``), ``parts`` their int4 parts (0: dense). Returns hidden
    and every layer's new keys and values [B, KV, D] (the cache write after the forward)."""
    num_tokens = hidden.shape[0]
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    new_keys: list[Tensor] = []
    new_values: list[Tensor] = []
    for i in range(len(workspace_keys)):
        x = _rms_norm(hidden, norms[2 * i], eps)
        qkv = _linear(x, weights, 4 * i, parts[4 * i], group)
        v = qkv[:, q_size + kv_size :].view(num_tokens, kv_heads, head_dim)
        qk = qkv[:, : q_size + kv_size].view(num_tokens, heads + kv_heads, head_dim)
        qk = qk * cos + qk.roll(head_dim // 2, -1) * signed_sin
        q, k = qk[:, :heads], qk[:, heads:]
        new_keys.append(k)
        new_values.append(v)
        keys, values = workspace_keys[i], workspace_values[i]
        keys.view(-1, head_dim).index_copy_(0, new_slots, k.transpose(0, 1).reshape(-1, head_dim))
        values.view(-1, head_dim).index_copy_(0, new_slots, v.transpose(0, 1).reshape(-1, head_dim))
        attn = _attend(q, keys, values, mask, kv_heads, head_dim)
        hidden += _linear(
            attn.reshape(num_tokens, q_size), weights, 4 * i + 1, parts[4 * i + 1], group
        )
        x = _rms_norm(hidden, norms[2 * i + 1], eps)
        gate, up = _linear(x, weights, 4 * i + 2, parts[4 * i + 2], group).chunk(2, dim=-1)
        hidden += _linear(
            torch.nn.functional.silu(gate) * up, weights, 4 * i + 3, parts[4 * i + 3], group
        )
    return hidden, new_keys, new_values
