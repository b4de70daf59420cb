"""Weight formats of the forward's linear layers: one ``apply(x)`` whatever the weights hold.

* ``DenseLinear``: a bf16/fp32/fp16 matrix, ``F.linear``.
* ``Int8Linear``: int8 per output channel, symmetric (``w = q * scale``), on
  ``aten._weight_int8pack_mm``. Scales are stored in the activation dtype (the kernel's rule).
* ``Int4Linear``: 4-bit groups of ``INT4_GROUP`` input columns, asymmetric, on
  ``aten._weight_int4pack_mm_for_cpu``. Measured (identity activations): the kernel dequantizes
  ``w = (q - 8) * scale + zero`` with one fp32 rounding (an FMA), q in [0, 15], scale and zero
  stored as [K / group, N, 2] in the activation dtype; N must be a multiple of 16 and K of the
  group. Only bf16 activations take its vectorized path; fp32 and fp16 run a scalar loop.
  With ``int4_kernel="own"`` (bf16 activations) it runs our kernel instead
  (``splitserve::int4_decode_mm``, engine_worker/int4_decode.py).
* ``BatchSizeSwitch``: a quantized copy for the decode rows of a step with at most
  ``max_tokens`` of them (decode: the weight bytes read decide the speed) and a dense copy for
  the others and for prompt rows (prefill: the integer kernels re-read and re-dequantize the
  weights for every 4 rows, dense GEMM does not).

Every kernel here computes a row the same way whatever else its call holds (dense bf16 above one
row, the int4 kernel; tests/engine_worker/test_weights.py and test_int4_decode.py hold it), so a
row's result depends on which kernel a layer picks for it, never on its neighbours: the pick
depends only on the row's kind (a decoded token's or a prompt's) and, for decode rows, on how
many there are.

Quantized weights arrive as ``Int4Groups`` (q, scale, zero per group) or ``Int8Blocks`` (GGUF
5- to 8-bit blocks: int8 with a scale, and maybe a zero, per 16 or 32 columns), from a
checkpoint's own blocks (gguf_blocks.py) or from ``quantize_int4`` of a dense matrix;
``dequantize`` gives every source as fp32 (weight_sources.py).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from engine_worker.weight_sources import MAX_INT4_PARTS as MAX_INT4_PARTS
from engine_worker.weight_sources import Int4Groups, WeightSource, source_rows
from engine_worker.weight_sources import Int8Blocks as Int8Blocks
from engine_worker.weight_sources import dequantize as dequantize
from engine_worker.weight_sources import dequantize_as as dequantize_as
from engine_worker.weight_sources import split_parts as split_parts

INT4_GROUP = 32  # columns per int4 scale/zero; GGUF Q4_0/Q4_1 blocks are 32 weights too


class LinearWeight(Protocol):
    out_features: int

    def apply(
        self, x: torch.Tensor, decode_rows: int = 0, decode_batch: int | None = None
    ) -> torch.Tensor:
        """x [T, in_features] in the activation dtype -> [T, out_features]; the first
        ``decode_rows`` rows are decode rows, of ``decode_batch`` decoding requests (default:
        one row each; a request verifying drafts has several). A format with two copies picks
        one by ``decode_batch``."""

    @property
    def nbytes(self) -> int:
        """Bytes of weight data one full apply reads (what bounds decode speed)."""


# Logits a low-precision head recomputes in float32 per row (refine_top_logits): bf16 logits are
# rounded to 8 significant bits, steps of 0.125 between 16 and 32, where a model's top two often
# lie closer (the default model's first answer token to "What is the capital of France?": "The"
# 25.325, "L" 25.243 in float32; both 25.25 through its bf16 head).
EXACT_TOP_LOGITS = 8


def refine_top_logits(
    logits: torch.Tensor, hidden: torch.Tensor, head: WeightSource, k: int = EXACT_TOP_LOGITS
) -> None:
    """Replaces each row's ``k`` largest ``logits`` [R, V] (float32 holding a low-precision
    head's output) with float32 dot products of ``hidden`` [R, K] and ``head``'s rows."""
    if not logits.shape[0]:  # a step whose rows all continue a prefill samples nothing
        return
    top = logits.topk(min(k, logits.shape[-1]), dim=-1).indices
    rows = source_rows(head, top.flatten()).view(*top.shape, -1)
    # A product and a sum over the last dimension: a row's sums do not depend on how many rows
    # the step has (a batched matmul's do, by a few ulps).
    exact = (rows * hidden.float().unsqueeze(1)).sum(-1)
    logits.scatter_(1, top, exact)


def quantize_int4(
    weight: torch.Tensor, scale_dtype: torch.dtype, group: int = INT4_GROUP
) -> Int4Groups:
    """Asymmetric min/max quantization per group. Scale and zero are rounded to ``scale_dtype``
    first and q is chosen against the rounded values, so the kernel's weights are the nearest
    its scale/zero can give."""
    w = weight.float()
    n, k = w.shape
    g = w.view(n, k // group, group)
    low, high = g.amin(dim=-1), g.amax(dim=-1)
    scale = ((high - low) / 15).clamp_min(1e-8).to(scale_dtype).float()
    zero = (low + 8 * scale).to(scale_dtype).float()
    q = torch.round((g - zero[..., None]) / scale[..., None]) + 8
    return Int4Groups(q.clamp_(0, 15).to(torch.uint8).view(n, k), scale, zero)


def quantize_int8(
    weight: torch.Tensor, scale_dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: (q int8 [N, K], scale float32 [N]); the scale is
    rounded to ``scale_dtype`` (the kernel's) before q is chosen against it."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / 127).clamp_min(1e-8).to(scale_dtype).float()
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def int4_supported(out_features: int, in_features: int, group: int = INT4_GROUP) -> bool:
    return out_features % 16 == 0 and in_features % group == 0


class DenseLinear:
    """A matrix in the activation dtype. On a CPU with bf16 activations it is applied through
    oneDNN on a copy packed once into oneDNN's blocked layout (``onednn_packed``): ``F.linear``
    repacks the plain matrix on every call (measured, 2 cores: the default model's head at 8 rows
    4.8 ms plain against 2.4 packed, its 120 layer copies at 16 rows 23.9 against 15.6), and the
    packed product is the plain one's bits at any row count, a lone row computed as two by both
    (tests/engine_worker/test_weights.py).
    ``keep_weight`` False drops the plain matrix once packed (a dense copy nothing else reads)."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None = None, keep_weight: bool = True
    ) -> None:
        weight = weight.contiguous()
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self.packed = onednn_packed(weight)
        self.weight: torch.Tensor | None = weight if keep_weight or self.packed is None else None
        self._bytes = weight.numel() * weight.element_size()

    def apply(
        self, x: torch.Tensor, decode_rows: int = 0, decode_batch: int | None = None
    ) -> torch.Tensor:
        one = x.shape[0] == 1
        if one:
            # One row takes another kernel, whose sums round differently from the same row's
            # among others (bf16, 1,536 inputs, plain or packed); two rows cost the same.
            x = x.expand(2, -1)
        if self.packed is not None:
            y = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        else:
            assert self.weight is not None
            y = F.linear(x, self.weight, self.bias)
        return y[:1] if one else y

    @property
    def nbytes(self) -> int:
        return self._bytes


