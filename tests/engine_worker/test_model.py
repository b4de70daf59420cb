"""Our forward against transformers' (fp32): prefill, chunked prefill and decode over the paged
KV cache, for every supported architecture and once for the real default model."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine_worker.attention import PagedCpuBackend, PagedKVCache, SdpaBackend, select_backend
from engine_worker.attention.flash_rows import fused_cpu_kernel_available
from engine_worker.engine import Engine
from engine_worker.model_config import ModelConfig
from ipc.engine_config import EngineConfig
from tests.engine_worker.helpers import compute_logits, give_blocks, manual_request
from tests.reference_model import load_reference_model
from tests.tiny_model import make_tiny_model

TOLERANCE = 1e-4


def reference_last_logits(hf_model, token_ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf_model(torch.tensor([token_ids])).logits[0, -1].float()


def check_against_transformers(
    model_dir,
    decode_steps: int,
    chunk: int | None = None,
    backend=None,
    prompts: list[list[int]] | None = None,
) -> None:
    # Dense fp32 weights: a GGUF checkpoint is dequantized exactly, as transformers does.
    engine = Engine(
        EngineConfig(
            model_path=str(model_dir),
            dtype="float32",
            weights="fp32",
            kv_cache_tokens=1024,
            block_size=4,
        )
    )
    if backend is not None:
        layers = engine.runner.model.config.layer_attention
        engine.runner.attention = backend(engine.runner.kv_cache, layers=layers)
    hf = load_reference_model(model_dir)
    prompts = prompts or [
        [1, 9690, 198, 2683, 314, 253, 5356, 30, 2],
        [1, 504, 3458, 282, 4649, 314, 253, 1467, 11, 4, 77, 9001, 18, 7],
    ]
    requests = [manual_request(engine, p, f"r{i}") for i, p in enumerate(prompts)]
    # Prefill both together (packed); optionally the second one in two chunks.
    if chunk:
        give_blocks(engine, requests[1], chunk)
        compute_logits(engine, [requests[1]], [chunk])
        requests[1].num_computed = chunk
    counts = []
    for r in requests:
        give_blocks(engine, r, r.num_tokens)
        counts.append(r.remaining)
    for step in range(decode_steps + 1):
        logits, emitting = compute_logits(engine, requests, counts)
        assert emitting == [0, 1]
        for r, row in zip(requests, logits):
            expected = reference_last_logits(hf, r.token_ids)
            diff = (row - expected).abs().max().item()
            assert diff < TOLERANCE, f"step {step} {r.request_id}: max abs diff {diff}"
            r.num_computed = r.num_tokens
            r.token_ids.append(int(expected.argmax()))
            give_blocks(engine, r, r.num_tokens)
        counts = [1, 1]


@pytest.mark.parametrize("architecture", ["llama", "qwen2", "qwen3", "mistral"])
def test_tiny_models_match_transformers(tmp_path, architecture):
    model_dir = make_tiny_model(tmp_path / architecture, architecture=architecture)
    check_against_transformers(model_dir, decode_steps=4, chunk=5)


def test_sdpa_backend_matches_transformers(tmp_path):
    """The backend CUDA and torch builds without the fused CPU kernel get: gathered decode,
    continuations one segment at a time."""
    model_dir = make_tiny_model(tmp_path / "llama", architecture="llama")
    check_against_transformers(model_dir, decode_steps=3, chunk=5, backend=SdpaBackend)


@pytest.mark.parametrize("backend", [None, SdpaBackend], ids=["chosen", "sdpa"])
@pytest.mark.parametrize(
    ("architecture", "window_config"),
    [
        ("mistral", {"sliding_window": 8}),  # every layer windowed
        # layer 0 full, layer 1 windowed (transformers' layer_types from max_window_layers)
        ("qwen2", {"sliding_window": 12, "use_sliding_window": True, "max_window_layers": 1}),
    ],
)
def test_sliding_window_models_match_transformers(tmp_path, architecture, window_config, backend):
    """Prompts of 30 and 37 tokens over a window of 8 or 12 (2-3 blocks of 4): a prefill, a
    chunk of 13 that straddles the window, then 16 decode steps (a kept workspace whose window
    moves every step). ``chosen``: the engine's own backend (the CPU paged one here)."""
    model_dir = make_tiny_model(tmp_path / architecture, architecture=architecture, **window_config)
    assert any(spec.window for spec in ModelConfig.from_dir(model_dir).layer_attention)
    rng = np.random.default_rng(0)
    prompts = [[1] + rng.integers(3, 40000, size=n).tolist() for n in (29, 36)]
    check_against_transformers(model_dir, 16, chunk=13, backend=backend, prompts=prompts)


