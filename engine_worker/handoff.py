"""What prefill/decode disaggregation asks of an ``Engine`` (docs/disaggregation.md), kept out of
engine.py: three operations on its scheduler, block manager and request table.

* ``take_first_tokens`` (prefill engine, after each step): every request that sampled its first
  token in the step and did not finish leaves the running batch; its KV blocks stay held (and
  its full blocks stay in this engine's prefix cache) until the process has copied them out.
* ``add_prefilled`` (decode engine): a request whose prompt another engine computed joins the
  running batch with fresh blocks, which the caller fills with the prompt's KV before the next
  step; it decodes from its first token on, its sampler where the prefill engine left it.
* ``release`` (either): forgets a request without a finish record and frees its blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine_worker.engine import Engine
from engine_worker.request import EngineRequest
from engine_worker.sampler import RequestSampler
from engine_worker.scheduler.handoff import has_room, join_prefilled, take_running
from engine_worker.speculative import may_speculate
from ipc.messages import FinishRecord, KVArrival, SamplingParams


@dataclass(slots=True)
class PumpResult:
    """What a disaggregated engine's role produced in one pass, for the process loop."""

    finished: list[FinishRecord] = field(default_factory=list)  # to send to the detokenizer
    left: list[str] = field(default_factory=list)  # requests no longer in this engine
    joined: list[str] = field(default_factory=list)  # requests that arrived in this engine
    arrivals: list[KVArrival] = field(default_factory=list)


def take_first_tokens(engine: Engine, emitted: list[str]) -> list[EngineRequest]:
    """The requests of ``emitted`` (a step's StepOutput.request_ids) still in the engine: out
    of the running batch, blocks held. A prefill engine samples only first tokens."""
    known = [engine.requests.get(request_id) for request_id in dict.fromkeys(emitted)]
    return take_running(engine.scheduler, [r for r in known if r is not None])


def add_prefilled(
    engine: Engine,
    request_id: str,
    token_ids: list[int],
    prompt_len: int,
    sampling: SamplingParams,
    generator_state: bytes = b"",
    cache_salt: str | None = None,
) -> list[int] | None:
    """``token_ids``: the prompt and the token(s) the prefill engine sampled. Returns the
    blocks to fill with the prompt's KV; None when the batch or the pool has no room now (ask
    again later); [] when the request was aborted on its way here (it ends at the next step)."""
    if request_id in engine.requests:
        raise ValueError(f"request id {request_id!r} is already running or waiting")
    needed = engine.blocks.blocks_for(prompt_len)
    if needed > engine.blocks.num_blocks:
        raise ValueError(
            f"the prompt's {prompt_len} tokens need {needed} KV blocks; this engine has "
            f"{engine.blocks.num_blocks}"
        )
    if not has_room(engine.scheduler, needed, engine.config.max_batch_size):
        return None
    if engine.aborts.arrived(request_id):
        return []
    stop_ids = frozenset(sampling.stop_token_ids) | (
        frozenset() if sampling.ignore_eos else frozenset(engine.eos_token_ids)
    )
    sampler = RequestSampler(sampling, engine.device, stop_ids)
    if generator_state and sampler.generator is not None:
        sampler.generator.set_state(torch.frombuffer(bytearray(generator_state), dtype=torch.uint8))
    request = EngineRequest(
        request_id,
        token_ids[:prompt_len],
        sampling,
        sampler,
        stop_ids,
        engine.max_model_len,
        0.0,
        cache_salt,
    )
    speculates = engine.scheduler.proposer is not None and may_speculate(sampling, sampler, False)
    engine.requests[request_id] = request
    return join_prefilled(engine.scheduler, request, token_ids[prompt_len:], needed, speculates)


def generator_state(request: EngineRequest) -> bytes:
    """The request's random stream where it stands (b"" for a greedy request)."""
    generator = request.sampler.generator
    return b"" if generator is None else generator.get_state().numpy().tobytes()


def release(engine: Engine, request_id: str) -> None:
    request = engine.requests.pop(request_id)
    engine.scheduler.remove(request)
    engine.grammars.forget(request)
