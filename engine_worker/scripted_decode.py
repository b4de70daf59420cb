"""The hot decode step through TorchScript: every decoder layer of a step that only decodes, on a
kept decode workspace, in one scripted call (``scripted_layers.DecodeLayers``).

Why: at batch 1 the default model's step is ~1,900 small ops; the kernels that do the work
(int4 matmul, flash attention) are about 60% of it and the rest is Python calling ops one by
one. TorchScript runs the same ops from its interpreter at ~60% of eager's cost each.

When it runs (``ScriptedDecode.applies``), else the eager forward does, unchanged:
* the CPU backend on a kept workspace with decode rows only (``metadata.deferred_kv`` set: no
  prefill rows, the workspace was built by an earlier step), no request verifying drafts;
* a plain Llama layer (``ModelConfig.features`` all default) with plain attention (no
  sliding window, soft-cap or other softmax scale: one mask for every layer), no q/k norm and
  no qkv bias, bf16/fp16 activations (fused ``RmsNorm``), every
  linear a ``BatchSizeSwitch`` of an ``Int4Linear`` and a ``DenseLinear`` without bias, every
  ``Int4Linear`` on one kernel (aten's or ours: ``OwnKernelDecodeLayers``);
  the step's batch picks the copy just as ``BatchSizeSwitch.apply`` does.

Bit-identical by construction: the same aten ops in the same order on the same tensors, run
with the graph executor's optimizations off (no fusion, no reordering, no profiling passes).
"""

from __future__ import annotations

import logging
import time
import warnings
from dataclasses import dataclass, field

import torch

from engine_worker.attention import AttentionBackend, AttentionMetadata, PagedCpuBackend
from engine_worker.attention.batch import DecodeWorkspace
from engine_worker.linear import BatchSizeSwitch, DenseLinear, Int4Linear

logger = logging.getLogger("splitserve.engine.scripted_decode")


