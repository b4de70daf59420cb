"""Logprobs in the engine against transformers' forward on the same ids (fp32): sampled tokens
with their top-k, prompt logprobs under chunked prefill, a step budget, a warm prefix cache and
preemption; scoring-only requests; min_tokens, logit_bias and min_p; requests that did not ask
are untouched."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from engine_worker.engine import Engine
from ipc.engine_config import EngineConfig
from ipc.messages import FINISH_LENGTH, FINISH_STOP, SamplingParams
from tests.engine_worker.helpers import collect, greedy

TOLERANCE = 1e-4
PROMPT = [1, 504, 3458, 282, 4649, 314, 253, 1467, 30, 77, 88, 99, 1000, 2000, 3000, 17, 9, 33]


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(tiny_model_dir), dtype=torch.float32
    ).eval()


def reference(hf, ids: list[int]) -> torch.Tensor:
    """transformers' log-softmax at every position of ``ids`` [len(ids), vocab]."""
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def make_engine(model_dir, **knobs) -> Engine:
    knobs.setdefault("kv_cache_tokens", 2048)
    return Engine(EngineConfig(model_path=str(model_dir), dtype="float32", device="cpu", **knobs))


def long_prompt(length: int, seed: int = 0) -> list[int]:
    return [1] + np.random.default_rng(seed).integers(3, 40000, size=length - 1).tolist()


def prompt_values(chunks) -> tuple[list[int], np.ndarray, np.ndarray, np.ndarray]:
    """(positions, logprobs, top ids, top logprobs) of a request's PromptLogprobs chunks."""
    positions, values, top_ids, top_values = [], [], [], []
    for chunk in chunks:
        lp = np.frombuffer(chunk.logprobs, "<f4")
        positions += range(chunk.start, chunk.start + lp.size)
        values.append(lp)
        top_ids.append(np.frombuffer(chunk.top_ids, "<i4").reshape(lp.size, chunk.top_k))
        top_values.append(np.frombuffer(chunk.top_logprobs, "<f4").reshape(lp.size, chunk.top_k))
    return positions, np.concatenate(values), np.concatenate(top_ids), np.concatenate(top_values)


def check_prompt(hf, prompt: list[int], chunks, top_k: int) -> None:
    positions, values, top_ids, top_values = prompt_values(chunks)
    assert positions == list(range(1, len(prompt))), "each position exactly once, in order"
    ref = reference(hf, prompt)
    expected = ref[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])].numpy()
    np.testing.assert_allclose(values, expected, atol=TOLERANCE, rtol=0)
    best = ref[:-1].topk(top_k)
    np.testing.assert_array_equal(top_ids, best.indices.numpy())
    np.testing.assert_allclose(top_values, best.values.numpy(), atol=TOLERANCE, rtol=0)


def test_sampled_token_logprobs_are_raw_and_only_for_rows_that_asked(tiny_model_dir, hf):
    engine = make_engine(tiny_model_dir)
    engine.add("alone", PROMPT, greedy(6))
    alone = collect(engine)["alone"]["tokens"]
    engine.add("plain", PROMPT, greedy(6))
    engine.add("top5", PROMPT, greedy(6, logprobs=5))
    # Temperature, a penalty and a bias change what is drawn, never the logprobs reported.
    engine.add(
        "drawn",
        PROMPT[:9],
        SamplingParams(
            max_tokens=6,
            temperature=0.8,
            seed=5,
            repetition_penalty=1.3,
            logprobs=0,
            logit_bias={17: 5.0},
        ),
    )
    results = collect(engine)
    assert results["plain"]["tokens"] == alone and "logprobs" not in results["plain"]
    assert results["top5"]["tokens"] == alone
    for name, prompt, k in (("top5", PROMPT, 5), ("drawn", PROMPT[:9], 0)):
        tokens, entries = results[name]["tokens"], results[name]["logprobs"]
        assert len(entries) == len(tokens) == 6
        ref = reference(hf, prompt + tokens)
        for i, (token, entry) in enumerate(zip(tokens, entries)):
            row = ref[len(prompt) - 1 + i]
            assert abs(entry.logprob - float(row[token])) < TOLERANCE
            top_ids = np.frombuffer(entry.top_ids, "<i4")
            assert top_ids.tolist() == row.topk(k).indices.tolist()
            np.testing.assert_allclose(
                np.frombuffer(entry.top_logprobs, "<f4"),
                row.topk(k).values.numpy(),
                atol=TOLERANCE,
                rtol=0,
            )


