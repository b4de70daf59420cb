"""The scheduler's side of prefill/decode disaggregation (docs/disaggregation.md): a request
leaving a prefill engine's running batch after its first token, and one joining a decode
engine's batch with its prompt computed elsewhere. Kept in the scheduler package, which alone
changes a request's scheduling fields (engine_worker/handoff.py composes these for the engine).
"""

from __future__ import annotations

from engine_worker.request import EngineRequest
from engine_worker.scheduler.scheduler import Scheduler


def take_running(scheduler: Scheduler, requests: list[EngineRequest]) -> list[EngineRequest]:
    """Those of ``requests`` in the running batch, taken out of it (their blocks stay held)."""
    taken = [r for r in requests if r in scheduler.running]
    for request in taken:
        scheduler.running.remove(request)
    return taken


def has_room(scheduler: Scheduler, blocks: int, max_batch_size: int) -> bool:
    """Whether one more request of ``blocks`` KV blocks fits in the running batch now."""
    return len(scheduler.running) < max_batch_size and blocks <= scheduler.blocks.num_available


def join_prefilled(
    scheduler: Scheduler, request: EngineRequest, sampled: list[int], blocks: int, speculates: bool
) -> list[int]:
    """``request`` (its prompt computed on another engine, ``sampled`` the tokens sampled
    there) joins the running batch decoding, with ``blocks`` fresh KV blocks: returned, for the
    caller to fill with the prompt's KV before the next step."""
    for token in sampled:
        request.append_token(token)
    request.num_computed = request.prompt_len
    request.started_sent = True  # the prefill engine sent its start and first token
    request.prompt_logprobs_from = request.prompt_len  # computed and sent there
    request.speculates = speculates
    request.block_ids = scheduler.blocks.allocate(blocks)
    scheduler.running.append(request)
    return request.block_ids