# The row count oneDNN is told to pack for: the product is the same bits at any count; packed
# for 8 rows the default model's layers ran no slower than packed for each count at 1-64 rows,
# ~15% slower at 256 (still faster than unpacked; one run on a loaded machine).
PACK_ROWS = 8


def packs_for_onednn(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether dense matrices of ``dtype`` on ``device`` are packed for oneDNN: where that is the
    plain product's bits, bf16 on a CPU whose torch sends bf16 products to oneDNN (float32 goes
    to another BLAS, whose sums round otherwise; CUDA has its own GEMMs)."""
    return (
        device.type == "cpu"
        and dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


def onednn_packed(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight`` [N, K] packed for oneDNN's matmul (``packs_for_onednn``), else None."""
    if not packs_for_onednn(weight.device, weight.dtype):
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS)
    except RuntimeError:  # a CPU oneDNN has no bf16 kernel for
        return None


class Int8Linear:
    def __init__(
        self,
        q: torch.Tensor,
        scale: torch.Tensor,
        dtype: torch.dtype,
        bias: torch.Tensor | None = None,
    ) -> None:
        self.q = q.contiguous()
        self.scale = scale.to(dtype).contiguous()
        self.bias, self.out_features = bias, q.shape[0]

    @classmethod
    def from_weight(
        cls, weight: torch.Tensor, dtype: torch.dtype, bias: torch.Tensor | None = None
    ) -> Int8Linear:
        return cls(*quantize_int8(weight, dtype), dtype, bias)

    def apply(
        self, x: torch.Tensor, decode_rows: int = 0, decode_batch: int | None = None
    ) -> torch.Tensor:
        y = torch.ops.aten._weight_int8pack_mm(x.contiguous(), self.q, self.scale)
        return y if self.bias is None else y + self.bias

    @property
    def nbytes(self) -> int:
        return self.q.numel() + self.scale.numel() * self.scale.element_size()


