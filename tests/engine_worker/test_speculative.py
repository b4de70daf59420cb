"""Speculative decoding (engine_worker/speculative.py) on the tiny model: the proposer's lookup,
the acceptance rule, seeded sampling that draws the same tokens with and without drafts, the
first tokens' distribution at temperature 1 (a chi-square bound), stops inside an accepted run,
and the KV cache after rejected drafts."""

from __future__ import annotations

import numpy as np
import pytest

from engine_worker.engine import Engine
from engine_worker.speculative import NgramProposer, accepted_tokens
from ipc.engine_config import EngineConfig
from ipc.messages import SamplingParams
from tests.engine_worker.helpers import collect, greedy

# A 3-token alphabet at temperature 1: logit_bias lifts these far above the rest of the tiny
# model's vocabulary, so the context repeats n-grams, drafts are found, and each is accepted
# about a third of the time.
ALPHABET = (100, 200, 300)
# 17 tokens: every request but the first takes its first block from the prefix cache and
# computes one prompt token (a decode-sized row, cheap in a large batch).
BIASED_PROMPT = [5, 7, 9, 11, 13, 15, 17, 19, 100, 200, 300, 200, 100, 300, 100, 300, 200]


def lookup(tokens: list[int], k: int = 3, min_n: int = 1, max_n: int = 3, limit: int = 99):
    return NgramProposer(k, min_n, max_n).propose(np.asarray(tokens, dtype=np.int32), limit)


def test_proposer_takes_the_longest_then_most_recent_match():
    # "1 2 3" ends the context; it occurred at 0 (then 7 8 9) and "2 3" at 5 (then 4 4).
    assert lookup([1, 2, 3, 7, 8, 9, 2, 3, 4, 4, 1, 2, 3]) == [7, 8, 9]
    # Only "3" matches: the most recent place followed by k tokens.
    assert lookup([3, 5, 6, 7, 3, 8, 9, 1, 2, 3]) == [8, 9, 1]
    assert lookup([3, 5, 6, 7, 3, 8, 9, 1, 2, 3], min_n=2) == []
    assert lookup([1, 2, 3, 4], min_n=1) == []  # nothing repeats
    assert lookup([1, 2, 3, 4, 5, 1, 2], limit=2) == [3, 4]  # never past the limit
    assert lookup([1, 2, 3, 4, 5, 1, 2], limit=0) == []
    # A run of one token: the most recent match is followed by one token, an earlier by k.
    assert lookup([7, 7, 7, 7, 7, 7]) == [7, 7, 7]


def test_acceptance_takes_drafts_while_they_match_then_the_models_token():
    assert accepted_tokens([5, 6, 7, 8], [5, 6, 7]) == [5, 6, 7, 8]  # all + bonus
    assert accepted_tokens([5, 6, 9, 8], [5, 6, 7]) == [5, 6, 9]  # correction at the third
    assert accepted_tokens([4, 6, 7, 8], [5, 6, 7]) == [4]


def make(tiny_model_dir, **knobs) -> Engine:
    config = {
        "dtype": "bfloat16",
        "adaptive_threads": False,
        "kv_cache_tokens": 8192,
        "max_batch_size": 64,
        "prompt_lookup_min": 1,
        "speculative_max_batch": 64,
        **knobs,
    }
    return Engine(EngineConfig(model_path=str(tiny_model_dir), **config))


@pytest.fixture(scope="module")
def engines(tiny_model_dir) -> dict[str, Engine]:
    return {"off": make(tiny_model_dir), "ngram": make(tiny_model_dir, speculative="ngram")}


def biased(seed: int, tokens: int = 4, **kwargs) -> SamplingParams:
    bias = {t: 30.0 for t in ALPHABET}
    return SamplingParams(max_tokens=tokens, temperature=1.0, seed=seed, logit_bias=bias, **kwargs)


def run(engine: Engine, params: list[SamplingParams], prompt=BIASED_PROMPT, tag="r") -> list:
    for i, p in enumerate(params):
        engine.add(f"{tag}{i}", prompt, p)
    results = collect(engine)
    return [results[f"{tag}{i}"]["tokens"] for i in range(len(params))]


def test_a_seeded_request_draws_the_same_tokens_with_and_without_drafts(engines):
    before = engines["ngram"].speculation.accepted_tokens
    params = [biased(seed, tokens=12) for seed in range(24)]
    plain = run(engines["off"], params)
    assert run(engines["ngram"], params) == plain
    assert engines["ngram"].speculation.accepted_tokens - before > 20
    # Alone, or beside requests that do not speculate: the same tokens again.
    assert run(engines["ngram"], params[:1]) == plain[:1]
    mixed = [biased(s, tokens=12, speculative=s % 2 == 0) for s in range(24)]
    assert run(engines["ngram"], mixed) == plain


