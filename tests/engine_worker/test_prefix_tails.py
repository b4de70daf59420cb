"""Prompt tails from the prefix cache (engine_worker/prefix_tails.py): a prompt the cache holds
whole computes nothing when its tail kept the prompt's end (only its last token when it ends a
whole block), with the logits a cold prefill gives; tails never cross salts, never outlive their
block, and never stand in for prompt logprobs."""

from __future__ import annotations

import numpy as np
import pytest

from engine_worker.block_manager import KVBlockManager
from engine_worker.engine import Engine
from engine_worker.prefix_cache import ROOT_NODE, PrefixCache
from ipc.engine_config import EngineConfig
from ipc.messages import SamplingParams
from tests.engine_worker.helpers import collect, greedy
from tests.engine_worker.test_block_manager import publish_chain

BLOCK = 16


def test_tails_are_read_after_their_step_per_salt_and_die_with_their_block():
    cache = PrefixCache(block_size=4)
    blocks = KVBlockManager(num_blocks=6, block_size=4, prefix_cache=cache)
    ids = [1, 2, 3, 4, 5, 6, 7]
    owned, keys, node = publish_chain(cache, blocks, ids[:4])
    [tail] = blocks.allocate(1)
    cache.register_tail(tail, (5, 6, 7), node, None)
    assert cache.tail_source(ids, keys, node, None) is None  # its step has not run yet
    cache.next_step()
    assert cache.tail_source(ids, keys, node, None) == tail
    assert cache.tail_source(ids[:6] + [9], keys, node, None) is None  # another last token
    assert cache.tail_source(ids[:6], keys, node, None) is None  # only exact tails
    # A whole block left: the cached full block of those tokens, once computed.
    longer = ids + [8]
    second, _, _ = publish_chain(cache, blocks, longer)
    assert cache.tail_source(longer, keys, node, None) is None  # published in this step
    cache.next_step()
    assert cache.tail_source(longer, keys, node, None) == second[1]
    # A tail with no full block before it carries its salt.
    [first] = blocks.allocate(1)
    cache.register_tail(first, (5, 6), ROOT_NODE, "a")
    cache.next_step()
    assert cache.tail_source([5, 6], [], ROOT_NODE, "a") == first
    assert cache.tail_source([5, 6], [], ROOT_NODE, None) is None
    assert cache.tail_source([5, 6], [], ROOT_NODE, "b") is None
    # Released, a tail waits among the evictable blocks; evicted, its entry goes with it.
    blocks.release([*owned, tail, first, *second])
    assert blocks.num_available == 6 and cache.tail_source(ids, keys, node, None) == tail
    taken = blocks.allocate(6)
    assert len(cache.tails) == 0 and len(cache) == 0
    blocks.release(taken)
    assert blocks.num_available == 6 and sum(blocks.ref_counts) == 0


def make_engine(model_dir, **knobs) -> Engine:
    knobs = {"dtype": "bfloat16", "weights": "bf16", "kv_cache_tokens": 1024, **knobs}
    return Engine(EngineConfig(model_path=str(model_dir), adaptive_threads=False, **knobs))


def ask(engine: Engine, prompts: dict[str, list[int]], salt=None, **sampling) -> tuple:
    """Runs ``prompts`` (added together) to the end; -> (results, totals of the step stats)."""
    for name, prompt in prompts.items():
        params = greedy(3, ignore_eos=True, logprobs=5, **sampling)
        engine.add(name, prompt, params, cache_salt=salt)
    totals: dict = {}
    results = collect(engine, totals=totals)
    assert engine.blocks.num_available == engine.blocks.num_blocks  # every block back at idle
    assert sum(engine.blocks.ref_counts) == 0
    return results, totals


def answer(result: dict) -> tuple:
    """Tokens and their top logprobs, bit for bit."""
    return tuple(result["tokens"]), tuple(e.top_logprobs for e in result["logprobs"])


@pytest.fixture(scope="module")
def engine(tiny_model_dir) -> Engine:
    return make_engine(tiny_model_dir)


@pytest.fixture(scope="module")
def prompts() -> dict[str, list[int]]:
    rng = np.random.default_rng(7)
    # A tail after full blocks, a whole block after full blocks, a tail alone, 3 whole blocks.
    return {f"p{n}": rng.integers(3, 40000, size=n).tolist() for n in (37, 32, 9, 48)}


