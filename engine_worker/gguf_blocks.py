"""GGUF quantized blocks parsed into the forward's weight sources, exactly.

Every served type becomes groups of 16 or 32 weights with one float32 scale (and zero) per
group, holding the file's own weights (``linear.dequantize`` of the source is the ``gguf``
package's ``dequantize``, value for value; tests/engine_worker/test_gguf_blocks.py):

* 4 bits or fewer per weight -> ``Int4Groups`` (``w = (q - 8) * scale + zero``, q in [0, 15]):
  Q4_0 (d (q - 8)), Q4_1 (d q + m), Q4_K (super-blocks of 256: fp16 d and dmin, 8 sub-blocks
  of 32 with 6-bit sc and m, ``w = d sc q - dmin m``), Q3_K (16 sub-blocks of 16, signed 6-bit
  sc, q in [-4, 3], ``w = d sc q``), Q2_K (16 sub-blocks of 16, 4-bit sc and m, q in [0, 3]);
* 5 to 8 bits -> ``Int8Blocks`` (``w = q * scale + zero``, q int8): Q5_0 (d (q - 16)),
  Q5_1 (d q + m), Q5_K (as Q4_K with 5-bit q), Q6_K (16 sub-blocks of 16, int8 sc,
  ``w = d sc (q - 32)``), Q8_0 (d q). The int4 layers serve them as two 4-bit planes
  (``Int8Blocks.as_int4_planes``).

Products of an fp16 d and a sub-block's integer scale are exact in float32 (at most 19
significant bits). A zero that folds a min and the kernel's offset of 8 (Q4_1 ``m + 8 d``, Q4_K
and Q2_K ``8 d sc - dmin m``) is one float32 rounding, exact for nearly every block: the
groups where it is not are counted (``INEXACT_ZEROS``; read_gguf logs them per file): their
weights are the file's to one float32 rounding.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import torch

from engine_worker.linear import Int4Groups, Int8Blocks, WeightSource
from engine_worker.weight_sources import ScaleCodes

logger = logging.getLogger("splitserve.engine.gguf")

QK_K = 256
# type -> (weights per block, bytes per block)
BLOCK_SHAPES = {
    "Q4_0": (32, 18),
    "Q4_1": (32, 20),
    "Q5_0": (32, 22),
    "Q5_1": (32, 24),
    "Q8_0": (32, 34),
    "Q2_K": (QK_K, 84),
    "Q3_K": (QK_K, 110),
    "Q4_K": (QK_K, 144),
    "Q5_K": (QK_K, 176),
    "Q6_K": (QK_K, 210),
}
BLOCK_TYPES = tuple(BLOCK_SHAPES)


def parse_blocks(type_name: str, raw: np.ndarray, rows: int, cols: int) -> WeightSource:
    """A matrix of ``rows`` x ``cols`` weights from its raw GGUF blocks (uint8)."""
    per_block, nbytes = BLOCK_SHAPES[type_name]
    blocks = np.asarray(raw, dtype=np.uint8).reshape(rows * (cols // per_block), nbytes)
    return _PARSERS[type_name](blocks, rows, cols, type_name)


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The fp16 at byte ``start`` of every block, as float32 [n_blocks, 1]."""
    return blocks[:, start : start + 2].view(np.float16).astype(np.float32)


def _bits(data: np.ndarray, shifts: list[int], mask: int) -> np.ndarray:
    """[n, parts, bytes] -> [n, parts, len(shifts), bytes]: each byte shifted, masked."""
    shift = np.array(shifts, dtype=np.uint8).reshape(1, 1, -1, 1)
    return (data[:, :, None, :] >> shift) & np.uint8(mask)


def _nibbles(qs: np.ndarray, run: int) -> np.ndarray:
    """Runs of ``run`` bytes: their low nibbles, then their high ones -> [n, weights] (written in
    place: two whole-array passes, no broadcast temporaries)."""
    n = qs.shape[0]
    runs = qs.reshape(n, -1, 1, run)
    out = np.empty((n, runs.shape[1], 2, run), dtype=np.uint8)
    np.bitwise_and(runs, np.uint8(15), out=out[:, :, :1])
    np.right_shift(runs, np.uint8(4), out=out[:, :, 1:])
    return out.reshape(n, -1)


def _per_row(v: np.ndarray, rows: int, dtype: type = np.float32) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(v.astype(dtype, copy=False)).reshape(rows, -1))


