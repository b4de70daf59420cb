"""A sliding-window model through the whole engine, against transformers (float32, tiny random
Mistral, window 8, prompts several windows long): prompt logprobs under chunked prefill whose
chunks straddle the window, sampled-token logprobs of 16 greedy decode steps, a second request
that takes the first one's blocks from the prefix cache, one decoding beside another; the
context is the model's own, not the window; and how configs name their windows."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine_worker.engine import Engine
from engine_worker.model_config import LayerAttention, _layer_attention
from ipc.engine_config import EngineConfig
from tests.engine_worker.helpers import collect, greedy
from tests.reference_model import load_reference_model
from tests.tiny_model import make_tiny_model

WINDOW = 8
TOLERANCE = 1e-3  # logprobs; measured ~1e-5


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("window")
    return make_tiny_model(root / "mistral", architecture="mistral", sliding_window=WINDOW)


@pytest.fixture(scope="module")
def hf(mistral_dir):
    return load_reference_model(mistral_dir)


def reference(hf, ids: list[int]) -> torch.Tensor:
    """transformers' log-softmax at every position of ``ids`` (a full forward, no cache)."""
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def prompt(length: int, seed: int) -> list[int]:
    return [1] + np.random.default_rng(seed).integers(3, 40000, size=length - 1).tolist()


def check_decoded(hf, prompt_ids: list[int], result: dict) -> None:
    """Each greedy token is transformers' argmax given the tokens before it, and its logprob
    (with the top 5) transformers'."""
    tokens, entries = result["tokens"], result["logprobs"]
    ref = reference(hf, prompt_ids + tokens)
    for i, (token, entry) in enumerate(zip(tokens, entries)):
        row = ref[len(prompt_ids) - 1 + i]
        assert abs(entry.logprob - float(row[token])) < TOLERANCE, i
        assert float(row[token]) > float(row.max()) - TOLERANCE, i  # greedy, up to ties
        top = np.frombuffer(entry.top_logprobs, "<f4")
        np.testing.assert_allclose(top, row.topk(5).values.numpy(), atol=TOLERANCE, rtol=0)


def test_chunked_prefill_prefix_cache_and_decode_match_transformers(mistral_dir, hf):
    engine = Engine(
        EngineConfig(
            model_path=str(mistral_dir),
            dtype="float32",
            weights="fp32",
            device="cpu",
            kv_cache_tokens=2048,
            block_size=4,
            prefill_chunk_tokens=6,  # chunks of 6 over a window of 8: each straddles it
        )
    )
    first = prompt(45, seed=0)
    engine.add("first", first, greedy(16, ignore_eos=True, logprobs=5, prompt_logprobs=0))
    results = collect(engine)["first"]
    assert len(results["tokens"]) == 16
    lp = np.concatenate([np.frombuffer(c.logprobs, "<f4") for c in results["prompt_logprobs"]])
    ref = reference(hf, first)
    expected = ref[torch.arange(len(first) - 1), torch.tensor(first[1:])].numpy()
    np.testing.assert_allclose(lp, expected, atol=TOLERANCE, rtol=0)
    check_decoded(hf, first, results)
    # The first prompt's blocks from the prefix cache, then more tokens; decoded beside a
    # fresh prompt's request.
    sharing, fresh = first + prompt(11, seed=1)[1:], prompt(23, seed=2)
    engine.add("sharing", sharing, greedy(16, ignore_eos=True, logprobs=5))
    engine.add("fresh", fresh, greedy(16, ignore_eos=True, logprobs=5))
    results = collect(engine)
    assert results["sharing"]["start"].cached_tokens >= 40
    check_decoded(hf, sharing, results["sharing"])
    check_decoded(hf, fresh, results["fresh"])


def test_the_context_is_the_models_not_the_window(mistral_dir):
    engine = Engine(
        EngineConfig(model_path=str(mistral_dir), dtype="float32", kv_cache_tokens=4096)
    )
    assert engine.max_model_len == 2048  # max_position_embeddings (it was capped to 8)


def test_configs_name_their_windows_as_transformers_reads_them():
    def layers(model_type: str, **cfg) -> tuple[LayerAttention, ...]:
        return _layer_attention({"max_position_embeddings": 4096, **cfg}, 4, model_type)

    assert layers("mistral", sliding_window=16) == (LayerAttention(16),) * 4
    assert layers("mistral", sliding_window=None) == ()
    assert layers("mistral", sliding_window=4096) == ()  # as long as the context: no window
    assert layers("qwen2", sliding_window=16, use_sliding_window=False) == ()
    types = ["full_attention", "sliding_attention", "full_attention", "sliding_attention"]
    expected = tuple(LayerAttention(w) for w in (0, 16, 0, 16))
    assert layers("qwen2", sliding_window=16, use_sliding_window=True, layer_types=types) == (
        expected
    )
    assert layers("qwen2", sliding_window=16, use_sliding_window=True, max_window_layers=2) == (
        tuple(LayerAttention(w) for w in (0, 0, 16, 16))
    )
    # Gemma 2 without layer_types: every other layer local, soft-capped scores, its own scale
    gemma2 = layers(
        "gemma2", sliding_window=16, attn_logit_softcapping=50.0, query_pre_attn_scalar=256
    )
    assert gemma2 == tuple(LayerAttention(w, 50.0, 1 / 16) for w in (16, 0, 16, 0))
    assert layers("gemma3", sliding_window=16, sliding_window_pattern=3) == tuple(
        LayerAttention(w) for w in (16, 16, 0, 16)
    )
    assert layers("granite", attention_multiplier=0.015625) == (LayerAttention(scale=0.015625),) * 4
    with pytest.raises(ValueError, match="layer_types"):
        layers("qwen2", sliding_window=16, layer_types=types[:3])
