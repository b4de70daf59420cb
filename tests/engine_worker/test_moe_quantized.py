"""A mixture of experts served from a GGUF's own quantized blocks (random blocks of Q4_K, Q4_0,
Q4_1, Q6_K and Q8_0 stacked as llama.cpp stacks experts; any bytes are a valid block): the
float32 forward equals the ``gguf`` package's dequantization of the file, with bf16 activations
every expert runs on our int4 kernel in its own blocks with no dense copy, a step runs each chosen
expert once over the rows that chose it, a row's answer does not depend on its batch, and the
engine reports the experts' load as a histogram."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from prometheus_client.parser import text_string_to_metric_families

from engine_worker import int4_decode
from engine_worker.engine import Engine
from engine_worker.linear import Int4Linear
from engine_worker.moe import GroupedExperts, route
from http_worker.engine_metrics import render_engine_metrics
from ipc.engine_config import EngineConfig
from ipc.messages import EXPERT_ROWS_BUCKETS
from ipc.messages.queries import EngineStatsReport, ReplicaStats
from tests.engine_worker.helpers import collect, greedy
from tests.engine_worker.moe_files import T, per_expert_checkpoint, tiny_moe, write_moe_gguf
from tests.engine_worker.test_gguf import last_logits
from tests.engine_worker.test_gguf_blocks import random_blocks
from tests.engine_worker.test_gguf_kquants import D_SIZE

# Per layer, the experts' GGUF types: Q4_K with Q4_0 (gate, up), Q6_K down; Q4_1 with Q4_K,
# Q8_0 down. Attention and the router stay F32.
EXPERT_TYPES = [
    {"ffn_gate_exps": "Q4_K", "ffn_up_exps": "Q4_0", "ffn_down_exps": "Q6_K"},
    {"ffn_gate_exps": "Q4_1", "ffn_up_exps": "Q4_K", "ffn_down_exps": "Q8_0"},
]
SHAPE = dict(
    hidden_size=256,
    moe_intermediate_size=256,  # K-quant rows of 256 weights, in and out
    num_hidden_layers=2,
    head_dim=64,
    num_experts=6,
    num_experts_per_tok=2,
    vocab_size=512,
)
PROMPT = [1, 9, 69, 198, 268, 314, 253, 356, 30, 2, 504, 345, 282, 464, 314]
needs_op = pytest.mark.skipif(not int4_decode.load_op(), reason="int4 decode op not built")


@pytest.fixture(scope="module")
def quantized_moe(tmp_path_factory):
    """(GGUF directory, directory of its weights as the gguf package dequantizes them, each
    expert under its own Hugging Face name)."""
    root = tmp_path_factory.mktemp("moe-quantized")
    tiny_moe("qwen3_moe", root / "hf", **SHAPE)

    def encode(w: np.ndarray, name: str):
        parts = name.split(".")
        type_name = EXPERT_TYPES[int(parts[1])].get(parts[2]) if name.startswith("blk.") else None
        if type_name is None:
            return np.ascontiguousarray(w), T.F32
        experts, rows, cols = w.shape
        seed = len(name) + 7 * int(parts[1])
        blocks = random_blocks(type_name, experts * rows, cols, seed, False, D_SIZE[type_name])
        return blocks.reshape(experts, rows, -1), T[type_name]

    written = write_moe_gguf(root / "hf", root / "gguf" / "model.gguf", "qwen3moe", encode)
    config = json.loads((root / "hf" / "config.json").read_text())
    per_expert_checkpoint(written, config, root / "dense")
    return root / "gguf", root / "dense"


def bf16_engine(model_dir, **kwargs) -> Engine:
    return Engine(
        EngineConfig(
            model_path=str(model_dir), dtype="bfloat16", kv_cache_tokens=512, block_size=4, **kwargs
        )
    )


def test_quantized_experts_forward_equals_their_dequantized_weights(quantized_moe):
    gguf_dir, dense_dir = quantized_moe
    config = dict(kv_cache_tokens=256, block_size=4, dtype="float32", weights="fp32")
    reference = last_logits(Engine(EngineConfig(model_path=str(dense_dir), **config)), PROMPT)
    served = last_logits(Engine(EngineConfig(model_path=str(gguf_dir), **config)), PROMPT)
    assert (served - reference).abs().max() < 1e-6 * reference.abs().max()


@needs_op
def test_experts_run_on_their_own_blocks_without_a_dense_copy(quantized_moe):
    gguf_dir, dense_dir = quantized_moe
    config = dict(kv_cache_tokens=256, block_size=4, dtype="float32", weights="fp32")
    reference = last_logits(Engine(EngineConfig(model_path=str(dense_dir), **config)), PROMPT)
    engine = bf16_engine(gguf_dir, int4_kernel="own")
    model = engine.runner.model
    experts = [lin for layer in model.layers for lin in (*layer.moe.gate_up, *layer.moe.down)]
    assert all(isinstance(lin, Int4Linear) and lin.own_kernel for lin in experts)
    kinds = {k: v for k, v in model.weight_format.counts.items() if k.startswith("expert")}
    # gate_up: 4-bit groups (Q4_K + Q4_0, Q4_1 + Q4_K); down: Q6_K 6-bit, Q8_0 two nibble planes
    assert kinds == {"expert int4": 12, "expert int6": 6, "expert int4x2": 6}, kinds
    logits = last_logits(engine, PROMPT)
    error = ((logits - reference).norm() / reference.norm()).item()
    assert error < 0.03, error  # bf16 activations and scales


class CountedLinear:
    """A real layer that records the rows of every call."""

    def __init__(self, inner) -> None:
        self.inner, self.calls = inner, []
        self.out_features = inner.out_features

    def apply(self, x, decode_rows=0, decode_batch=None):
        self.calls.append(x.shape[0])
        return self.inner.apply(x, decode_rows, decode_batch)


class RecordedGroups:
    """A real ``GroupedExperts`` that records each call's experts and their rows."""

    def __init__(self, inner) -> None:
        self.inner, self.calls = inner, []

    def run(self, x, used, counts, activation, prompt=False):
        self.calls.append((list(used), list(counts), x.shape[0]))
        return self.inner.run(x, used, counts, activation, prompt)


