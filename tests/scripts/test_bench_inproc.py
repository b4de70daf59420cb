"""The benchmark's in-process server runs the cluster's cores: the tokenizer worker's preparer,
the Engine and the DetokenizerCore, so stop strings and the stream interval apply to it too."""

from __future__ import annotations

import queue
import time

import pytest

from ipc.codec import unpack_id_list
from ipc.engine_config import EngineConfig
from ipc.messages import SamplingParams, StreamEvent
from scripts.bench.inproc import InprocServer

MAX_TOKENS = 12


class Inbox:
    def __init__(self) -> None:
        self.events: queue.SimpleQueue[StreamEvent] = queue.SimpleQueue()

    def deliver(self, events: list[StreamEvent]) -> None:
        for event in events:
            self.events.put(event)

    def until_finished(self, request_id: str) -> list[StreamEvent]:
        out = []
        while not out or not out[-1].finished:
            event = self.events.get(timeout=60)
            assert event.request_id == request_id
            out.append(event)
        return out


@pytest.fixture(scope="module")
def make_server(tiny_model_dir):
    servers = []

    def make(stream_interval_tokens: int = 1, **knobs) -> tuple[InprocServer, Inbox]:
        inbox = Inbox()
        # No prefix cache: a repeated prompt is computed the same way twice.
        config = EngineConfig(
            model_path=str(tiny_model_dir),
            dtype="float32",
            kv_cache_tokens=4096,
            enable_prefix_cache=False,
            engine_threads=1,
            **knobs,
        )
        server = InprocServer(config, inbox.deliver, stream_interval_tokens=stream_interval_tokens)
        servers.append(server)
        return server, inbox

    yield make
    for server in servers:
        server.close()


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, **kwargs)


def test_a_stop_string_ends_the_text_and_frees_the_request_in_the_engine(make_server):
    server, inbox = make_server()
    server.submit("full", greedy(), prompt="Once upon a time there was")
    full = inbox.until_finished("full")
    text = "".join(e.text for e in full)
    assert full[-1].finish_reason == "length" and full[-1].usage.completion_tokens == MAX_TOKENS
    stop = text[len(text) // 3 : len(text) // 3 + 3]
    assert len(stop) == 3 and stop.strip(), text

    server.submit("stopped", greedy(stop=[stop]), prompt="Once upon a time there was")
    stopped = inbox.until_finished("stopped")
    assert "".join(e.text for e in stopped) == text[: text.index(stop)]
    assert stopped[-1].finish_reason == "stop"
    assert stopped[-1].usage.completion_tokens < MAX_TOKENS
    deadline = time.monotonic() + 10
    while server.engine.has_work() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.engine.num_running == 0  # the stop string's abort reached the engine
    assert inbox.events.empty()  # nothing after the terminal event


def test_the_stream_interval_batches_deltas(make_server):
    server, inbox = make_server(stream_interval_tokens=4)
    server.submit("r", greedy(), messages=[{"role": "user", "content": "Count to ten."}])
    events = inbox.until_finished("r")
    sizes = [len(unpack_id_list(e.token_ids)) for e in events]
    assert sizes == [1, 4, 4, 3]  # the first at once; the finishing step's token rides last
    assert events[-1].usage.prompt_tokens > 10  # the chat template was applied


def test_bad_input_ends_with_the_tokenizer_workers_error(make_server):
    server, inbox = make_server()
    server.submit("bad", greedy(), prompt_token_ids=[1, 10**6])
    (event,) = inbox.until_finished("bad")
    assert event.finish_reason == "error" and event.error_code == "bad_request"
    assert "prompt_token_ids must be in" in event.error


def first_step_of_each(inbox: Inbox, request_ids: set[str]) -> dict[str, float]:
    """t_scheduled of each request, read from its terminal event (events may interleave)."""
    scheduled: dict[str, float] = {}
    while set(scheduled) != request_ids:
        event = inbox.events.get(timeout=60)
        if event.finished:
            assert event.finish_reason == "length", event.error
            scheduled[event.request_id] = event.timings.t_scheduled
    return scheduled


@pytest.mark.parametrize("window_ms", [0.0, 1000.0])
def test_the_idle_window_lets_a_burst_share_the_first_step(make_server, window_ms):
    # A fixed window far longer than the gap between the two submits, however loaded the
    # machine; without it the first request's step starts (and on the tiny model ends) alone.
    server, inbox = make_server(idle_batch_window_ms=window_ms, idle_batch_window_step_fraction=0.0)
    server.submit("first", greedy(), prompt="The first request of a burst")
    time.sleep(0.2)
    server.submit("second", greedy(), prompt="and the second one")
    scheduled = first_step_of_each(inbox, {"first", "second"})
    shared = scheduled["first"] == scheduled["second"]
    assert shared == (window_ms > 0), scheduled
