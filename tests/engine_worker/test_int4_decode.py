"""Our int4 decode kernel (engine_worker/int4_decode.py): the torch op against the ctypes build of
the same source and against float32 of the same weights, a row's bits alone (not the call's other
rows, nor the thread count), the engine on it (``int4_kernel="own"``: scripted == eager), and
aten's kernel where the op is not built. Skipped where the op is not built or cannot run (no g++,
no AVX-512 BF16/VNNI; scripts/setup_env.sh builds it)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from engine_worker import int4_decode
from engine_worker.gguf_blocks import parse_blocks
from engine_worker.linear import (
    BatchSizeSwitch,
    Int4Groups,
    Int4Linear,
    Int8Blocks,
    dequantize,
    quantize_int4,
)
from engine_worker.weight_format import WeightFormat, _planes
from engine_worker.weight_sources import ScaleCodes
from tests.engine_worker import int4_ctypes
from tests.engine_worker.helpers import greedy
from tests.engine_worker.scripted_helpers import assert_same, make_engine
from tests.engine_worker.test_gguf_blocks import random_blocks

needs_op = pytest.mark.skipif(
    not int4_decode.load_op() or int4_ctypes.library() is None,
    reason="int4 decode op not built, or no g++ / AVX-512 BF16",
)
CPU = torch.device("cpu")


def groups(n: int, k: int, seed: int = 0):
    weight = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    return quantize_int4(weight, torch.bfloat16)


def rows(m: int, k: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).bfloat16()


def relative_error(y: torch.Tensor, reference: torch.Tensor) -> float:
    return ((y.float() - reference).norm() / reference.norm()).item()


@needs_op
@pytest.mark.parametrize("planes", [1, 2])
def test_op_equals_the_ctypes_kernel_and_float32_of_the_weights(planes):
    sources = [groups(48, 96, seed=p) for p in range(planes)]
    blocks = int4_decode.pack(sources)
    weight = sum(dequantize(s) for s in sources)
    for m in range(1, 9):  # rows go 4 at a time: partial and second chunks too
        x = rows(m, 96, seed=m)
        y = torch.ops.splitserve.int4_decode_mm(x, blocks, planes)
        assert torch.equal(y, int4_ctypes.apply_ctypes(blocks, x, planes))
        sums = int4_ctypes.apply_ctypes(blocks, x, planes, f32=True)
        assert relative_error(sums, x.float() @ weight.t()) < 1e-6  # exact products
        assert torch.equal(y, sums.bfloat16())


@needs_op
def test_a_q8_0_head_as_two_planes_matches_its_weights():
    generator = torch.Generator().manual_seed(2)
    q = torch.randint(-127, 128, (32, 64), dtype=torch.int8, generator=generator)
    scale = (torch.rand(32, 2, generator=generator) * 0.01).bfloat16().float()  # bf16 holds it
    blocks = Int8Blocks(q, scale)
    x = rows(2, 64)
    sums = int4_ctypes.apply_ctypes(int4_decode.pack(blocks.as_int4_planes()), x, 2, f32=True)
    assert relative_error(sums, x.float() @ dequantize(blocks).t()) < 1e-6


def assert_rows_alone(op, blocks: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``op(x, blocks, 1)`` gives each row the bits it gets alone, on 2 threads and on 1;
    returns the rows together."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        together = op(x, blocks, 1)
        alone = [op(x[i : i + 1], blocks, 1) for i in range(len(x))]
        torch.set_num_threads(1)
        one_thread = op(x, blocks, 1)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(together, torch.cat(alone)) and torch.equal(together, one_thread)
    return together


@needs_op
def test_a_rows_bits_depend_on_that_row_alone():
    """Large enough that more than one row runs on two threads and one row on the caller's."""
    blocks = int4_decode.pack([groups(256, 576)])
    assert_rows_alone(torch.ops.splitserve.int4_decode_mm, blocks, rows(7, 576))


@needs_op
@pytest.mark.parametrize(("group", "bits", "planes"), [(32, 4, 1), (16, 6, 1), (32, 4, 2)])
def test_grouped_op_equals_one_call_per_weight(group, bits, planes):
    """Several weights of one layout in one call (a mixture's chosen experts), each over its own
    rows, on two threads: each row's bits are those of its weight's own call, 0 to 9 rows a
    weight (more than 4: a tile takes them 4 at a time from its cached blocks)."""
    weights = [
        int4_decode.pack([wide_planes(64, 128, group, bits, 10 * e + p) for p in range(planes)])
        for e in range(4)
    ]
    counts = [3, 9, 0, 1]
    x = rows(sum(counts), 128, seed=5)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        together = torch.ops.splitserve.int4_decode_grouped_mm(x, weights, counts, planes)
    finally:
        torch.set_num_threads(threads)
    alone = [
        torch.ops.splitserve.int4_decode_mm(part, blocks, planes)
        for part, blocks in zip(x.split(counts), weights)
    ]
    assert torch.equal(together, torch.cat(alone))
    with pytest.raises(RuntimeError, match="counts sum to 13, x has 14 rows"):
        torch.ops.splitserve.int4_decode_grouped_mm(rows(14, 128), weights, counts, planes)
    other = int4_decode.pack([wide_planes(32, 128, group, bits, seed=0)] * planes)
    with pytest.raises(RuntimeError, match="weights of one layout"):
        torch.ops.splitserve.int4_decode_grouped_mm(x, [*weights[:3], other], counts, planes)


