"""The Engine API: continuous batching against transformers' greedy choices, stops, aborts,
validation, back-pressure and seeded sampling."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from engine_worker.engine import Engine, EngineOverloaded
from ipc.engine_config import EngineConfig
from ipc.messages import FINISH_ABORT, FINISH_LENGTH, FINISH_STOP, SamplingParams
from tests.engine_worker.helpers import collect, greedy
from tests.reference_model import load_reference_model

PROMPT = [1, 504, 3458, 282, 4649, 314, 253, 1467, 30]


@pytest.fixture(scope="module")
def tiny_engine(tiny_model_dir):
    return Engine(
        EngineConfig(model_path=str(tiny_model_dir), kv_cache_tokens=1024, max_waiting_requests=8)
    )


def assert_idle_and_leak_free(engine: Engine) -> None:
    assert not engine.has_work() and engine.num_running == 0 and engine.num_waiting == 0
    assert engine.blocks.num_available == engine.blocks.num_blocks
    assert all(count == 0 for count in engine.blocks.ref_counts)


@pytest.mark.slow
def test_continuous_batching_matches_transformers_greedy_choices(default_model_dir):
    prompts = [
        "The capital of France is",
        "def fibonacci(n):",
        "Once upon a time, in a small village,",
        "The three primary colors are",
        "Water boils at",
        "import numpy as np\n",
        "My favourite book is",
        "The quick brown fox jumps over",
    ]
    from tokenizers import Tokenizer  # the test may tokenize; the engine never does

    tokenizer = Tokenizer.from_file(str(default_model_dir / "tokenizer.json"))
    ids = [tokenizer.encode(p).ids for p in prompts]
    engine = Engine(
        EngineConfig(
            model_path=str(default_model_dir), dtype="float32", weights="fp32", kv_cache_tokens=2048
        )
    )
    arrivals = {0: [0, 1, 2], 2: [3], 3: [4, 5], 7: [6], 12: [7]}  # step -> prompts arriving

    def arrive(step, eng):
        for i in arrivals.get(step, []):
            eng.add(f"p{i}", ids[i], greedy(32))

    results = collect(engine, on_step=arrive)
    hf = load_reference_model(default_model_dir)
    for i, prompt_ids in enumerate(ids):
        tokens = results[f"p{i}"]["tokens"]
        # transformers' greedy choice after the prompt and each prefix of our output, from one
        # forward over the whole sequence (generate() would take 32 steps of ~0.2 s each here):
        # our tokens are its greedy continuation exactly when each one is its argmax.
        with torch.no_grad():
            logits = hf(torch.tensor([prompt_ids + tokens])).logits[0, len(prompt_ids) - 1 :]
        expected = logits.argmax(-1).tolist()[: len(tokens)]
        assert tokens == expected, f"prompt {i} differs"
        ended = FINISH_STOP if tokens[-1] == 2 else FINISH_LENGTH
        assert 2 not in tokens[:-1] and (len(tokens) == 32 or tokens[-1] == 2)  # EOS ends it
        assert results[f"p{i}"]["reason"] == ended
    assert_idle_and_leak_free(engine)


def test_engine_imports_no_tokenizer_code(tiny_model_dir):
    import subprocess

    code = (
        "import sys; from engine_worker.engine import Engine; "
        "from ipc.engine_config import EngineConfig; "
        f"Engine(EngineConfig(model_path={str(tiny_model_dir)!r}, kv_cache_tokens=256)); "
        "bad = [m for m in sys.modules if m.startswith(('tokenizers', 'transformers'))]; "
        "print('LOADED', bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "LOADED []" in out.stdout, out.stdout + out.stderr


def test_stops_max_tokens_eos_and_context_limit(tiny_model_dir):
    engine = Engine(
        EngineConfig(
            model_path=str(tiny_model_dir), kv_cache_tokens=512, max_model_len=len(PROMPT) + 5
        )
    )
    engine.add("len", PROMPT, greedy(3))
    engine.add("ctx", PROMPT, greedy(100))
    results = collect(engine)
    assert len(results["len"]["tokens"]) == 3 and results["len"]["reason"] == FINISH_LENGTH
    assert len(results["ctx"]["tokens"]) == 5 and results["ctx"]["reason"] == FINISH_LENGTH
    # Greedy output is deterministic: its second token as a stop id ends the request there.
    stop_token = results["len"]["tokens"][1]
    engine.add("stop", PROMPT, greedy(3, stop_token_ids=[stop_token]))
    engine.eos_token_ids.clear()
    results = collect(engine)
    assert results["stop"]["tokens"] == results_prefix(stop_token, results["stop"]["tokens"])
    assert results["stop"]["reason"] == FINISH_STOP
    assert_idle_and_leak_free(engine)


def results_prefix(stop_token: int, tokens: list[int]) -> list[int]:
    return tokens[: tokens.index(stop_token) + 1]


def test_eos_stops_unless_ignore_eos(tiny_model_dir):
    engine = Engine(EngineConfig(model_path=str(tiny_model_dir), kv_cache_tokens=512))
    engine.add("probe", PROMPT, greedy(4))
    first = collect(engine)["probe"]["tokens"][0]
    engine.eos_token_ids.add(first)  # make the model's first greedy token an eos id
    engine.add("eos", PROMPT, greedy(4))
    engine.add("ignore", PROMPT, greedy(4, ignore_eos=True))
    results = collect(engine)
    assert results["eos"]["tokens"] == [first] and results["eos"]["reason"] == FINISH_STOP
    assert len(results["ignore"]["tokens"]) == 4 and results["ignore"]["reason"] == FINISH_LENGTH


def test_abort_running_waiting_and_not_yet_arrived(tiny_engine):
    engine = tiny_engine
    engine.add("running", PROMPT, greedy(50))
    engine.step()
    engine.abort("early")  # not seen yet: remembered
    engine.abort("running")
    engine.add("waiting", PROMPT, greedy(50))
    engine.abort("waiting")
    engine.add("early", PROMPT, greedy(50))
    out = engine.step()
    assert sorted(r.request_id for r in out.finished) == ["early", "running", "waiting"]
    assert {r.reason for r in out.finished} == {FINISH_ABORT}
    assert not out.request_ids
    assert_idle_and_leak_free(engine)
    assert engine.step().finished == []  # an idle step returns at once, empty


def test_invalid_requests_raise_clear_errors(tiny_engine):
    engine = tiny_engine
    with pytest.raises(ValueError, match="non-empty"):
        engine.add("empty", [], greedy(1))
    with pytest.raises(ValueError, match="token ids must be in"):
        engine.add("vocab", [1, engine.vocab_size], greedy(1))
    with pytest.raises(ValueError, match="token ids must be in"):
        engine.add("negative", np.array([1, -3]), greedy(1))
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add("long", [1] * engine.max_model_len, greedy(1))
    # The context is capped to what the 1024-token KV pool holds, so a prompt the pool cannot
    # hold is refused up front as too long for the context.
    assert engine.max_model_len == 1024
    with pytest.raises(ValueError, match="max_model_len is 1024"):
        engine.add("pool", [1] * 1500, greedy(1))
    engine.add("dup", PROMPT, greedy(1))
    with pytest.raises(ValueError, match="already"):
        engine.add("dup", PROMPT, greedy(1))
    collect(engine)
    assert_idle_and_leak_free(engine)


def test_overload_raises_engine_overloaded(tiny_engine):
    engine = tiny_engine
    for i in range(engine.config.max_waiting_requests):
        engine.add(f"q{i}", PROMPT, greedy(1))
    with pytest.raises(EngineOverloaded):
        engine.add("one-too-many", PROMPT, greedy(1))
    results = collect(engine)
    assert len(results) == engine.config.max_waiting_requests
    assert_idle_and_leak_free(engine)


def test_seeded_sampling_is_independent_of_the_batch(tiny_engine):
    engine = tiny_engine
    params = SamplingParams(max_tokens=8, temperature=1.0, top_p=0.9, top_k=50, seed=1234)
    engine.add("alone", PROMPT, params)
    alone = collect(engine)["alone"]["tokens"]
    engine.add("noise1", PROMPT[:4], SamplingParams(max_tokens=8, temperature=1.5))
    engine.add("seeded", PROMPT, params)
    engine.add("noise2", PROMPT[::-1], SamplingParams(max_tokens=8, temperature=0.7, top_p=0.5))
    engine.add(
        "other-seed",
        PROMPT,
        SamplingParams(max_tokens=8, temperature=1.0, top_p=0.9, top_k=50, seed=99),
    )
    results = collect(engine)
    assert results["seeded"]["tokens"] == alone
    assert results["other-seed"]["tokens"] != alone  # 8 sampled tokens: a clash is negligible


def test_top_k_one_and_tiny_top_p_are_greedy(tiny_engine):
    engine = tiny_engine
    engine.add("greedy", PROMPT, greedy(6))
    engine.add("top_k1", PROMPT, SamplingParams(max_tokens=6, temperature=1.0, top_k=1))
    engine.add("top_p", PROMPT, SamplingParams(max_tokens=6, temperature=0.8, top_p=1e-6, seed=3))
    results = collect(engine)
    assert results["top_k1"]["tokens"] == results["greedy"]["tokens"]
    assert results["top_p"]["tokens"] == results["greedy"]["tokens"]


def test_request_start_reported_once_with_queue_times(tiny_engine):
    engine = tiny_engine
    engine.add("a", PROMPT, greedy(3), arrival_time=1.0)
    results = collect(engine)
    start = results["a"]["start"]
    assert start.t_arrived == 1.0 and start.t_scheduled > 1.0


def test_decode_workspace_matches_the_gather_path(tiny_model_dir):
    """The persistent decode workspace (reused while the decode set is unchanged, rebuilt when
    requests join, leave or outgrow it) gives the same logits as gathering every step."""
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, 200, size=int(n)).tolist() for n in (5, 17, 40, 9, 33)]
    sampling = SamplingParams(max_tokens=60, temperature=0.8, seed=11, ignore_eos=True)
    logits = {}
    for budget in (0, 1 << 30):
        engine = Engine(
            EngineConfig(
                model_path=tiny_model_dir,
                dtype="float32",
                device="cpu",
                kv_cache_tokens=4096,
                enable_prefix_cache=False,
                decode_workspace_max_bytes=budget,
            )
        )
        seen, original = [], engine.runner._forward

        def recording(inputs, original=original, seen=seen):
            out = original(inputs)
            seen.append(out.logits.clone())
            return out

        engine.runner._forward = recording
        reused, make = [], engine.runner.attention._decode_workspace

        def tracking(*args, make=make, reused=reused):
            ws = make(*args)
            reused.append(ws is not None and not ws.fresh)
            return ws

        engine.runner.attention._decode_workspace = tracking
        arrivals = {0: [0, 1], 3: [2], 7: [3, 4]}  # joins rebuild; 60 tokens outgrow 32 spare
        collect(
            engine,
            on_step=lambda step, e, arrivals=arrivals: [
                e.add(f"r{i}", prompts[i], sampling) for i in arrivals.get(step, [])
            ],
        )
        assert engine.runner.attention._workspace is None  # dropped once idle
        assert (sum(reused) > 40) == (budget > 0) and (sum(reused) == 0) == (budget == 0)
        logits[budget] = seen
    assert len(logits[0]) == len(logits[1 << 30]) > 60
    for gathered, kept in zip(logits[0], logits[1 << 30]):
        torch.testing.assert_close(kept, gathered, rtol=0, atol=1e-5)


def test_cpu_steps_take_a_bounded_number_of_prompt_tokens(tiny_model_dir):
    """prefill_max_tokens 0 on CPU: a burst of prompts is spread over steps of at most 512 prompt
    tokens (a step stalls every decoding request), and a request still decoding gets its token
    in every one of those steps."""
    # A fixed token-key bound far above these prompts: the step pace (timing, hence load)
    # would otherwise make some steps smaller than the token bound this test is about.
    config = EngineConfig(
        model_path=str(tiny_model_dir), kv_cache_tokens=8192, prefill_max_token_keys=1 << 40
    )
    engine = Engine(config)
    assert engine.config.prefill_max_tokens == 512
    engine.add("early", PROMPT, greedy(12, ignore_eos=True))
    engine.step()
    for i in range(8):
        engine.add(f"burst{i}", [5 + i] * 200, greedy(1, ignore_eos=True))
    prefill_steps = 0
    while engine.num_waiting or any(not r.is_decoding for r in engine.scheduler.running):
        out = engine.step()
        prefill_steps += 1
        assert 0 < out.stats.prefill_tokens <= 512
        assert "early" in out.request_ids  # it decodes meanwhile
    assert prefill_steps == 4  # 1,600 prompt tokens in steps of at most 512
    collect(engine)
    assert_idle_and_leak_free(engine)
    explicit = Engine(
        EngineConfig(model_path=str(tiny_model_dir), kv_cache_tokens=1024, prefill_max_tokens=4096)
    )
    assert explicit.config.prefill_max_tokens == 4096


def test_a_decode_only_step_lays_out_its_rows_as_the_general_layout_does(tiny_engine):
    """``StepLayout.decode_inputs`` (every request decodes one token) against the general
    ``layout_inputs`` of the same step: same rows, slots, tables and sampling rows."""
    collect(tiny_engine)
    for i, n in enumerate((3, 20, 9)):
        tiny_engine.add(f"layout{i}", PROMPT[:n] * 2, greedy(8))
    requests = tiny_engine.scheduler.running
    while len(requests) < 3 or any(r.num_computed < r.prompt_len for r in requests):
        tiny_engine.step()
    requests = list(requests)
    runner = tiny_engine.runner
    fast, general = (
        runner.layout.decode_inputs(requests),
        runner.layout.layout_inputs(requests, [1] * 3),
    )
    for name in ("input_ids", "positions"):
        assert torch.equal(getattr(fast, name), getattr(general, name))
    assert fast.logit_rows is None and general.logit_rows is None
    for name in ("emitting", "widths", "prompt_spans", "decode_rows", "batches"):
        assert getattr(fast, name) == getattr(general, name)
    for name in ("starts", "lengths", "row_starts", "block_tables", "slots", "decoded"):
        assert np.array_equal(getattr(fast.step, name), getattr(general.step, name)), name
    collect(tiny_engine)
    assert_idle_and_leak_free(tiny_engine)
