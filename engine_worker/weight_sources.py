"""The weights of a linear layer as a checkpoint's quantized blocks give them (``Int4Groups``,
``Int8Blocks``) or a dense tensor, and their float32 values (``dequantize``): what the formats of
linear.py are built from."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TypeAlias

import torch

MAX_INT4_PARTS = 2  # more would read the 4-bit weights as often as a dense bf16 layer's bytes
SUPER_BLOCK = 256  # weights along K of a GGUF K-quant super-block (one d, one dmin a row)


@dataclass(slots=True)
class ScaleCodes:
    """A K-quant's scales as its file holds them: a group's scale is ``d[n, k // 256] *
    sc[n, k // group]`` (float32, exact) and its min ``dmin[n, k // 256] * m[n, k // group]``
    (None: no min); d and dmin float32 holding fp16 values, sc and m int8. Our kernel reads
    these in place of a float per group (int4_decode.cpp: coded scales)."""

    d: torch.Tensor
    sc: torch.Tensor
    dmin: torch.Tensor | None = None
    m: torch.Tensor | None = None

    def least(self) -> torch.Tensor | None:
        """Every group's min, dmin * m in float32 (exact), or None."""
        if self.dmin is None or self.m is None:
            return None
        return _per_group(self.dmin, self.m) * self.m.float()

    def scale(self) -> torch.Tensor:
        return _per_group(self.d, self.sc) * self.sc.float()


def cat_codes(sources: list[Int4Groups] | list[Int8Blocks]) -> ScaleCodes | None:
    """The codes of sources stacked along the output rows, where each has codes of one form
    (groups, super-blocks, a min or none); else None."""
    codes = [s.codes for s in sources]
    present = [c for c in codes if c is not None]
    forms = {(c.d.shape[1], c.sc.shape[1], c.dmin is None) for c in present}
    if len(present) < len(codes) or len(forms) != 1:
        return None
    names = ("d", "sc") if present[0].dmin is None else ("d", "sc", "dmin", "m")
    return ScaleCodes(*(torch.cat([getattr(c, name) for c in present]) for name in names))


def _per_group(per_super: torch.Tensor, per_group: torch.Tensor) -> torch.Tensor:
    return per_super.repeat_interleave(per_group.shape[1] // per_super.shape[1], 1)


@dataclass(slots=True)
class Int4Groups:
    """w[n, k] = (q[n, k] - 8) * scale[n, k // group] + zero[n, k // group]; q uint8 in [0, 15],
    scale and zero float32. With ``bits`` 5 or 6 (our kernel only): q in [0, 2^bits), less
    2^(bits - 1) in place of 8. ``codes``: a K-quant's own scales, where scale is their
    ``scale()`` and zero ``2^(bits - 1) scale - least()`` rounded once (no min: zero 0)."""

    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    bits: int = 4
    codes: ScaleCodes | None = None

    @property
    def group(self) -> int:
        return self.q.shape[1] // self.scale.shape[1]

    def rounded(self, dtype: torch.dtype, parts: int = 1) -> Int4Groups:
        """The groups with scale and zero as a kernel of ``parts`` parts holds them (each the sum
        of ``split_parts`` in ``dtype``)."""
        scale, zero = (_total(split_parts(v, dtype, parts)) for v in (self.scale, self.zero))
        return Int4Groups(self.q, scale, zero, self.bits)  # not the codes' values: none

    def split(self, dtype: torch.dtype, parts: int) -> list[Int4Groups]:
        """``parts`` planes of these weights whose scales and zeros ``dtype`` holds and whose
        sum is these groups' (``split_parts``); one part is these groups."""
        if parts == 1:
            return [self]
        scales, zeros = (split_parts(v, dtype, parts) for v in (self.scale, self.zero))
        return [Int4Groups(self.q, s.float(), z.float(), self.bits) for s, z in zip(scales, zeros)]

    def as_int8(self) -> Int8Blocks:
        """The same weights as ``Int8Blocks`` (q less its offset; the zero then folds the
        offset: no codes)."""
        q = self.q.to(torch.int8) - (1 << (self.bits - 1))
        return Int8Blocks(q, self.scale, self.zero)

    def parts_for(self, dtype: torch.dtype) -> int:
        """The fewest kernel parts (at most ``MAX_INT4_PARTS``) that hold the scales and zeros
        exactly in ``dtype``; 0 when none does."""
        return next((p for p in range(1, MAX_INT4_PARTS + 1) if self.exact_in(dtype, p)), 0)

    def exact_in(self, dtype: torch.dtype, parts: int = 1) -> bool:
        """Whether ``parts`` values of ``dtype`` summed hold every scale and zero exactly (the
        kernel then computes the checkpoint's own weights)."""
        r = self.rounded(dtype, parts)
        return torch.equal(r.scale, self.scale) and torch.equal(r.zero, self.zero)


@dataclass(slots=True)
class Int8Blocks:
    """w[n, k] = q[n, k] * scale[n, k // group] + zero[n, k // group]; q int8, scale and zero
    float32, zero None for none (GGUF Q8_0, Q5_0, Q6_K; Q5_1 and Q5_K have one). ``codes``: a
    K-quant's own scales (Q5_K, Q6_K), scale their ``scale()`` and zero ``-least()``."""

    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None = None
    codes: ScaleCodes | None = None

    @property
    def group(self) -> int:
        return self.q.shape[1] // self.scale.shape[1]

    def as_int4_planes(self) -> list[Int4Groups]:
        """The same weights as two 4-bit planes for ``Int4Linear``: with
        q + 128 = 16 hi + lo, w = 16 d (hi - 8) + d (lo - 8) + (8 d + zero). Scales in the
        kernel's dtype round d alone (16 d rounds alike), so the layer computes round(d) * q
        (+ the zero, rounded). 8 d + zero is one float32 rounding where there is a zero."""
        u = self.q.to(torch.int16) + 128
        hi, lo = (u >> 4).to(torch.uint8), (u & 15).to(torch.uint8)
        zero = 8 * self.scale if self.zero is None else 8 * self.scale + self.zero
        return [
            Int4Groups(hi, 16 * self.scale, torch.zeros_like(self.scale)),
            Int4Groups(lo, self.scale.clone(), zero),
        ]

    def as_planes(self, max_bits: int) -> list[Int4Groups]:
        """One plane of q's own width where it spans at most ``max_bits`` bits (5 or 6: our
        kernel's wide q; a zero-free q centred on 0 as it is, else 2^(bits - 1) scale folded
        into the zero: one float32 rounding), else the two nibble planes."""
        low, high = (int(v) for v in torch.aminmax(self.q))
        for bits in range(4, max_bits + 1):
            half = 1 << (bits - 1)
            zero = torch.zeros_like(self.scale) if self.zero is None else self.zero
            if -half <= low and high < half:
                # q + half in one uint8 pass: the bytes of a negative q wrap to it; the codes
                # still hold where there is no min (a min here is not the codes' form)
                codes = self.codes if self.zero is None else None
                return [Int4Groups(self.q.view(torch.uint8) + half, self.scale, zero, bits, codes)]
            if 0 <= low and high < 2 * half:
                zero = zero + half * self.scale
                return [Int4Groups(self.q.to(torch.uint8), self.scale, zero, bits, self.codes)]
        return self.as_int4_planes()


WeightSource: TypeAlias = torch.Tensor | Int4Groups | Int8Blocks


def _total(parts: list[torch.Tensor]) -> torch.Tensor:
    total = parts[0].float()
    for part in parts[1:]:
        total = total + part.float()
    return total


def split_parts(values: torch.Tensor, dtype: torch.dtype, parts: int) -> list[torch.Tensor]:
    """``values`` (float32) as ``parts`` tensors of ``dtype`` whose sum is nearest to them: each
    part rounds what the ones before it left over. Two bf16 parts hold any fp16 value exactly
    (8 + 8 significant bits against 11, and bf16 has float32's exponent range)."""
    out, rest = [], values.float()
    for _ in range(parts):
        out.append(rest.to(dtype))
        rest = rest - out[-1].float()
    return out


def dequantize(source: WeightSource) -> torch.Tensor:
    """The source's weights as float32 [N, K]. For int4 groups this is the value the kernel
    computes, (q - 8) * scale + zero rounded once, wherever (q - 8) * scale is exact in float32:
    scales of at most 20 significant bits (fp16 GGUF blocks, bf16 kernels)."""
    if isinstance(source, torch.Tensor):
        return source.float()
    n, k = source.q.shape
    groups = source.scale.shape[1]
    scale = source.scale[..., None]
    if isinstance(source, Int8Blocks):
        w = source.q.view(n, groups, -1).float() * scale
        return (w if source.zero is None else w.add_(source.zero[..., None])).view(n, k)
    q = source.q.view(n, groups, -1).float().sub_(1 << (source.bits - 1))
    return q.mul_(scale).add_(source.zero[..., None]).view(n, k)


# Weights dequantized at a time by ``dequantize_as``: its float32 rows stay in a core's L2 cache
DEQUANTIZE_CHUNK = 1 << 17


def dequantize_as(source: WeightSource, dtype: torch.dtype) -> torch.Tensor:
    """``dequantize(source).to(dtype)``, the same values, without the whole float32 matrix:
    blocks of rows dequantized and rounded in turn (a tensor source is converted as it is)."""
    if isinstance(source, torch.Tensor):
        return source.float().to(dtype)
    n, k = source.q.shape
    out = torch.empty(n, k, dtype=dtype)
    step = max(1, DEQUANTIZE_CHUNK // k)
    for start in range(0, n, step):
        out[start : start + step] = dequantize(row_range(source, start, start + step))
    return out


def row_range(source: WeightSource, start: int, stop: int) -> WeightSource:
    """Rows [start, stop) of ``source`` (``map_rows`` of a slice: views, codes included)."""
    return map_rows(source, lambda t: t[start:stop])


def map_rows(source: WeightSource, rows: Callable[[torch.Tensor], torch.Tensor]) -> WeightSource:
    """``source`` with ``rows`` (a function of a tensor's first dimension: a slice, an index, a
    permutation) applied to each of its tensors along the output rows (whole rows: quantized
    blocks and their codes move as they are)."""
    if isinstance(source, torch.Tensor):
        return rows(source)
    codes = source.codes
    if codes is not None:
        dmin = None if codes.dmin is None else rows(codes.dmin)
        m = None if codes.m is None else rows(codes.m)
        codes = ScaleCodes(rows(codes.d), rows(codes.sc), dmin, m)
    zero = None if source.zero is None else rows(source.zero)
    return replace(source, q=rows(source.q), scale=rows(source.scale), zero=zero, codes=codes)


def source_rows(source: WeightSource, rows: torch.Tensor) -> torch.Tensor:
    """Rows ``rows`` of the source's weights as float32 [len(rows), K], as ``dequantize``."""
    return dequantize(map_rows(source, lambda t: t.index_select(0, rows)))


def stack_sources(sources: list[WeightSource]) -> WeightSource:
    """Sources stacked along the output dimension in one kind: 4-bit groups or int8 blocks
    (GGUF types mixed: each as int8 blocks, groups repeated to the smallest), else dense."""
    if len(sources) == 1:
        return sources[0]
    quantized = [s for s in sources if isinstance(s, Int4Groups | Int8Blocks)]
    if len(quantized) == len(sources):
        group = min(s.group for s in quantized)

        def cat(values: list[torch.Tensor | None]) -> torch.Tensor:
            return torch.cat(
                [
                    (torch.zeros_like(s.scale) if v is None else v).repeat_interleave(
                        s.group // group, 1
                    )
                    for s, v in zip(quantized, values)
                ]
            )

        int4 = [s for s in quantized if isinstance(s, Int4Groups)]
        if len(int4) == len(sources) and len({s.bits for s in int4}) == 1:
            q = torch.cat([s.q for s in int4])
            scale, zero = cat([s.scale for s in int4]), cat([s.zero for s in int4])
            return Int4Groups(q, scale, zero, int4[0].bits, cat_codes(int4))
        blocks = [s if isinstance(s, Int8Blocks) else s.as_int8() for s in quantized]
        zero = None if all(b.zero is None for b in blocks) else cat([b.zero for b in blocks])
        q, scale = torch.cat([b.q for b in blocks]), cat([b.scale for b in blocks])
        return Int8Blocks(q, scale, zero, cat_codes(blocks))
    if all(isinstance(s, torch.Tensor) for s in sources):
        return torch.cat(sources)
    return torch.cat([dequantize(s) for s in sources])  # quantized and dense mixed
