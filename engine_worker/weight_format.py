"""Which format each linear layer's weights take (the ``weights`` knob), decided once at load.

  auto  on a CPU with bf16 activations, a GGUF's own blocks on the int4 kernel, as ``int4``
        below: 4-bit (and Q2_K/Q3_K) layers as they are, Q5_x/Q6_K as one plane of 5- or
        6-bit q on our kernel, Q8_0 ones (the default model's tied head) as two 4-bit planes
        (gguf_blocks.py); groups of 16 dense where aten's kernel serves (it takes none);
        everything else dense in the activation dtype (F16/F32, safetensors, float32
        activations, where the int4 kernel runs ~30x slower). Nothing is re-quantized
  bf16, fp32  dense weights in that dtype (quantized blocks are dequantized)
  int8  per-channel int8 for every linear layer, lm_head included (re-quantized)
  int4  one call of torch's group-32 int4 kernel per layer, scales and zeros in the activation
        dtype: a GGUF's fp16 scales rounded to bf16 (every weight of a block scaled by the same
        rounded value; on the default model as close to float32's logits as dense bf16
        weights). Q8_0 blocks become two planes of nibbles (hi and lo 4 bits, one call over the
        input twice: 1 byte per weight); dense layers are quantized to int4, except a dense
        lm_head, which stays dense (re-quantized to int4 it left 5 of 32 greedy continuations
        equal to float32's)
  int4-exact  as int4, with every scale and zero split into bf16 parts that sum to the file's
        fp16 value (two per plane): the file's own weights, each plane read twice

A quantized layer also keeps a dense copy, when that copy fits the memory budget: prompt rows
run on it (prefill, where dense GEMM beats the integer kernels), and so do the decode rows of a
step that has more than ``max_tokens`` of them (``linear.BatchSizeSwitch``), unless the format
is ``deterministic``: then decode rows always run on the quantized kernels. Quantized kernels
are CPU-only: on CUDA, auto serves dense weights.
``int4_kernel="own"``: the int4 layers (bf16 activations) on our kernel (int4_decode.py), packed
straight from the planes above, where its op is built; aten's kernel otherwise.
Whatever the head's format, below float32 each row's top logits are recomputed in float32 from
the checkpoint's head rows (``linear.refine_top_logits``, in the model's forward).
"""

from __future__ import annotations

import logging
import threading

import torch

from engine_worker import int4_decode
from engine_worker.linear import (
    INT4_GROUP,
    MAX_INT4_PARTS,
    BatchSizeSwitch,
    DenseLinear,
    Int4Groups,
    Int4Linear,
    Int4PromptLinear,
    Int8Blocks,
    Int8Linear,
    LinearWeight,
    WeightSource,
    dequantize,
    dequantize_as,
    int4_supported,
    packs_for_onednn,
    quantize_int4,
    quantize_int8,
)
from engine_worker.weight_sources import stack_sources
from ipc.engine_config import INT4_KERNELS, PROMPT_KERNELS, WEIGHTS

logger = logging.getLogger("splitserve.engine.weights")

WEIGHT_FORMATS = WEIGHTS
DENSE_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# Largest step (tokens through a linear layer) that still runs on the quantized copy: measured
# crossovers on a 2-core AVX-512 (BF16) CPU with bf16 activations. Above it the dense bf16 copy
# (oneDNN-packed, ``linear.DenseLinear``) is faster. int4 and int4x2 from the default model's
# whole decode step, both choices interleaved in one engine at each batch: layers 10 (8 rows
# 27.1 ms int4 against 29.8 dense; 12 rows 38.6 against 36.4), head 2 (3 rows 15.65 int4x2
# against 15.19). int4x4 and int8 are from the benchmark's `engine kernels` (commit b159b28)
# against the unpacked dense copy.
QUANTIZED_MAX_TOKENS = {"int4": 10, "int4x2": 2, "int4x4": 1, "int8": 4}
# The same on our int4 kernel (``int4_kernel="own"``), measured alike: layers 24 (20 rows 47.1 ms
# int4 against 48.4 dense, 24 rows 49.8 against 55.5, 32 rows even), head 4 (4 rows 12.9 int4x2
# against 13.7, 5 rows 17.5 against 16.8).
OWN_KERNEL_MAX_TOKENS = {**QUANTIZED_MAX_TOKENS, "int4": 24, "int4x2": 4}
# The same where the other copy is the int8 kernel on the layer's own blocks
# (``prompt_kernel="int8"``): the 1.1B Q4_K_M's whole decode step, both choices alternating step
# by step in one process (2026-12-07, load 1.1-1.4): 3 rows 44.5 ms decode kernel against 42.6
# int8 (even), 4 rows 58.2 against 46.3, 8 rows 89.5 against 66.3.
INT8_ROWS_MAX_TOKENS = {**OWN_KERNEL_MAX_TOKENS, "int4": 3}
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


