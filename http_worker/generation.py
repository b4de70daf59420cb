"""The engine requests behind one HTTP request: submitting them, one merged event stream,
accounting, and aborting what is left when the client goes away."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request

from http_worker.answer_format import AnswerFormat, usage_body
from http_worker.chat_protocol import ChatCompletionRequest
from http_worker.frontend import Frontend
from http_worker.protocol import MAX_CHOICES, APIError, CompletionRequest, bad_request
from http_worker.request_metrics import RequestClock
from ipc.client import ERR_TIMEOUT, AsyncRequestHandle, Delta, SplitserveError
from ipc.field_rules import FieldError
from ipc.messages import ERR_BAD_REQUEST, ERR_OVERLOADED, ERR_UNAVAILABLE, FINISH_ERROR


def api_error_from(
    exc: SplitserveError, body: CompletionRequest | ChatCompletionRequest | None = None
) -> APIError:
    """The HTTP answer to an SDK error: the client's mistakes are 4xx, never 500. A bad request
    names its field, as ``body`` calls it (max_tokens may be max_completion_tokens there)."""
    message = str(exc)
    if exc.code == ERR_BAD_REQUEST:
        if body is not None:  # a message without a param may still name fields (tools[0]...)
            named = body.named(FieldError(exc.param or "", message))
            return bad_request(str(named), named.param or None)
        return bad_request(message, exc.param)
    if exc.code == ERR_OVERLOADED:
        return APIError(429, message, "rate_limit_error", None, ERR_OVERLOADED)
    if exc.code == ERR_UNAVAILABLE:
        return APIError(503, message, "server_error", None, ERR_UNAVAILABLE)
    if exc.code == ERR_TIMEOUT:
        return APIError(504, message, "server_error", None, ERR_TIMEOUT)
    return APIError(500, message, "server_error", None, exc.code)


class GenerationCall:
    """The engine requests behind one HTTP request (prompts x n choices, choice i = handle i):
    one merged stream of (choice, delta), accounting, and an idempotent close that aborts
    whatever is unfinished (a client that went away, a sibling choice that failed)."""

    def __init__(
        self,
        frontend: Frontend,
        handles: list[AsyncRequestHandle],
        body: CompletionRequest | ChatCompletionRequest,
        t_arrived: float,
    ) -> None:
        self.frontend, self.handles, self.body, self.t_arrived = frontend, handles, body, t_arrived
        self.n = body.n
        self.finals: list[Delta | None] = [None] * len(handles)
        self.errors: list[str] = [""] * len(handles)
        self._first_t: list[float] = [0.0] * len(handles)
        self._last_t: list[float] = [0.0] * len(handles)
        self._clocks = [
            RequestClock(frontend.metrics.vllm, frontend.model_name, t_arrived) for _ in handles
        ]
        self._pumps: list[asyncio.Task] = []
        self._closed = False
        frontend.metrics.in_flight.inc()
        frontend.metrics.generations_in_flight.inc(len(handles))

    async def events(self) -> AsyncIterator[tuple[int, Delta]]:
        """Deltas in arrival order; raises the SplitserveError of the first choice that fails."""
        source = self._single() if len(self.handles) == 1 else self._merged()
        async for i, delta in source:
            self._account(i, delta)
            yield i, delta

    async def _single(self) -> AsyncIterator[tuple[int, Delta]]:
        try:
            async for delta in self.handles[0]:
                yield 0, delta
        except SplitserveError as exc:
            self.errors[0] = exc.code
            raise

    async def _merged(self) -> AsyncIterator[tuple[int, Delta]]:
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, handle: AsyncRequestHandle) -> None:
            try:
                async for delta in handle:
                    queue.put_nowait((i, delta))
            except SplitserveError as exc:
                self.errors[i] = exc.code
                queue.put_nowait((i, exc))

        loop = asyncio.get_running_loop()
        self._pumps = [loop.create_task(pump(i, h)) for i, h in enumerate(self.handles)]
        open_choices = len(self.handles)
        while open_choices:
            i, item = await queue.get()
            if isinstance(item, SplitserveError):
                raise item
            open_choices -= item.finished
            yield i, item

    def _account(self, i: int, delta: Delta) -> None:
        metrics = self.frontend.metrics
        if delta.text or delta.token_ids:
            if not any(self._first_t):
                metrics.ttft.observe(delta.t_received - self.t_arrived)
            self._first_t[i] = self._first_t[i] or delta.t_received
            self._last_t[i] = delta.t_received
            self.frontend.last_alive = delta.t_received
            self._clocks[i].on_tokens(delta.engine_index, len(delta.token_ids), delta.t_received)
        if delta.finished:
            self.finals[i] = delta
            if delta.finish_reason != FINISH_ERROR and delta.usage is not None:
                usage = delta.usage
                self._clocks[i].on_finished(
                    delta.engine_index,
                    usage.prompt_tokens,
                    usage.completion_tokens,
                    delta.t_received,
                )
            metrics.generations_in_flight.dec()
            metrics.observe_generation(
                delta.finish_reason, delta.usage, delta.timings, self._first_t[i], self._last_t[i]
            )

    def usage(self) -> dict[str, Any]:
        """OpenAI counts a prompt once however many choices it has."""
        usages = [f.usage if f is not None else None for f in self.finals]
        per_prompt = [u for u in usages[:: self.n] if u is not None]
        return usage_body(
            sum(u.prompt_tokens for u in per_prompt),
            sum(u.completion_tokens for u in usages if u is not None),
            sum(u.cached_tokens for u in per_prompt),
        )

    def close(self, outcome: str = "disconnected") -> None:
        """Aborts the unfinished choices (counted under ``outcome``, or their own error)."""
        if self._closed:
            return
        self._closed = True
        metrics = self.frontend.metrics
        for task in self._pumps:
            task.cancel()
        unfinished = [i for i, final in enumerate(self.finals) if final is None]
        for i in unfinished:
            self.handles[i].abort()  # frees the request in the engine (a no-op if it has ended)
            metrics.generations_in_flight.dec()
            metrics.generations.labels(self.errors[i] or outcome).inc()
        metrics.in_flight.dec()
        ended = [f.t_received for f in self.finals if f is not None]
        if not unfinished:  # a latency only for answers given in full: arrival to last event
            metrics.e2e.observe(max(ended) - self.t_arrived)

    async def aclose(self) -> None:
        # For Starlette's BackgroundTask, which would run a plain function in a thread.
        self.close()

    def fail(self, exc: SplitserveError) -> APIError:
        """A choice failed: the others are aborted, the client gets the error."""
        self.close("abort")
        return api_error_from(exc, self.body)


async def _until_disconnect(request: Request) -> None:
    # After the body is read, uvicorn's receive() returns only when the client goes away.
    while (await request.receive())["type"] != "http.disconnect":
        pass


class ClientGone(Exception):
    pass


async def unless_disconnected(request: Request, awaitable: Any) -> Any:
    """Awaits ``awaitable``; raises ClientGone (cancelling it) if the client disconnects first."""
    work = asyncio.ensure_future(awaitable)
    watch = asyncio.ensure_future(_until_disconnect(request))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if work.done():
        return work.result()
    work.cancel()
    raise ClientGone


@dataclass(slots=True)
class GenerationPlan:
    """What one HTTP request asks of the cluster, derived from its body before anything is sent
    (http_worker.body runs this off the event loop for a large body): one submit() keyword set
    per engine request, choice i of prompt p at p * n + i."""

    body: CompletionRequest | ChatCompletionRequest
    submits: list[dict[str, Any]]


def plan_generation(
    body: CompletionRequest | ChatCompletionRequest, default_max_tokens: int
) -> GenerationPlan:
    """Bad values raise APIError(400) naming the field."""
    prompts = body.prompts()
    if len(prompts) * body.n > MAX_CHOICES:
        raise bad_request(f"at most {MAX_CHOICES} choices per request (prompts x n)", "n")
    samplings = [body.sampling(default_max_tokens, j) for j in range(body.n)]
    options = body.output_options()
    return GenerationPlan(
        body,
        [
            {**prompt, "sampling": sampling, **options}
            for prompt in prompts
            for sampling in samplings
        ],
    )


def submit_all(
    frontend: Frontend, plan: GenerationPlan, fmt: AnswerFormat, t_arrived: float
) -> GenerationCall:
    body = plan.body
    client = frontend.require_client()  # after validation: bad input is a 400 even when down
    handles: list[AsyncRequestHandle] = []
    try:
        for submit in plan.submits:
            handles.append(
                client.submit(
                    **submit,
                    request_id=f"{fmt.id}-{len(handles)}",
                    continuous_usage_stats=body.continuous_usage,
                )
            )
    except SplitserveError as exc:
        for h in handles:
            h.abort()
        raise api_error_from(exc, body) from None
    return GenerationCall(frontend, handles, body, t_arrived)
