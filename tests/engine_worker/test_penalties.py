"""Repetition, frequency and presence penalties: the batched device path against a plain per-row
reference, the incremental token statistics against a recount, and the engine's greedy output
with repetition_penalty against transformers' generate with the same penalty."""

from __future__ import annotations

import random

import pytest
import torch
import transformers

from engine_worker.engine import Engine
from engine_worker.sampler import RequestSampler, apply_penalties, sample
from ipc.engine_config import EngineConfig
from ipc.messages import SamplingParams
from tests.engine_worker.helpers import collect, greedy

VOCAB = 50


def reference(
    row: list[float], tokens: list[int], prompt_len: int, p: SamplingParams
) -> list[float]:
    out = list(row)
    generated = tokens[prompt_len:]
    for t in set(tokens):
        out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
    for t in set(generated):
        out[t] -= p.frequency_penalty * generated.count(t) + p.presence_penalty
    return out


def test_batched_penalties_match_a_per_row_reference_as_tokens_are_added():
    rng = random.Random(5)
    params = [
        SamplingParams(temperature=0.0, presence_penalty=0.7, frequency_penalty=0.3),
        SamplingParams(temperature=0.0),  # no penalty: its row stays as it is
        SamplingParams(temperature=0.0, repetition_penalty=1.8),
        SamplingParams(
            temperature=0.5,
            repetition_penalty=0.6,
            frequency_penalty=-1.0,
            presence_penalty=-0.5,
            seed=3,
        ),
    ]
    samplers = [RequestSampler(p, torch.device("cpu")) for p in params]
    histories = [[rng.randrange(VOCAB) for _ in range(rng.randrange(1, 12))] for _ in params]
    prompt_lens = [len(h) for h in histories]
    for step in range(6):  # the statistics fold in only what each step added
        logits = torch.randn(len(params), VOCAB, generator=torch.Generator().manual_seed(step))
        got = apply_penalties(logits, samplers, list(zip(histories, prompt_lens)))
        for i, p in enumerate(params):
            want = reference(logits[i].tolist(), histories[i], prompt_lens[i], p)
            assert got[i].tolist() == pytest.approx(want, abs=1e-5), (step, i)
        assert torch.equal(got[1], logits[1])
        for h in histories:
            h.extend(
                rng.choice(h) if rng.random() < 0.6 else rng.randrange(VOCAB)
                for _ in range(rng.randrange(1, 3))
            )


def test_greedy_with_penalties_picks_the_penalized_argmax():
    p = SamplingParams(temperature=0.0, frequency_penalty=2.0)
    sampler = RequestSampler(p, torch.device("cpu"))
    logits = torch.zeros(1, VOCAB)
    logits[0, 7] = 3.0  # the favourite, generated twice already: 3 - 2 * 2 < 0.5
    logits[0, 9] = 0.5
    assert sample(logits, [sampler], [([1, 2, 7, 7], 2)]).tolist() == [9]
    with pytest.raises(ValueError, match="histories"):
        sample(logits, [sampler])


def test_bad_penalties_are_refused():
    for kwargs in (
        {"presence_penalty": 2.5},
        {"frequency_penalty": float("nan")},
        {"repetition_penalty": 0.0},
        {"repetition_penalty": float("inf")},
        {"presence_penalty": True},
    ):
        with pytest.raises(ValueError, match="penalty"):
            SamplingParams(**kwargs)


def test_repetition_penalty_matches_transformers_generate(tiny_model_dir):
    """Same greedy tokens as transformers with the same repetition_penalty, for requests that
    share their batch with unpenalized ones (which stay as they are alone)."""
    prompts = [[1, 504, 3458, 282, 4649, 314, 253, 1467, 30], [1, 22, 333, 4444, 22, 333]]
    engine = Engine(
        EngineConfig(model_path=str(tiny_model_dir), dtype="float32", kv_cache_tokens=1024)
    )
    for i, ids in enumerate(prompts):
        engine.add(f"pen{i}", ids, greedy(24, repetition_penalty=1.6))
        engine.add(f"plain{i}", ids, greedy(24))
    results = collect(engine)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(tiny_model_dir), dtype=torch.float32
    ).eval()
    for i, ids in enumerate(prompts):
        for name, penalty in ((f"pen{i}", 1.6), (f"plain{i}", 1.0)):
            expected = hf.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids)),
                max_new_tokens=24,
                do_sample=False,
                repetition_penalty=penalty,
                eos_token_id=None,
                pad_token_id=0,
            )[0, len(ids) :].tolist()
            assert results[name]["tokens"] == expected, name
        assert results[f"pen{i}"]["tokens"] != results[f"plain{i}"]["tokens"]
