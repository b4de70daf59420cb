"""Shared helpers for engine tests: run requests to completion, drive the model runner by hand."""

from __future__ import annotations

import select

import torch

from engine_worker.engine import Engine
from engine_worker.request import EngineRequest
from engine_worker.sampler import RequestSampler
from ipc.codec import unpack_ids
from ipc.messages import SamplingParams


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kwargs)


def collect(
    engine: Engine,
    max_steps: int = 10_000,
    on_step=None,
    totals: dict | None = None,
    mask_wait_s: float = 30.0,
) -> dict[str, dict]:
    """Steps the engine until idle; returns per-request tokens, finish reason, start info and,
    where asked, the TokenLogprobs ("logprobs") and PromptLogprobs ("prompt_logprobs").

    An engine whose only work is grammar work off the step (a build, once it has a vocabulary,
    or a mask) is waited for on its wake-up pipe, as the engine process does, up to
    ``mask_wait_s``.
    ``totals`` (if given) accumulates the step stats: prefill_tokens, preempted, ..."""
    results: dict[str, dict] = {}
    for step in range(max_steps):
        if on_step is not None:
            on_step(step, engine)
        if not engine.has_work():
            if (
                not _grammar_work_pending(engine)
                or not select.select([engine.wakeup_fd], [], [], mask_wait_s)[0]
            ):
                break
            continue
        out = engine.step()
        if totals is not None:
            for name in ("prefill_tokens", "cached_tokens", "decode_tokens", "preempted"):
                totals[name] = totals.get(name, 0) + getattr(out.stats, name)
        for chunk in out.prompt_logprobs:  # a step's prompt logprobs precede its tokens
            entry = results.setdefault(chunk.request_id, {"tokens": []})
            assert not entry["tokens"], "prompt logprobs after the first token"
            entry.setdefault("prompt_logprobs", []).append(chunk)
        for request_id, token in zip(out.request_ids, unpack_ids(out.token_ids)):
            results.setdefault(request_id, {"tokens": []})["tokens"].append(int(token))
        for entry in out.logprobs:
            request_id = out.request_ids[entry.row]
            results[request_id].setdefault("logprobs", []).append(entry)
        for start in out.started:
            entry = results.setdefault(start.request_id, {"tokens": []})
            assert "start" not in entry, "RequestStart sent twice"
            entry["start"] = start
        for record in out.finished:
            entry = results.setdefault(record.request_id, {"tokens": []})
            assert "reason" not in entry, "finished twice"
            entry["reason"], entry["error"], entry["code"] = (
                record.reason,
                record.error,
                record.code,
            )
    return results


def _grammar_work_pending(engine: Engine) -> bool:
    if engine.grammars.building and engine.grammars.builder.has_vocabulary:
        return True
    return any(r.grammar is not None and r.grammar.pending for r in engine.requests.values())


def manual_request(engine: Engine, token_ids: list[int], name: str = "r") -> EngineRequest:
    """A request the test drives through engine.runner directly (no scheduler)."""
    params = greedy(1)
    return EngineRequest(
        name,
        list(token_ids),
        params,
        RequestSampler(params, engine.device),
        frozenset(),
        engine.max_model_len,
        0.0,
    )


def compute_logits(
    engine: Engine, requests: list[EngineRequest], counts: list[int]
) -> tuple[torch.Tensor, list[int]]:
    """Runs the forward of ``counts`` tokens of each request (their KV written) through
    engine.runner, no scheduler; returns the logits of the requests that sample in this step,
    and those requests' indices."""
    step = engine.runner.forward(requests, counts)
    return step.logits[: sum(step.widths)], step.emitting


def give_blocks(engine: Engine, request: EngineRequest, num_tokens: int) -> None:
    needed = engine.blocks.blocks_for(num_tokens) - len(request.block_ids)
    if needed > 0:
        request.block_ids += engine.blocks.allocate(needed)
