"""The hot decode step through TorchScript: every decoder layer of a step that only decodes, on a
kept decode workspace, in one call of a module compiled from the layers' one definition
(``decoder_layer.DecoderLayer`` as ``scripted_layers.ScriptedLayer``, in a ``DecodeStack``).

When it runs (``ScriptedDecode.applies``), else the eager layers do (``layers.EagerLayers``):
* the CPU backend on a kept workspace with decode rows only (``metadata.deferred_kv`` set: no
  prefill rows, the workspace was built by an earlier step), no request verifying drafts;
* bf16/fp16 activations (fused ``RmsNorm``), every linear a ``BatchSizeSwitch`` of an
  ``Int4Linear`` and a ``DenseLinear`` with int4 decode rows; any family, features and
  attention (windows, soft-caps, scales); the step's batch picks each linear's copy just as
  ``BatchSizeSwitch.apply`` does.

Compiled once per choice of copies: scripted, then frozen (the weights and the family's
constants become graph constants, the branches a layer does not take are folded away, every
call inlined), run with the graph executor's optimizations off (no fusion, no reordering, no
profiling passes). The same aten ops in the same order on the same values as the eager layers,
so the same bits (tests/engine_worker/test_scripted_decode.py).

TorchScript is deprecated in torch 2.13 but works; ``torch.compile`` is no substitute here: on
this 2-core CPU it compiled the decode step for 223 s and again whenever the workspace grew,
and it fuses ops, which changes a row's bits between paths (docs/benchmarks.md).
"""

from __future__ import annotations

import logging
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from engine_worker.attention import AttentionBackend, AttentionMetadata, PagedCpuBackend
from engine_worker.attention.batch import DecodeBatch, DecodeWorkspace
from engine_worker.layers import EagerLayer
from engine_worker.linear import BatchSizeSwitch, DenseLinear, Int4Linear, Int4PromptLinear
from engine_worker.scripted_layers import DecodeStack, OwnKernelLayer, ScriptedLayer, copy_tensors

logger = logging.getLogger("splitserve.engine.scripted_decode")


