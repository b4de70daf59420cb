"""A token's logits do not depend on the path that computed it (DESIGN property 9), on the tiny
model in bf16: a cold prefill, after cached blocks (a prefix-cache hit), in chunks of 7, as a
decode row alone or in a batch, 8 prompts in one step; the same with a sliding window of 16
(tiny Mistral: every layer windowed, prompts longer than it). Bitwise, no tolerance: every path
attends with one arithmetic (engine_worker/attention/flash_rows.py) and runs its linear layers
on a kernel whose row results do not depend on the other rows. An attention path that rounds
otherwise (the bf16 scores continuations and decode rows had) moves these logits by ~1e-2."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine_worker.engine import Engine
from engine_worker.request import EngineRequest
from engine_worker.sampler import RequestSampler
from ipc.engine_config import EngineConfig
from ipc.messages import SamplingParams
from tests.engine_worker.helpers import compute_logits
from tests.tiny_model import make_tiny_model

Plan = list[tuple[list[int], list[int], int]]  # per request: tokens, chunk sizes, prompt length


def run_plan(engine: Engine, plan: Plan) -> list[torch.Tensor]:
    """Step s computes chunk s of every request that has one; per request, the logits after
    each of its chunks [chunks, vocab] (float32). Tokens past the prompt length are decoded
    tokens to the engine (what it would have sampled, forced)."""
    requests = []
    for i, (ids, _, prompt_len) in enumerate(plan):
        params = SamplingParams(max_tokens=len(ids), temperature=0.0)
        r = EngineRequest(
            f"r{i}", list(ids[:prompt_len]), params, RequestSampler(params, engine.device),
            frozenset(), engine.max_model_len, 0.0,
        )  # fmt: skip
        r.block_ids = engine.blocks.allocate(engine.blocks.blocks_for(len(ids)))
        requests.append(r)
    out: list[list[torch.Tensor]] = [[] for _ in plan]
    for s in range(max(len(chunks) for _, chunks, _ in plan)):
        batch = [(i, chunks[s]) for i, (_, chunks, _) in enumerate(plan) if s < len(chunks)]
        stepping = [requests[i] for i, _ in batch]
        for (i, count), r in zip(batch, stepping):
            r.token_ids = plan[i][0][: r.num_computed + count]  # the step emits at its end
            r.num_generated = max(0, len(r.token_ids) - r.prompt_len)
        logits, emitting = compute_logits(engine, stepping, [n for _, n in batch])
        for row, index in zip(logits, emitting):
            out[batch[index][0]].append(row.float().clone())
        for (_, count), r in zip(batch, stepping):
            r.num_computed += count
    for r in requests:
        engine.blocks.release(r.block_ids)
    return [torch.stack(o) for o in out]


def first_token_paths(engine: Engine, prompts: list[list[int]]) -> dict[str, torch.Tensor]:
    """[prompts, vocab] logits after each whole prompt, per path."""

    def one_by_one(chunks_of) -> torch.Tensor:
        return torch.cat([run_plan(engine, [(p, chunks_of(p), len(p))])[0][-1:] for p in prompts])

    def cached(p: list[int]) -> list[int]:
        whole = (len(p) - 1) // 16 * 16  # the full blocks a prefix-cache hit leaves computed
        return [whole, len(p) - whole]

    def sevens(p: list[int]) -> list[int]:
        return [7] * ((len(p) - 1) // 7) + [len(p) - (len(p) - 1) // 7 * 7]

    together = run_plan(engine, [(p, [len(p)], len(p)) for p in prompts])
    decoded = run_plan(engine, [(p, [len(p) - 1, 1], len(p) - 1) for p in prompts])
    return {
        "cold prefill": one_by_one(lambda p: [len(p)]),
        "cold, all in one step": torch.stack([o[-1] for o in together]),
        "after cached blocks": one_by_one(cached),
        "after a cached tail": one_by_one(lambda p: [len(p) - 1, 1]),
        "in chunks of 7": one_by_one(sevens),
        "decode row alone": torch.cat(
            [run_plan(engine, [(p, [len(p) - 1, 1], len(p) - 1)])[0][-1:] for p in prompts]
        ),
        "decode row, all in one step": torch.stack([o[-1] for o in decoded]),
    }


@pytest.fixture(scope="module", params=["full", "window"])
def model_dir(request, tiny_model_dir, tmp_path_factory):
    if request.param == "full":
        return tiny_model_dir
    root = tmp_path_factory.mktemp("window")
    return make_tiny_model(root / "mistral", architecture="mistral", sliding_window=16)


def bf16_engine(model_dir) -> Engine:
    return Engine(
        EngineConfig(
            model_path=str(model_dir),
            dtype="bfloat16",
            weights="bf16",
            kv_cache_tokens=4096,
            max_batch_size=64,
            adaptive_threads=False,
        )
    )


def test_every_path_gives_a_prompts_next_token_the_same_logits(model_dir):
    engine = bf16_engine(model_dir)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 40000, size=n).tolist() for n in rng.integers(20, 50, size=8)]
    paths = first_token_paths(engine, prompts)
    cold = paths.pop("cold prefill")
    for path, logits in paths.items():
        assert torch.equal(logits, cold), path


def test_decode_steps_on_a_kept_workspace_leave_their_keys_in_the_paged_cache(model_dir):
    """Decode steps on a kept workspace write every layer's keys and values into the paged
    cache after the forward (one copy per tensor, attention.backend.finish); a chunk that
    continues those sequences reads them back from the cache: its logits are a cold prefill's."""
    engine = bf16_engine(model_dir)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 40000, size=n).tolist() for n in (30, 41)]
    # A prefill, a decode step that builds the workspace, three that keep it, then a chunk.
    decoded = run_plan(engine, [(p, [len(p) - 8, 1, 1, 1, 1, 4], len(p) - 8) for p in prompts])
    for prompt, rows in zip(prompts, decoded):
        cold = run_plan(engine, [(prompt, [len(prompt)], len(prompt))])[0]
        assert torch.equal(rows[-1], cold[-1])
