"""A long prompt does not stall the others (issue 38): its chunks shrink as the keys they attend
grow (a step's cost budget, in token-keys), and short prompts are admitted past it, while it
still finishes. On the tiny model, through the real engine; no timing is asserted."""

from __future__ import annotations

import numpy as np

from engine_worker.engine import Engine
from engine_worker.prefill_budget import (
    MIN_CHUNK_TOKENS,
    PACE_MIN_KEYS,
    SHORT_PROMPT_SHARE,
    TOKEN_WORK_KEYS,
    StepPace,
    chunk_cost,
    tokens_within_keys,
)
from ipc.codec import unpack_ids
from ipc.engine_config import PREFILL_STEP_TARGET_MS_CPU, PREFILL_TOKEN_KEYS_CPU, EngineConfig
from tests.engine_worker.helpers import collect, greedy

LONG = 1800
TOKENS = 256  # prefill_max_tokens
KEYS = 200_000  # prefill_max_token_keys: a 256-token chunk fits only near the prompt's start


def engine_for(model_dir, **knobs) -> Engine:
    knobs = {
        "prefill_max_tokens": TOKENS,
        "prefill_max_token_keys": KEYS,
        "kv_cache_tokens": 4096,
        "dtype": "bfloat16",
        "weights": "bf16",
        "adaptive_threads": False,
        **knobs,
    }
    return Engine(EngineConfig(model_path=str(model_dir), **knobs))


def prompt(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 40000, size=n).tolist()


def test_tokens_within_keys_is_the_largest_chunk_whose_cost_fits():
    for start in (0, 1, 15, 1000, 7000, 100_000):
        for keys in (0, 1, 1024, 5000, 200_000, 1 << 20, 1 << 40):
            count = tokens_within_keys(start, keys)
            assert count == 0 or chunk_cost(start, count) <= keys
            assert chunk_cost(start, count + 1) > keys


def test_a_long_prompts_chunks_shrink_as_its_offset_grows(tiny_model_dir):
    engine = engine_for(tiny_model_dir)
    assert engine.config.prefill_max_token_keys == KEYS
    engine.add("long", prompt(LONG, 0), greedy(2, ignore_eos=True))
    chunks, offset = [], 0
    while offset < LONG:
        chunks.append(engine.step().stats.prefill_tokens)
        assert chunk_cost(offset, chunks[-1]) <= KEYS  # each step within the cost budget
        offset += chunks[-1]
    assert offset == LONG
    assert chunks == sorted(chunks, reverse=True)  # deeper, smaller
    assert chunks[0] == tokens_within_keys(0, KEYS) < TOKENS and chunks[-1] < chunks[0] / 2
    collect(engine)


def test_a_context_past_the_budget_still_moves_by_a_minimum_chunk(tiny_model_dir):
    engine = engine_for(tiny_model_dir, prefill_max_token_keys=5_000)
    assert tokens_within_keys(0, 5_000) < MIN_CHUNK_TOKENS
    engine.add("long", prompt(100, 1), greedy(1, ignore_eos=True))
    assert engine.step().stats.prefill_tokens == MIN_CHUNK_TOKENS
    assert collect(engine)["long"]["reason"] == "length"


def test_a_short_request_starts_in_the_step_after_it_arrives_during_a_long_prefill(tiny_model_dir):
    """Before the fairness rule it waited, first come first served, behind every chunk of the
    long prompt."""
    engine = engine_for(tiny_model_dir)
    engine.add("long", prompt(LONG, 0), greedy(2, ignore_eos=True))
    engine.step()
    engine.add("short", prompt(32, 2), greedy(3, ignore_eos=True))
    out = engine.step()
    assert "short" in out.request_ids  # its whole prompt computed, its first token sampled
    assert out.stats.prefill_tokens > 32  # and the long prompt went on in the same step
    long = engine.requests["long"]
    assert 0 < long.num_computed < LONG


def test_a_long_prompt_finishes_under_a_stream_of_short_requests(tiny_model_dir):
    """A short request arrives before every step: each starts in the step after it arrives,
    and the long prompt keeps at least the rest of the budget, so its prefill ends. Its tokens
    are those it gets alone, computed in chunks that the short requests made other."""
    long_prompt = prompt(LONG, 0)
    alone = engine_for(tiny_model_dir, prefill_max_tokens=4096, prefill_max_token_keys=1 << 40)
    alone.add("long", long_prompt, greedy(4, ignore_eos=True))
    expected = collect(alone)["long"]["tokens"]

    engine = engine_for(tiny_model_dir)
    engine.add("long", long_prompt, greedy(4, ignore_eos=True))
    share = int(TOKENS * SHORT_PROMPT_SHARE)
    steps, tokens = 0, []
    while "long" in engine.requests:
        engine.add(f"short{steps}", prompt(20 + steps % 40, 100 + steps), greedy(2))
        out = engine.step()
        assert f"short{steps}" in out.request_ids
        tokens += [t for r, t in zip(out.request_ids, out_tokens(out)) if r == "long"]
        steps += 1
        assert steps < 4 * LONG // (TOKENS - share), "the long prompt starves"
    assert tokens == expected
    collect(engine)
    assert engine.blocks.num_available == engine.blocks.num_blocks


def out_tokens(out) -> list[int]:
    return [int(t) for t in unpack_ids(out.token_ids)]