@needs_op
def test_a_step_runs_each_chosen_expert_once_over_its_rows(quantized_moe):
    """Eight rows: on our kernel one grouped call takes each expert some row chose once, over
    exactly those rows, the others not at all, and the block counts those experts' reads and
    bytes; one call per chosen expert where the experts run one by one gives the same bits; each
    row's output is its own alone, bit for bit."""
    engine = bf16_engine(quantized_moe[0], int4_kernel="own")
    block = engine.runner.model.layers[0].moe
    assert isinstance(block.grouped, GroupedExperts)
    x = torch.randn(8, SHAPE["hidden_size"], generator=torch.Generator().manual_seed(0))
    x = x.to(torch.bfloat16)
    _, chosen = route(block.router.logits(x), block.top_k, block.normalize)
    rows = torch.bincount(chosen.flatten(), minlength=len(block.down)).tolist()
    used = [e for e, count in enumerate(rows) if count]
    assert len(used) >= 3  # the batch is spread over experts

    block.grouped = RecordedGroups(block.grouped)
    load = block.load
    reads, nbytes = load.reads, load.bytes
    out = block.apply(x, F.silu)
    assert block.grouped.calls == [(used, [rows[e] for e in used], 8 * block.top_k)]
    assert load.reads - reads == len(used)
    packed = [block.gate_up[e].packed.numel() + block.down[e].packed.numel() for e in used]
    assert load.bytes - nbytes == sum(packed)

    block.grouped = None  # each expert's own layers, one call each
    block.gate_up = [CountedLinear(lin) for lin in block.gate_up]
    block.down = [CountedLinear(lin) for lin in block.down]
    assert torch.equal(block.apply(x, F.silu), out)
    for expert, count in enumerate(rows):
        expected = [count] if count else []
        assert block.gate_up[expert].calls == expected and block.down[expert].calls == expected
    for i in range(len(x)):
        assert torch.equal(block.apply(x[i : i + 1], F.silu), out[i : i + 1]), i