def test_prompt_logprobs_under_chunked_prefill_and_a_step_budget(tiny_model_dir, hf):
    prompt = long_prompt(41)
    engine = make_engine(tiny_model_dir, prefill_chunk_tokens=5, enable_prefix_cache=False)
    engine.scheduler.prompt_logprob_tokens = 6  # two requests share 6 positions a step
    engine.add("score", prompt, SamplingParams(max_tokens=0, prompt_logprobs=3))
    engine.add("then", prompt[:20], greedy(2, prompt_logprobs=0))
    results = collect(engine)
    score = results["score"]
    assert score["tokens"] == [] and score["reason"] == FINISH_LENGTH and "start" in score
    assert all(len(c.logprobs) // 4 <= 5 for c in score["prompt_logprobs"])
    check_prompt(hf, prompt, score["prompt_logprobs"], 3)
    assert len(results["then"]["tokens"]) == 2
    check_prompt(hf, prompt[:20], results["then"]["prompt_logprobs"], 0)


def test_prompt_logprobs_never_read_the_prefix_cache(tiny_model_dir, hf):
    prompt = long_prompt(70, seed=1)
    engine = make_engine(tiny_model_dir, prefill_chunk_tokens=32)
    engine.add("warm", prompt, greedy(1))
    collect(engine)
    engine.add("scored", prompt, greedy(1, prompt_logprobs=2))
    scored = collect(engine)["scored"]
    assert scored["start"].cached_tokens == 0
    check_prompt(hf, prompt, scored["prompt_logprobs"], 2)
    engine.add("again", prompt, greedy(1))  # the scored request's blocks are still shared
    # 4 blocks and the tail, with its prompt end: the scored request kept it too
    assert collect(engine)["again"]["start"].cached_tokens == 70


def test_prompt_logprobs_are_sent_once_across_preemption(tiny_model_dir, hf):
    prompts = [long_prompt(40, seed=2), long_prompt(40, seed=3)]
    engine = make_engine(
        tiny_model_dir, kv_cache_tokens=80, prefill_chunk_tokens=16, enable_prefix_cache=False
    )
    for i, prompt in enumerate(prompts):
        engine.add(f"p{i}", prompt, greedy(8, prompt_logprobs=1, ignore_eos=True))
    totals: dict = {}
    results = collect(engine, totals=totals)
    assert totals["preempted"] > 0
    for i, prompt in enumerate(prompts):
        assert len(results[f"p{i}"]["tokens"]) == 8
        check_prompt(hf, prompt, results[f"p{i}"]["prompt_logprobs"], 1)


def test_min_tokens_masks_stop_ids_until_reached(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    engine.add("probe", PROMPT, greedy(4))
    first = collect(engine)["probe"]["tokens"][0]
    engine.add("stops", PROMPT, greedy(8, stop_token_ids=[first]))
    engine.add("min3", PROMPT, greedy(8, stop_token_ids=[first], min_tokens=3))
    results = collect(engine)
    assert results["stops"]["tokens"] == [first] and results["stops"]["reason"] == FINISH_STOP
    tokens = results["min3"]["tokens"]
    assert len(tokens) >= 3 and first not in tokens[:2]
    assert results["min3"]["reason"] == (FINISH_STOP if tokens[-1] == first else FINISH_LENGTH)


def test_logit_bias_changes_the_output_and_min_p_one_is_greedy(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    engine.add("greedy", PROMPT, greedy(5))
    base = collect(engine)["greedy"]["tokens"]
    engine.add("forced", PROMPT, greedy(5, logit_bias={4242: 100.0}))
    engine.add("banned", PROMPT, greedy(5, logit_bias={t: -100.0 for t in set(base)}))
    engine.add("min_p", PROMPT, SamplingParams(max_tokens=5, temperature=1.0, seed=7, min_p=1.0))
    engine.add("free", PROMPT, SamplingParams(max_tokens=5, temperature=1.0, seed=7))
    results = collect(engine)
    assert results["forced"]["tokens"] == [4242] * 5
    assert not set(results["banned"]["tokens"]) & set(base)
    assert results["min_p"]["tokens"] == base
    assert results["free"]["tokens"] != base