@dataclass(slots=True)
class ScriptedDecode:
    """The compiled decode stacks of a model (``LlamaFamilyModel``), prepared once at load."""

    model: Any  # LlamaFamilyModel (which imports this module)
    windows: list[int]  # the distinct sliding windows, in the backend's order
    # the compiled stacks by which linears take the int4 copy (_stack_for)
    by_copies: dict[tuple[bool, ...], torch.jit.ScriptModule] = field(default_factory=dict)
    # ... and by decode batch size
    by_batch: dict[int, torch.jit.ScriptModule] = field(default_factory=dict)

    @classmethod
    def build(cls, model) -> ScriptedDecode | None:
        """For ``model``, or None where its layers are not the hot case or TorchScript cannot
        compile them (logged)."""
        reason = _unsupported(model)
        if reason:
            logger.info("scripted decode off: %s", reason)
            return None
        start = time.perf_counter()
        cfg = model.config
        windows = sorted({cfg.attention_of(i).window for i in range(cfg.num_layers)} - {0})
        scripted = cls(model, windows)
        # Every choice of copies a batch size makes: one decode row, and one past each
        # linear's int4 limit.
        limits = {s.max_tokens for layer in model.layers for s in _linears(layer)}
        batches = {1} | {most + 1 for most in limits if most < BatchSizeSwitch.UNBOUNDED}
        try:
            for batch in sorted(batches):
                scripted._stack_for(batch)
        except Exception as error:  # a torch build without TorchScript, or one it cannot compile
            logger.warning("scripted decode off: TorchScript failed (%s)", error)
            return None
        logger.info("scripted decode on (%.0f ms to compile)", (time.perf_counter() - start) * 1e3)
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
        ropes: list[tuple[torch.Tensor, torch.Tensor]],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Every layer of the step (``applies`` held) -> the last layer's output; the new
        keys/values go to ``metadata.stacked_kv`` for ``AttentionBackend.finish``."""
        decode = metadata.decode
        assert decode is not None and decode.workspace is not None
        stack = self._stack_for(hidden.shape[0])
        more_ropes = [t for rope in ropes[1:] for t in rope]
        starts = [decode.window_starts.get(w, 0) for w in self.windows]
        with torch.jit.optimized_execution(False):
            hidden, keys, values = stack.forward(
                hidden, *ropes[0], more_ropes, self._step_tensors(decode, decode.workspace), starts
            )
        metadata.stacked_kv = keys, values
        return hidden

    def _step_tensors(self, decode: DecodeBatch, ws: DecodeWorkspace) -> list[torch.Tensor]:
        """``ScriptedLayer``'s step tensors: the new tokens' slots, the masks, and per layer its
        keys and values as [KV * B * columns, D] and as [B, KV, columns, D] (the views
        ``PagedCpuBackend._decode`` takes each step). The same tensors every step of a kept
        workspace (advanced in place), listed once per workspace."""
        if ws.scripted_views:
            return ws.scripted_views
        kv_heads, head_dim = self.model.config.num_kv_heads, self.model.config.head_dim
        assert ws.new_slots is not None
        views = [ws.new_slots, decode.mask, *(decode.window_masks[w] for w in self.windows)]
        batch = len(ws.sequences)
        for keys, values in zip(ws.keys, ws.values):
            views += [keys.view(-1, head_dim), values.view(-1, head_dim)]
            views += [
                t.view(kv_heads, batch, ws.capacity, head_dim).transpose(0, 1)
                for t in (keys, values)
            ]
        ws.scripted_views = views
        return views

    def _stack_for(self, batch: int) -> torch.jit.ScriptModule:
        """The compiled stack with each linear's copy for ``batch`` decode rows
        (``BatchSizeSwitch.apply``'s pick)."""
        stack = self.by_batch.get(batch)
        if stack is not None:
            return stack
        model = self.model
        quantized = tuple(batch <= s.max_tokens for x in model.layers for s in _linears(x))
        stack = self.by_copies.get(quantized)
        if stack is None:
            stack = self.by_copies[quantized] = compile_stack(model, quantized, self.windows)
        self.by_batch[batch] = stack
        return stack


def compile_stack(model, quantized: tuple[bool, ...], windows: list[int]):
    """``model``'s layers as one frozen TorchScript ``DecodeStack``, each linear on its int4
    copy where ``quantized`` says so (four a layer, in order), else its dense copy."""
    layers = []
    for i, weights in enumerate(model.layers):
        copies = [copy_tensors(s, q) for s, q in zip(_linears(weights), quantized[4 * i :])]
        own = any(parts > 0 and group <= 0 for _, _, _, parts, group in copies)
        kind = OwnKernelLayer if own else ScriptedLayer
        layers.append(kind(model.config, weights, i, copies, windows))
    with warnings.catch_warnings():
        # torch 2.13 says TorchScript is deprecated (see the module's docstring)
        warnings.simplefilter("ignore", DeprecationWarning)
        scripted = torch.jit.script(DecodeStack(layers).eval())
        # Attributes become constants, calls are inlined and the branches on constants folded
        # (else each read of a weight is an interpreter instruction). Not ``torch.jit.freeze``:
        # its optimizations rewrite ops (a linear's weight pre-transposed), which changes bits.
        frozen = torch.jit.RecursiveScriptModule(torch._C._freeze_module(scripted._c))
        torch.jit.RecursiveScriptModule._finalize_scriptmodule(frozen)
    return frozen


def _linears(layer) -> tuple:
    return (layer.qkv, layer.o_proj, layer.gate_up, layer.down)


def _unsupported(model) -> str:
    """Why ``model``'s layers are not the scripted case ('' where they are)."""
    if model.device.type != "cpu":
        return f"device {model.device.type}"
    if model.dtype == torch.float32:
        return "float32 activations (RmsNorm is not fused)"
    if any(type(layer) is not EagerLayer for layer in model.eager_layers.layers):
        return "a layer with parts of its own"
    for layer in model.layers:
        for linear in _linears(layer):
            if not (
                isinstance(linear, BatchSizeSwitch)
                and isinstance(linear.quantized, Int4Linear)
                and isinstance(linear.dense, DenseLinear | Int4PromptLinear)
            ):
                return f"a {type(linear).__name__} linear"
            if linear.max_tokens < 1:  # one decode row on the dense copy: another kernel
                return "a linear without int4 decode rows"
    return ""