@needs_op
def test_a_request_decodes_alike_alone_and_in_a_batch(quantized_moe):
    prompts = [[1, 5, 9, 300], [1, 17, 400, 5, 6, 7, 8], [1, 2, 3], [1, 99, 98, 97, 96]]
    params = greedy(8, ignore_eos=True)
    alone = {}
    for i, prompt in enumerate(prompts):
        engine = bf16_engine(quantized_moe[0], enable_prefix_cache=False)
        engine.add(f"r{i}", prompt, params)
        alone[f"r{i}"] = collect(engine)[f"r{i}"]["tokens"]
    engine = bf16_engine(quantized_moe[0], enable_prefix_cache=False)
    for i, prompt in enumerate(prompts):
        engine.add(f"r{i}", prompt, params)
    together = {rid: result["tokens"] for rid, result in collect(engine).items()}
    assert together == alone


@needs_op
def test_int8_prompt_rows_on_the_experts_blocks(quantized_moe):
    """``prompt_kernel="int8"``: the experts' prompt rows take int8 activations (on their
    blocks of every width: Q4_K, Q6_K, Q8_0's planes), near the float32 reference; decode
    rows keep the decode kernel, so a request decodes alike alone and beside another's prompt,
    and a prompt computed in chunks of 5 gets the tokens of one computed whole."""
    gguf_dir, dense_dir = quantized_moe
    config = dict(kv_cache_tokens=256, block_size=4, dtype="float32", weights="fp32")
    reference = last_logits(Engine(EngineConfig(model_path=str(dense_dir), **config)), PROMPT)
    engine = bf16_engine(gguf_dir, prompt_kernel="int8", enable_prefix_cache=False)
    layers = [layer.moe.grouped for layer in engine.runner.model.layers]
    assert all(g is not None for g in layers)
    assert all(g.prompt_int8 for g in layers)
    logits = last_logits(engine, PROMPT)
    assert ((logits - reference).norm() / reference.norm()).item() < 0.05
    params = greedy(6, ignore_eos=True, logprobs=3)
    alone = bf16_engine(gguf_dir, prompt_kernel="int8", enable_prefix_cache=False)
    alone.add("a", [1, 5, 9, 300], params)
    tokens = collect(alone)["a"]["tokens"]
    mixed = bf16_engine(gguf_dir, prompt_kernel="int8", enable_prefix_cache=False)
    mixed.add("a", [1, 5, 9, 300], params)
    mixed.step()  # "a"'s prompt and first token; then "a" decodes beside "b"'s prompt
    mixed.add("b", PROMPT, params)
    both = collect(mixed)
    assert both["a"]["tokens"] == tokens[1:]  # (its first token came from the step above)
    chunked = bf16_engine(
        gguf_dir, prompt_kernel="int8", enable_prefix_cache=False, prefill_chunk_tokens=5
    )
    chunked.add("b", PROMPT, params)
    # "b"'s prompt in steps of its own (chunks of 5) and beside "a"'s decode: the same int8
    # path, so its first token's logprobs have the same bits
    whole = collect(chunked)["b"]
    assert whole["tokens"] == both["b"]["tokens"]
    assert whole["logprobs"][0].top_logprobs == both["b"]["logprobs"][0].top_logprobs
    # decode batches above the crossover (3 requests) take the int8 kernel too
    engine = bf16_engine(gguf_dir, prompt_kernel="int8", enable_prefix_cache=False)
    assert {layer.moe.int8_above for layer in engine.runner.model.layers} == {3}
    layer = engine.runner.model.layers[0].moe
    x = torch.randn(4, layer.router.weight.shape[1]).bfloat16()
    act = torch.nn.functional.silu
    four = layer.apply(x, act, decode_rows=4)
    assert torch.equal(four, layer.apply(x, act, decode_rows=0))  # as prompt rows
    assert not torch.equal(layer.apply(x[:3], act, decode_rows=3), four[:3])


