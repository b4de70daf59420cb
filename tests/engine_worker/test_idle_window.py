"""The idle-engine batching window: the rule on its own, the Engine's use of it, and the engine
process's loop honouring it (a real cluster on the tiny model)."""

from __future__ import annotations

import time

import pytest

from engine_worker.engine import Engine
from engine_worker.idle_window import IdleBatchWindow
from ipc.client import Client
from ipc.engine_config import EngineConfig
from procs.launch_cluster import launch_cluster
from tests.engine_worker.helpers import greedy

PROMPT = [1, 504, 3458, 282, 4649, 314, 253, 1467, 30]


def test_the_window_opens_only_on_an_idle_engine_and_closes_at_its_deadline():
    window = IdleBatchWindow(0.050, step_fraction=0.0, max_requests=4)  # a fixed window
    assert window.remaining_s(100.0, 0) == 0.0
    window.on_arrival(100.0, engine_was_idle=False, first_step_tokens=10)  # busy: never waits
    assert window.remaining_s(100.0, 1) == 0.0
    window.on_arrival(100.0, engine_was_idle=True, first_step_tokens=10)
    assert window.remaining_s(100.010, 1) == pytest.approx(0.040)
    window.on_arrival(100.020, engine_was_idle=False, first_step_tokens=10)  # keeps the deadline
    assert window.remaining_s(100.030, 2) == pytest.approx(0.020)
    assert window.remaining_s(100.050, 2) == 0.0
    assert window.remaining_s(100.051, 2) == 0.0  # closed for good, not reopened by time


def test_the_window_closes_when_the_first_step_is_full_or_the_engine_steps():
    window = IdleBatchWindow(1.0, step_fraction=0.0, max_requests=3)
    window.on_arrival(0.0, engine_was_idle=True, first_step_tokens=10)
    assert window.remaining_s(0.1, 2) > 0
    assert window.remaining_s(0.1, 3) == 0.0  # a first step could take no more
    window.on_arrival(5.0, engine_was_idle=True, first_step_tokens=10)
    window.close()
    assert window.remaining_s(5.1, 1) == 0.0
    off = IdleBatchWindow(0.0, step_fraction=0.0, max_requests=3)
    off.on_arrival(0.0, engine_was_idle=True, first_step_tokens=10)
    assert off.remaining_s(0.0, 1) == 0.0
    with pytest.raises(ValueError):
        IdleBatchWindow(-1.0, step_fraction=0.0, max_requests=3)


def test_the_wait_is_a_fraction_of_the_expected_first_step():
    window = IdleBatchWindow(1.0, step_fraction=0.05, max_requests=32)
    assert window.window_s(2048) == 0.0  # nothing timed yet: no expectation, no wait
    window.observe_step(0.010, prefill_tokens=8)  # decode-like steps do not count
    assert window.seconds_per_token is None
    window.observe_step(2.0, prefill_tokens=1000)  # 2 ms a token
    assert window.window_s(100) == pytest.approx(0.05 * 0.2)  # a short prompt barely waits
    assert window.window_s(2048) == pytest.approx(0.05 * 4.096)
    assert window.window_s(100_000) == 1.0  # never past the cap
    window.observe_step(1.0, prefill_tokens=1000)  # 1 ms a token: halfway there
    assert window.seconds_per_token == pytest.approx(0.0015)
    window.on_arrival(10.0, engine_was_idle=True, first_step_tokens=1000)
    assert window.remaining_s(10.0, 1) == pytest.approx(0.05 * 1.5)
    # A first step of a few tokens: 5% of it is below the loop's 1 ms resolution, so no wait
    # (the loop would round it up to a whole millisecond).
    window.on_arrival(20.0, engine_was_idle=True, first_step_tokens=10)
    assert window.window_s(10) == pytest.approx(0.05 * 0.015)
    assert window.remaining_s(20.0, 1) == 0.0


@pytest.fixture(scope="module")
def windowed_engine(tiny_model_dir):
    return Engine(
        EngineConfig(
            model_path=str(tiny_model_dir),
            kv_cache_tokens=1024,
            idle_batch_window_ms=200.0,
            idle_batch_window_step_fraction=0.0,
        )
    )


def test_an_idle_engine_waits_and_a_busy_one_does_not(windowed_engine):
    engine = windowed_engine
    engine.add("a", PROMPT, greedy(4, ignore_eos=True))
    delay = engine.step_delay_s()
    assert 0 < delay <= 0.2
    engine.add("b", PROMPT[:5], greedy(1))  # within the window: joins the first step
    out = engine.step()
    assert sorted(s.request_id for s in out.started) == ["a", "b"]
    assert engine.step_delay_s() == 0.0
    engine.add("c", PROMPT[:3], greedy(1))  # "a" is still decoding: no waiting
    assert engine.has_work() and engine.step_delay_s() == 0.0
    while engine.has_work():
        engine.step()
    engine.add("d", PROMPT, greedy(1))  # idle again: the window reopens
    assert engine.step_delay_s() > 0
    engine.step()


def test_a_cached_prompt_waits_only_for_the_part_the_cache_does_not_hold(tiny_model_dir):
    """The window is a fraction of the first step's expected time, and a prompt the prefix
    cache holds computes only its last block in that step: it waits accordingly little."""
    engine = Engine(
        EngineConfig(
            model_path=str(tiny_model_dir),
            kv_cache_tokens=1024,
            idle_batch_window_ms=10_000.0,
            idle_batch_window_step_fraction=0.5,
        )
    )
    engine.idle_window.seconds_per_token = 0.01  # as if timed: 10 ms a prompt token
    prompt = [(7 * i) % 500 + 3 for i in range(100)]
    engine.add("fresh", prompt, greedy(1, ignore_eos=True))
    fresh = engine.step_delay_s()
    assert 0.4 < fresh <= 0.5  # half of 100 tokens x 10 ms
    while engine.requests:
        engine.step()
    engine.add("cached", prompt, greedy(1, ignore_eos=True))
    block = engine.config.block_size
    assert engine.step_delay_s() <= 0.5 * 0.01 * (100 - (99 // block) * block)
    while engine.requests:
        engine.step()


def test_the_engine_process_lets_a_burst_share_its_first_step(tiny_model_dir):
    window_ms = 1000.0  # far longer than the gap below, however loaded the machine
    with (
        launch_cluster(
            str(tiny_model_dir),
            tokenizer_workers=1,
            kv_cache_tokens=4096,
            idle_batch_window_ms=window_ms,
            idle_batch_window_step_fraction=0.0,
        ) as cluster,
        Client(cluster.client_addr, deadline_s=120) as client,
    ):
        first = client.submit(
            prompt="The first request of a burst", max_tokens=2, temperature=0, ignore_eos=True
        )
        time.sleep(0.05)
        second = client.submit(
            prompt="and the second one", max_tokens=2, temperature=0, ignore_eos=True
        )
        a, b = first.result(timeout=60), second.result(timeout=60)
        # One step scheduled both and produced both first tokens.
        assert a.timings.t_scheduled == b.timings.t_scheduled
        assert a.timings.t_first_token == b.timings.t_first_token

        # A busy engine takes a newcomer into its next step: no window wait.
        long = client.submit(prompt="Keep going", max_tokens=1500, temperature=0, ignore_eos=True)
        next(iter(long.stream(timeout=60)))  # its first token: the engine is decoding it
        late = client.submit(prompt="A late arrival", max_tokens=1, temperature=0)
        result = late.result(timeout=60)
        assert not long.done, "the long request should still be decoding"
        assert result.timings.t_scheduled - result.timings.t_arrived < window_ms / 2e3
        long.abort()
