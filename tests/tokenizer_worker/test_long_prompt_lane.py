"""The long-prompt lane on its own: its thread runs nicer than the caller, it holds at most
MAX_QUEUED requests (the worker refuses more), results come back through take() with the fd
readable, and close() hands back what it never answered."""

from __future__ import annotations

import os
import select
import threading

from ipc.messages import SamplingParams, SubmitRequest
from runtime.model_files import load_tokenizer
from tokenizer_worker.long_prompts import MAX_QUEUED, LongPromptLane
from tokenizer_worker.prepare import Limits, RequestPreparer


def test_the_lane_encodes_beside_the_caller_nicer_and_bounded(default_model_dir):
    preparer = RequestPreparer(load_tokenizer(default_model_dir), None, Limits(8192, 49152))
    release = threading.Event()

    def encode(batch):
        release.wait(30)
        return preparer.encode(batch)

    lane = LongPromptLane(encode, 3)
    base = os.getpriority(os.PRIO_PROCESS, 0)
    assert os.getpriority(os.PRIO_PROCESS, lane.native_id) == min(19, base + 3)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == base
    screened = [
        preparer.screen(SubmitRequest(f"r{i}", b"c", SamplingParams(), prompt="word " * 500))
        for i in range(MAX_QUEUED + 1)
    ]
    assert all(lane.submit(s) for s in screened[:MAX_QUEUED])
    assert not lane.submit(screened[-1])  # full
    assert lane.take() == []
    release.set()
    results = []
    while len(results) < MAX_QUEUED:
        select.select([lane.fd], [], [], 30)
        results += lane.take()
    assert [r.request_id for r in results] == [f"r{i}" for i in range(MAX_QUEUED)]
    expected = len(preparer.tokenizer.encode("word " * 500).ids)
    assert all(r.meta.prompt_tokens == expected for r in results)
    assert lane.submit(screened[-1]) and lane.queued
    release.clear()
    left = lane.close()  # still blocked in encode: handed back, for the worker to end
    assert [s.request.request_id for s in left] == [f"r{MAX_QUEUED}"]
    release.set()