def test_first_tokens_follow_the_same_distribution_at_temperature_1(engines):
    """Chi-square homogeneity of the first 3 tokens (27 outcomes) over disjoint seeds, 600 runs
    each (the second and third tokens are drawn by verification rows where a draft was found);
    the bound is the 0.999 quantile with 26 degrees of freedom."""
    runs = 600
    counts = {}
    for mode, first_seed in (("off", 0), ("ngram", 10**6)):
        params = [biased(first_seed + i, tokens=3) for i in range(runs)]
        outcomes = run(engines[mode], params, tag=mode)
        counts[mode] = np.bincount(
            [sum(ALPHABET.index(t) * 3 ** (2 - j) for j, t in enumerate(o)) for o in outcomes],
            minlength=27,
        )
    table = np.stack([counts["off"], counts["ngram"]]).astype(float)
    table = table[:, table.sum(0) > 0]
    expected = table.sum(1, keepdims=True) * table.sum(0, keepdims=True) / table.sum()
    chi2 = float(((table - expected) ** 2 / expected).sum())
    assert chi2 < 54.05, (chi2, counts)


def test_a_stop_inside_an_accepted_run_ends_the_request_there(engines):
    """Seeded runs over the alphabet, cut at the first 300 or at max_tokens: the tokens of the
    run without a stop, up to there, whatever the step that drew them verified."""
    seeds = range(16)
    plain = run(engines["off"], [biased(s, tokens=16) for s in seeds])
    engine = engines["ngram"]
    before = engine.speculation.accepted_tokens
    for i, seed in enumerate(seeds):
        engine.add(f"stop{i}", BIASED_PROMPT, biased(seed, tokens=16, stop_token_ids=[300]))
        engine.add(f"short{i}", BIASED_PROMPT, biased(seed, tokens=5 + i % 3))
    results = collect(engine)
    assert engine.speculation.accepted_tokens > before
    for i, tokens in enumerate(plain):
        end = tokens.index(300) + 1 if 300 in tokens else len(tokens)
        stopped = results[f"stop{i}"]
        assert stopped["tokens"] == tokens[:end]
        assert stopped["reason"] == ("stop" if 300 in tokens else "length")
        assert results[f"short{i}"]["tokens"] == tokens[: 5 + i % 3]


def collect_one(engine: Engine, prompt: list[int], params: SamplingParams) -> dict:
    engine.add("one", prompt, params)
    return collect(engine)["one"]


def test_the_cache_after_rejected_drafts_holds_exactly_the_accepted_tokens(engines):
    """A request whose drafts were partly rejected publishes its blocks; a request on its whole
    text then hits them, and gets the bits of a cold request (salted: no cache shared)."""
    engine = engines["ngram"]
    before = (engine.speculation.draft_tokens, engine.speculation.accepted_tokens)
    first = collect_one(engine, BIASED_PROMPT, biased(7, tokens=60))
    drafted = engine.speculation.draft_tokens - before[0]
    assert 0 < engine.speculation.accepted_tokens - before[1] < drafted
    text = BIASED_PROMPT + first["tokens"]
    asked = greedy(8, ignore_eos=True, logprobs=3)
    engine.add("cached", text, asked)
    engine.add("cold", text, asked, cache_salt="no-sharing")
    results = collect(engine)
    assert results["cached"]["start"].cached_tokens >= 48
    assert results["cold"]["start"].cached_tokens == 0
    assert results["cached"]["tokens"] == results["cold"]["tokens"]
    assert [e.top_logprobs for e in results["cached"]["logprobs"]] == [
        e.top_logprobs for e in results["cold"]["logprobs"]
    ]
    assert engine.blocks.num_available == engine.blocks.num_blocks


def test_logprobs_of_accepted_tokens_are_those_without_speculation(engines):
    prompt = [5, 17, 29, 41, 5, 17]
    params = [greedy(24, ignore_eos=True, logprobs=2), biased(3, tokens=24, logprobs=2)]
    got = {}
    for mode in ("off", "ngram"):
        got[mode] = []
        for i, p in enumerate(params):
            result = collect_one(engines[mode], prompt if i == 0 else BIASED_PROMPT, p)
            got[mode].append(
                (result["tokens"], [(e.logprob, e.top_ids) for e in result["logprobs"]])
            )
    assert got["ngram"] == got["off"]


def test_preemption_and_aborts_while_speculating_keep_outputs_and_blocks(tiny_model_dir, engines):
    """A KV cache too small for the batch preempts requests that hold drafts' blocks; an abort
    lands mid-run. Outputs are those of a roomy engine without speculation."""
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 40000, size=40).tolist() for _ in range(4)]
    params = [biased(s, tokens=60) for s in range(4)]
    plain = [
        run(engines["off"], [p], prompt, tag=f"roomy{i}")[0]
        for i, (p, prompt) in enumerate(zip(params, prompts))
    ]
    small = make(tiny_model_dir, speculative="ngram", kv_cache_tokens=192)
    for i, (p, prompt) in enumerate(zip(params, prompts)):
        small.add(f"p{i}", prompt, p)
    small.add("gone", prompts[0], biased(9, tokens=60))
    totals: dict = {}
    results = collect(
        small, totals=totals, on_step=lambda step, e: e.abort("gone") if step == 6 else None
    )
    assert totals["preempted"] > 0 and small.speculation.accepted_tokens > 0
    assert [results[f"p{i}"]["tokens"] for i in range(4)] == plain
    assert results["gone"]["reason"] == "abort"
    assert small.blocks.num_available == small.blocks.num_blocks
