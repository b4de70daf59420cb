"""The decoder layers of a decode step as one TorchScript module (``scripted_decode`` decides
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


def _linear(x: Tensor, packed: Tensor, scale_zero: Tensor, parts: int, group: int) -> Tensor:
    """``Int4Linear.apply`` (``parts`` > 0) or ``DenseLinear.apply`` of more than one row
    (``parts`` == 0: ``packed`` is the plain matrix; -1: oneDNN's packed one)."""
    if parts == -1:
        no_scalars: list[int | float | complex | None] = []  # the op's Scalar?[]
        return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", no_scalars, "")
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


class DecodeLayers(torch.nn.Module):
    """Every layer of a decode step on a kept workspace, with one choice of copy per linear:
    the weights are the module's, converted for TorchScript once (passed as arguments, the
    ~420 tensors of a step's lists cost ~35 µs a call to convert); ``norms`` each layer's two
    doubled norm weights, ``weights`` its four linears' two tensors each (qkv, o_proj,
    gate_up, down; ``_linear``), ``parts`` their int4 parts (0: dense, -1: dense packed for
    oneDNN)."""

    def __init__(
        self,
        norms: list[Tensor],
        weights: list[Tensor],
        parts: list[int],
        group: int,
        eps: float,
        heads: int,
        kv_heads: int,
    ) -> None:
        super().__init__()
        # Per layer, one tuple: unpacked in one interpreter step, where indexing the flat lists
        # took a dozen (an index and its arithmetic each)
        self.layers = [
            (norms[2 * i], norms[2 * i + 1], *weights[8 * i : 8 * i + 8])
            for i in range(len(norms) // 2)
        ]
        self.parts = [tuple(parts[4 * i : 4 * i + 4]) for i in range(len(norms) // 2)]
        self.group, self.eps, self.heads, self.kv_heads = group, eps, heads, kv_heads

    def _linear(self, x: Tensor, packed: Tensor, scale_zero: Tensor, parts: int) -> Tensor:
        return _linear(x, packed, scale_zero, parts, self.group)

    def forward(
        self,
        hidden: Tensor,
        cos: Tensor,
        signed_sin: Tensor,
        mask: Tensor,
        query_rows: Tensor,
        new_slots: Tensor,
        workspace: list[Tensor],
    ) -> tuple[Tensor, Tensor, Tensor]:
        """``hidden`` [B, hidden] (updated in place, as the eager forward does),
        ``cos``/``signed_sin`` [B, 1, D] the rows' rotary rows; per layer ``workspace`` its
        keys and values as [KV * B * columns, D] (where the new token goes) and as
        [B, KV, columns, D] (what attention reads). Returns hidden and every layer's new keys
        and values stacked [L, B, KV, D] (the cache write after the forward). One loop for all
        layers, longer than our usual: every call out of TorchScript costs what the ops it
        saves do."""
        heads, kv_heads, eps = self.heads, self.kv_heads, self.eps
        num_tokens, width = hidden.shape[0], hidden.shape[1]
        head_dim = cos.shape[-1]
        qk_width, v_width = (heads + kv_heads) * head_dim, kv_heads * head_dim
        # The residual stream beside its negation, [B, 2 * hidden]: the fused RmsNorm's input
        # (``rms_norm.RmsNorm``: layer norm of [x, -x]) without a cat and a neg per norm, kept
        # so by one more subtraction per update (-h - y is -(h + y) exactly: rounding to
        # nearest is symmetric).
        both = torch.cat([hidden, hidden.neg()], dim=-1)
        residual, negated = both.narrow(1, 0, width), both.narrow(1, width, width)
        new_keys: list[Tensor] = []
        new_values: list[Tensor] = []
        for i in range(len(self.layers)):
            (
                input_norm,
                post_attention_norm,
                qkv_weight,
                qkv_scales,
                o_weight,
                o_scales,
                gate_up_weight,
                gate_up_scales,
                down_weight,
                down_scales,
            ) = self.layers[i]
            qkv_parts, o_parts, gate_up_parts, down_parts = self.parts[i]
            x = torch.layer_norm(both, [2 * width], input_norm, None, eps).narrow(1, 0, width)
            qkv = self._linear(x, qkv_weight, qkv_scales, qkv_parts)
            v = qkv.narrow(1, qk_width, v_width).view(num_tokens, kv_heads, head_dim)
            qk = qkv.narrow(1, 0, qk_width).view(num_tokens, heads + kv_heads, head_dim)
            qk = qk * cos + qk.roll(head_dim // 2, -1) * signed_sin
            q, k = qk.narrow(1, 0, heads), qk.narrow(1, heads, kv_heads)
            new_keys.append(k)
            new_values.append(v)
            workspace[4 * i].index_copy_(0, new_slots, k.transpose(0, 1).reshape(-1, head_dim))
            workspace[4 * i + 1].index_copy_(0, new_slots, v.transpose(0, 1).reshape(-1, head_dim))
            attn = _attend(
                q, workspace[4 * i + 2], workspace[4 * i + 3], mask, query_rows, kv_heads
            )
            y = self._linear(attn, o_weight, o_scales, o_parts)
            residual += y
            negated -= y
            x = torch.layer_norm(both, [2 * width], post_attention_norm, None, eps)
            x = x.narrow(1, 0, width)
            gate_up = self._linear(x, gate_up_weight, gate_up_scales, gate_up_parts)
            half = gate_up.shape[1] // 2
            mixed = torch.ops.aten.silu(gate_up.narrow(1, 0, half)) * gate_up.narrow(1, half, half)
            y = self._linear(mixed, down_weight, down_scales, down_parts)
            residual += y
            negated -= y
        return hidden.copy_(residual), torch.stack(new_keys), torch.stack(new_values)


class OwnKernelDecodeLayers(DecodeLayers):
    """``DecodeLayers`` with the int4 copies on our kernel (``Int4Linear`` with blocks:
    ``splitserve::int4_decode_mm``, the call its ``apply`` makes). A class of its own: TorchScript
    compiles a call to the op only where the op is loaded."""

    def _linear(self, x: Tensor, packed: Tensor, scale_zero: Tensor, parts: int) -> Tensor:
        if parts <= 0:  # the dense copy
            return _linear(x, packed, scale_zero, parts, self.group)
        return torch.ops.splitserve.int4_decode_mm(x, packed, parts)