def test_engine_reports_the_experts_load_as_a_histogram(quantized_moe):
    """Every step's MoE layers count each expert once (0 rows where none chose it) and route
    top_k per row; /metrics renders the counts as a Prometheus histogram per engine."""
    engine = Engine(
        EngineConfig(model_path=str(quantized_moe[1]), dtype="float32", kv_cache_tokens=256)
    )
    engine.add("a", PROMPT, greedy(4, ignore_eos=True))
    engine.add("b", PROMPT[:5], greedy(6, ignore_eos=True))
    steps, rows = 0, 0
    while engine.has_work():
        out = engine.step()
        computed = out.stats.prefill_tokens + out.stats.decode_tokens
        steps, rows = steps + (computed > 0), rows + computed
    stats = out.stats
    moe_layers, experts, top_k = SHAPE["num_hidden_layers"], SHAPE["num_experts"], 2
    assert len(stats.expert_rows_buckets_total) == len(EXPERT_ROWS_BUCKETS) + 1
    assert sum(stats.expert_rows_buckets_total) == steps * moe_layers * experts
    assert stats.expert_rows_total == rows * top_k * moe_layers
    # each chosen expert read once a layer and step: the observations above 0 rows
    chosen = sum(stats.expert_rows_buckets_total) - stats.expert_rows_buckets_total[0]
    assert stats.expert_reads_total == chosen > 0
    layers = [layer.moe for layer in engine.runner.model.layers]
    assert all(len(set(b.expert_bytes)) == 1 for b in layers)  # one layout a layer
    per_read = {b.expert_bytes[0] for b in layers}
    assert min(per_read) * chosen <= stats.expert_bytes_total <= max(per_read) * chosen
    report = EngineStatsReport("q", stats, replicas=[ReplicaStats(0, stats)])
    text = render_engine_metrics(report, "tiny").decode()
    (family,) = [
        f
        for f in text_string_to_metric_families(text)
        if f.name == "splitserve_engine_moe_expert_rows"
    ]
    values = {(s.name, s.labels.get("le")): s.value for s in family.samples}
    assert values[("splitserve_engine_moe_expert_rows_count", None)] == steps * moe_layers * experts
    assert values[("splitserve_engine_moe_expert_rows_sum", None)] == stats.expert_rows_total
    assert (
        values[("splitserve_engine_moe_expert_rows_bucket", "0.0")]
        == stats.expert_rows_buckets_total[0]
    )


def torch_bookkeeping(block, x, weights, chosen, activation):
    """The experts' sum as ``MoeBlock._experts`` computed it before its bookkeeping moved to
    numpy (torch's bincount, stable argsort, nonzero): (output, counts)."""
    flat = chosen.flatten()
    counts = torch.bincount(flat, minlength=len(block.down))
    order = flat.argsort(stable=True)
    rows = order // block.top_k
    used_at = counts.nonzero().flatten()
    used, per_expert = used_at.tolist(), counts[used_at].tolist()
    pairs = x.index_select(0, rows)
    if block.grouped is not None:
        y = block.grouped.run(pairs, used, per_expert, activation)
    else:
        parts = pairs.split(per_expert)
        y = torch.cat([block._expert(e, part, activation) for e, part in zip(used, parts)])
    out = torch.zeros(x.shape, dtype=torch.float32)
    return out.index_add_(0, rows, y.float().mul_(weights.flatten()[order].unsqueeze(1))), counts


@pytest.mark.parametrize("kernel", [pytest.param("own", marks=needs_op), "aten"])
def test_experts_sum_keeps_its_bits_with_numpy_bookkeeping(quantized_moe, kernel):
    """Random rows and routings at 1, 3, 8 and 64 rows: the block's experts' sum equals the torch
    bookkeeping's bit for bit, grouped on our kernel or expert by expert, and the load counts
    the same rows, reads and bytes; at the model's top 2 and at top 4 (where the order of a
    row's sum shows in its bits)."""
    engine = bf16_engine(quantized_moe[0], int4_kernel=kernel)
    block = engine.runner.model.layers[1].moe
    assert (block.grouped is not None) == (kernel == "own")
    generator = torch.Generator().manual_seed(5)
    for rows, top_k in itertools.product((1, 3, 8, 64), (2, 4)):
        block.top_k = top_k
        x = torch.randn(rows, SHAPE["hidden_size"], generator=generator).to(torch.bfloat16)
        logits = torch.randn(rows, SHAPE["num_experts"], generator=generator) * 3
        weights, chosen = route(logits, block.top_k, block.normalize)
        expected, counts = torch_bookkeeping(block, x, weights, chosen, F.silu)
        load = block.load
        reads, nbytes, pending = load.reads, load.bytes, len(load._pending)
        out = block._experts(x, weights, chosen, F.silu)
        assert torch.equal(out, expected), rows
        assert load._pending[pending:] and np.array_equal(load._pending[-1], counts.numpy())
        used = counts.nonzero().flatten().tolist()
        assert load.reads - reads == len(used)
        assert load.bytes - nbytes == sum(block.expert_bytes[e] for e in used)
