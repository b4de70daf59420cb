"""The frontend's per-call accounting on a real cluster (tiny model), in-process: the routes'
GenerationCall over the real AsyncClient."""

from __future__ import annotations

import asyncio
import time

import pytest

from http_worker.frontend import Frontend, FrontendSettings
from http_worker.generation import GenerationCall
from http_worker.protocol import CompletionRequest
from procs.launch_cluster import launch_cluster


@pytest.fixture(scope="module")
def one_slot_cluster(tiny_model_dir):
    # One request decodes at a time, so a second one waits, deterministically, without a token.
    with launch_cluster(
        str(tiny_model_dir),
        tokenizer_workers=1,
        max_batch_size=1,
        kv_cache_tokens=8192,
        max_model_len=4096,
    ) as c:
        yield c


def test_a_call_that_ends_without_a_token_observes_a_true_latency(one_slot_cluster):
    async def scenario() -> tuple[float, float, float]:
        frontend = Frontend(FrontendSettings(client_addr=one_slot_cluster.client_addr))
        await frontend.start()
        try:
            client = frontend.require_client()
            busy = client.submit(
                "keep the only slot", max_tokens=4000, ignore_eos=True, temperature=0
            )
            async for _ in busy:  # it holds the slot once its first token is out
                break
            waiting = client.submit("never scheduled", max_tokens=4, temperature=0)
            t_arrived = time.monotonic()
            body = CompletionRequest(prompt="never scheduled")
            call = GenerationCall(frontend, [waiting], body, t_arrived)
            await asyncio.sleep(0.2)
            waiting.abort()
            deltas = [delta async for _, delta in call.events()]
            call.close()
            busy.abort()
            assert deltas[-1].finish_reason == "abort" and not any(d.token_ids for d in deltas)
            value = frontend.metrics.registry.get_sample_value
            return (
                value("splitserve_http_e2e_request_latency_seconds_count"),
                value("splitserve_http_e2e_request_latency_seconds_sum"),
                time.monotonic() - t_arrived,
            )
        finally:
            await frontend.close()

    count, total, elapsed = asyncio.run(scenario())
    # Observed once, from arrival to the abort's terminal event: at least the 0.2 s waited and
    # no more than the whole scenario (before, the last token's time of 0 made it -uptime).
    assert count == 1 and 0.2 <= total <= elapsed
