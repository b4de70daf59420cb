"""The hot decode step's layers as TorchScript modules: ``decoder_layer.DecoderLayer`` (the one
definition every step runs) with its linears and its attention given as graph ops
(``scripted_decode`` compiles them, decides when they run and prepares their inputs).

* ``ScriptedLayer.apply``: one copy of a ``linear.BatchSizeSwitch``, the call its ``apply``
  makes (``Int4Linear`` on aten's kernel or ours (``OwnKernelLayer``), ``DenseLinear`` of more
  than one row);
* ``ScriptedLayer.attend``: ``PagedCpuBackend._decode`` on a kept decode workspace (the new
  keys/values written into it, the same flash kernel, masks and key columns);
* ``DecodeStack``: every layer of the step in one call.

Why: at batch 1 the default model's step is ~1,900 small ops; the kernels that do the work (int4
matmul, flash attention) are about 60% of it and the rest is Python calling ops one by one.
TorchScript's interpreter runs the same ops at ~60% of eager's cost each. Nothing is fused or
reordered (``scripted_decode`` runs it without the graph executor's optimizations), so every row
gets the eager forward's bits.

No ``from __future__ import annotations`` here: TorchScript reads the annotations at run time.
"""

from typing import TYPE_CHECKING, Final

import torch
from torch import Tensor

from engine_worker.attention.flash_rows import MIN_QUERY_ROWS, soft_capped_attention
from engine_worker.decoder_layer import LINEARS, DecoderLayer, residual_stream
from engine_worker.linear import BatchSizeSwitch, DenseLinear, Int4Linear, Int4PromptLinear

if TYPE_CHECKING:
    from engine_worker.layers import LayerWeights
    from engine_worker.model_config import ModelConfig


def copy_tensors(switch: BatchSizeSwitch, int4: bool) -> tuple[Tensor, Tensor, Tensor, int, int]:
    """The int4 copy of ``switch`` (``int4``) or its dense copy as ``ScriptedLayer.apply``
    takes it: weight, scales, bias (empty: none), parts (> 0: int4 planes, on our kernel where
    the group is 0, with int8 activations where it is -1; 0: the plain dense matrix; -1:
    oneDNN's packed one), group."""
    if int4:
        q = switch.quantized
        assert isinstance(q, Int4Linear)
        bias = torch.empty(0) if q.bias is None else q.bias
        return q.packed, q.scale_zero, bias, q.parts, 0 if q.own_kernel else q.group
    dense = switch.dense
    if isinstance(dense, Int4PromptLinear):  # the same blocks, int8 activations: group -1
        q = dense.layer
        bias = torch.empty(0) if q.bias is None else q.bias
        return q.packed, q.scale_zero, bias, q.parts, -1
    assert isinstance(dense, DenseLinear)
    matrix = dense.weight if dense.packed is None else dense.packed
    bias = torch.empty(0) if dense.bias is None else dense.bias
    return matrix, matrix, bias, 0 if dense.packed is None else -1, 0


