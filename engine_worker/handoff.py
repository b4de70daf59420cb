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

import torch

from engine_worker.engine import Engine
from engine_worker.request import EngineRequest
from engine_worker.sampler import RequestSampler
from engine_worker.speculative import may_speculate
from ipc.messages import SamplingParams


def take_first_tokens(engine: Engine, emitted: list[str]) -> list[EngineRequest]:
    """The requests of ``emitted`` (a step's StepOutput.request_ids) still in the engine: out
    of the running batch, blocks held. A prefill engine samples only first tokens."""
    taken = []
    running = engine.scheduler.running
    for request_id in dict.fromkeys(emitted):
        request = engine.requests.get(request_id)
        if request is not None and request in running:
            running.remove(request)
            taken.append(request)
    return taken


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
    running = engine.scheduler.running
    if len(running) >= engine.config.max_batch_size or needed > engine.blocks.num_available:
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
    for token in token_ids[prompt_len:]:
        request.append_token(token)
    request.num_computed = prompt_len
    request.started_sent = True  # the prefill engine sent its start and first token
    request.prompt_logprobs_from = prompt_len  # computed and sent there
    request.speculates = engine.scheduler.proposer is not None and may_speculate(
        sampling, sampler, ""
    )
    request.block_ids = engine.blocks.allocate(needed)
    engine.requests[request_id] = request
    running.append(request)
    return request.block_ids


def generator_state(request: EngineRequest) -> bytes:
    """The request's random stream where it stands (b"" for a greedy request)."""
    generator = request.sampler.generator
    return b"" if generator is None else generator.get_state().numpy().tobytes()


def release(engine: Engine, request_id: str) -> None:
    request = engine.requests.pop(request_id)
    engine.scheduler.remove(request)
    engine.grammars.forget(request)
