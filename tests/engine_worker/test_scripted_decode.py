"""The scripted decode step (engine_worker/scripted_decode.py) gives the eager forward's bits: the
same greedy tokens, the same seeded samples and bit-equal logits, on the real default model at
batch 1 and on both sides of the int4/dense line; where it does not apply, the eager forward
runs. Each comparison runs the same requests on one engine with the scripted layers switched
off and on (``LlamaFamilyModel.scripted_decode``)."""

from __future__ import annotations

import pytest
import torch

from engine_worker.engine import Engine
from ipc.engine_config import EngineConfig
from ipc.messages import SamplingParams
from scripts.bench.chat_prompts import chat_prompt_ids
from scripts.bench.tiny_model import make_tiny_model
from tests.engine_worker.helpers import collect, greedy


def make_engine(model_dir, **knobs) -> Engine:
    knobs = {"dtype": "bfloat16", "weights": "auto", "adaptive_threads": False, **knobs}
    return Engine(EngineConfig(model_path=str(model_dir), kv_cache_tokens=8192, **knobs))


def run(engine: Engine, scripted: bool, prompts, params, tag: str) -> tuple[list, list]:
    """Every prompt's tokens, and the logits of each step that only decoded (recorded from the
    real forward), with the scripted layers on or off."""
    model = engine.runner.model
    kept = model.scripted_decode
    assert kept is not None
    model.scripted_decode = kept if scripted else None
    forward, logits = model.forward, []

    def recording_forward(*args, **kwargs):
        out = forward(*args, **kwargs)
        if args[3].deferred_kv is not None:  # metadata: a decode-only step on a kept workspace
            logits.append(out.logits.clone())
        return out

    model.forward = recording_forward
    try:
        names = [f"{tag}-{scripted}-{i}" for i in range(len(prompts))]
        for name, prompt in zip(names, prompts):
            engine.add(name, prompt, params)
        results = collect(engine)
    finally:
        del model.forward
        model.scripted_decode = kept
    return [results[n]["tokens"] for n in names], logits


def assert_same(engine: Engine, prompts, params, tag: str) -> None:
    collect(engine)  # whatever a failed test left runs out first: the runs get the same batches
    scripted = engine.runner.model.scripted_decode
    steps = scripted.steps
    tokens_eager, logits_eager = run(engine, False, prompts, params, tag)
    tokens_scripted, logits_scripted = run(engine, True, prompts, params, tag)
    assert scripted.steps - steps == len(logits_scripted) > 0  # the scripted path did run
    assert tokens_scripted == tokens_eager
    assert len(logits_scripted) == len(logits_eager)
    for eager, ours in zip(logits_eager, logits_scripted):
        assert torch.equal(eager, ours)


# --- the real default model -------------------------------------------------------------------
@pytest.fixture(scope="module")
def default_engine(default_model_dir) -> Engine:
    # no prefix cache: the second run of the same prompts is scheduled as the first was
    engine = make_engine(default_model_dir, enable_prefix_cache=False)
    assert engine.runner.model.scripted_decode is not None
    return engine


@pytest.fixture(scope="module")
def chat_prompts(default_model_dir) -> list[list[int]]:
    return chat_prompt_ids(default_model_dir)[1]


@pytest.mark.slow
def test_default_model_greedy_tokens_and_logits_match_eager(default_engine, chat_prompts):
    # 32 prompts together decode at batch 32 (the dense copies); then batches on the int4 side
    assert len(chat_prompts) == 32
    assert_same(default_engine, chat_prompts, greedy(32, ignore_eos=True), "all")
    for batch in (1, 4, 16):
        assert_same(default_engine, chat_prompts[:batch], greedy(12, ignore_eos=True), f"b{batch}")


@pytest.mark.slow
def test_default_model_seeded_sampling_matches_eager(default_engine, chat_prompts):
    params = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)
    assert_same(default_engine, chat_prompts[:4], params, "seeded")


# --- the tiny model: which models and steps run scripted --------------------------------------
@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory) -> dict[str, object]:
    root = tmp_path_factory.mktemp("scripted")
    models = {a: make_tiny_model(root / a, architecture=a) for a in ("llama", "qwen2", "qwen3")}
    models["mistral-window"] = make_tiny_model(
        root / "mistral-window", architecture="mistral", sliding_window=8
    )
    return models


def test_tiny_model_scripted_matches_eager(tiny_models):
    engine = make_engine(tiny_models["llama"], weights="int4", enable_prefix_cache=False)
    prompts = [[1, 5, 9, 300], [1, 17, 4000, 5, 6, 7, 8], [1, 2000]]
    assert_same(engine, prompts, greedy(8, ignore_eos=True), "tiny")


def test_steps_with_prompt_rows_run_eagerly(tiny_models):
    engine = make_engine(tiny_models["llama"], weights="int4")
    scripted = engine.runner.model.scripted_decode
    assert scripted is not None
    engine.add("a", [1, 5, 9, 300], greedy(6, ignore_eos=True))
    engine.step()  # the prompt
    engine.step()  # builds the decode workspace: gathers, eager
    assert scripted.steps == 0
    engine.step()
    assert scripted.steps == 1
    engine.add("b", [1, 7, 7, 7, 7], greedy(2, ignore_eos=True))
    engine.step()  # b's prompt beside a's decode row
    assert scripted.steps == 1
    collect(engine)


@pytest.mark.parametrize(
    ("architecture", "knobs"),
    [
        ("llama", {"dtype": "float32", "weights": "fp32"}),  # RmsNorm not fused
        ("llama", {"weights": "bf16"}),  # no int4 copies
        ("llama", {"scripted_decode": False}),
        ("qwen2", {"weights": "int4"}),  # qkv bias
        ("qwen3", {"weights": "int4"}),  # q/k norm
        ("mistral-window", {"weights": "int4"}),  # a sliding window
    ],
)
def test_models_it_does_not_cover_run_eagerly(tiny_models, architecture, knobs):
    engine = make_engine(tiny_models[architecture], **knobs)
    assert engine.runner.model.scripted_decode is None
    results = collect_one(engine)
    assert len(results) == 4


def collect_one(engine: Engine) -> list[int]:
    engine.add("one", [1, 5, 9, 300], greedy(4, ignore_eos=True))
    return collect(engine)["one"]["tokens"]
