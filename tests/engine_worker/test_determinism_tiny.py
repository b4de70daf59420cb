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
from ipc.engine_config import EngineConfig
from scripts.bench.engine_determinism import first_token_paths, run_plan
from scripts.bench.tiny_model import make_tiny_model


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