def computed_rows(prompt: list[int]) -> int:
    """What a fully cached prompt computes: nothing after a tail (its end is kept), its last
    token when it ends a whole block (a full block keeps no end)."""
    return 0 if len(prompt) % BLOCK else 1


def test_a_cached_prompt_computes_nothing_or_its_last_token_with_cold_logits(engine, prompts):
    cold, _ = ask(engine, prompts, salt="s")
    for name, prompt in prompts.items():
        warm, totals = ask(engine, {name: prompt}, salt="s")
        assert answer(warm[name]) == answer(cold[name])
        rows = computed_rows(prompt)
        assert totals["prefill_tokens"] == rows
        assert totals["cached_tokens"] == warm[name]["start"].cached_tokens == len(prompt) - rows
    # Another salt shares nothing, not even a tail; prompt logprobs take no shortcut.
    other, totals = ask(engine, prompts, salt="t")
    assert totals["prefill_tokens"] == sum(map(len, prompts.values()))
    assert [answer(r) for r in other.values()] == [answer(r) for r in cold.values()]
    name, prompt = "p37", prompts["p37"]
    scored, totals = ask(engine, {name: prompt}, salt="s", prompt_logprobs=1)
    assert totals["prefill_tokens"] == len(prompt) and totals["cached_tokens"] == 0
    assert sum(len(c.logprobs) for c in scored[name]["prompt_logprobs"]) == 4 * (len(prompt) - 1)
    assert answer(scored[name]) == answer(cold[name])


def test_same_prompt_twice_in_one_step_computes_its_tail_twice(engine):
    prompt = np.random.default_rng(8).integers(3, 40000, size=45).tolist()
    results, totals = ask(engine, {"a": prompt, "b": prompt})
    # b shares a's two full blocks in the step that computes them, not a's tail (not computed
    # before the step): 45 + 13 rows.
    assert totals["cached_tokens"] == 32 and totals["prefill_tokens"] == 45 + 13
    assert answer(results["a"]) == answer(results["b"])
    again, totals = ask(engine, {"c": prompt})
    assert totals["prefill_tokens"] == 0 and answer(again["c"]) == answer(results["a"])


def test_a_tail_never_outlives_its_block_nor_an_aborted_prefill(tiny_model_dir):
    """A pool of 6 blocks, prompts in chunks of 16: a prompt's tail block is taken by another
    prompt while its full blocks stay cached, and the prompt asked again computes its tail,
    with cold logits; a prefill aborted after its first chunk leaves no tail; chunked prefill
    registers the tail at the prompt's end."""
    engine = make_engine(tiny_model_dir, kv_cache_tokens=6 * BLOCK, prefill_chunk_tokens=16)
    assert engine.blocks.num_blocks == 6
    rng = np.random.default_rng(9)
    prompt = rng.integers(3, 40000, size=40).tolist()
    cold, _ = ask(engine, {"cold": prompt})
    assert len(engine.prefix_cache.tails) == 1
    # 50 + 3 tokens: the 3 free blocks, then the least recently released one, the tail's.
    ask(engine, {"filler": rng.integers(3, 40000, size=50).tolist()})
    again, totals = ask(engine, {"again": prompt})
    assert totals["cached_tokens"] == 32 and totals["prefill_tokens"] == 8
    assert answer(again["again"]) == answer(cold["cold"])

    fresh = rng.integers(3, 40000, size=40).tolist()
    engine.add("aborted", fresh, greedy(4))
    engine.step()  # its first chunk of 16
    engine.abort("aborted")
    collect(engine)
    done, totals = ask(engine, {"done": fresh})
    assert totals["prefill_tokens"] == 40 - 16  # its first block was cached, no tail
    hit, totals = ask(engine, {"hit": fresh})
    assert totals["prefill_tokens"] == 0 and answer(hit["hit"]) == answer(done["done"])


