"""The scripted decode step (engine_worker/scripted_decode.py) gives the eager forward's bits: the
same greedy tokens, the same seeded samples and bit-equal logits, on the real default model at
batch 1 and on both sides of the int4/dense line; where it does not apply, the eager forward
runs. Each comparison runs the same requests on one engine with the scripted layers switched
off and on (``LlamaFamilyModel.scripted_decode``; tests/engine_worker/scripted_helpers.py).
Every family's tiny model is compared too (tests/engine_worker/test_families.py)."""

from __future__ import annotations

import pytest

from engine_worker.engine import Engine
from ipc.messages import SamplingParams
from tests.chat_prompts import chat_prompt_ids
from tests.engine_worker.helpers import collect, greedy
from tests.engine_worker.scripted_helpers import assert_same, counted, make_engine
from tests.tiny_model import make_tiny_model


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


@pytest.mark.parametrize("architecture", ["llama", "qwen2", "qwen3", "mistral-window"])
def test_tiny_model_scripted_matches_eager(tiny_models, architecture):
    # qwen2: qkv bias; qwen3: q/k norm; mistral-window: a sliding window shorter than the rows
    engine = make_engine(tiny_models[architecture], weights="int4", enable_prefix_cache=False)
    prompts = [[1, 5, 9, 300], [1, 17, 4000, 5, 6, 7, 8, 9, 10, 11], [1, 2000]]
    if architecture == "mistral-window":
        # past a block of 512 key columns outside every row's window, which attention skips
        prompts.append([1, *range(3, 600)])
    assert_same(engine, prompts, greedy(12, ignore_eos=True), architecture)


def test_steps_with_prompt_rows_run_eagerly(tiny_models):
    engine = make_engine(tiny_models["llama"], weights="int4")
    scripted = counted(engine)
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
