"""Weight formats on their own: what torch's int4/int8 CPU kernels compute (layout, dequant
formula, dtype rules, checked with identity activations), our quantizers, the batch-size switch
and the weights/dtype knobs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine_worker import weight_sources
from engine_worker.device import cpu_has_native_bf16, resolve_dtype
from engine_worker.linear import (
    BatchSizeSwitch,
    DenseLinear,
    Int4Groups,
    Int4Linear,
    Int8Blocks,
    Int8Linear,
    dequantize,
    dequantize_as,
    onednn_packed,
    packs_for_onednn,
    quantize_int4,
    quantize_int8,
    refine_top_logits,
    split_parts,
)
from engine_worker.weight_format import WeightFormat, check_weights_and_dtype
from ipc.engine_config import EngineConfig

CPU = torch.device("cpu")


def random_groups(n: int, k: int, seed: int = 0) -> Int4Groups:
    """Int4 groups with fp16-valued scales and zeros, as a GGUF Q4_1 file holds them."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    d = (torch.rand(n, k // 32, generator=g) * 0.05 + 1e-3).half().float()
    m = (-torch.rand(n, k // 32, generator=g) * 0.4).half().float()
    return Int4Groups(q, d, m + 8 * d)


def kernel_weights(layer, k: int, dtype: torch.dtype) -> torch.Tensor:
    """The weights a layer computes with: its output for the identity (one product per sum)."""
    return layer.apply(torch.eye(k, dtype=dtype)).t().float()


def test_int4_kernel_computes_q_minus_8_times_scale_plus_zero_in_fp32():
    groups = random_groups(64, 96)
    layer = Int4Linear(groups, torch.float32)
    assert layer.scale_zero.shape == (3, 64, 2)  # [K / group, N, (scale, zero)]
    assert torch.equal(kernel_weights(layer, 96, torch.float32), dequantize(groups))


def test_int4_kernel_with_bf16_activations_rounds_scale_and_zero():
    groups = random_groups(64, 96)
    assert groups.exact_in(torch.float32) and not groups.exact_in(torch.bfloat16)
    layer = Int4Linear(groups, torch.bfloat16)
    expected = dequantize(groups.rounded(torch.bfloat16)).bfloat16().float()
    assert torch.equal(kernel_weights(layer, 96, torch.bfloat16), expected)
    assert not torch.equal(expected, dequantize(groups).bfloat16().float())


def test_two_bf16_parts_hold_fp16_scales_and_the_kernel_sums_them():
    groups = random_groups(64, 96)
    assert groups.parts_for(torch.bfloat16) == 2 and groups.exact_in(torch.bfloat16, 2)
    fp16 = (torch.randn(10_000) * 10.0 ** torch.randint(-6, 4, (10_000,))).half().float()
    high, low = split_parts(fp16, torch.bfloat16, 2)
    assert torch.equal(high.float() + low.float(), fp16)
    # One kernel call over the input twice: the file's weights, rounded once to the bf16 output.
    layer = Int4Linear(groups.split(torch.bfloat16, 2), torch.bfloat16)
    assert layer.scale_zero.shape == (6, 64, 2)
    assert torch.equal(
        kernel_weights(layer, 96, torch.bfloat16), dequantize(groups).bfloat16().float()
    )
    assert layer.nbytes == 2 * Int4Linear(groups, torch.bfloat16).nbytes


def test_q8_0_blocks_as_two_nibble_planes():
    g = torch.Generator().manual_seed(1)
    q = torch.randint(-127, 128, (48, 96), generator=g, dtype=torch.int8)
    d = (torch.rand(48, 3, generator=g) * 0.01 + 1e-4).half().float()
    blocks = Int8Blocks(q, d)
    planes = blocks.as_int4_planes()
    assert all(p.q.max() <= 15 for p in planes)
    layer = Int4Linear(planes, torch.float32)
    assert torch.equal(kernel_weights(layer, 96, torch.float32), dequantize(blocks))
    # In bf16 the block scale alone is rounded: round(d) * q, then the bf16 output rounding.
    layer = Int4Linear(planes, torch.bfloat16)
    rounded = Int8Blocks(q, d.bfloat16().float())
    expected = dequantize(rounded).bfloat16().float()
    assert torch.equal(kernel_weights(layer, 96, torch.bfloat16), expected)
    # int4-exact: two bf16 parts per plane hold d exactly.
    exact = WeightFormat("int4-exact", torch.bfloat16, CPU, dense_copy=False).linear([blocks])
    assert exact.parts == 4
    assert torch.equal(
        kernel_weights(exact, 96, torch.bfloat16), dequantize(blocks).bfloat16().float()
    )


@pytest.mark.parametrize("kind", ["dense", "q8_0", "int4"])
def test_refine_top_logits_recomputes_the_largest_in_float32(kind):
    g = torch.Generator().manual_seed(2)
    q = torch.randint(-127, 128, (64, 96), generator=g, dtype=torch.int8)
    blocks = Int8Blocks(q, (torch.rand(64, 3, generator=g) * 0.01).half().float())
    head = {"dense": dequantize(blocks).bfloat16(), "q8_0": blocks, "int4": random_groups(64, 96)}
    source = head[kind]
    hidden = torch.randn(5, 96, generator=g).bfloat16()
    exact = hidden.float() @ dequantize(source).t()
    logits = (hidden @ dequantize(source).bfloat16().t()).float()  # a bf16 head's output
    refine_top_logits(logits, hidden, source, k=4)
    top = exact.topk(4, dim=-1)
    assert torch.allclose(logits.gather(1, top.indices), top.values, rtol=1e-6, atol=1e-6)
    assert torch.equal(logits.argmax(-1), exact.argmax(-1))
    empty = torch.empty(0, 64)
    refine_top_logits(empty, torch.empty(0, 96).bfloat16(), source)  # no rows: nothing to do


def test_int4_refuses_shapes_the_kernel_cannot_take():
    with pytest.raises(ValueError, match="multiple|% 16"):
        Int4Linear(random_groups(40, 64), torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_quantizer_error_is_within_half_a_step(dtype):
    w = torch.randn(48, 128) * 0.1
    groups = quantize_int4(w, dtype)
    err = (dequantize(groups) - w).abs().view(48, 4, 32)
    step = groups.scale[..., None]
    # Half a step from rounding q, plus the rounding of the zero to the scale dtype.
    zero_rounding = (groups.zero[..., None].abs() * 2.0**-8) if dtype == torch.bfloat16 else 0
    assert (err <= step / 2 * 1.0001 + zero_rounding).all()
    layer = Int4Linear(groups, dtype)
    x = torch.randn(3, 128).to(dtype)
    expected = x.float() @ dequantize(groups).t()
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert (layer.apply(x).float() - expected).abs().max() < tolerance * expected.abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_per_channel(dtype):
    w = torch.randn(48, 128) * 0.1
    q, scale = quantize_int8(w, dtype)
    assert q.dtype == torch.int8 and scale.shape == (48,)
    assert ((q.float() * scale[:, None] - w).abs() <= scale[:, None] / 2 * 1.0001).all()
    layer = Int8Linear(q, scale, dtype)
    assert layer.scale.dtype == dtype  # the kernel's rule: scales in the activation dtype
    x = torch.randn(3, 128).to(dtype)
    expected = x.float() @ (q.float() * scale[:, None]).t()
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert (layer.apply(x).float() - expected).abs().max() < tolerance * expected.abs().max()


@pytest.mark.skipif(
    onednn_packed(torch.ones(16, 32, dtype=torch.bfloat16)) is None,
    reason="this torch or CPU sends bf16 products elsewhere than oneDNN",
)
@pytest.mark.parametrize("shape", [(3072, 576), (576, 1536), (49152, 576), (40, 24)])
def test_dense_bf16_packed_for_onednn_computes_the_plain_products_bits(shape):
    # Packing only moves the matrix into oneDNN's layout once: every row gets the bits the plain
    # F.linear gives it among others, alone (one row: F.linear alone takes another kernel),
    # whatever the call's row count or the thread count.
    n, k = shape
    g = torch.Generator().manual_seed(n + k)
    w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
    bias = torch.randn(n, generator=g).bfloat16()
    x = torch.randn(300, k, generator=g).bfloat16()
    expected = F.linear(x, w, bias)
    layer = DenseLinear(w, bias, keep_weight=False)
    assert layer.packed is not None and layer.weight is None
    assert layer.nbytes == n * k * 2
    for rows in (2, 3, 7, 16, 33, 300):
        assert torch.equal(layer.apply(x[-rows:]), expected[-rows:]), rows
    alone = torch.cat([layer.apply(x[i : i + 1]) for i in range(64)])
    assert torch.equal(alone, expected[:64])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert torch.equal(layer.apply(x[:5]), expected[:5])
    finally:
        torch.set_num_threads(threads)
    assert DenseLinear(w.float()).packed is None  # float32: another BLAS, left as it was


@pytest.mark.skipif(
    not packs_for_onednn(CPU, torch.bfloat16),
    reason="this torch or CPU sends bf16 products elsewhere than oneDNN",
)
def test_packed_dense_layers_hold_one_copy_and_a_head_keeps_its_matrix_for_refinement():
    # A packed layer's plain matrix is dropped (it would double the model's memory), except a
    # head's: model._exact_head_rows recomputes each row's top logits in float32 from it.
    w = torch.randn(64, 64) * 0.1
    for weights in ("bf16", "int8"):
        fmt = WeightFormat(weights, torch.bfloat16, CPU)
        layer, head = fmt.linear([w]), fmt.linear([w], head=True)
        layer, head = (getattr(x, "dense", x) for x in (layer, head))
        assert layer.packed is not None and layer.weight is None, weights
        assert head.packed is not None and torch.equal(head.weight, w.bfloat16()), weights


def test_batch_size_switch_picks_by_decode_rows():
    # Decode rows (the first ones) run quantized while there are at most max_tokens of them;
    # prompt rows always run dense, so a prompt row's result never depends on the step.
    w = torch.randn(32, 64)
    quantized = Int4Linear(quantize_int4(w, torch.float32), torch.float32)
    dense = DenseLinear(w)
    switch = BatchSizeSwitch(quantized, dense, max_tokens=4)
    for rows, decode_rows in ((1, 1), (4, 4), (5, 5), (9, 0), (3, 0), (7, 3), (9, 5)):
        x = torch.randn(rows, 64)
        if 0 < decode_rows <= 4:
            expected = torch.cat([quantized.apply(x[:decode_rows]), dense.apply(x[decode_rows:])])[
                :rows
            ]
        else:  # every row dense, in one call (float32 GEMM on 2 threads is not row-invariant)
            expected = dense.apply(x)
        assert torch.equal(switch.apply(x, decode_rows), expected), (rows, decode_rows)
    assert switch.nbytes == quantized.nbytes < dense.nbytes / 5  # 4 bits + fp32 scale, zero per 32


def test_weight_format_builds_each_kind_and_keeps_checkpoint_weights_dense():
    w = torch.randn(64, 64) * 0.1
    fmt = WeightFormat("int4", torch.float32, CPU, max_tokens=2)
    layer = fmt.linear([w[:32], w[32:]])
    assert isinstance(layer, BatchSizeSwitch) and isinstance(layer.quantized, Int4Linear)
    assert torch.equal(layer.dense.weight, w)  # the dense copy is the checkpoint's, not int4's
    assert isinstance(
        WeightFormat("int8", torch.bfloat16, CPU, dense_copy=False).linear([w]), Int8Linear
    )
    assert isinstance(WeightFormat("auto", torch.bfloat16, CPU).linear([w]), DenseLinear)
    auto = WeightFormat("auto", torch.bfloat16, CPU, dense_copy=False)
    # auto takes the checkpoint's 4-bit groups as int4 (one part, bf16 scales) with bf16
    # activations; int4-exact as many parts as hold its scales.
    groups = random_groups(32, 64)
    layer = auto.linear([groups])
    assert isinstance(layer, Int4Linear) and layer.parts == 1
    exact = WeightFormat("int4-exact", torch.bfloat16, CPU, dense_copy=False)
    assert exact.linear([groups]).parts == 2
    assert exact.linear([groups.rounded(torch.bfloat16)]).parts == 1
    assert exact.counts == {"int4x2": 1, "int4": 1}
    fp32_auto = WeightFormat("auto", torch.float32, CPU, dense_copy=False)
    assert isinstance(fp32_auto.linear([groups]), DenseLinear)
    # The reference holds exactly the weights the kernel computes with, densely, in fp32.
    reference = WeightFormat("int4", torch.float32, CPU, reference_for=torch.bfloat16)
    dense = reference.linear([w])
    assert isinstance(dense, DenseLinear) and dense.weight.dtype == torch.float32
    assert torch.equal(dense.weight, dequantize(quantize_int4(w, torch.bfloat16)))


def test_weights_and_dtype_knobs():
    with pytest.raises(ValueError, match="weights must be one of"):
        EngineConfig(model_path="x", weights="int3")
    with pytest.raises(ValueError, match="needs dtype"):
        check_weights_and_dtype("bf16", torch.float32, CPU)
    with pytest.raises(ValueError, match="CPU kernels only"):
        check_weights_and_dtype("int4", torch.bfloat16, torch.device("cuda"))
    assert resolve_dtype("auto", CPU, "fp32") == torch.float32
    assert resolve_dtype("auto", CPU, "bf16") == torch.bfloat16
    assert resolve_dtype("float32", CPU, "int4") == torch.float32
    flags = set()
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    native = bool(flags & {"avx512_bf16", "amx_bf16"})
    assert cpu_has_native_bf16() == native
    assert resolve_dtype("auto", CPU, "auto") == (torch.bfloat16 if native else torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_dense_copies_dequantized_by_row_blocks_equal_the_whole_matrix(dtype, monkeypatch):
    """``dequantize_as`` (blocks of rows, no whole float32 matrix: what the dense copies are
    built with) gives ``dequantize(source).to(dtype)``'s bits, rows left over included."""
    monkeypatch.setattr(weight_sources, "DEQUANTIZE_CHUNK", 5 * 64)  # 5 rows a block
    g = torch.Generator().manual_seed(3)
    four = random_groups(23, 64, seed=4)
    wide = Int4Groups(
        torch.randint(0, 64, (23, 64), generator=g, dtype=torch.uint8),
        torch.randn(23, 4, generator=g),
        torch.randn(23, 4, generator=g),
        bits=6,
    )
    q8 = torch.randint(-128, 128, (23, 64), generator=g, dtype=torch.int8)
    blocks = [
        Int8Blocks(q8, torch.randn(23, 2, generator=g)),
        Int8Blocks(q8, torch.randn(23, 2, generator=g), torch.randn(23, 2, generator=g)),
    ]
    for source in [four, wide, *blocks, torch.randn(23, 64, generator=g).half()]:
        expected = dequantize(source).to(dtype)
        got = dequantize_as(source, dtype)
        assert got.dtype == dtype and torch.equal(
            got.view(-1).view(torch.uint8), expected.view(-1).view(torch.uint8)
        )