def test_backend_is_chosen_from_the_device_and_the_torch_build(tiny_model_dir):
    config = ModelConfig.from_dir(tiny_model_dir)
    on_cpu = PagedKVCache(config, 4, 4, torch.float32, torch.device("cpu"))
    expected = PagedCpuBackend if fused_cpu_kernel_available() else SdpaBackend
    assert type(select_backend(on_cpu, 1 << 20)) is expected
    elsewhere = PagedKVCache(config, 4, 4, torch.float32, torch.device("meta"))
    assert type(select_backend(elsewhere, 1 << 20)) is SdpaBackend


def test_rope_llama3_scaling_matches_transformers(tmp_path):
    import json

    model_dir = make_tiny_model(tmp_path / "llama3-rope", architecture="llama")
    config_file = model_dir / "config.json"
    config = json.loads(config_file.read_text())
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
        "rope_theta": 500000.0,
    }
    config["rope_parameters"] = scaling
    config["rope_scaling"] = scaling
    config_file.write_text(json.dumps(config))
    check_against_transformers(model_dir, decode_steps=2)


@pytest.mark.slow
def test_default_model_matches_transformers(default_model_dir):
    check_against_transformers(default_model_dir, decode_steps=3, chunk=6)


def test_cpu_backend_matches_per_segment_attention(tiny_model_dir):
    """The CPU backend (every row through the flash kernel over keys from position 0) gives
    the same logits as SDPA attending each segment on its own: continuations that share
    prefix blocks, a chunked prompt, a fresh one."""
    engine = Engine(
        EngineConfig(
            model_path=str(tiny_model_dir), dtype="float32", kv_cache_tokens=1024, block_size=4
        )
    )
    prefix = [1, 9690, 198, 2683, 314, 253, 5356, 30, 2, 504, 3458, 282]  # 3 whole blocks
    first = manual_request(engine, prefix + [7, 8], "first")
    give_blocks(engine, first, first.num_tokens)
    compute_logits(engine, [first], [first.num_tokens])
    sharing = []
    for i, tail in enumerate([[11, 12, 13], [21, 22, 23, 24, 25, 26], [31]]):
        r = manual_request(engine, prefix + tail, f"share{i}")
        r.block_ids = list(first.block_ids[:3])
        give_blocks(engine, r, r.num_tokens)
        r.num_computed = len(prefix)
        sharing.append(r)
    chunked = manual_request(engine, [1, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49], "chunked")
    give_blocks(engine, chunked, chunked.num_tokens)
    compute_logits(engine, [chunked], [5])
    chunked.num_computed = 5
    fresh = manual_request(engine, [1, 60, 61, 62, 63], "fresh")
    give_blocks(engine, fresh, fresh.num_tokens)
    requests = sharing + [chunked, fresh]
    counts = [r.remaining for r in requests]
    results = {}
    for batched, backend in (
        (True, PagedCpuBackend(engine.runner.kv_cache, 1 << 30)),
        (False, SdpaBackend(engine.runner.kv_cache)),
    ):
        engine.runner.attention = backend
        results[batched] = compute_logits(engine, requests, counts)
    assert results[True][1] == results[False][1] == [0, 1, 2, 3, 4]
    diff = (results[True][0] - results[False][0]).abs().max().item()
    assert diff < 1e-5, diff