def test_preempted_requests_and_seeded_sampling_keep_their_tokens(tiny_model_dir):
    """A pool too small for all requests at once: preemptions, recomputes and tail hits beside
    each other give every request the tokens it gets alone on a cold engine."""
    rng = np.random.default_rng(10)
    prompts = {f"q{i}": rng.integers(3, 40000, size=int(n)).tolist() for i, n in enumerate(
        rng.integers(18, 40, size=4))}  # fmt: skip
    sampling = {"temperature": 0.8, "seed": 3, "max_tokens": 12}
    engine = make_engine(tiny_model_dir, enable_prefix_cache=False)
    alone = {}
    for name, prompt in prompts.items():
        engine.add(name, prompt, SamplingParams(**sampling))
        alone[name] = collect(engine)[name]["tokens"]
    engine = make_engine(tiny_model_dir, kv_cache_tokens=6 * BLOCK)
    for repeat in range(2):
        for name, prompt in prompts.items():
            engine.add(f"{name}-{repeat}", prompt, SamplingParams(**sampling))
    totals: dict = {}
    results = collect(engine, totals=totals)
    assert totals["preempted"] > 0
    for name in prompts:
        assert results[f"{name}-0"]["tokens"] == results[f"{name}-1"]["tokens"] == alone[name]
    assert engine.blocks.num_available == engine.blocks.num_blocks


def test_kept_prompt_ends_sample_beside_computed_rows(engine, prompts):
    """Fully cached prompts admitted in one step with a fresh prompt, while another request
    decodes: each samples from its kept end in that step, with cold logits, and so do the
    others."""
    cold, _ = ask(engine, prompts, salt="k")
    rng = np.random.default_rng(11)
    fresh, long = (rng.integers(3, 40000, size=n).tolist() for n in (21, 26))
    alone, _ = ask(engine, {"fresh": fresh, "long": long}, salt="alone")
    engine.add("long", long, greedy(3, ignore_eos=True, logprobs=5), cache_salt="z")
    engine.step()  # its prefill and first token: it decodes from the next step on
    for name in ("p37", "p9"):
        engine.add(name, prompts[name], greedy(3, ignore_eos=True, logprobs=5), cache_salt="k")
    engine.add("fresh", fresh, greedy(3, ignore_eos=True, logprobs=5), cache_salt="k")
    totals: dict = {}
    results = collect(engine, totals=totals)
    assert totals["cached_tokens"] == 37 + 9 and totals["prefill_tokens"] == len(fresh)
    assert answer(results["p37"]) == answer(cold["p37"])
    assert answer(results["p9"]) == answer(cold["p9"])
    assert answer(results["fresh"]) == answer(alone["fresh"])
    assert results["long"]["tokens"] == alone["long"]["tokens"][1:]


def test_a_whole_block_prompt_never_takes_a_shorter_prompts_end(tiny_model_dir):
    """A prompt's tail block, once its request's generated tokens fill it, is a cached full
    block too: a longer prompt that ends there computes its own last token, not the end kept
    for the shorter prompt's position."""
    engine = make_engine(tiny_model_dir)
    prompt = np.random.default_rng(5).integers(3, 40000, size=37).tolist()  # 2 blocks + 5
    engine.add("short", prompt, greedy(20, ignore_eos=True))
    generated = collect(engine)["short"]["tokens"]
    longer = prompt + generated[:11]  # 48: its third block is the short prompt's tail block
    reference, _ = ask(engine, {"ref": longer}, salt="other")
    again, totals = ask(engine, {"again": longer})
    assert totals["prefill_tokens"] == 1 and answer(again["again"]) == answer(reference["ref"])


def test_a_tail_whose_block_is_handed_back_to_its_next_prompt_lives_on(tiny_model_dir):
    """The one free block an admission takes can be the evicted tail's own (its slots are then
    already in place): the tail and its kept end are registered again on it, so the prompt asked
    a third time still computes nothing."""
    engine = make_engine(tiny_model_dir, kv_cache_tokens=6 * BLOCK)
    rng = np.random.default_rng(9)
    prompt = rng.integers(3, 40000, size=40).tolist()
    cold, _ = ask(engine, {"cold": prompt})
    engine.add("filler", rng.integers(3, 40000, size=33).tolist(), greedy(3))
    engine.step()  # 3 blocks: none is free but the cached ones, the tail's released last
    second, totals = ask(engine, {"second": prompt})  # its one fresh block: the tail's
    assert totals["prefill_tokens"] == 0 and answer(second["second"]) == answer(cold["cold"])
    third, totals = ask(engine, {"third": prompt})
    assert totals["prefill_tokens"] == 0 and answer(third["third"]) == answer(cold["cold"])
