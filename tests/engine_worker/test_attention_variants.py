"""Per-layer attention variants in both backends, against a float64 reference: a sliding window
(a query at position p sees keys at positions > p - W), soft-capped scores (C * tanh(s / C)) and
another softmax scale, layer by layer, through prefill, a continuation that straddles the
window, and decode steps on a kept workspace (float32). And the CPU backend's skipping of whole
key blocks outside a window: the same bits as attending them, whatever path computes a row."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine_worker.attention import PagedCpuBackend, PagedKVCache, SdpaBackend, StepBatch, paged_cpu
from engine_worker.attention.flash_rows import fused_cpu_kernel_available
from engine_worker.model_config import PLAIN_ATTENTION, LayerAttention, ModelConfig

KV_HEADS, GROUP, HEAD_DIM, BLOCK = 2, 3, 16, 4
LAYERS = (
    LayerAttention(window=7),
    LayerAttention(softcap=5.0, scale=0.4),
    LayerAttention(window=10, softcap=3.0, scale=0.3),
    PLAIN_ATTENTION,
)
LENGTHS = {"A": 40, "B": 26}
BASE_BLOCK = {"A": 0, "B": 20, "L": 0, "M": 400}  # each sequence's blocks are contiguous
LONG = {"L": 1400, "M": 1150}  # past two of the flash kernel's 512-key blocks
BACKENDS = [SdpaBackend] + ([PagedCpuBackend] if fused_cpu_kernel_available() else [])


def make_data(seed=0, lengths=LENGTHS, layers=4, dtype=torch.float32) -> dict:
    """(layer, name) -> q [N, H, D], k and v [N, KV, D]."""
    gen = torch.Generator().manual_seed(seed)
    heads = KV_HEADS * GROUP
    return {
        (layer, name): (
            (torch.randn(n, heads, HEAD_DIM, generator=gen) * 2).to(dtype),  # sharp softmaxes
            torch.randn(n, KV_HEADS, HEAD_DIM, generator=gen).to(dtype),
            torch.randn(n, KV_HEADS, HEAD_DIM, generator=gen).to(dtype),
        )
        for layer in range(layers)
        for name, n in lengths.items()
    }


def make_backend(kind, layers=LAYERS, blocks=40, dtype=torch.float32):
    config = ModelConfig(
        model_type="llama", vocab_size=8, hidden_size=KV_HEADS * GROUP * HEAD_DIM,
        intermediate_size=8, num_layers=len(layers), num_heads=KV_HEADS * GROUP,
        num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, rms_norm_eps=1e-6,
        max_position_embeddings=4096, tie_word_embeddings=True, attention_bias=False,
        qk_norm=False, layer_attention=layers,
    )  # fmt: skip
    cache = PagedKVCache(config, blocks, BLOCK, dtype, torch.device("cpu"))
    if kind is PagedCpuBackend:
        return PagedCpuBackend(cache, 1 << 30, layers=layers)
    return SdpaBackend(cache, layers)


def slots(name: str, positions: np.ndarray) -> np.ndarray:
    return (BASE_BLOCK[name] + positions // BLOCK) * BLOCK + positions % BLOCK


def run_step(backend, data, sequences: dict, step: list[tuple[str, int, int]], fill=False) -> dict:
    """Computes ``count`` tokens from ``start`` of each (name, start, count) in every layer;
    -> {(layer, name, position): output row}. ``fill``: write the keys and values before
    ``start`` into the cache first (else earlier steps computed them)."""
    for name, start, _ in step if fill else ():
        for layer in range(len(backend.layers)):
            _, k, v = data[layer, name]
            at = torch.from_numpy(slots(name, np.arange(start)))
            backend.cache.write(layer, at, k[:start], v[:start])
    lengths = np.array([count for _, _, count in step])
    batch = StepBatch(
        sequences=[sequences[name] for name, _, _ in step],
        starts=np.array([start for _, start, _ in step]),
        lengths=lengths,
        row_starts=np.cumsum(lengths) - lengths,
        block_tables=np.stack([BASE_BLOCK[name] + np.arange(400) for name, _, _ in step]),
        slots=np.concatenate([slots(n, np.arange(s, s + c)) for n, s, c in step]),
        block_size=BLOCK,
    )
    metadata = backend.prepare(batch)
    results = {}
    for layer in range(len(backend.layers)):
        q, k, v = (torch.cat([data[layer, n][j][s : s + c] for n, s, c in step]) for j in range(3))
        out = backend.forward(q, k, v, layer, metadata)
        rows = [(layer, n, p) for n, s, c in step for p in range(s, s + c)]
        results.update(zip(rows, out))
    backend.finish(metadata)
    return results


def reference(data, layer: int, name: str, position: int, layers=LAYERS) -> torch.Tensor:
    """The row as the spec says, in float64."""
    spec = layers[layer]
    q, k, v = (t.double() for t in data[layer, name])
    first = max(0, position - spec.window + 1) if spec.window else 0
    keys = k[first : position + 1].repeat_interleave(GROUP, dim=1)  # [L, H, D]
    values = v[first : position + 1].repeat_interleave(GROUP, dim=1)
    scale = HEAD_DIM**-0.5 if spec.scale is None else spec.scale
    scores = torch.einsum("hd,lhd->hl", q[position], keys) * scale
    if spec.softcap:
        scores = spec.softcap * torch.tanh(scores / spec.softcap)
    return torch.einsum("hl,lhd->hd", scores.softmax(-1), values)


@pytest.mark.parametrize("kind", BACKENDS, ids=lambda k: k.name)
def test_windows_soft_caps_and_scales_follow_the_reference_on_every_path(kind):
    data = make_data()
    backend = make_backend(kind)
    sequences = {name: object() for name in LENGTHS}
    plan = [
        [("A", 0, 18), ("B", 0, 11)],  # fresh prompts
        [("A", 18, 12), ("B", 11, 9)],  # continuations reaching back across the window
        *[[("A", 30 + i, 1), ("B", 20 + i, 1)] for i in range(6)],  # decode, a kept workspace
        *[[("A", 36 + i, 1)] for i in range(4)],  # a new decode batch
    ]
    for step in plan:
        for (layer, name, position), row in run_step(backend, data, sequences, step).items():
            expected = reference(data, layer, name, position)
            diff = (row.double() - expected).abs().max().item()
            assert diff < 1e-5, (layer, name, position, diff)
    if kind is PagedCpuBackend:
        assert backend._workspace is not None and not backend._workspace.fresh


def test_the_window_hides_keys_that_full_attention_sees():
    """The reference is not trivially met: without the window the late rows differ."""
    data = make_data()
    windowed = reference(data, 0, "A", 30)
    q, k, v = (t.double() for t in data[0, "A"])
    scores = torch.einsum("hd,lhd->hl", q[30], k[:31].repeat_interleave(GROUP, dim=1))
    full = torch.einsum(
        "hl,lhd->hd", (scores * HEAD_DIM**-0.5).softmax(-1), v[:31].repeat_interleave(GROUP, 1)
    )
    assert (windowed - full).abs().max() > 1e-2


@pytest.mark.skipif(not fused_cpu_kernel_available(), reason="no fused CPU attention kernel")
def test_key_blocks_outside_the_window_are_skipped_and_change_no_bits(monkeypatch):
    """bf16, a window of 100 over contexts of 1,150-1,400: decode rows (gathered, then on a kept
    workspace), a prompt's last rows in a chunk and alone skip the whole key blocks of 512 that
    no row of theirs sees, and get the bits of attending every block; each row gets the same
    bits whichever path computes it."""
    layers = (LayerAttention(window=100),)
    data = make_data(3, LONG, 1, torch.bfloat16)

    def run_plan(plan, skip: bool, fill: bool = False) -> tuple[dict, list[bool]]:
        if not skip:
            monkeypatch.setattr(paged_cpu, "window_start", lambda first, block_size: 0)
        backend = make_backend(PagedCpuBackend, layers, 800, torch.bfloat16)
        sequences = {name: object() for name in LONG}
        out: dict = {}
        seen = []
        for step in plan:
            out.update(run_step(backend, data, sequences, step, fill))
            seen.append(backend._workspace is not None and not backend._workspace.fresh)
        monkeypatch.undo()
        return out, seen

    decoding = [[("L", 1390 + i, 1), ("M", 1140 + i, 1)] for i in range(4)]
    prefill = [[("L", 0, 1370)], [("L", 1370, 24)], [("M", 0, 1100)], [("M", 1100, 44)]]
    for plan in (prefill + decoding, decoding):
        skipped, kept = run_plan(plan, skip=True)
        attended, _ = run_plan(plan, skip=False)
        assert kept[-1]  # the last decode steps ran on a kept workspace
        for key, row in skipped.items():
            assert torch.equal(row, attended[key]), key
    alone = {}
    for name, position in [("L", 1393), ("M", 1142), ("L", 1380)]:
        alone.update(run_plan([[(name, position, 1)]], skip=True, fill=True)[0])
    together, _ = run_plan(prefill + decoding, skip=True)
    for key, row in alone.items():
        assert torch.equal(row, together[key]), key
        expected = reference(data, *key, layers=layers)
        floor = (expected.bfloat16().double() - expected).abs().mean()
        assert (row.double() - expected).abs().mean() < 1.5 * floor, key


def test_window_start_is_whole_kernel_blocks_before_the_first_visible_key():
    assert paged_cpu.window_start(511, 16) == 0
    assert paged_cpu.window_start(1300, 16) == 1024
    assert paged_cpu.window_start(-50, 16) == 0
    assert paged_cpu.window_start(1300, 12) == 0  # lcm(512, 12) = 1536
