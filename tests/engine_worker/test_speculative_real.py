"""Speculative decoding on the real default model (docs/speculative.md): a verification row's
logits are the bits the same position gets decoded alone, and greedy output is token for token
the output without speculation, for 32 chat prompts (8 of them asking the model to quote or
rework their input, so drafts are found and accepted), in a batch where half the requests opted
out. bf16 activations and the default weights (int4 decode rows, dense prompt rows)."""

from __future__ import annotations

import pytest
import torch

from engine_worker.engine import Engine
from engine_worker.request import EngineRequest
from engine_worker.sampler import RequestSampler
from ipc.engine_config import EngineConfig
from ipc.messages import SamplingParams
from tests.chat_prompts import QUESTIONS, chat_prompt_ids
from tests.engine_worker.helpers import collect, compute_logits, greedy

pytestmark = pytest.mark.slow
TOKENS = 64
PASSAGE = (
    "The engine owns the model, the paged KV cache, the prefix cache and the scheduler. One "
    "step schedules requests, runs one forward over every scheduled token, samples, applies "
    "stops and sends one message with the new tokens of every request."
)
CODE = "def add(a, b):\n    total = a + b\n    return total\n\nprint(add(2, 3))\n"
QUOTING = [
    f"Repeat this text exactly: {PASSAGE}",
    f"Summarize in one sentence: {PASSAGE}",
    f"Rewrite this code so the function is called plus:\n{CODE}",
    f"Copy this code and add a docstring:\n{CODE}",
    "Repeat after me: the quick brown fox jumps over the lazy dog, the quick brown fox.",
    f"Quote the first sentence of this passage: {PASSAGE}",
    "List the numbers from one to twenty in words, separated by commas.",
    f"Translate to French: {PASSAGE}",
]


def make_engine(model_dir, **knobs) -> Engine:
    knobs = {"dtype": "bfloat16", "adaptive_threads": False, "max_batch_size": 16, **knobs}
    return Engine(EngineConfig(model_path=str(model_dir), kv_cache_tokens=8192, **knobs))


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Bits do not depend on the thread count (docs/determinism.md); one thread keeps these
    runs quick on a machine shared with other work."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def prompts(default_model_dir) -> list[list[int]]:
    return chat_prompt_ids(default_model_dir, QUOTING + QUESTIONS[: 32 - len(QUOTING)])[1]


def verification_logits(engine: Engine, prompt: list[int], run: list[int], decoding: bool):
    """Logits after each token of ``run`` following ``prompt`` (run[0] is the first sampled
    token): decoded one per step, or verified in one step as the last token + drafts. A
    second request prefills a chunk beside it, as a busy step would have."""
    params = SamplingParams(max_tokens=TOKENS, temperature=0.0)

    def request(name: str, ids: list[int]) -> EngineRequest:
        r = EngineRequest(
            name, list(ids), params, RequestSampler(params, engine.device), frozenset(),
            engine.max_model_len, 0.0,
        )  # fmt: skip
        r.block_ids = engine.blocks.allocate(engine.blocks.blocks_for(len(ids) + len(run)))
        return r

    main = request("main", prompt)
    neighbour = request("neighbour", prompt[::-1] * 2)
    compute_logits(engine, [main], [len(prompt)])
    main.num_computed = len(prompt)
    main.token_ids.append(run[0])
    main.num_generated = 1
    rows = []
    if decoding:
        for token in run[1:] + [None]:
            logits, _ = compute_logits(engine, [main, neighbour], [1, 9])
            rows.append(logits[0])
            neighbour.num_computed += 9
            main.num_computed += 1
            if token is not None:
                main.token_ids.append(token)
    else:
        main.draft_ids = run[1:]
        logits, _ = compute_logits(engine, [main, neighbour], [len(run), 9])
        rows = list(logits[: len(run)])
    engine.blocks.release(main.block_ids)
    engine.blocks.release(neighbour.block_ids)
    return torch.stack(rows)


def test_verification_rows_are_the_bits_of_decode_rows(default_model_dir, prompts):
    engine = make_engine(default_model_dir)
    # A long one too: past 512 keys the kernel's last block of key columns must be whole
    # (flash_rows.KEY_BLOCK_COLUMNS), or the decode workspace's headroom showed in the bits.
    long_prompt = (sum(prompts, []) * 2)[:700]
    for prompt in [*prompts[:3], long_prompt]:
        run = prompt[5:10]  # any tokens: the rows must agree whatever they hold
        decoded = verification_logits(engine, prompt, run, decoding=True)
        verified = verification_logits(engine, prompt, run, decoding=False)
        assert torch.equal(decoded, verified)


def test_greedy_output_is_the_same_with_speculation_in_a_mixed_batch(default_model_dir, prompts):
    def tokens(engine: Engine, tag: str, opt_out_every: int = 0) -> list[list[int]]:
        for i, prompt in enumerate(prompts):
            speculative = not opt_out_every or i % opt_out_every != 0
            engine.add(
                f"{tag}{i}", prompt, greedy(TOKENS, ignore_eos=True, speculative=speculative)
            )
        results = collect(engine)
        return [results[f"{tag}{i}"]["tokens"] for i in range(len(prompts))]

    plain = tokens(make_engine(default_model_dir), "plain")
    spec_engine = make_engine(default_model_dir, speculative="ngram", speculative_max_batch=16)
    speculated = tokens(spec_engine, "spec", opt_out_every=2)
    counters = spec_engine.speculation
    assert counters.accepted_tokens > 100  # quoting prompts took many drafts
    assert counters.accepted_tokens < counters.draft_tokens  # and some were rejected
    assert speculated == plain
    assert spec_engine.blocks.num_available == spec_engine.blocks.num_blocks
