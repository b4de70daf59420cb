"""Our forward against transformers' (fp32): prefill, chunked prefill and decode over the paged
KV cache, for every supported architecture and once for the real default model."""

from __future__ import annotations

import pytest
import torch
import transformers

from engine_worker.config import EngineConfig
from engine_worker.engine import Engine
from procs.model_store import make_tiny_model
from tests.engine_worker.helpers import give_blocks, manual_request

TOLERANCE = 1e-4


def reference_last_logits(hf_model, token_ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf_model(torch.tensor([token_ids])).logits[0, -1].float()


def check_against_transformers(model_dir, decode_steps: int, chunk: int | None = None) -> None:
    engine = Engine(EngineConfig(model_path=str(model_dir), dtype="float32",
                                 kv_cache_tokens=1024, block_size=4))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir),
                                                           dtype=torch.float32).eval()
    prompts = [[1, 9690, 198, 2683, 314, 253, 5356, 30, 2],
               [1, 504, 3458, 282, 4649, 314, 253, 1467, 11, 4, 77, 9001, 18, 7]]
    requests = [manual_request(engine, p, f"r{i}") for i, p in enumerate(prompts)]
    # Prefill both together (packed); optionally the second one in two chunks.
    if chunk:
        give_blocks(engine, requests[1], chunk)
        engine.runner.compute_logits([requests[1]], [chunk])
        requests[1].num_computed = chunk
    counts = []
    for r in requests:
        give_blocks(engine, r, r.num_tokens)
        counts.append(r.remaining)
    for step in range(decode_steps + 1):
        logits, emitting = engine.runner.compute_logits(requests, counts)
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


def test_rope_llama3_scaling_matches_transformers(tmp_path):
    import json

    model_dir = make_tiny_model(tmp_path / "llama3-rope", architecture="llama")
    config_file = model_dir / "config.json"
    config = json.loads(config_file.read_text())
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16,
               "rope_theta": 500000.0}
    config["rope_parameters"] = scaling
    config["rope_scaling"] = scaling
    config_file.write_text(json.dumps(config))
    check_against_transformers(model_dir, decode_steps=2)


@pytest.mark.slow
def test_default_model_matches_transformers(default_model_dir):
    check_against_transformers(default_model_dir, decode_steps=3, chunk=6)