def _int4(
    q: np.ndarray,
    scale: np.ndarray,
    zero: np.ndarray,
    rows: int,
    cols: int,
    codes: ScaleCodes | None = None,
) -> Int4Groups:
    q4 = torch.from_numpy(np.ascontiguousarray(q, dtype=np.uint8).reshape(rows, cols))
    return Int4Groups(q4, _per_row(scale, rows), _per_row(zero, rows), codes=codes)


def _int8(
    q: np.ndarray,
    scale: np.ndarray,
    zero: np.ndarray | None,
    rows: int,
    cols: int,
    codes: ScaleCodes | None = None,
) -> Int8Blocks:
    q8 = torch.from_numpy(np.ascontiguousarray(q.astype(np.int8, copy=False)).reshape(rows, cols))
    zero8 = None if zero is None else _per_row(zero, rows)
    return Int8Blocks(q8, _per_row(scale, rows), zero8, codes)


def _codes(
    rows: int,
    d: np.ndarray,
    sc: np.ndarray,
    dmin: np.ndarray | None = None,
    m: np.ndarray | None = None,
) -> ScaleCodes:
    """A K-quant's super-block d (and dmin) [n, 1] and sub-block codes sc (and m) [n, runs]."""
    least = None if dmin is None else _per_row(dmin, rows)
    return ScaleCodes(
        _per_row(d, rows),
        _per_row(sc, rows, np.int8),
        least,
        None if m is None else _per_row(m, rows, np.int8),
    )


def folded_zero(scale: np.ndarray, offset: np.ndarray, type_name: str) -> np.ndarray:
    """``8 scale + offset`` in float32 (the zero of ``w = scale q + offset`` as ``Int4Groups``
    holds it); how many of them float32 rounds is added to ``INEXACT_ZEROS`` (``read_gguf``
    reports them per file, and each tensor at debug level)."""
    zero = (np.float32(8) * scale + offset).astype(np.float32)
    inexact = int((zero.astype(np.float64) != 8 * scale.astype(np.float64) + offset).sum())
    INEXACT_ZEROS[0] += inexact
    INEXACT_ZEROS[1] += zero.size
    if inexact:
        logger.debug("%d of %d %s zeros rounded by float32", inexact, zero.size, type_name)
    return zero


# [zeros float32 rounded, zeros folded] since the last reset (read_gguf resets and reports)
INEXACT_ZEROS = [0, 0]


def _q4_0(b: np.ndarray, rows: int, cols: int, name: str) -> WeightSource:
    d = _f16(b, 0)
    return _int4(_nibbles(b[:, 2:], 16), d, np.zeros_like(d), rows, cols)


def _q4_1(b: np.ndarray, rows: int, cols: int, name: str) -> WeightSource:
    d, m = _f16(b, 0), _f16(b, 2)
    return _int4(_nibbles(b[:, 4:], 16), d, folded_zero(d, m, name), rows, cols)


def _q8_0(b: np.ndarray, rows: int, cols: int, name: str) -> WeightSource:
    return _int8(b[:, 2:].copy().view(np.int8), _f16(b, 0), None, rows, cols)


def _q5(b: np.ndarray, start: int) -> np.ndarray:
    """Q5_0/Q5_1 5-bit q: 32 high bits (a little-endian uint32) at ``start``, nibbles after."""
    qh = b[:, start : start + 4].copy().view(np.uint32)
    high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
    return _nibbles(b[:, start + 4 :], 16) | (high << 4)


def _q5_0(b: np.ndarray, rows: int, cols: int, name: str) -> WeightSource:
    return _int8(_q5(b, 2).astype(np.int8) - 16, _f16(b, 0), None, rows, cols)