@dataclass(slots=True)
class ScriptedDecode:
    """The scripted layers, one module per choice of copies, prepared once at load."""

    norms: list[torch.Tensor]  # per layer: input norm, post-attention norm (doubled weights)
    # every layer's linears (qkv, o_proj, gate_up, down): the int4 copy, the dense copy and the
    # most decoding requests the int4 copy takes (BatchSizeSwitch)
    copies: list[tuple[Int4Linear, DenseLinear, int]]
    group: int
    eps: float
    shape: tuple[int, int, int]  # heads, kv_heads, head_dim
    device: torch.device
    own_kernel: bool = False  # the int4 copies on our kernel (Int4Linear.own_kernel)
    steps: int = 0  # steps run scripted (tests read it)
    # the query rows index by the kernel's row count (_query_rows)
    query_rows: dict[int, torch.Tensor] = field(default_factory=dict)
    # the scripted layers by which linears take the int4 copy (_layers_for)
    by_copies: dict[tuple[bool, ...], torch.jit.ScriptModule] = field(default_factory=dict)
    # ... and by decode batch size
    by_batch: dict[int, torch.jit.ScriptModule] = field(default_factory=dict)

    @classmethod
    def build(cls, model) -> ScriptedDecode | None:
        """For ``model`` (a ``LlamaFamilyModel``), or None where its layers are not the hot case
        or TorchScript cannot compile them (logged)."""
        reason = _unsupported(model)
        if reason:
            logger.info("scripted decode off: %s", reason)
            return None
        start = time.perf_counter()
        cfg = model.config
        scripted = cls(
            norms=[
                n.doubled_weight
                for x in model.layers
                for n in (x.input_norm, x.post_attention_norm)
            ],
            copies=[
                (lin.quantized, lin.dense, lin.max_tokens)
                for layer in model.layers
                for lin in _linears(layer)
            ],
            group=model.layers[0].qkv.quantized.group,
            eps=model.layers[0].input_norm.eps,
            shape=(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim),
            device=model.device,
            own_kernel=model.layers[0].qkv.quantized.own_kernel,
        )
        # Every choice of copies a batch size makes: one decode row, and one past each
        # linear's int4 limit.
        batches = {1} | {
            most + 1 for _, _, most in scripted.copies if most < BatchSizeSwitch.UNBOUNDED
        }
        try:
            for batch in sorted(batches):
                scripted._layers_for(batch)
        except Exception as error:  # a torch build without TorchScript, or one it cannot compile
            logger.warning("scripted decode off: TorchScript failed (%s)", error)
            return None
        logger.info("scripted decode on (%.0f ms to script)", (time.perf_counter() - start) * 1e3)
        return scripted

    @staticmethod
    def applies(
        attention: AttentionBackend,
        metadata: AttentionMetadata,
        num_tokens: int,
        decode_rows: int,
        batches: tuple[int, int] | None,
    ) -> bool:
        """Whether this step is the hot case (decode rows only, on a kept workspace)."""
        decode = metadata.decode
        return (
            metadata.deferred_kv is not None
            and isinstance(attention, PagedCpuBackend)
            and decode is not None
            and decode.rows is None
            and decode.workspace is not None
            and not decode.workspace.fresh
            and decode_rows == num_tokens
            and batches is None
        )

    def run(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        signed_sin: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Every layer of the step (``applies`` held); the new keys/values go to
        ``metadata.stacked_kv`` for ``AttentionBackend.finish``."""
        decode = metadata.decode
        assert (
            decode is not None and decode.workspace is not None and metadata.deferred_kv is not None
        )
        layers = self._layers_for(hidden.shape[0])
        with torch.jit.optimized_execution(False):
            hidden, keys, values = layers.forward(
                hidden,
                cos,
                signed_sin,
                decode.mask,
                self._query_rows(decode.mask.shape[2]),
                decode.workspace.new_slots,
                self._workspace_views(decode.workspace),
            )
        metadata.stacked_kv = keys, values
        self.steps += 1
        return hidden

    def _workspace_views(self, ws: DecodeWorkspace) -> list[torch.Tensor]:
        """Per layer: keys and values as [KV * B * columns, D] (where a new token is written)
        and as [B, KV, columns, D] (what attention reads), the views ``PagedCpuBackend._decode``
        takes each step, taken once per workspace."""
        if ws.scripted_views:
            return ws.scripted_views
        kv_heads, head_dim = self.shape[1], self.shape[2]
        batch = len(ws.sequences)
        views = []
        for keys, values in zip(ws.keys, ws.values):
            views += [keys.view(-1, head_dim), values.view(-1, head_dim)]
            views += [
                t.view(kv_heads, batch, ws.capacity, head_dim).transpose(0, 1)
                for t in (keys, values)
            ]
        ws.scripted_views = views
        return views

    def _query_rows(self, rows: int) -> torch.Tensor:
        """Which of a kv head's query heads each of the kernel's ``rows`` query rows is: the
        group, then its last head repeated (``PagedCpuBackend._decode``'s padding)."""
        index = self.query_rows.get(rows)
        if index is None:
            group = self.shape[0] // self.shape[1]
            index = torch.tensor([min(r, group - 1) for r in range(rows)], device=self.device)
            self.query_rows[rows] = index
        return index

    def _layers_for(self, batch: int) -> torch.jit.ScriptModule:
        """The scripted layers with each linear's copy for ``batch`` decode rows
        (``BatchSizeSwitch.apply``'s pick)."""
        layers = self.by_batch.get(batch)
        if layers is not None:
            return layers
        quantized = tuple(batch <= most for _, _, most in self.copies)
        layers = self.by_copies.get(quantized)
        if layers is None:
            from engine_worker.scripted_layers import DecodeLayers, OwnKernelDecodeLayers

            weights, parts = [], []
            for (int4, dense, _), int4_copy in zip(self.copies, quantized):
                if int4_copy:
                    weights += [int4.packed, int4.scale_zero]
                    parts.append(int4.parts)
                else:  # the dense copy, packed for oneDNN where it is (DenseLinear)
                    matrix = dense.weight if dense.packed is None else dense.packed
                    weights += [matrix] * 2
                    parts.append(0 if dense.packed is None else -1)
            heads, kv_heads, _ = self.shape
            kind = OwnKernelDecodeLayers if self.own_kernel else DecodeLayers
            module = kind(self.norms, weights, parts, self.group, self.eps, heads, kv_heads)
            with warnings.catch_warnings():
                # torch 2.13 says TorchScript is deprecated: torch.compile fuses and reorders
                # ops (other bits) and compiles for minutes, so it is no substitute here
                warnings.simplefilter("ignore", DeprecationWarning)
                layers = self.by_copies[quantized] = torch.jit.script(module)
            # The helper functions' calls inlined: run unoptimized, each call is an interpreter
            # frame (their records took ~0.35 ms of a profiled batch-1 step)
            torch._C._jit_pass_inline(layers.graph)
        self.by_batch[batch] = layers
        return layers


def _linears(layer) -> tuple:
    return (layer.qkv, layer.o_proj, layer.gate_up, layer.down)


def _unsupported(model) -> str:
    """Why ``model``'s layers are not the scripted case ('' where they are)."""
    if model.device.type != "cpu":
        return f"device {model.device.type}"
    if model.dtype == torch.float32:
        return "float32 activations (RmsNorm is not fused)"
    if not model.config.features.plain:  # the scripted layers are the plain Llama layer only
        return f"model features ({model.config.features.describe()})"
    if any(not spec.plain for spec in model.config.layer_attention):
        # its layers attend with one mask and the kernel's own scale
        return "sliding windows, soft-capped scores or another softmax scale"
    for layer in model.layers:
        if layer.q_norm is not None or layer.k_norm is not None:
            return "q/k norm"
        if not (layer.input_norm.fused and layer.post_attention_norm.fused):
            return "unfused RmsNorm"
        for linear in _linears(layer):
            if not (
                isinstance(linear, BatchSizeSwitch)
                and isinstance(linear.quantized, Int4Linear)
                and isinstance(linear.dense, DenseLinear)
            ):
                return f"a {type(linear).__name__} linear"
            if linear.quantized.bias is not None or linear.dense.bias is not None:
                return "a linear with bias"
            if linear.max_tokens < 1:  # one decode row on the dense copy: another kernel
                return "a linear without int4 decode rows"
    kernels = {lin.quantized.own_kernel for layer in model.layers for lin in _linears(layer)}
    if len(kernels) != 1:
        return "int4 layers on two kernels (some too wide for ours)"
    # our kernel's blocks carry their own group size; aten's takes one for every call
    groups = {lin.quantized.group for layer in model.layers for lin in _linears(layer)}
    return "" if kernels == {True} or len(groups) == 1 else "int4 groups differ between layers"
