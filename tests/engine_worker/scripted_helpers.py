"""Helpers for the scripted decode step's tests: an engine to compare on, a count of the steps
the compiled layers ran, and the comparison itself (the same requests with the compiled layers
switched off and on: the same tokens, and bit-equal logits at every decode-only step)."""

from __future__ import annotations

import torch

from engine_worker.engine import Engine
from engine_worker.scripted_decode import ScriptedDecode
from ipc.engine_config import PREFILL_TOKEN_KEYS_CPU, EngineConfig
from tests.engine_worker.helpers import collect


def make_engine(model_dir, **knobs) -> Engine:
    # A fixed token-key bound: steps paced by their measured time would batch each run anew
    knobs = {
        "dtype": "bfloat16",
        "weights": "auto",
        "adaptive_threads": False,
        "prefill_max_token_keys": PREFILL_TOKEN_KEYS_CPU,
        **knobs,
    }
    return Engine(EngineConfig(model_path=str(model_dir), kv_cache_tokens=8192, **knobs))


class CountedScriptedDecode:
    """A model's ``ScriptedDecode`` with a count of the steps it ran (``steps``): what the
    forward calls of it, passed through."""

    def __init__(self, scripted: ScriptedDecode) -> None:
        self.scripted, self.steps = scripted, 0

    def applies(self, *args) -> bool:
        return self.scripted.applies(*args)

    def run(self, *args) -> torch.Tensor:
        self.steps += 1
        return self.scripted.run(*args)


def counted(engine: Engine) -> CountedScriptedDecode:
    """The engine's model's scripted decode, counted from here on (wrapped in place, once)."""
    model = engine.runner.model
    scripted = model.scripted_decode
    assert scripted is not None
    if not isinstance(scripted, CountedScriptedDecode):
        scripted = model.scripted_decode = CountedScriptedDecode(scripted)
    return scripted


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
    scripted = counted(engine)
    steps = scripted.steps
    tokens_eager, logits_eager = run(engine, False, prompts, params, tag)
    tokens_scripted, logits_scripted = run(engine, True, prompts, params, tag)
    assert scripted.steps - steps == len(logits_scripted) > 0  # the scripted path did run
    assert tokens_scripted == tokens_eager
    assert len(logits_scripted) == len(logits_eager)
    for eager, ours in zip(logits_eager, logits_scripted):
        assert torch.equal(eager, ours)
