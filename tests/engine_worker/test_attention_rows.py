"""The CPU backend attends every query row with one arithmetic (engine_worker/attention/flash_rows):
a row gets the same bits whichever path computes it (fresh prompt, continuation after cached
blocks, in chunks, as a decode row, beside other sequences, on 1 or 2 threads), and decode and
continuation rows are as precise as a fresh prompt's: float32 scores, softmax and weighted sum.
bf16 keys and values, the default launch's on this CPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine_worker.attention import PagedCpuBackend, PagedKVCache, StepBatch, paged_cpu
from engine_worker.attention.flash_rows import fused_cpu_kernel_available
from engine_worker.model_config import ModelConfig

pytestmark = pytest.mark.skipif(
    not fused_cpu_kernel_available(), reason="this torch build has no fused CPU attention kernel"
)
KV_HEADS, GROUP, HEAD_DIM, BLOCK = 2, 3, 64, 4
# Sequence name -> context length; B's context crosses the kernel's 512-key blocks.
LENGTHS = {"A": 600, "B": 560, "C": 30, "D": 20}
BASE_BLOCK = {
    "A": 0,
    "B": 200,
    "C": 400,
    "D": 550,
}  # each sequence's blocks are contiguous from here


def make_data(seed: int = 0) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    heads = KV_HEADS * GROUP
    return {
        name: (
            (torch.randn(n, heads, HEAD_DIM, generator=gen) * 3).bfloat16(),  # sharp softmaxes
            torch.randn(n, KV_HEADS, HEAD_DIM, generator=gen).bfloat16(),
            torch.randn(n, KV_HEADS, HEAD_DIM, generator=gen).bfloat16(),
        )
        for name, n in LENGTHS.items()
    }


def make_backend(whole_key_blocks: bool = False) -> PagedCpuBackend:
    config = ModelConfig(
        model_type="llama", vocab_size=8, hidden_size=KV_HEADS * GROUP * HEAD_DIM,
        intermediate_size=8, num_layers=1, num_heads=KV_HEADS * GROUP, num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM, rms_norm_eps=1e-6, max_position_embeddings=1024,
        tie_word_embeddings=True, attention_bias=False, qk_norm=False,
    )  # fmt: skip
    return PagedCpuBackend(
        PagedKVCache(config, 700, BLOCK, torch.bfloat16, torch.device("cpu")),
        1 << 30,
        whole_key_blocks,
    )


def slots(name: str, positions: np.ndarray) -> np.ndarray:
    return (BASE_BLOCK[name] + positions // BLOCK) * BLOCK + positions % BLOCK


def run_step(backend, data, step: list[tuple[str, int, int]], keep=(), decoded=None) -> dict:
    """One step computing ``count`` tokens from ``start`` of each (name, start, count), with the
    positions before ``start`` already in the cache; -> {(name, position): output row}.
    ``keep``: the sequence objects of the last step (a decode workspace is kept for them);
    ``decoded``: StepBatch.decoded (None: every one-row sequence is a decode row)."""
    cache = backend.cache
    for name, start, _ in step:
        if start:
            at = np.arange(start)
            _, k, v = data[name]
            cache.write(0, torch.from_numpy(slots(name, at)), k[:start], v[:start])
    sequences = list(keep) or [object() for _ in step]
    lengths = np.array([count for _, _, count in step])
    tables = np.stack([BASE_BLOCK[name] + np.arange(150) for name, _, _ in step])
    batch = StepBatch(
        sequences=sequences,
        starts=np.array([start for _, start, _ in step]),
        lengths=lengths,
        row_starts=np.cumsum(lengths) - lengths,
        block_tables=tables,
        slots=np.concatenate([slots(n, np.arange(s, s + c)) for n, s, c in step]),
        block_size=BLOCK,
        decoded=None if decoded is None else np.array(decoded),
    )
    rows = [(n, p) for n, s, c in step for p in range(s, s + c)]
    q, k, v = (torch.cat([data[n][j][s : s + c] for n, s, c in step]) for j in range(3))
    out = backend.forward(q, k, v, 0, backend.prepare(batch))
    return dict(zip(rows, out)), sequences


def test_a_row_gets_the_same_bits_whatever_path_computes_it():
    data = make_data()
    together, _ = run_step(make_backend(), data, [("A", 599, 1), ("B", 520, 40), ("C", 0, 30)])
    fresh_b, _ = run_step(make_backend(), data, [("B", 0, 560)])  # three query chunks
    chunks = {}
    for first in range(0, 30, 7):  # C in chunks of 7, a decode row beside each
        out, _ = run_step(make_backend(), data, [("A", 599, 1), ("C", first, min(7, 30 - first))])
        chunks.update(out)
    torch.set_num_threads(1)
    try:
        alone = {}
        for name, position in [("A", 599), ("B", 520), ("B", 547), ("B", 559), ("C", 0), ("C", 29)]:
            alone.update(run_step(make_backend(), data, [(name, position, 1)])[0])
    finally:
        torch.set_num_threads(2)
    for key, row in alone.items():  # as a decode row alone, on one thread
        assert torch.equal(row, together[key]), key
    for key in [("B", p) for p in range(520, 560)]:
        assert torch.equal(fresh_b[key], together[key]), key
    for key in [("C", p) for p in range(30)] + [("A", 599)]:
        assert torch.equal(chunks[key], together[key]), key


def test_a_kept_decode_workspace_gives_the_gathered_bits():
    data = make_data(1)
    backend = make_backend()
    first, sequences = run_step(backend, data, [("A", 590, 1), ("B", 550, 1)])
    kept, _ = run_step(backend, data, [("A", 591, 1), ("B", 551, 1)], keep=sequences)
    assert backend._workspace is not None and not backend._workspace.fresh
    gathered, _ = run_step(make_backend(), data, [("A", 591, 1), ("B", 551, 1)])
    for key, row in kept.items():
        assert torch.equal(row, gathered[key]), key


def test_with_whole_key_blocks_a_short_decode_row_gets_the_same_bits_beside_any_longer_row():
    # Below 512 keys a row over a partial key block can get other bits with the block's width
    # (here, on AVX-512: B's row at 218, seed 0, alone over 256 columns with the workspace's
    # headroom against beside A's at 234, 298 or 490); a deterministic launch attends whole
    # blocks of 512 for every row, and its workspace is as wide as its longest row's blocks.
    data = make_data(0)
    alone, _ = run_step(make_backend(whole_key_blocks=True), data, [("B", 218, 1)])
    for partner in (234, 298, 490):
        beside, _ = run_step(
            make_backend(whole_key_blocks=True), data, [("B", 218, 1), ("A", partner, 1)]
        )
        assert torch.equal(beside[("B", 218)], alone[("B", 218)]), partner
    backend = make_backend(whole_key_blocks=True)
    _, sequences = run_step(backend, data, [("B", 217, 1), ("A", 297, 1)])
    kept, _ = run_step(backend, data, [("B", 218, 1), ("A", 298, 1)], keep=sequences)
    assert backend._workspace is not None and not backend._workspace.fresh
    assert backend._workspace.capacity == 512
    assert torch.equal(kept[("B", 218)], alone[("B", 218)])


def test_a_prompts_last_row_alone_is_attended_as_in_its_cold_prefill():
    """A prompt whose other tokens came from the prefix cache computes its last one alone: a
    prefill segment over the key columns its cold prefill gives it (224 at position 218), not
    a decode row over a fresh decode workspace's (256 with its headroom), which gave other bits
    at 4 of the positions 200 to 259 on AVX-512, this one among them."""
    data = make_data(0)
    cold, _ = run_step(make_backend(), data, [("B", 0, 219)])
    backend = make_backend()
    last, _ = run_step(backend, data, [("B", 218, 1)], decoded=[False])
    assert backend._workspace is None  # no decode row
    assert torch.equal(last[("B", 218)], cold[("B", 218)])


def test_a_decode_row_far_longer_than_the_others_is_attended_apart_with_its_cold_bits(monkeypatch):
    """Padding a decode batch to one long row makes every row read its keys (a 7k-token row
    beside short ones: a 0.6-0.8 s step); such a row is attended alone, as a one-row segment,
    and every row keeps its bits."""
    monkeypatch.setattr(paged_cpu, "APART_MIN_COLUMNS", 256)  # this cache holds 800 a row
    monkeypatch.setattr(paged_cpu, "APART_ROW_COLUMNS", 64)
    data = make_data(3)
    backend = make_backend()
    out, sequences = run_step(backend, data, [("C", 20, 1), ("A", 599, 1), ("D", 10, 1)])
    assert backend._workspace is not None
    assert backend._workspace.sequences == [sequences[0], sequences[2]]  # A apart
    cold, _ = run_step(make_backend(), data, [("A", 0, 600)])
    assert torch.equal(out[("A", 599)], cold[("A", 599)])
    for name, position in [("C", 20), ("D", 10)]:
        alone, _ = run_step(make_backend(), data, [(name, position, 1)])
        assert torch.equal(out[(name, position)], alone[(name, position)]), name
    # Rows of like lengths stay one padded batch.
    backend = make_backend()
    _, sequences = run_step(backend, data, [("A", 599, 1), ("B", 559, 1), ("D", 10, 1)])
    assert backend._workspace is not None and len(backend._workspace.sequences) == 3


def reference(data, name: str, position: int) -> torch.Tensor:
    q, k, v = (t.double() for t in data[name])
    keys = k[: position + 1].repeat_interleave(GROUP, dim=1)  # [L, H, D]
    values = v[: position + 1].repeat_interleave(GROUP, dim=1)
    scores = torch.einsum("hd,lhd->hl", q[position], keys) / HEAD_DIM**0.5
    return torch.einsum("hl,lhd->hd", scores.softmax(-1), values)


def test_decode_and_continuation_rows_are_as_precise_as_float32_allows():
    # Against float64: the mean error of the reference itself rounded to bf16 is the floor any
    # bf16 output has. Scores rounded to bf16 (the old decode and continuation path) measured
    # 4.8x that floor on such rows; float32 scores and sums 1.1x.
    data = make_data(2)
    out, _ = run_step(make_backend(), data, [("A", 599, 1), ("B", 520, 40)])
    for key, row in out.items():
        exact = reference(data, *key)
        floor = (exact.bfloat16().double() - exact).abs().mean()
        assert (row.double() - exact).abs().mean() < 1.5 * floor, key


def test_gather_takes_each_kv_heads_blocks_in_table_order():
    """kv_cache.gather (rows of block_size x D, one index_select) against the blocks picked one
    by one: repeated, unordered and edge blocks, from one layer of a multi-layer cache."""
    from engine_worker.attention.kv_cache import gather

    cache = torch.randn(3, KV_HEADS, 50, BLOCK, HEAD_DIM).bfloat16()
    layer = cache.unbind(0)[1]
    table = torch.tensor([5, 0, 49, 7, 7, 12])
    expected = torch.stack(
        [torch.cat([layer[h, b] for b in table.tolist()]) for h in range(KV_HEADS)]
    )
    assert torch.equal(gather(layer, table), expected)
