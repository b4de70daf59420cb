"""Every served GGUF block type parsed from random blocks (any bytes are a valid block) equals the
``gguf`` package's own ``dequantize``, value for value; the int4 planes the layers build from
them hold the same weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from engine_worker.gguf_blocks import BLOCK_SHAPES, INEXACT_ZEROS, folded_zero, parse_blocks
from engine_worker.linear import Int4Groups, Int8Blocks, dequantize

# Byte offsets of each type's fp16 super-scales (d, dmin): random bytes there may be NaN or inf.
FP16_AT = {
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q5_0": (0,),
    "Q5_1": (0, 2),
    "Q8_0": (0,),
    "Q2_K": (80, 82),
    "Q3_K": (108,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
}
GROUPS = {"Q2_K": 16, "Q3_K": 16, "Q6_K": 16}  # sub-block sizes; the others' groups are 32


def random_blocks(
    type_name: str, rows: int, cols: int, seed: int, wide: bool, d_size: float = 2e-3
) -> np.ndarray:
    """Random blocks whose fp16 scales are finite: normal of standard deviation ``d_size``
    (``wide`` False) or any finite fp16, subnormals included (``wide``)."""
    per_block, nbytes = BLOCK_SHAPES[type_name]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows * cols // per_block, nbytes), dtype=np.uint8)
    for at in FP16_AT[type_name]:
        if wide:
            bits = rng.integers(0, 1 << 16, size=blocks.shape[0], dtype=np.uint16)
            bits[(bits & 0x7C00) == 0x7C00] &= 0xBFFF  # exponent 31 (inf, NaN) -> 15
            d = bits.view(np.float16)
        else:
            d = (rng.standard_normal(blocks.shape[0]) * d_size).astype(np.float16)
        blocks[:, at : at + 2] = d.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def reference(type_name: str, blocks: np.ndarray, rows: int) -> torch.Tensor:
    qtype = GGMLQuantizationType[type_name]
    out = np.asarray(quants.dequantize(blocks, qtype), dtype=np.float32).reshape(rows, -1)
    return torch.from_numpy(out)


@pytest.mark.parametrize("type_name", sorted(BLOCK_SHAPES))
def test_blocks_equal_gguf_dequantize(type_name):
    rows, cols = 32, 512
    blocks = random_blocks(
        type_name, rows, cols, seed=len(type_name) + ord(type_name[1]), wide=False
    )
    source = parse_blocks(type_name, blocks, rows, cols)
    expected = reference(type_name, blocks, rows)
    got = dequantize(source)
    assert got.shape == (rows, cols)
    # the same values (a weight of 0 may be +0 or -0 on either side), but where a zero folding
    # 8 d sc and dmin m needs more than float32's 24 bits (1 in 512 groups here)
    assert_equal_but_folded_zeros(type_name, source, got, expected, most=0.01)
    assert source.group == GROUPS.get(type_name, 32)
    kind = Int4Groups if type_name[1] in "234" else Int8Blocks
    assert isinstance(source, kind)
    if isinstance(source, Int8Blocks):
        # the two nibble planes the int4 layers serve hold the same weights
        planes = sum(dequantize(p).double() for p in source.as_int4_planes())
        assert torch.allclose(planes, expected.double(), rtol=0, atol=1e-7 * expected.abs().max())


@pytest.mark.parametrize("type_name", sorted(BLOCK_SHAPES))
def test_blocks_of_any_finite_scale_equal_gguf_where_the_zero_is_exact(type_name):
    """Scales of any finite fp16 (subnormal to 65504): d sc and dmin m stay exact in float32, and
    only a zero 8 d sc - dmin m that float32 cannot hold (d and dmin far apart) differs, by one
    rounding, in its own group only."""
    rows, cols = 16, 256
    blocks = random_blocks(type_name, rows, cols, seed=7, wide=True)
    source = parse_blocks(type_name, blocks, rows, cols)
    expected = reference(type_name, blocks, rows)
    assert_equal_but_folded_zeros(type_name, source, dequantize(source), expected, most=0.25)


@pytest.mark.parametrize("type_name", ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"])
def test_k_quants_keep_their_codes_which_give_their_scales_and_zeros(type_name):
    """A K-quant's parsed weights carry its own codes (super-block d and dmin, sub-block sc and
    m: what our kernel reads in place of float scales), and the codes give the scales exactly
    and the zeros as the weights fold them, at any finite fp16 d."""
    blocks = random_blocks(type_name, 16, 512, seed=9, wide=True)
    source = parse_blocks(type_name, blocks, 16, 512)
    codes = source.codes
    assert codes is not None and codes.d.shape == (16, 2) and codes.sc.dtype == torch.int8
    assert torch.equal(codes.scale(), source.scale)
    least = codes.least()
    assert (least is None) == (type_name in ("Q3_K", "Q6_K"))
    if isinstance(source, Int8Blocks):
        assert (source.zero is None) if least is None else torch.equal(source.zero, -least)
    elif least is None:
        assert not source.zero.any()
    else:
        assert torch.equal(source.zero, 8 * source.scale - least)


def assert_equal_but_folded_zeros(type_name, source, got, expected, most: float) -> None:
    """Equal (NaN to NaN) everywhere for types whose zero folds nothing; for Q4_1, Q4_K and
    Q2_K, off by the zero's float32 rounding in at most ``most`` of the weights."""
    same = (got == expected) | (got.isnan() & expected.isnan())
    if type_name not in ("Q4_1", "Q4_K", "Q2_K"):
        assert bool(same.all()), (type_name, int((~same).sum()))
        return
    zero = source.zero.repeat_interleave(source.group, 1)
    slack = 2 * torch.finfo(torch.float32).eps * (zero.abs() + expected.abs())
    assert bool(((got - expected).abs() <= slack)[~same].all()), type_name
    assert int((~same).sum()) <= most * got.numel(), (type_name, int((~same).sum()))


def test_folded_zero_counts_what_float32_rounds():
    scale = np.array([[1.0, 2.0**-30]], dtype=np.float32)
    offset = np.array([[-3.0, 1.0]], dtype=np.float32)  # 1 + 2^-27: rounds to 1
    INEXACT_ZEROS[:] = [0, 0]
    zero = folded_zero(scale, offset, "Q4_K")
    assert zero.tolist() == [[5.0, 1.0]]
    assert INEXACT_ZEROS == [1, 2]