class Int4Linear:
    """One call of the int4 kernel over ``planes``: 4-bit group layers of one shape, each applied
    to the same input and summed, laid side by side along K (the input repeated once per plane)
    so the sum accumulates in float32 inside the kernel. One plane (or plain ``Int4Groups``) is
    the plain int4 layer; ``Int4Groups.split`` gives planes whose scales and zeros the activation
    dtype holds where it alone cannot (a GGUF's fp16 scales in bf16); a Q8_0 tensor is two
    planes of nibbles (``Int8Blocks.as_int4_planes``). Each plane is read once.

    ``blocks``: the same planes packed for our kernel (``int4_decode.pack``, bf16 activations):
    the layer then calls ``splitserve::int4_decode_mm`` instead of aten's kernel and holds no
    copy in aten's layout (``packed`` is the blocks, ``scale_zero`` empty: they hold the
    scales)."""

    def __init__(
        self,
        planes: Int4Groups | list[Int4Groups],
        dtype: torch.dtype,
        bias: torch.Tensor | None = None,
        blocks: torch.Tensor | None = None,
    ) -> None:
        if isinstance(planes, Int4Groups):
            planes = [planes]
        n, k = planes[0].q.shape
        group = planes[0].group
        if not int4_supported(n, k, group):
            raise ValueError(
                f"int4 needs out_features % 16 == 0 and in_features % {group} == 0, got {n} x {k}"
            )
        self.group, self.bias, self.out_features, self.parts = group, bias, n, len(planes)
        self.own_kernel = blocks is not None
        if blocks is not None:
            self.packed, self.scale_zero = blocks, torch.empty(0, dtype=dtype)
            return
        q = torch.cat([p.q for p in planes], dim=1).int()
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        self.scale_zero = (
            torch.cat([torch.stack([p.scale.t(), p.zero.t()], dim=-1) for p in planes])
            .to(dtype)
            .contiguous()
        )  # [parts * K / group, N, 2]

    def apply(
        self, x: torch.Tensor, decode_rows: int = 0, decode_batch: int | None = None
    ) -> torch.Tensor:
        if self.own_kernel:
            y = torch.ops.splitserve.int4_decode_mm(x, self.packed, self.parts)
        else:
            x = x.contiguous() if self.parts == 1 else x.repeat(1, self.parts)
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x, self.packed, self.group, self.scale_zero
            )
        return y if self.bias is None else y + self.bias

    @property
    def nbytes(self) -> int:
        return self.packed.numel() + self.scale_zero.numel() * self.scale_zero.element_size()


class Int4PromptLinear:
    """An int4 layer on our kernel (``Int4Linear`` with 4-bit blocks) for many rows: the same
    blocks against int8 activations (``splitserve::int4_prompt_mm``: each row's groups of 32
    rounded to int8 with a float32 scale, VNNI integer products, the groups' float32 scales
    and zeros as the decode kernel applies them). What prompt rows run on in place of a dense
    bf16 copy under ``prompt_kernel="int8"``: nothing more is held in memory. A row's result
    depends on that row alone."""

    def __init__(self, layer: Int4Linear) -> None:
        self.layer = layer
        self.out_features = layer.out_features

    def apply(
        self, x: torch.Tensor, decode_rows: int = 0, decode_batch: int | None = None
    ) -> torch.Tensor:
        layer = self.layer
        y = torch.ops.splitserve.int4_prompt_mm(x, layer.packed, layer.parts)
        return y if layer.bias is None else y + layer.bias

    @property
    def nbytes(self) -> int:
        return self.layer.nbytes


class BatchSizeSwitch:
    """``quantized`` for the decode rows of a step in which at most ``max_tokens`` requests
    decode (a request verifying drafts has several decode rows; the choice is by requests, so
    they run on the kernel its plain decode row would), ``dense`` for the others and for every
    prompt row. A prompt token is thus computed alike
    whether its prompt came in one step, in chunks or after a prefix-cache hit; a decoded one
    alike while the decode batch stays on one side of ``max_tokens`` (a deterministic launch
    sets it to ``UNBOUNDED``)."""

    UNBOUNDED = 1 << 62

    def __init__(self, quantized: LinearWeight, dense: LinearWeight, max_tokens: int) -> None:
        self.quantized, self.dense, self.max_tokens = quantized, dense, max_tokens
        self.out_features = quantized.out_features

    def apply(
        self, x: torch.Tensor, decode_rows: int = 0, decode_batch: int | None = None
    ) -> torch.Tensor:
        batch = decode_rows if decode_batch is None else decode_batch
        if decode_rows <= 0 or not 0 < batch <= self.max_tokens:
            return self.dense.apply(x)
        if decode_rows == x.shape[0]:
            return self.quantized.apply(x)
        return torch.cat([self.quantized.apply(x[:decode_rows]), self.dense.apply(x[decode_rows:])])

    @property
    def nbytes(self) -> int:
        return self.quantized.nbytes  # what a decode step reads