def dense_copy_fits(config, dtype: torch.dtype, budget_bytes: int, device: torch.device) -> bool:
    """Whether dense copies of every linear layer (what a quantized format adds for large steps)
    fit ``budget_bytes``. A tied lm_head's dense copy is the embedding table, free unless it is
    packed for oneDNN (``linear.packs_for_onednn``: then the packed copy is its own)."""
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    hidden, moe = config.hidden_size, config.features.moe
    params = 0
    for layer in range(config.num_layers):
        # a mixture's experts keep no dense copy (``linear(expert=True)``); its shared one does
        inner = config.intermediate_size
        if moe is not None and moe.sparse(layer):
            inner = moe.shared_size
        params += hidden * (q + 2 * kv) + q * hidden + 3 * hidden * inner
    if not config.tie_word_embeddings or packs_for_onednn(device, dtype):
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


INT8_PROMPT = " int8-prompt"  # a count's kind: prompt rows on the layer's blocks, int8 activations


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
        deterministic: bool = False,
        int4_kernel: str = "aten",
        prompt_kernel: str = "dense",
    ) -> None:
        check_weights_and_dtype(weights, reference_for or dtype, device)
        if int4_kernel not in INT4_KERNELS:
            raise ValueError(f"int4_kernel must be one of {INT4_KERNELS}, got {int4_kernel!r}")
        self.weights, self.dtype, self.device = weights, dtype, device
        self.max_tokens = BatchSizeSwitch.UNBOUNDED if deterministic else max_tokens
        self.dense_copy = dense_copy and reference_for is None
        self.reference_for = reference_for
        if prompt_kernel not in PROMPT_KERNELS:
            raise ValueError(
                f"prompt_kernel must be one of {PROMPT_KERNELS}, got {prompt_kernel!r}"
            )
        self.prompt_kernel = prompt_kernel
        self.counts: dict[str, int] = {}  # layers built per kind, for the start-up log line
        self._counting = threading.Lock()  # layers may be built on several threads
        # Our int4 kernel (int4_decode.py) where asked for and it runs here: bf16 activations on
        # the CPU, the op built (here, once for this torch, where it is not yet) and loaded: else
        # aten's, logged once
        self.own_int4 = (
            int4_kernel == "own"
            and reference_for is None
            and device.type == "cpu"
            and dtype == torch.bfloat16
            and int4_decode.load_op()
        )
        if prompt_kernel == "int8" and not self.own_int4 and reference_for is None:
            logger.warning(
                "prompt_kernel=int8 runs on our int4 kernel, which does not serve here "
                "(int4_kernel=%s, %s, %s): prompt rows use dense copies",
                int4_kernel,
                device.type,
                dtype,
            )

    def crossover(self, kind: str) -> int:
        """The most decode rows a step runs on a ``kind`` layer's quantized copy by default
        (``kind`` + INT8_PROMPT: its blocks on the decode kernel, against the int8 kernel)."""
        table = OWN_KERNEL_MAX_TOKENS if self.own_int4 else QUANTIZED_MAX_TOKENS
        if kind.endswith(INT8_PROMPT):
            table, kind = INT8_ROWS_MAX_TOKENS, kind.removesuffix(INT8_PROMPT)
        # 5- and 6-bit q (our kernel only) take their 4-bit kind's crossover: not measured
        # apart (the products are the same; a block reads 1.2-1.6x the bytes)
        return table[kind] if kind in table else table["int4" + kind[4:]]

    def int8_rows_above(self) -> int:
        """The most decoding requests a step runs on the decode kernel where the int8 kernel
        serves prompt rows (``prompt_kernel="int8"``): its layers' crossover."""
        return self.max_tokens or self.crossover("int4" + INT8_PROMPT)

    def dense(self, source: WeightSource) -> torch.Tensor:
        """A tensor in the activation dtype (embedding, norms, biases, dense layers)."""
        return dequantize_as(source, self.dtype).to(self.device).contiguous()

    def linear(
        self,
        sources: list[WeightSource],
        bias: torch.Tensor | None = None,
        dense: torch.Tensor | None = None,
        head: bool = False,
        expert: bool = False,
    ) -> LinearWeight:
        """One linear layer from ``sources`` stacked along the output dimension (q/k/v,
        gate/up). ``dense``: the checkpoint's weights already in the activation dtype, to share
        (a tied lm_head's embedding table). A dense copy kept beside quantized weights holds the
        checkpoint's weights, not the re-quantized ones. ``head``: this is the lm_head.
        ``expert``: one expert of a mixture (engine_worker.moe), which keeps no dense copy: the
        experts would double the model's memory, and a step reads only the chosen ones."""
        kind = self._kind(sources, head)
        source = stack_sources(sources)
        if kind == "dense":
            self._count(kind, expert)
            return self._dense_layer(source, bias, dense, head)
        scale_dtype = self.reference_for or self.dtype
        if kind == "int4":
            planes = self._int4_planes(source, scale_dtype)
            kind = f"int{planes[0].bits}" + ("" if len(planes) == 1 else f"x{len(planes)}")
            if self.reference_for is not None:
                self._count(kind, expert)
                weight = torch.stack([dequantize(p.rounded(scale_dtype)) for p in planes])
                return DenseLinear(weight.sum(0), bias)
            own = self.own_int4 and int4_decode.takes(planes)
            blocks = int4_decode.pack(planes) if own else None
            layer: LinearWeight = Int4Linear(planes, self.dtype, bias, blocks)
            if self._int8_prompt_rows(layer, head or expert):
                # prompt rows on the same blocks (int8 activations): no dense copy
                self._count(kind + INT8_PROMPT)
                assert isinstance(layer, Int4Linear)
                limit = self.max_tokens or self.crossover(kind + INT8_PROMPT)
                return BatchSizeSwitch(layer, Int4PromptLinear(layer), limit)
            self._count(kind, expert)
        else:
            self._count(kind, expert)
            q, scale = quantize_int8(dequantize(source), scale_dtype)
            if self.reference_for is not None:
                return DenseLinear(q.float() * scale[:, None], bias)
            layer = Int8Linear(q, scale, self.dtype, bias)
        if self.dense_copy and not expert:
            copy = self._dense_layer(source, bias, dense, head)
            layer = BatchSizeSwitch(layer, copy, self.max_tokens or self.crossover(kind))
        return layer

    def _dense_layer(
        self,
        source: WeightSource,
        bias: torch.Tensor | None,
        dense: torch.Tensor | None,
        head: bool,
    ) -> DenseLinear:
        """The dense layer (or dense copy) of ``source``: ``dense`` where it is shared (the
        embedding table, kept anyway); else its own matrix, whose plain copy stays beside a
        oneDNN-packed one only for a head (model._exact_head_rows refines from it)."""
        if dense is not None:
            return DenseLinear(dense, bias)
        return DenseLinear(self.dense(source), bias, keep_weight=head)

    def _int4_planes(self, source: WeightSource, dtype: torch.dtype) -> list[Int4Groups]:
        """The planes of one int4 layer: a checkpoint's 4-bit groups as they are; its 5- to
        8-bit blocks as one plane of 5- or 6-bit q on our kernel (Q5_x, Q6_K), else two nibble
        planes (Q8_0, and each on aten's kernel); dense weights quantized. aten's kernel takes
        no groups of 16 (Q2_K, Q3_K, Q6_K): there they are re-quantized to groups of 32 (auto
        serves them dense: ``_kind``). int4-exact splits each plane's scales and zeros into as
        many ``dtype`` parts as hold them, except a K-quant's on our kernel (its coded scales)."""
        planes = _planes(source, dtype, int4_decode.MAX_BITS if self.own_int4 else 4)
        if self.own_int4 and not int4_decode.takes(planes):
            planes = _planes(source, dtype, 4)
        if (not self.own_int4 or not int4_decode.takes(planes)) and planes[0].group != INT4_GROUP:
            logger.warning("aten's int4 kernel takes no groups of 16: a layer re-quantized")
            planes = [quantize_int4(dequantize(source), dtype)]
        if self.weights != "int4-exact" or (self.own_int4 and int4_decode.coded(planes)):
            return planes  # coded scales are the file's own: exact as they are
        out = []
        for plane in planes:
            parts = plane.parts_for(dtype)
            if not parts:
                logger.warning(
                    "%d %s parts cannot hold a layer's int4 scales exactly: nearest kept",
                    MAX_INT4_PARTS,
                    dtype,
                )
            out += plane.split(dtype, parts or MAX_INT4_PARTS)
        return out

    def _int8_prompt_rows(self, layer: LinearWeight, own_rows: bool) -> bool:
        """Whether ``layer``'s prompt rows run on its own blocks with int8 activations
        (``prompt_kernel="int8"``): blocks on our kernel, not a head's nor an expert's (an
        expert's run in its mixture's grouped call)."""
        return (
            self.prompt_kernel == "int8"
            and isinstance(layer, Int4Linear)
            and layer.own_kernel
            and not own_rows
        )

    def _count(self, kind: str, expert: bool = False) -> None:
        kind = f"expert {kind}" if expert else kind  # no dense copy: told apart in describe()
        with self._counting:
            self.counts[kind] = self.counts.get(kind, 0) + 1

    def _kind(self, sources: list[WeightSource], head: bool) -> str:
        weights = self.weights
        blocks = all(isinstance(s, Int4Groups | Int8Blocks) for s in sources)
        if weights == "auto":
            dtype = self.reference_for or self.dtype
            # The checkpoint's own 4-bit and Q8_0 blocks, with bf16 activations (the int4
            # kernel's fast path: with float32 ones it runs ~30x slower); anything else dense,
            # never re-quantized.
            if self.device.type != "cpu" or dtype != torch.bfloat16 or not blocks:
                return "dense"
            if not self.own_int4 and any(s.group != INT4_GROUP for s in sources):
                return "dense"  # groups of 16, which aten's int4 kernel does not take
            weights = "int4"
        if weights in DENSE_DTYPES:
            return "dense"
        if weights == "int8":
            return "int8"
        # int4 or int4-exact from here
        if head and not blocks:
            # Re-quantizing a dense head to 4 bits left 5 of 32 of the default model's greedy
            # continuations equal to float32's; it stays dense.
            return "dense"
        n = sum(s.shape[0] if isinstance(s, torch.Tensor) else s.q.shape[0] for s in sources)
        k = sources[0].shape[1] if isinstance(sources[0], torch.Tensor) else sources[0].q.shape[1]
        if not int4_supported(n, k, INT4_GROUP):
            logger.warning(
                "a %d x %d layer cannot take int4 (needs rows %% 16 == 0 and "
                "columns %% %d == 0): int8 instead",
                n,
                k,
                INT4_GROUP,
            )
            return "int8"
        return "int4"

    def describe(self) -> str:
        parts = []
        for kind, count in sorted(self.counts.items()):
            text = f"{count} {kind}"
            if kind.endswith(INT8_PROMPT):
                base = kind.removesuffix(INT8_PROMPT)
                limit = self.max_tokens or self.crossover(kind)
                above = (
                    "" if limit == BatchSizeSwitch.UNBOUNDED else f" and above {limit} decode rows"
                )
                text = f"{count} {base} (int8 activations for prompt rows{above})"
            elif kind != "dense" and self.dense_copy and not kind.startswith("expert"):
                limit = self.max_tokens or self.crossover(kind)
                above = "" if limit == BatchSizeSwitch.UNBOUNDED else f", above {limit} decode rows"
                text += f" (dense for prompt rows{above})"
            parts.append(text)
        kernel = (
            ", int4 on our kernel"
            if self.own_int4 and self.counts.keys() - {"dense", "expert dense"}
            else ""
        )
        return f"weights={self.weights}: {', '.join(parts)} linear layers{kernel}"


def _planes(source: WeightSource, dtype: torch.dtype, max_bits: int) -> list[Int4Groups]:
    if isinstance(source, Int4Groups):
        return [source]
    if isinstance(source, Int8Blocks):
        return source.as_planes(max_bits)
    return [quantize_int4(dequantize(source), dtype)]