def test_a_prompt_over_the_short_share_waits_its_turn(tiny_model_dir):
    """One token over the share: first come, first served, after the long prompt's chunk."""
    engine = engine_for(tiny_model_dir)
    engine.add("long", prompt(LONG, 0), greedy(1, ignore_eos=True))
    engine.step()
    medium = int(TOKENS * SHORT_PROMPT_SHARE) + 1
    engine.add("medium", prompt(medium, 3), greedy(1, ignore_eos=True))
    out = engine.step()
    assert "medium" not in out.request_ids
    assert engine.requests["medium"].num_computed < medium
    assert out.stats.prefill_tokens > engine.requests["medium"].num_computed


def test_the_step_pace_sizes_steps_to_their_target_from_measured_steps():
    """Steps that cost a fixed 20 ms plus 1 us a token-key, paced to 250 ms: the bound settles
    where a step takes the target, whatever the starting guess; steps without prompt work and
    steps too small to measure leave it alone; it never passes the given bound."""
    fixed_s, per_key_s, target_s = 0.02, 1e-6, 0.25
    pace = StepPace(target_s, keys=4 << 20, most_keys=1 << 40)
    for _ in range(40):
        keys = pace.keys
        pace.observe(keys, prefill_tokens=100, seconds=fixed_s + per_key_s * keys)
    assert abs(fixed_s + per_key_s * pace.keys - target_s) < 0.01
    settled = pace.keys
    pace.observe(settled, prefill_tokens=0, seconds=10.0)  # decode only: not paced
    pace.observe(PACE_MIN_KEYS - 1, prefill_tokens=1, seconds=10.0)  # too small to measure
    assert pace.keys == settled
    bounded = StepPace(target_s, keys=1000, most_keys=50_000)
    bounded.observe(1 << 20, prefill_tokens=100, seconds=0.001)  # a fast machine
    assert bounded.keys == 50_000
    slow = StepPace(target_s, keys=1 << 20, most_keys=1 << 40)
    slow.observe(1 << 20, prefill_tokens=100, seconds=1000.0)  # a stalled one: chunks still move
    assert slow.keys == MIN_CHUNK_TOKENS * TOKEN_WORK_KEYS
    unpaced = StepPace(0.0, keys=KEYS, most_keys=KEYS)
    unpaced.observe(1 << 20, prefill_tokens=100, seconds=10.0)
    assert unpaced.keys == KEYS


def test_a_cpu_engine_paces_its_steps_unless_a_token_key_bound_is_given(tiny_model_dir):
    paced = engine_for(tiny_model_dir, prefill_max_token_keys=0)
    assert paced.config.prefill_step_target_ms == PREFILL_STEP_TARGET_MS_CPU
    paced.add("long", prompt(LONG, 2), greedy(2, ignore_eos=True))
    collect(paced)
    pace = paced.scheduler.pace  # measured (no figure asserted: the machine is shared)
    assert pace.seconds_per_key > 0 and pace.most_keys > PREFILL_TOKEN_KEYS_CPU
    expected = int(PREFILL_STEP_TARGET_MS_CPU / 1e3 / pace.seconds_per_key)
    assert pace.keys == max(MIN_CHUNK_TOKENS * TOKEN_WORK_KEYS, min(expected, pace.most_keys))
    fixed = engine_for(tiny_model_dir)  # a bound given: it is kept, nothing is paced
    assert fixed.config.prefill_step_target_ms == 0 and fixed.scheduler.pace.keys == KEYS
    both = engine_for(tiny_model_dir, prefill_step_target_ms=100)
    assert both.scheduler.pace.most_keys == KEYS


def test_the_short_lane_stays_open_however_small_a_paced_step(tiny_model_dir):
    """A step bounded down to the pace's floor (its fixed costs nearly fill the target) still
    admits a short prompt in the step after it arrives; before, the lane's half of the keys
    could not hold one and short requests waited for the long prompts to end."""
    floor = MIN_CHUNK_TOKENS * TOKEN_WORK_KEYS
    assert chunk_cost(0, 32) > floor * SHORT_PROMPT_SHARE  # the lane's half alone would not do
    # paced, within a bound at the pace's floor: the smallest step a pace ever makes
    engine = engine_for(tiny_model_dir, prefill_max_token_keys=floor, prefill_step_target_ms=250)
    assert engine.scheduler.pace.keys == floor
    engine.add("long", prompt(LONG, 3), greedy(2, ignore_eos=True))
    engine.step()
    engine.add("short", prompt(32, 4), greedy(3, ignore_eos=True))
    out = engine.step()
    assert "short" in out.request_ids  # its whole prompt computed, its first token sampled
    assert 0 < engine.requests["long"].num_computed < LONG  # the long prompt still moves
    assert collect(engine)["long"]["reason"] == "length"


def test_the_pace_sizes_a_step_for_the_threads_it_runs_on():
    """A probe step on one thread (the thread tuner's) is sized for one thread: until measured
    as proportionally slower than the most threads measured, then at its own rate."""
    pace = StepPace(0.25, keys=4 << 20, most_keys=1 << 40)
    pace.threads = 2
    pace.observe(250_000, prefill_tokens=100, seconds=0.25, threads=2)  # 1 us a token-key
    assert pace.keys == 250_000
    pace.threads = 1
    assert pace.keys == 125_000  # not measured: twice as slow
    pace.observe(125_000, prefill_tokens=100, seconds=0.1875, threads=1)  # 1.5 us measured
    assert pace.keys == int(0.25 / 1.5e-6)
    pace.threads = 2
    assert pace.keys == 250_000
    pace.threads = 4  # more threads than measured: not assumed faster
    assert pace.keys == 250_000
