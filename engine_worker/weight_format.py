"""Which format each linear layer's weights take (the ``weights`` knob), decided once at load.

  auto  on a CPU with bf16 activations, a GGUF's Q4_0/Q4_1 layers as int4 (as ``int4`` below);
        everything else dense in the activation dtype (Q8_0, F16/F32, safetensors, and any
        checkpoint with float32 activations, where the int4 kernel runs ~30x slower)
  bf16, fp32  dense weights in that dtype (quantized blocks are dequantized)
  int8  per-channel int8 for every linear layer, lm_head included
  int4  group-32 int4 for every linear layer, one kernel pass with scales and zeros in the
        activation dtype: a GGUF's fp16 Q4 scales rounded to bf16 (on the default model, as
        close to float32's logits as dense bf16 weights: mean KL 1.2e-3 against 1.1e-3). The
        lm_head takes int4 only when the checkpoint's head is 4-bit already, else it is dense:
        re-quantizing this model's Q8_0 head to int4 left 5 of 32 greedy continuations equal to
        float32's, and to int8 it answered "What is the capital of France?" wrongly at batch 1
  int4-exact  as int4, with every scale and zero split into two bf16 parts that sum to the
        file's fp16 value, the kernel reading the 4-bit weights twice in one call: the file's
        own weights, at about half int4's decode speed

A quantized layer also keeps a dense copy, used by steps of more than ``max_tokens`` tokens
(prefill and large decode batches, where dense GEMM beats the integer kernels), when that copy
fits the memory budget. Quantized kernels are CPU-only: on CUDA, auto serves dense weights.
"""

from __future__ import annotations

import logging

import torch

from engine_worker.linear import (
    INT4_GROUP,
    MAX_INT4_PARTS,
    BatchSizeSwitch,
    DenseLinear,
    Int4Groups,
    Int4Linear,
    Int8Blocks,
    Int8Linear,
    LinearWeight,
    WeightSource,
    dequantize,
    int4_supported,
    quantize_int4,
    quantize_int8,
)
from ipc.engine_config import WEIGHTS

logger = logging.getLogger("splitserve.engine.weights")

WEIGHT_FORMATS = WEIGHTS
DENSE_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# Largest step (tokens through a linear layer) that still runs on the quantized copy: measured
# crossovers on a 2-core AVX-512 (BF16) CPU with bf16 activations, scripts/bench_engine.py
# kernels. Above it the dense bf16 copy is faster.
QUANTIZED_MAX_TOKENS = {"int4": 16, "int4x2": 4, "int8": 4}
QUANTIZED_FORMATS = ("int8", "int4", "int4-exact")


def check_weights_and_dtype(weights: str, dtype: torch.dtype, device: torch.device) -> None:
    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"weights must be one of {WEIGHT_FORMATS}, got {weights!r}")
    if weights in DENSE_DTYPES and DENSE_DTYPES[weights] != dtype:
        raise ValueError(
            f"weights={weights} needs dtype {DENSE_DTYPES[weights]} (or auto), got {dtype}"
        )
    if weights in QUANTIZED_FORMATS and device.type != "cpu":
        raise ValueError(
            f"weights={weights} runs on torch's CPU kernels only; on "
            f"{device.type} use auto or a dense format"
        )
    if weights in QUANTIZED_FORMATS and dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"weights={weights} needs dtype float32 or bfloat16, got {dtype}")


def dense_copy_fits(config, dtype: torch.dtype, budget_bytes: int) -> bool:
    """Whether dense copies of every linear layer (what a quantized format adds for large steps)
    fit ``budget_bytes``. A tied lm_head's dense copy is the embedding table: free."""
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    hidden, inner = config.hidden_size, config.intermediate_size
    per_layer = hidden * (q + 2 * kv) + q * hidden + 3 * hidden * inner
    params = config.num_layers * per_layer
    if not config.tie_word_embeddings:
        params += config.vocab_size * hidden
    needed = params * torch.empty((), dtype=dtype).element_size()
    if needed > budget_bytes:
        logger.warning(
            "dense weight copies (%d MiB) exceed the memory budget (%d MiB): quantized "
            "layers serve every step",
            needed >> 20,
            budget_bytes >> 20,
        )
    return needed <= budget_bytes


def dtype_for_weights(weights: str) -> torch.dtype | None:
    """The activation dtype a dense ``weights`` format implies (dtype=auto follows it)."""
    return DENSE_DTYPES.get(weights)