@needs_op
def test_int4_layers_take_the_op_and_refuse_other_rows():
    fmt = WeightFormat("int4", torch.bfloat16, CPU, int4_kernel="own")
    layer = fmt.linear([torch.randn(48, 96)])
    assert isinstance(layer, BatchSizeSwitch) and layer.quantized.own_kernel
    with pytest.raises(RuntimeError, match="rows of 96"):
        layer.quantized.apply(rows(1, 64))
    with pytest.raises(ValueError, match="int4_kernel"):
        WeightFormat("int4", torch.bfloat16, CPU, int4_kernel="mine")


@needs_op
def test_engine_on_our_kernel_scripted_matches_eager(tiny_model_dir):
    engine = make_engine(
        tiny_model_dir, weights="int4", int4_kernel="own", enable_prefix_cache=False
    )
    model = engine.runner.model
    assert model.scripted_decode is not None
    # the compiled layers call our kernel
    assert "splitserve::int4_decode_mm" in str(model.scripted_decode.by_batch[1].graph)
    assert all(isinstance(x.down.quantized, Int4Linear) for x in model.layers)
    assert all(x.down.quantized.own_kernel for x in model.layers)
    prompts = [[1, 5, 9, 300], [1, 17, 4000, 5, 6, 7, 8], [1, 2000]]
    assert_same(engine, prompts, greedy(8, ignore_eos=True), "own")


FALLBACK = """
import logging, torch
logging.basicConfig(level=logging.WARNING)
from engine_worker.weight_format import WeightFormat
cpu = torch.device("cpu")
formats = [WeightFormat("int4", torch.bfloat16, cpu, int4_kernel="own") for _ in range(2)]
layers = [fmt.linear([torch.randn(48, 96)]) for fmt in formats]
own = any(f.own_int4 for f in formats) or any(x.quantized.own_kernel for x in layers)
print("own" if own else "aten")
"""