class ScriptedLayer(DecoderLayer):
    """The layer with one copy of each linear and attention on a kept decode workspace. Its
    step inputs: ``step_tensors`` the new tokens' slots in the workspace (0), the masks (at
    ``mask_at``) and per layer its workspace keys and values viewed as [KV * B * columns, D]
    (where the new token goes) and [B, KV, columns, D] (what attention reads; from
    ``workspace_at``); ``step_ints`` the first key column of each window
    (``window_at``)."""

    # Constants named here, not annotated: TorchScript reads the annotations of one class only
    # (the first that has any), and DecoderLayer's are its constants. ``workspace_at`` differs
    # per layer: an attribute (``DecoderLayer``'s comment says why)
    __constants__ = ["group", "pads_rows", "mask_at", "window_at", "capped_scale"]
    __constants__ += [name + "_kind" for name in LINEARS]

    def __init__(
        self,
        config: "ModelConfig",
        weights: "LayerWeights",
        index: int,
        copies: list[tuple[Tensor, Tensor, Tensor, int, int]],
        windows: list[int],
    ) -> None:
        super().__init__(config, weights, index)
        # per linear (qkv, o_proj, gate_up, down): its tensors as attributes, its kind constant
        for name, (weight, scale_zero, bias, parts, group) in zip(LINEARS, copies):
            setattr(self, name + "_weight", weight)
            setattr(self, name + "_scale_zero", scale_zero)
            setattr(self, name + "_bias", bias)
            setattr(self, name + "_kind", (parts, group, bias.numel() > 0))
        self.group = self.heads // self.kv_heads  # query heads per kv head
        rows = max(MIN_QUERY_ROWS, self.group)  # PagedCpuBackend's query rows a kv head
        self.pads_rows = rows > self.group
        self.query_rows = torch.tensor([min(r, self.group - 1) for r in range(rows)])
        self.window_at = windows.index(self.window) if self.window else -1
        self.mask_at = 1 if not self.window else 2 + self.window_at
        self.workspace_at = 2 + len(windows) + 4 * index
        self.capped_scale = self.head_dim**-0.5 if self.scale is None else self.scale

    def linear(self, x: Tensor, which: str) -> Tensor:
        if which == "qkv":
            return self.apply(x, self.qkv_weight, self.qkv_scale_zero, self.qkv_bias, self.qkv_kind)
        if which == "o_proj":
            w, sz, b, kind = (
                self.o_proj_weight,
                self.o_proj_scale_zero,
                self.o_proj_bias,
                self.o_proj_kind,
            )
            return self.apply(x, w, sz, b, kind)
        if which == "gate_up":
            w, sz, b, kind = (
                self.gate_up_weight,
                self.gate_up_scale_zero,
                self.gate_up_bias,
                self.gate_up_kind,
            )
            return self.apply(x, w, sz, b, kind)
        return self.apply(x, self.down_weight, self.down_scale_zero, self.down_bias, self.down_kind)

    def apply(
        self,
        x: Tensor,
        weight: Tensor,
        scale_zero: Tensor,
        bias: Tensor,
        kind: tuple[int, int, bool],
    ) -> Tensor:
        """One copy's ``apply`` (``copy_tensors``): ``Int4Linear.apply`` on aten's kernel or
        ours, or ``DenseLinear.apply`` of more than one row."""
        parts, group, has_bias = kind
        if parts == -1:
            no_scalars: list[int | float | complex | None] = []  # the op's Scalar?[]
            op = torch.ops.mkldnn._linear_pointwise
            if has_bias:
                return op(x, weight, bias, "none", no_scalars, "")
            return op(x, weight, None, "none", no_scalars, "")
        if parts == 0:
            if has_bias:
                return torch.nn.functional.linear(x, weight, bias)
            return torch.nn.functional.linear(x, weight)
        if group == 0:
            y = self.own_kernel(x, weight, parts)
        elif group == -1:
            y = self.prompt_kernel(x, weight, parts)
        else:
            x = x.contiguous() if parts == 1 else x.repeat(1, parts)
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, weight, group, scale_zero)
        return y + bias if has_bias else y

    def own_kernel(self, x: Tensor, blocks: Tensor, parts: int) -> Tensor:
        raise NotImplementedError  # OwnKernelLayer's: the op exists where it is loaded

    def prompt_kernel(self, x: Tensor, blocks: Tensor, parts: int) -> Tensor:
        raise NotImplementedError  # OwnKernelLayer's

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, step_tensors: list[Tensor], step_ints: list[int]
    ) -> Tensor:
        """q [B, H, D]; the kernel's query rows a kv head are its group, the last repeated
        (``PagedCpuBackend._decode``'s padding ``cat``, as one ``index_select``)."""
        head_dim, at, new_slots = self.head_dim, self.workspace_at, step_tensors[0]
        step_tensors[at].index_copy_(0, new_slots, k.transpose(0, 1).reshape(-1, head_dim))
        step_tensors[at + 1].index_copy_(0, new_slots, v.transpose(0, 1).reshape(-1, head_dim))
        keys, values, mask = step_tensors[at + 2], step_tensors[at + 3], step_tensors[self.mask_at]
        rows = q.view(-1, self.kv_heads, self.group, head_dim)
        if self.pads_rows:
            rows = rows.index_select(2, self.query_rows)
        if self.window > 0:
            first = step_ints[self.window_at]  # whole key blocks no row sees
            if first > 0:
                keys = keys.narrow(2, first, keys.shape[2] - first)
                values = values.narrow(2, first, values.shape[2] - first)
                mask = mask.narrow(3, first, mask.shape[3] - first)
        if self.softcap > 0.0:
            o = soft_capped_attention(rows, keys, values, mask, self.capped_scale, self.softcap)
        else:
            op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
            o = op(rows, keys, values, attn_mask=mask, scale=self.scale)[0]
        return o.narrow(2, 0, self.group).reshape(-1, self.heads * head_dim)


class OwnKernelLayer(ScriptedLayer):
    """``ScriptedLayer`` with int4 copies on our kernel (``Int4Linear`` with blocks:
    ``splitserve::int4_decode_mm``). A class of its own: TorchScript compiles a call to the op
    only where the op is loaded."""

    def own_kernel(self, x: Tensor, blocks: Tensor, parts: int) -> Tensor:
        return torch.ops.splitserve.int4_decode_mm(x, blocks, parts)

    def prompt_kernel(self, x: Tensor, blocks: Tensor, parts: int) -> Tensor:
        return torch.ops.splitserve.int4_prompt_mm(x, blocks, parts)


class DecodeStack(torch.nn.Module):
    """Every layer of a decode step; returns the last layer's output and every layer's new
    keys and values stacked [L, B, KV, D] (the cache write after the forward)."""

    negated_stream: Final[bool]

    def __init__(self, layers: list[ScriptedLayer]) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(layers)
        self.negated_stream = layers[0].negated_stream

    def forward(
        self,
        hidden: Tensor,
        cos: Tensor,
        signed_sin: Tensor,
        more_ropes: list[Tensor],
        step_tensors: list[Tensor],
        step_ints: list[int],
    ) -> tuple[Tensor, Tensor, Tensor]:
        stream, residual, negated = residual_stream(hidden, self.negated_stream)
        new_keys: list[Tensor] = []
        new_values: list[Tensor] = []
        for layer in self.layers:
            k, v = layer(
                stream, residual, negated, cos, signed_sin, more_ropes, step_tensors, step_ints
            )
            new_keys.append(k)
            new_values.append(v)
        return residual, torch.stack(new_keys), torch.stack(new_values)
