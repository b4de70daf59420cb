"""Prompt rows on the int4 blocks with int8 activations (``splitserve::int4_prompt_mm``,
``--prompt-kernel int8``): the op against the computation it states, written out in torch (each
row's groups of 32 rounded to int8, integer products, the groups' scales and zeros), its rows
independent of each other and of the thread count, and an engine serving on it."""

from __future__ import annotations

import pytest
import torch

from engine_worker import int4_decode
from engine_worker.linear import BatchSizeSwitch, Int4Groups, Int4PromptLinear, dequantize
from engine_worker.weight_format import WeightFormat
from tests.engine_worker.helpers import collect, greedy
from tests.engine_worker.scripted_helpers import assert_same, make_engine
from tests.engine_worker.test_int4_decode import (
    assert_rows_alone,
    groups,
    needs_op,
    relative_error,
    rows,
)


def stated(planes: Int4Groups, x: torch.Tensor) -> torch.Tensor:
    """What the op computes, in float64 after the int8 rounding (which it reproduces exactly):
    per row and group of 32, d = max |x| / 127, xq = round(x * 127 / max |x|); per scale run
    d (sum q xq - c sum xq) times the run's scale (c: 8, 16 or 32 for q of 4, 5 or 6 bits),
    plus its zero times the run's sum of x."""
    n, k = planes.q.shape
    m, size, centre = x.shape[0], planes.group, 8 << (planes.bits - 4)
    xf = x.float().view(m, k // 32, 32)
    most = xf.abs().amax(-1, keepdim=True)
    inverse = torch.where(most > 0, 127.0 / most, torch.zeros_like(most))
    xq = torch.round(xf * inverse).view(m, k // size, size).double()
    d = (most / 127.0).repeat_interleave(32 // size, dim=1)  # [m, runs, 1]
    q = planes.q.double().view(n, k // size, size)
    dot = torch.einsum("mrk,nrk->mnr", xq, q)  # exact: integers
    centered = ((dot - centre * xq.sum(-1).unsqueeze(1)).float() * d.view(m, 1, -1)).double()
    scale = planes.scale.bfloat16().double()  # the blocks hold bf16 (scale, zero) pairs
    zero = planes.zero.bfloat16().double()
    sums = x.double().view(m, k // size, size).sum(-1)
    return (centered * scale).sum(-1) + sums @ zero.t()


@needs_op
@pytest.mark.parametrize(("group", "bits"), [(32, 4), (16, 4), (32, 5), (16, 6)])
def test_op_computes_what_it_states_and_near_the_weights_product(group, bits):
    planes = groups(64, 256) if (group, bits) == (32, 4) else wide(64, 256, group, bits)
    blocks = int4_decode.pack([planes])
    weight = dequantize(planes)
    for m in (1, 3, 8, 9, 20):  # rows go 8 at a time: partial and later blocks too
        x = rows(m, 256, seed=m)
        y = torch.ops.splitserve.int4_prompt_mm(x, blocks, 1)
        assert y.dtype == torch.bfloat16 and y.shape == (m, 64)
        assert relative_error(y, stated(planes, x).float()) < 2.5e-3  # its bf16 rounding
        assert relative_error(y, x.float() @ weight.t()) < 2e-2  # int8 activations


def wide(n: int, k: int, group: int, bits: int) -> Int4Groups:
    generator = torch.Generator().manual_seed(3)
    q = torch.randint(0, 1 << bits, (n, k), dtype=torch.uint8, generator=generator)
    scale = torch.rand(n, k // group, generator=generator) * 0.01 + 1e-3
    zero = (torch.rand(n, k // group, generator=generator) - 0.5) * 0.01
    return Int4Groups(q, scale, zero, bits)


@needs_op
def test_a_rows_bits_depend_on_that_row_alone_and_not_on_threads():
    blocks = int4_decode.pack([groups(256, 576)])
    x = rows(19, 576)
    x[4] = 0  # a row of zeros: d = 0, no division by it
    together = assert_rows_alone(torch.ops.splitserve.int4_prompt_mm, blocks, x)
    assert torch.isfinite(together).all()


@needs_op
def test_engine_on_int8_prompt_rows(tiny_model_dir):
    """Prompt rows take the int8 path, decode rows the decode kernel up to its measured
    crossover against the int8 kernel (3 rows), the int8 kernel above; a prompt computed in
    chunks of 7 gets the tokens of one computed whole (each row its own)."""
    int8 = make_engine(tiny_model_dir, weights="int4", int4_kernel="own", prompt_kernel="int8")
    fmt = int8.runner.model.weight_format
    assert "int8 activations for prompt rows and above 3 decode rows" in fmt.describe()
    down = int8.runner.model.layers[0].down
    assert isinstance(down, BatchSizeSwitch) and isinstance(down.dense, Int4PromptLinear)
    assert down.max_tokens == 3
    chunked = make_engine(
        tiny_model_dir,
        weights="int4",
        int4_kernel="own",
        prompt_kernel="int8",
        prefill_chunk_tokens=7,
        enable_prefix_cache=False,
    )
    prompt = [1, 5, 9, 300, 17, 23, 99, 1000, 4, 8, 15, 16, 23, 42, 7, 77, 777]
    outputs = []
    for engine in (int8, chunked):
        engine.add("a", prompt, greedy(6, ignore_eos=True))
        outputs.append(collect(engine)["a"]["tokens"])
    assert len(outputs[0]) == 6 and outputs[0] == outputs[1]


@needs_op
def test_grouped_op_equals_one_call_per_weight():
    """A mixture's experts over their prompt rows in one call (rows 0, 1, 9 and 20 an expert):
    each expert's rows get the bits of that expert's own call."""
    weights = [groups(48, 128, seed=e) for e in range(4)]
    blocks = [int4_decode.pack([w]) for w in weights]
    counts = [1, 0, 9, 20]
    x = rows(sum(counts), 128, seed=5)
    y = torch.ops.splitserve.int4_prompt_grouped_mm(x, blocks, counts, 1)
    start = 0
    for block, count in zip(blocks, counts):
        if count:
            part = x[start : start + count]
            assert torch.equal(
                y[start : start + count], torch.ops.splitserve.int4_prompt_mm(part, block, 1)
            )
        start += count


@needs_op
def test_scripted_decode_takes_int8_prompt_layers(tiny_model_dir):
    """Decode-only steps run as the compiled stack with int8 prompt layers too, the same bits
    as eager; above the quantized crossover its layers call the int8 op."""
    engine = make_engine(
        tiny_model_dir,
        weights="int4",
        int4_kernel="own",
        prompt_kernel="int8",
        enable_prefix_cache=False,
        quantized_max_tokens=2,
    )
    model = engine.runner.model
    assert model.scripted_decode is not None
    prompts = [[1, 5, 9, 300], [1, 17, 4000, 5, 6, 7, 8], [1, 2000]]  # 3 rows > 2: int8
    assert_same(engine, prompts, greedy(6, ignore_eos=True), "int8")
    scripted = model.scripted_decode
    stacks = getattr(scripted, "scripted", scripted).by_copies.values()  # (counted by assert_same)
    assert any("splitserve::int4_prompt_mm" in str(stack.graph) for stack in stacks)


def test_int8_prompt_rows_without_our_kernel_say_so(caplog):
    """Asked for where our kernel does not serve (aten's int4 kernel, float32 activations), the
    format says so once and keeps the dense copies."""
    with caplog.at_level("WARNING", logger="splitserve.engine.weights"):
        WeightFormat(
            "auto", torch.bfloat16, torch.device("cpu"), int4_kernel="aten", prompt_kernel="int8"
        )
        WeightFormat(
            "auto", torch.float32, torch.device("cpu"), int4_kernel="own", prompt_kernel="int8"
        )
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2 and all("prompt rows use dense copies" in m for m in said), said
    assert "int4_kernel=aten" in said[0] and "torch.float32" in said[1]
    layer = WeightFormat(
        "int4", torch.bfloat16, torch.device("cpu"), int4_kernel="aten", prompt_kernel="int8"
    ).linear([groups(32, 64)])
    assert isinstance(layer, BatchSizeSwitch) and not isinstance(layer.dense, Int4PromptLinear)