@pytest.mark.parametrize(
    "env, why",
    [
        ({int4_decode.NO_BUILD: "1", "PATH": "/usr/bin:/bin"}, "SPLITSERVE_NO_KERNEL_BUILD is set"),
        ({"PATH": "/nonexistent"}, "no g++ on PATH"),
    ],
)
def test_without_a_built_op_aten_serves_logged_once_with_why(tmp_path, env, why):
    """A cache without the op (a fresh machine) where it is not to be built, or cannot be:
    aten's kernel, one warning that says why and what it costs."""
    done = subprocess.run(
        [sys.executable, "-c", FALLBACK],
        env={"SPLITSERVE_CACHE": str(tmp_path), **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "aten"
    assert done.stderr.count("our int4 kernel is unavailable") == 1
    assert why in done.stderr and "~30% slower per token" in done.stderr
    assert not list(tmp_path.glob("kernels/*/*.so"))


def wide_planes(n: int, k: int, group: int, bits: int, seed: int) -> Int4Groups:
    """Random q of ``bits`` bits in groups of ``group``, scales and zeros bf16 holds."""
    generator = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 1 << bits, (n, k), dtype=torch.uint8, generator=generator)
    scale = (torch.rand(n, k // group, generator=generator) * 0.01).bfloat16().float()
    zero = (torch.randn(n, k // group, generator=generator) * 0.05).bfloat16().float()
    return Int4Groups(q, scale, zero, bits)


@pytest.mark.skipif(int4_ctypes.library() is None, reason="no g++ / AVX-512 BF16")
@pytest.mark.parametrize("group", [16, 32])
@pytest.mark.parametrize("bits", [4, 5, 6])
def test_groups_of_16_and_wide_q_match_their_weights(group, bits):
    """The kernel's variants (GGUF Q2_K/Q3_K/Q6_K sub-blocks of 16; Q5_x and Q6_K q of 5 and 6
    bits): float32 sums of the exact products, a row's bits alone."""
    planes = [wide_planes(48, 128, group, bits, seed=p) for p in range(2)]
    assert int4_decode.takes(planes)
    blocks = int4_decode.pack(planes)
    weight = sum(dequantize(p) for p in planes)
    for m in (1, 3, 6):
        x = rows(m, 128, seed=m)
        sums = int4_ctypes.apply_ctypes(blocks, x, 2, f32=True)
        assert relative_error(sums, x.float() @ weight.t()) < 1e-6, m
        alone = int4_ctypes.apply_ctypes(blocks, x[-1:], 2, f32=True)
        assert torch.equal(alone[0], sums[-1])
    if int4_decode.load_op():
        y = torch.ops.splitserve.int4_decode_mm(x, blocks, 2)
        assert torch.equal(y, int4_ctypes.apply_ctypes(blocks, x, 2))


def layout_reference(planes: list[Int4Groups]) -> torch.Tensor:
    """The kernel's block layout (int4_decode.cpp) built the plain way, index by index with torch
    views: what ``int4_decode.pack`` (whole-array numpy on the bytes) must equal, byte for byte."""
    tile, group = int4_decode.TILE, int4_decode.GROUP
    q = torch.cat([p.q for p in planes], dim=1)
    scale = torch.cat([p.scale for p in planes], dim=1)
    zero = torch.cat([p.zero for p in planes], dim=1)
    n, k = q.shape
    tiles, blocks, sub = n // tile, k // group, group // planes[0].group
    # word i of chunk c, nibble s: q[16 t + i // 2, 32 g + 2 (4 c + s) + i % 2]
    nibbles = (q & 15).view(tiles, tile, blocks, 4, 4, 2).permute(0, 2, 3, 1, 5, 4)
    words = torch.stack(
        [nibbles[..., 0] | (nibbles[..., 1] << 4), nibbles[..., 2] | (nibbles[..., 3] << 4)], -1
    )
    parts = [words.reshape(tiles, blocks, 256)]
    lanes = q.view(tiles, tile, blocks, 4, 4, 2).permute(0, 2, 3, 4, 1, 5).reshape(-1, 8)
    for h in range(planes[0].bits - 4):  # mask 4 c + s, bit i of q[...] bit 4 + h
        bits = ((lanes >> (4 + h)) & 1).int() << torch.arange(8)
        parts.append(bits.sum(-1).to(torch.uint8).reshape(tiles, blocks, 64))
    pairs = torch.stack([scale, zero], dim=-1).to(torch.bfloat16)
    pairs = pairs.view(tiles, tile, blocks, sub, 2).permute(0, 2, 3, 1, 4).contiguous()
    parts.append(pairs.view(torch.uint8).reshape(tiles, blocks, sub * 64))
    packed = torch.cat(parts, -1)
    return packed if sub == 1 else packed.view(tiles, blocks, sub, -1)


@pytest.mark.parametrize("group", [16, 32])
@pytest.mark.parametrize("bits", [4, 5, 6])
@pytest.mark.parametrize("parts", [1, 2])
def test_pack_equals_the_layout_built_index_by_index(group, bits, parts, monkeypatch):
    if parts == 2:  # a tile at a time: three runs of pack's loop
        monkeypatch.setattr(int4_decode, "PACK_CHUNK", int4_decode.TILE * 192)
    planes = [wide_planes(48, 192, group, bits, seed=7 * p + bits) for p in range(parts)]
    # scales and zeros of any float32 (pack rounds them to bf16 itself)
    generator = torch.Generator().manual_seed(group + bits)
    for plane in planes:
        plane.scale = torch.randn(plane.scale.shape, generator=generator)
        plane.zero = torch.randn(plane.zero.shape, generator=generator)
    packed = int4_decode.pack(planes)
    expected = layout_reference(planes)
    assert packed.dtype == torch.uint8 and packed.shape == expected.shape
    assert torch.equal(packed, expected)
    # rows cut out of a larger tensor (a mixture's experts) pack as the rows alone do
    tall = Int4Groups(
        torch.cat([planes[0].q, planes[0].q]),
        planes[0].scale.repeat(2, 1),
        planes[0].zero.repeat(2, 1),
        bits,
    )
    assert torch.equal(int4_decode.pack([tall])[:3], int4_decode.pack([planes[0]]))


def k_quant(type_name: str, rows: int, cols: int, seed: int) -> list[Int4Groups]:
    """A K-quant's random blocks (test_gguf_blocks.random_blocks) as our kernel's one plane."""
    source = parse_blocks(type_name, random_blocks(type_name, rows, cols, seed, False), rows, cols)
    return _planes(source, torch.bfloat16, int4_decode.MAX_BITS)


# type -> bits a weight of the coded layout: the file's own for Q4_K (4.5 + a byte of d, dmin
# per 16 x 256), Q5_K and Q6_K; Q2_K and Q3_K keep 4-bit q
CODED_BITS = {"Q2_K": 5.125, "Q3_K": 4.5625, "Q4_K": 4.625, "Q5_K": 5.625, "Q6_K": 6.5625}


@needs_op
@pytest.mark.parametrize("type_name", sorted(CODED_BITS))
def test_k_quants_pack_with_their_own_codes_and_compute_their_weights(type_name):
    """A K-quant's sub-block codes and super-block d (dmin) in place of bf16 (scale, zero)
    pairs: the file's bytes a weight (not 5 or 8), and the file's own weights exactly (the
    pairs' bf16 rounds Q4_K's 17-bit scales): float32 sums of the exact products, the op equal
    to the ctypes build, a row's bits alone; the prompt kernel reads the same blocks."""
    planes = k_quant(type_name, 48, 512, seed=len(type_name))
    assert int4_decode.coded(planes)
    blocks = int4_decode.pack(planes)
    assert blocks.numel() * 8 / (48 * 512) == CODED_BITS[type_name]
    weight = dequantize(planes[0])
    x = rows(6, 512, seed=2)
    sums = int4_ctypes.apply_ctypes(blocks, x, f32=True)
    assert relative_error(sums, x.float() @ weight.t()) < 1e-6
    y = assert_rows_alone(torch.ops.splitserve.int4_decode_mm, blocks, x)
    assert torch.equal(y, int4_ctypes.apply_ctypes(blocks, x))
    prompt = assert_rows_alone(torch.ops.splitserve.int4_prompt_mm, blocks, x)
    assert relative_error(prompt, x.float() @ weight.t()) < 0.05  # int8 activations
    # planes side by side, or a d that is no fp16 value, take bf16 pairs
    assert not int4_decode.coded(planes * 2)
    codes = planes[0].codes
    assert codes is not None
    codes.d[0, 0] = 1 / 3
    assert not int4_decode.coded(planes)


@needs_op
def test_q4_k_projections_stacked_keep_their_codes_and_mixed_types_take_pairs():
    """q, k, v of one K-quant stack with their codes (one coded layer); a Q6_K v beside Q4_K q
    and k stacks as int8 blocks without codes, packed as bf16 pairs, the same weights."""
    fmt = WeightFormat("auto", torch.bfloat16, CPU, int4_kernel="own")
    parts = [k_quant("Q4_K", n, 256, seed) for n, seed in ((64, 1), (32, 2), (32, 3))]
    layer = fmt.linear([p[0] for p in parts])
    assert isinstance(layer, BatchSizeSwitch) and int4_decode.layout_of(layer.quantized.packed)[4]
    weight = torch.cat([dequantize(p[0]) for p in parts])
    x = rows(2, 256)
    y = layer.quantized.apply(x)
    assert relative_error(y, x.float() @ weight.t()) < 4e-3  # bf16 outputs
    v = parse_blocks("Q6_K", random_blocks("Q6_K", 32, 256, 4, False), 32, 256)
    mixed = fmt.linear([parts[0][0], parts[1][0], v])
    assert isinstance(mixed, BatchSizeSwitch)
    assert int4_decode.layout_of(mixed.quantized.packed)[4] == 0


@needs_op
@pytest.mark.parametrize(
    ("with_min", "layout"),
    [(m, x) for m in (True, False) for x in [(1, 0), (1, 1), (1, 2), (2, 0), (2, 1), (2, 2)]],
)
def test_the_kernel_takes_exactly_the_coded_layouts_pack_makes(with_min, layout):
    """Coded scales in every (groups, q width) a K-quant's blocks come to (int4_decode.CODED):
    the kernel computes their weights; the others (no kernel instance) pack as bf16 pairs."""
    sub, high = layout
    n, k, group = 32, 256, 32 // sub
    generator = torch.Generator().manual_seed(sub * 10 + high)
    plane = wide_planes(n, k, group, 4 + high, seed=high)
    sc = torch.randint(-60, 60, (n, k // group), dtype=torch.int8, generator=generator)
    d, dmin = ((torch.rand(n, 1, generator=generator) + 0.5).half().float() for _ in range(2))
    codes = ScaleCodes(d / 1024, sc)  # fp16 values
    if with_min:
        codes.dmin = dmin / 1024
        codes.m = torch.randint(0, 60, sc.shape, dtype=torch.int8, generator=generator)
    plane.scale, plane.codes = codes.scale(), codes
    least = codes.least()
    centre = 1 << (plane.bits - 1)
    plane.zero = torch.zeros_like(plane.scale) if least is None else centre * plane.scale - least
    taken = layout in int4_decode.CODED[with_min]
    assert int4_decode.coded([plane]) == taken
    if not taken:
        return
    blocks = int4_decode.pack([plane])
    x = rows(3, k)
    sums = int4_ctypes.apply_ctypes(blocks, x, f32=True)
    assert relative_error(sums, x.float() @ dequantize(plane).t()) < 1e-6
