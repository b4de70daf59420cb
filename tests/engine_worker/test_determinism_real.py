"""Same request, same answer (DESIGN property 9) on the real default model: greedy tokens of 32
chat prompts do not depend on the prefix cache, the thread count, chunk boundaries or the batch
they share (docs/determinism.md says what the default launch and --deterministic each promise).
bf16 activations pinned: the default on this CPU, and the arithmetic the promise is measured for."""

from __future__ import annotations

import pytest
import torch

from engine_worker.engine import Engine
from engine_worker.weight_format import WeightFormat
from ipc.engine_config import EngineConfig
from tests.chat_prompts import chat_prompt_ids
from tests.engine_worker.helpers import collect, greedy

pytestmark = pytest.mark.slow
TOKENS = 16
# The default launch runs decode rows on the int4 kernels while a step has at most this many of
# them (dense above): its promise holds for decode batches on one side of that line.
DEFAULT_DECODE_BATCH = WeightFormat(
    "auto",
    torch.bfloat16,
    torch.device("cpu"),
    int4_kernel=EngineConfig(model_path="-").int4_kernel,
).crossover("int4")


def make_engine(model_dir, **knobs) -> Engine:
    knobs = {"dtype": "bfloat16", "weights": "auto", "adaptive_threads": False, **knobs}
    return Engine(EngineConfig(model_path=str(model_dir), kv_cache_tokens=8192, **knobs))


def greedy_tokens(engine: Engine, prompts, tag: str, one_per_step: bool = False) -> list:
    """Every prompt's greedy tokens; all added at once, or one more at each step."""
    names = [f"{tag}{i}" for i in range(len(prompts))]

    def add(step: int, e: Engine) -> None:
        if step < len(prompts):
            e.add(names[step], prompts[step], greedy(TOKENS, ignore_eos=True))

    if not one_per_step:
        for step in range(len(prompts)):
            add(step, engine)
    results = collect(engine, on_step=add if one_per_step else None)
    return [results[name]["tokens"] for name in names]


@pytest.fixture(scope="module")
def prompts(default_model_dir) -> list[list[int]]:
    """The 32 chat prompts, every fourth cut to whole blocks: a prompt asked again then takes
    its last full block's slots from the cache and computes its last token (a prompt tail
    otherwise)."""
    ids = chat_prompt_ids(default_model_dir)[1]
    return [p[: len(p) // 16 * 16] if i % 4 == 3 else p for i, p in enumerate(ids)]


@pytest.fixture(scope="module")
def default_launch(default_model_dir) -> Engine:
    return make_engine(default_model_dir, max_batch_size=DEFAULT_DECODE_BATCH)


@pytest.fixture(scope="module")
def cold(default_launch, prompts) -> list[list[int]]:
    return greedy_tokens(default_launch, prompts, "cold")


def test_default_launch_same_tokens_from_the_prefix_cache_and_on_one_thread(
    default_launch, prompts, cold
):
    totals: dict = {}
    for i, prompt in enumerate(prompts):
        default_launch.add(f"warm{i}", prompt, greedy(TOKENS, ignore_eos=True))
    results = collect(default_launch, totals=totals)
    assert totals["cached_tokens"] >= 32 * len(prompts)  # every prompt's first 2 blocks at least
    assert [results[f"warm{i}"]["tokens"] for i in range(len(prompts))] == cold
    torch.set_num_threads(1)
    try:
        assert greedy_tokens(default_launch, prompts[:4], "one-thread") == cold[:4]
    finally:
        torch.set_num_threads(2)


def test_a_whole_prompt_from_the_cache_gets_its_cold_first_token_logprobs(default_launch, prompts):
    """A prompt asked again computes nothing (its full blocks and its tail from the prefix
    cache, the tail with its prompt end's final hidden state), or its last token alone when it
    ends a whole block: its first token's logprobs are the cold prefill's, bit for bit. Each
    request runs alone, so the head computes one sampling row both times (docs/determinism.md:
    the head's logits below the top ones depend on the sampling rows' count)."""

    def first_tokens(tag: str) -> list[tuple]:
        rows = []
        for i, prompt in enumerate(prompts[:16]):
            totals: dict = {}
            salt = f"tail{i}"  # nothing shared with the other prompts: the first run is cold
            default_launch.add(f"{tag}{i}", prompt, greedy(1, logprobs=5), cache_salt=salt)
            result = collect(default_launch, totals=totals)[f"{tag}{i}"]
            logprobs = result["logprobs"][0]
            rows.append((totals["prefill_tokens"], result["tokens"], logprobs.top_logprobs))
        return rows

    cold, warm = first_tokens("first-cold"), first_tokens("first-warm")
    assert [row[0] for row in cold] == [len(p) for p in prompts[:16]]
    assert [row[0] for row in warm] == [0 if len(p) % 16 else 1 for p in prompts[:16]]
    assert [row[1:] for row in warm] == [row[1:] for row in cold]


def test_deterministic_mode_same_tokens_whatever_the_decode_batch_and_chunks(
    default_model_dir, prompts, cold
):
    # 32 decode rows a step (above the default's line), prompts in chunks of 11 tokens (33
    # query rows a kv head: a block of 32 and a padded tail) beside
    # others' prefill and decode rows; then 12 prompts arriving one per step (decode batches of
    # 1 to 12, their prompts from the prefix cache). Decode rows stay on the int4 kernels, so the
    # tokens are also the default launch's at up to DEFAULT_DECODE_BATCH decode rows.
    engine = make_engine(
        default_model_dir,
        deterministic=True,
        max_batch_size=32,
        prefill_chunk_tokens=11,
        prefill_max_tokens=88,
    )
    assert greedy_tokens(engine, prompts, "together") == cold
    assert greedy_tokens(engine, prompts[:12], "staggered", one_per_step=True) == cold[:12]


@pytest.mark.parametrize("weights", ["bf16", "fp32", "int8", "int4", "int4-exact"])
def test_every_weight_mode_same_tokens_from_the_prefix_cache_and_on_one_thread(
    default_model_dir, prompts, weights
):
    """The default launch's promise in the other weight modes (8 of the prompts: a float32 step
    is several times a bf16 one on this CPU). The one-thread run decodes as many rows a step as
    the first: int8's and int4-exact's crossovers to the dense copy are at 4 and 1 rows, and the
    promise holds on one side of them (--deterministic covers both)."""
    dtype = "float32" if weights == "fp32" else "bfloat16"
    engine = make_engine(default_model_dir, weights=weights, dtype=dtype, max_batch_size=8)
    some = prompts[:8]
    cold = greedy_tokens(engine, some, "cold")
    totals: dict = {}
    for i, prompt in enumerate(some):
        engine.add(f"warm{i}", prompt, greedy(TOKENS, ignore_eos=True))
    results = collect(engine, totals=totals)
    assert totals["cached_tokens"] >= 32 * len(some)
    assert [results[f"warm{i}"]["tokens"] for i in range(len(some))] == cold
    torch.set_num_threads(1)
    try:
        assert greedy_tokens(engine, some, "one-thread") == cold
    finally:
        torch.set_num_threads(2)