def _q5_1(b: np.ndarray, rows: int, cols: int, name: str) -> WeightSource:
    return _int8(_q5(b, 4), _f16(b, 0), _f16(b, 2), rows, cols)


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: 8 6-bit scales and 8 6-bit mins packed in 12 bytes -> two [n, 8] uint8.
    Bytes 0-3 (d), 4-7 (m) and 8-11 (low) as three little-endian uint32 words, each byte's
    fields masked and shifted in place (a shift by 2 moves bits 6-7 to 4-5 of the same byte)."""
    words: list[np.ndarray] = [scales[:, i : i + 4].view(np.uint32)[:, 0] for i in (0, 4, 8)]
    d, m, low = words
    sc: np.ndarray = np.empty((len(d), 2), np.uint32)
    mn: np.ndarray = np.empty((len(d), 2), np.uint32)
    sc[:, 0] = d & np.uint32(0x3F3F3F3F)
    sc[:, 1] = (low & np.uint32(0x0F0F0F0F)) | ((d >> np.uint32(2)) & np.uint32(0x30303030))
    mn[:, 0] = m & np.uint32(0x3F3F3F3F)
    mn[:, 1] = ((low >> np.uint32(4)) & np.uint32(0x0F0F0F0F)) | (
        (m >> np.uint32(2)) & np.uint32(0x30303030)
    )
    return sc.view(np.uint8), mn.view(np.uint8)


def _k_scales(b: np.ndarray, rows: int) -> tuple[np.ndarray, np.ndarray, ScaleCodes]:
    """Q4_K/Q5_K sub-block scale d sc and min dmin m, float32 [n, 8] (both exact), and their
    codes."""
    sc, mn = _k_scale_min(b[:, 4:16])
    d, dmin = _f16(b, 0), _f16(b, 2)
    codes = _codes(rows, d, sc, dmin, mn)
    return d * sc.astype(np.float32), dmin * mn.astype(np.float32), codes


def _q4_k(b: np.ndarray, rows: int, cols: int, name: str) -> WeightSource:
    scale, dm, codes = _k_scales(b, rows)
    zero = folded_zero(scale, -dm, name)
    return _int4(_nibbles(b[:, 16:], 32), scale, zero, rows, cols, codes)


def _q5_k(b: np.ndarray, rows: int, cols: int, name: str) -> WeightSource:
    scale, dm, codes = _k_scales(b, rows)
    n = b.shape[0]
    high = _bits(b[:, 16:48].reshape(n, 1, 32), list(range(8)), 1).reshape(n, -1)
    q = _nibbles(b[:, 48:], 32) | (high << 4)
    return _int8(q, scale, -dm, rows, cols, codes)


def _q6_k(b: np.ndarray, rows: int, cols: int, name: str) -> WeightSource:
    n = b.shape[0]
    q: np.ndarray = _nibbles(b[:, :128], 64).reshape(n, 2, 4, 32)
    high = b[:, 128:192].reshape(n, 2, 32)
    for j in range(4):  # bits 2 j and 2 j + 1 of the high bytes: bits 4 and 5 of run j's q
        q[:, :, j] |= ((high >> np.uint8(2 * j)) & np.uint8(3)) << np.uint8(4)
    q = q.reshape(n, -1)
    np.subtract(q, np.uint8(32), out=q)  # wraps: q - 32 as int8's bytes
    d, sc = _f16(b, 208), np.ascontiguousarray(b[:, 192:208]).view(np.int8)
    return _int8(q.view(np.int8), d * sc.astype(np.float32), None, rows, cols, _codes(rows, d, sc))


def _q3_k(b: np.ndarray, rows: int, cols: int, name: str) -> WeightSource:
    n = b.shape[0]
    low = _bits(b[:, 32:96].reshape(n, 2, 32), [0, 2, 4, 6], 3).reshape(n, -1)
    # a weight's bit in the 32-byte mask clear means 4 less (q in [-4, 3])
    mask = _bits(b[:, :32].reshape(n, 1, 32), list(range(8)), 1).reshape(n, -1)
    q = low + 4 + (mask << 2)  # q + 8, in [4, 11]
    packed = b[:, 96:108]
    low_sc = _bits(packed[:, None, :8], [0, 4], 15).reshape(n, 16)
    high_sc = _bits(packed[:, None, 8:], [0, 2, 4, 6], 3).reshape(n, 16)
    sc = (low_sc | (high_sc << 4)).astype(np.int8) - np.int8(32)
    d = _f16(b, 108)
    scale = d * sc.astype(np.float32)
    return _int4(q, scale, np.zeros_like(scale), rows, cols, _codes(rows, d, sc))


def _q2_k(b: np.ndarray, rows: int, cols: int, name: str) -> WeightSource:
    n = b.shape[0]
    packed = b[:, :16]
    d, dmin, sc, mn = _f16(b, 80), _f16(b, 82), packed & 15, packed >> 4
    scale, dm = d * sc.astype(np.float32), dmin * mn.astype(np.float32)
    q = _bits(b[:, 16:80].reshape(n, 2, 32), [0, 2, 4, 6], 3).reshape(n, -1)
    zero = folded_zero(scale, -dm, name)
    return _int4(q, scale, zero, rows, cols, _codes(rows, d, sc, dmin, mn))


_PARSERS: dict[str, Callable[[np.ndarray, int, int, str], WeightSource]] = {
    "Q4_0": _q4_0,
    "Q4_1": _q4_1,
    "Q5_0": _q5_0,
    "Q5_1": _q5_1,
    "Q8_0": _q8_0,
    "Q2_K": _q2_k,
    "Q3_K": _q3_k,
    "Q4_K": _q4_k,
    "Q5_K": _q5_k,
    "Q6_K": _q6_k,
}