class WeightFormat:
    """Builds every linear layer in the configured format.

    ``reference_for``: instead of quantized layers, build dense float32 layers holding exactly
    the weights the quantized kernels would compute with at that activation dtype (scales
    rounded as the kernels store them): the reference that measures a kernel's own error,
    apart from the quantization's (tests, accuracy benchmarks)."""

    def __init__(
        self,
        weights: str,
        dtype: torch.dtype,
        device: torch.device,
        max_tokens: int = 0,
        dense_copy: bool = True,
        reference_for: torch.dtype | None = None,
    ) -> None:
        check_weights_and_dtype(weights, reference_for or dtype, device)
        self.weights, self.dtype, self.device = weights, dtype, device
        self.max_tokens = max_tokens
        self.dense_copy = dense_copy and reference_for is None
        self.reference_for = reference_for
        self.counts: dict[str, int] = {}  # layers built per kind, for the start-up log line

    def dense(self, source: WeightSource) -> torch.Tensor:
        """A tensor in the activation dtype (embedding, norms, biases, dense layers)."""
        return dequantize(source).to(device=self.device, dtype=self.dtype).contiguous()

    def linear(
        self,
        sources: list[WeightSource],
        bias: torch.Tensor | None = None,
        dense: torch.Tensor | None = None,
        head: bool = False,
    ) -> LinearWeight:
        """One linear layer from ``sources`` stacked along the output dimension (q/k/v,
        gate/up). ``dense``: the checkpoint's weights already in the activation dtype, to share
        (a tied lm_head's embedding table). A dense copy kept beside quantized weights holds the
        checkpoint's weights, not the re-quantized ones. ``head``: this is the lm_head."""
        kind = self._kind(sources)
        if head and kind == "int4" and not all(isinstance(s, Int4Groups) for s in sources):
            kind = "dense"
        source = _stack(sources)
        if kind == "dense":
            self._count(kind)
            return DenseLinear(dense if dense is not None else self.dense(source), bias)
        scale_dtype = self.reference_for or self.dtype
        if kind == "int4":
            groups = (
                source
                if isinstance(source, Int4Groups)
                else quantize_int4(dequantize(source), scale_dtype)
            )
            parts = self._int4_parts(groups, scale_dtype)
            kind = "int4" if parts == 1 else f"int4x{parts}"
            self._count(kind)
            if self.reference_for is not None:
                return DenseLinear(dequantize(groups.rounded(scale_dtype, parts)), bias)
            layer: LinearWeight = Int4Linear(groups, self.dtype, bias, parts)
        else:
            self._count(kind)
            q, scale = quantize_int8(dequantize(source), scale_dtype)
            if self.reference_for is not None:
                return DenseLinear(q.float() * scale[:, None], bias)
            layer = Int8Linear(q, scale, self.dtype, bias)
        if self.dense_copy:
            copy = DenseLinear(dense if dense is not None else self.dense(source), bias)
            layer = BatchSizeSwitch(layer, copy, self.max_tokens or QUANTIZED_MAX_TOKENS[kind])
        return layer

    def _int4_parts(self, groups: Int4Groups, dtype: torch.dtype) -> int:
        if self.weights != "int4-exact":
            return 1
        parts = groups.parts_for(dtype)
        if not parts:
            logger.warning(
                "%d bf16 parts cannot hold this layer's int4 scales exactly: nearest kept",
                MAX_INT4_PARTS,
            )
        return parts or MAX_INT4_PARTS

    def _count(self, kind: str) -> None:
        self.counts[kind] = self.counts.get(kind, 0) + 1

    def _kind(self, sources: list[WeightSource]) -> str:
        weights = self.weights
        if weights == "auto":
            dtype = self.reference_for or self.dtype
            if self.device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
                return "dense"
            # The checkpoint's 4-bit blocks, with bf16 activations (the int4 kernel's fast path:
            # with float32 ones it runs ~30x slower). Anything else is dense: re-quantizing
            # a Q8_0 head (to int8 or int4) changed the default model's greedy answers.
            q4 = all(isinstance(s, Int4Groups) for s in sources)
            if dtype != torch.bfloat16 or not q4:
                return "dense"
            weights = "int4"
        if weights in DENSE_DTYPES:
            return "dense"
        n = sum(s.shape[0] if isinstance(s, torch.Tensor) else s.q.shape[0] for s in sources)
        k = sources[0].shape[1] if isinstance(sources[0], torch.Tensor) else sources[0].q.shape[1]
        if weights == "int4-exact":
            weights = "int4"
        if weights == "int4" and not int4_supported(n, k, INT4_GROUP):
            logger.warning(
                "a %d x %d layer cannot take int4 (needs rows %% 16 == 0 and "
                "columns %% %d == 0): int8 instead",
                n,
                k,
                INT4_GROUP,
            )
            return "int8"
        return weights

    def describe(self) -> str:
        parts = []
        for kind, count in sorted(self.counts.items()):
            text = f"{count} {kind}"
            if kind != "dense" and self.dense_copy:
                text += f" (dense above {self.max_tokens or QUANTIZED_MAX_TOKENS[kind]} tokens)"
            parts.append(text)
        return f"weights={self.weights}: {', '.join(parts)} linear layers"


def _stack(sources: list[WeightSource]) -> WeightSource:
    if len(sources) == 1:
        return sources[0]
    int4 = [s for s in sources if isinstance(s, Int4Groups)]
    if len(int4) == len(sources) and len({s.group for s in int4}) == 1:
        return Int4Groups(
            torch.cat([s.q for s in int4]),
            torch.cat([s.scale for s in int4]),
            torch.cat([s.zero for s in int4]),
        )
    int8 = [s for s in sources if isinstance(s, Int8Blocks)]
    if len(int8) == len(sources):
        return Int8Blocks(torch.cat([s.q for s in int8]), torch.cat([s.scale for s in int8]))
    if all(isinstance(s, torch.Tensor) for s in sources):
        return torch.cat(sources)
    return torch.cat([dequantize(s) for s in sources])  # mixed block types: no common blocks
