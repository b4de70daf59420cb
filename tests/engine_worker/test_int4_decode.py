"""Our int4 decode kernel (engine_worker/int4_decode.py): what each variant computes against
float32 of the same weights, and that a row's result depends on that row alone (not on the
call's other rows, nor on the thread count). Skipped where the kernel cannot be built or run
(no g++, no AVX-512 BF16/VNNI)."""

from __future__ import annotations

import pytest
import torch

from engine_worker import int4_decode
from engine_worker.int4_decode import VARIANTS, Int4DecodeLinear, groups_of
from engine_worker.linear import Int4Linear, Int8Blocks, dequantize, quantize_int4

pytestmark = pytest.mark.skipif(
    int4_decode.library() is None, reason="int4 decode kernel needs g++ and AVX-512 BF16/VNNI"
)

# Worst relative (Frobenius) error against float32 of the same weights, Gaussian rows: bf16
# forms every product exactly (float32 sums); int16 / int8 round the row per group of 32.
TOLERANCE = {"bf16": 1e-6, "int16": 1e-4, "int8": 2e-2}


def int4_layer(n: int, k: int, seed: int = 0) -> Int4Linear:
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=generator) * 0.05
    return Int4Linear(quantize_int4(weight, torch.bfloat16), torch.bfloat16)


def rows(m: int, k: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).bfloat16()


def relative_error(y: torch.Tensor, reference: torch.Tensor) -> float:
    return ((y.float() - reference).norm() / reference.norm()).item()


def test_groups_of_reads_back_the_layers_weights():
    source = quantize_int4(torch.randn(48, 96) * 0.05, torch.bfloat16)
    groups = groups_of(Int4Linear(source, torch.bfloat16))
    assert torch.equal(groups.q, source.q)
    assert torch.equal(groups.scale, source.scale) and torch.equal(groups.zero, source.zero)


@pytest.mark.parametrize("variant", VARIANTS)
def test_each_variant_against_float32_of_the_same_weights(variant):
    layer = int4_layer(48, 96)
    kernel = Int4DecodeLinear(layer, variant)
    weight = dequantize(groups_of(layer))
    for m in (1, 3, 4, 6):  # rows go 4 at a time: a partial and a second chunk too
        x = rows(m, 96, seed=m)
        reference = x.float() @ weight.t()
        assert relative_error(kernel.apply(x, torch.float32), reference) < TOLERANCE[variant]
        out = kernel.apply(x)
        assert out.dtype == torch.bfloat16
        assert torch.equal(out, kernel.apply(x, torch.float32).bfloat16())


def test_a_q8_0_head_as_two_planes_matches_its_weights():
    generator = torch.Generator().manual_seed(2)
    q = torch.randint(-127, 128, (32, 64), dtype=torch.int8, generator=generator)
    scale = (torch.rand(32, 2, generator=generator) * 0.01).bfloat16().float()  # bf16 holds it
    blocks = Int8Blocks(q, scale)
    layer = Int4Linear(blocks.as_int4_planes(), torch.bfloat16)
    x = rows(2, 64)
    reference = x.float() @ dequantize(blocks).t()
    assert relative_error(Int4DecodeLinear(layer).apply(x, torch.float32), reference) < 1e-6


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_rows_result_depends_on_that_row_alone(variant):
    """Large enough that more than one row runs on two threads and one row on the caller's."""
    kernel = Int4DecodeLinear(int4_layer(256, 576), variant)
    x = rows(7, 576)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        together = kernel.apply(x, torch.float32)
        alone = torch.cat([kernel.apply(x[i : i + 1], torch.float32) for i in range(7)])
        torch.set_num_threads(1)
        one_thread = kernel.apply(x, torch.float32)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(together, alone) and torch.equal(together, one_thread)


def test_shapes_it_does_not_take_are_refused():
    kernel = Int4DecodeLinear(int4_layer(48, 96))
    with pytest.raises(ValueError, match="bf16 rows of 96"):
        kernel.apply(rows(1, 64))
    with pytest.raises(ValueError, match="variant"):
        Int4DecodeLinear(int4_layer(48, 96), "fp8")
