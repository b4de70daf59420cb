"""Answering one generation request, whichever API it came in: submit its plan, then either
collect the whole answer or stream it. The endpoint's format (completions_bodies.py,
responses_api_bodies.py or messages_api_bodies.py) writes the bodies and the stream's events;
this module owns what every API shares: the first event awaited before answering, the client's
disconnect aborting what is left in the engine, and exactly one ending per stream."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from http_worker import path_times
from http_worker.answer_format import AnswerFormat, ChoiceOutput, usage_body
from http_worker.frontend import Frontend
from http_worker.generation import (
    ClientGone,
    GenerationCall,
    GenerationPlan,
    submit_all,
    unless_disconnected,
)
from ipc.client import Delta, SplitserveError

# nginx's status for a client that closed the connection before its answer: counted as such in
# splitserve_http_requests_total, never as a 5xx (docs/operations.md).
CLIENT_CLOSED_REQUEST = 499


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(
        json.dumps(body, ensure_ascii=False, separators=(",", ":")),
        status,
        headers,
        media_type="application/json",
    )


async def generate(
    request: Request, plan: GenerationPlan, fmt: AnswerFormat, t_arrived: float
) -> Response:
    body = plan.body
    frontend: Frontend = request.app.state.frontend
    frontend.check_model(body.model)
    call = submit_all(frontend, plan, fmt, t_arrived)
    events = call.events()
    try:
        if not body.stream:
            return json_response(await unless_disconnected(request, _collect(call, events, fmt)))
        # Wait for the first event before answering, so that errors caught before the engine
        # (bad input, overload) still get their HTTP status instead of a 200 stream.
        first = await unless_disconnected(request, events.__anext__())
    except ClientGone:
        call.close()
        return Response(status_code=CLIENT_CLOSED_REQUEST)  # nobody reads it; the metrics count it
    except SplitserveError as exc:
        raise call.fail(exc) from None
    except BaseException:
        call.close("internal")
        raise
    return StreamingResponse(
        _stream(call, first, events, fmt, path_times.wanted(request)),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        background=BackgroundTask(call.aclose),
    )


async def _collect(
    call: GenerationCall, events: AsyncIterator[tuple[int, Delta]], fmt: AnswerFormat
) -> dict[str, Any]:
    choices = [ChoiceOutput() for _ in call.handles]
    async for i, delta in events:
        choices[i].add(delta)
    call.close()
    return fmt.full(choices, call.usage())


async def _stream(
    call: GenerationCall,
    first: tuple[int, Delta],
    events: AsyncIterator[tuple[int, Delta]],
    fmt: AnswerFormat,
    trace: bool = False,
) -> AsyncIterator[bytes]:
    """The SSE body: the format's opening, one write per delta, then its ending, or its error
    ending when a choice fails mid-stream. A delta's pieces (and the opening, with the first)
    go out as one write: one send and one wake-up of the client per token, not two. A client
    disconnect cancels this generator; ``finally`` aborts what is left. ``trace``: each write
    with tokens starts with its path times (http_worker.path_times)."""
    try:
        opening = b"".join(fmt.stream_start(len(call.handles), _usage_so_far(first[1], 0)))
        i, delta = first
        while True:
            out = opening + b"".join(
                fmt.stream_delta(i, ChoiceOutput().add(delta), _usage_so_far(delta))
            )
            opening = b""
            if out:
                yield (path_times.delta_comment(delta) + out) if trace else out
            try:
                i, delta = await events.__anext__()
            except StopAsyncIteration:
                break
        ending = fmt.stream_end(call.usage())
    except SplitserveError as exc:
        ending = fmt.stream_error(call.fail(exc))
    finally:
        call.close()
    stages = path_times.request_comment(call.t_arrived, call.finals) if trace else b""
    if tail := stages + b"".join(ending):
        yield tail


def _usage_so_far(delta: Delta, completion_tokens: int | None = None) -> dict[str, Any] | None:
    """A choice's usage as of this delta (continuous_usage_stats asks for one on every event)."""
    u = delta.usage
    if u is None:
        return None
    done = u.completion_tokens if completion_tokens is None else completion_tokens
    return usage_body(u.prompt_tokens, done, u.cached_tokens)
