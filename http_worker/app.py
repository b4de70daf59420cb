"""The OpenAI-compatible routes of one frontend process (FastAPI), its error handlers and
middleware, and its lifespan: connect to the cluster, report to the supervisor.

Endpoints: POST /v1/completions, POST /v1/chat/completions (SSE with ``stream``),
GET /v1/models, GET /health, GET /metrics, and (tokenize_routes.py) POST /tokenize,
POST /detokenize, GET /tokenizer_info, GET /version.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import os
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import zmq
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException
from starlette.responses import Response, StreamingResponse

from http_worker.body import BodyReader, validation_error
from http_worker.frontend import Frontend, FrontendSettings
from http_worker.generation import (
    ClientGone,
    GenerationCall,
    GenerationPlan,
    plan_generation,
    submit_all,
    unless_disconnected,
)
from http_worker.openapi import JSON_OBJECT, install_openapi, operation, reading
from http_worker.protocol import APIError, ChatCompletionRequest, CompletionRequest, error_body
from http_worker.responses import (
    ChatFormat,
    ChoiceOutput,
    CompletionFormat,
    ResponseFormat,
    models_body,
    usage_body,
)
from http_worker.tokenize_routes import (
    POLICIES,
    TOKENIZER_BODIES,
    TOKENIZER_PATHS,
    install_tokenize_routes,
    package_version,
)
from ipc.client import Delta, SplitserveError
from ipc.sampling import DEFAULT_MAX_TOKENS
from ipc.sockets import CurveKeys
from runtime.supervisor_link import SupervisorLink

logger = logging.getLogger("splitserve.http")
SSE_DONE = b"data: [DONE]\n\n"
KNOWN_ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", *TOKENIZER_PATHS)


def _json(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(
        json.dumps(body, ensure_ascii=False, separators=(",", ":")),
        status,
        headers,
        media_type="application/json",
    )


def _sse(body: Any) -> bytes:
    return (
        b"data: " + json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"
    )


async def _generate(
    request: Request, plan: GenerationPlan, fmt: ResponseFormat, t_arrived: float
) -> Response:
    body = plan.body
    frontend: Frontend = request.app.state.frontend
    frontend.check_model(body.model)
    call = submit_all(frontend, plan, fmt, t_arrived)
    events = call.events()
    try:
        if not body.stream:
            return _json(await unless_disconnected(request, _collect(call, events, fmt)))
        # Wait for the first event before answering, so that errors caught before the engine
        # (bad input, overload) still get their HTTP status instead of a 200 stream.
        first = await unless_disconnected(request, events.__anext__())
    except ClientGone:
        call.close()
        return Response(status_code=499)  # nobody reads it; the access log does
    except SplitserveError as exc:
        raise call.fail(exc) from None
    except BaseException:
        call.close("internal")
        raise
    return StreamingResponse(
        _stream(call, first, events, fmt),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        background=BackgroundTask(call.aclose),
    )


async def _collect(
    call: GenerationCall, events: AsyncIterator[tuple[int, Delta]], fmt: ResponseFormat
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
    fmt: ResponseFormat,
) -> AsyncIterator[bytes]:
    """The SSE body. Ends with [DONE], or with an error object then [DONE] when a choice fails
    mid-stream. A client disconnect cancels this generator; ``finally`` aborts what is left."""
    try:
        opening = _usage_so_far(first[1], completion_tokens=0)
        for i in range(len(call.handles)):
            if (chunk := fmt.first_chunk(i, opening)) is not None:
                yield _sse(chunk)
        i, delta = first
        while True:
            out = ChoiceOutput().add(delta)
            if out.has_content:
                yield _sse(fmt.chunk(i, out, _usage_so_far(delta)))
            try:
                i, delta = await events.__anext__()
            except StopAsyncIteration:
                break
        if fmt.include_usage:
            yield _sse(fmt.usage_chunk(call.usage()))
    except SplitserveError as exc:
        yield _sse(call.fail(exc).body())
    finally:
        call.close()
    yield SSE_DONE


def _usage_so_far(delta: Delta, completion_tokens: int | None = None) -> dict[str, Any] | None:
    """A choice's usage as of this delta (continuous_usage_stats asks for one on every event)."""
    u = delta.usage
    if u is None:
        return None
    done = u.completion_tokens if completion_tokens is None else completion_tokens
    return usage_body(u.prompt_tokens, done, u.cached_tokens)


# --- the app ------------------------------------------------------------------------------------


async def _report_to_supervisor(settings: FrontendSettings, frontend: Frontend) -> None:
    """As every worker does: WorkerReady once serving (after the cluster handshake), then
    heartbeats with this frontend's in-flight counts, until cancelled."""
    ctx = zmq.Context()
    curve = CurveKeys(settings.server_public_key) if settings.server_public_key else None
    link = SupervisorLink(
        ctx, settings.supervisor_addr, "http", settings.index, settings.heartbeat_interval_s, curve
    )
    try:
        welcome = frontend.require_client().welcome
        link.ready(
            [settings.url],
            model_name=frontend.model_name,
            max_model_len=frontend.max_model_len,
            vocab_size=welcome.vocab_size if welcome else 0,
        )
        while True:
            link.maybe_heartbeat(frontend.stats())
            await asyncio.sleep(link.heartbeat_due_in_ms() / 1000)
    finally:
        link.close()
        ctx.term()


def build_app(settings: FrontendSettings) -> FastAPI:
    frontend = Frontend(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await frontend.start()
        print(
            f"splitserve http[{settings.index}] pid={os.getpid()} ready: {settings.url} "
            f"model {frontend.model_name!r}, cluster at {settings.client_addr}",
            file=sys.stderr,
            flush=True,
        )
        reporting = None
        if settings.supervisor_addr:
            reporting = asyncio.get_running_loop().create_task(
                _report_to_supervisor(settings, frontend)
            )
        try:
            yield
        finally:
            if reporting is not None:
                reporting.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await reporting
            await frontend.close()

    app = FastAPI(
        title="splitserve",
        description="An OpenAI-compatible API. Request fields are typed strictly (an integer "
        "field takes an integer, never a string or a boolean) and unknown fields are refused "
        "with a 400 naming them; docs/field-policy.md states the rules.",
        version=package_version(),
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url="/openapi.json",
    )
    app.state.frontend = frontend
    bodies = BodyReader(settings.max_body_bytes, settings.lenient_fields, POLICIES)
    _install_error_handlers(app)
    _install_middleware(app, frontend, settings.api_key)
    install_openapi(app, [CompletionRequest, ChatCompletionRequest, *TOKENIZER_BODIES])

    _install_generation_routes(app, frontend, bodies)

    @app.get("/v1/models", openapi_extra=reading(JSON_OBJECT, "401"))
    async def models() -> Response:
        return _json(models_body(frontend.model_name, frontend.t_start, frontend.max_model_len))

    health_answers = {"503": {"description": "a process does not answer", "content": JSON_OBJECT}}

    @app.get(
        "/health",
        openapi_extra={"responses": {**reading(JSON_OBJECT)["responses"], **health_answers}},
    )
    async def health() -> Response:
        problem = await frontend.healthy()
        who = {"pid": os.getpid(), "index": settings.index}
        if problem is None:
            return _json({"status": "ok", **who})
        return _json({"status": "unavailable", "reason": problem, **who}, 503)

    @app.get("/metrics", openapi_extra=reading({"text/plain": {"schema": {"type": "string"}}}))
    async def metrics() -> Response:
        text, content_type = frontend.metrics.render()
        return Response(text + await frontend.engine_metrics(), media_type=content_type)

    install_tokenize_routes(app, frontend, bodies, _json)
    return app


def _install_generation_routes(app: FastAPI, frontend: Frontend, bodies: BodyReader) -> None:
    """POST /v1/completions and /v1/chat/completions: each body is read and planned by
    ``bodies`` (http_worker.body: off the event loop when it is large), then submitted."""

    async def plan(request: Request, model: type, default_max_tokens: int) -> GenerationPlan:
        return await bodies.parse(
            request, lambda data: model, lambda body: plan_generation(body, default_max_tokens)
        )

    @app.post("/v1/completions", openapi_extra=operation(CompletionRequest, stream=True))
    async def completions(request: Request) -> Response:
        t_arrived = time.monotonic()
        body_plan = await plan(request, CompletionRequest, DEFAULT_MAX_TOKENS)
        body = body_plan.body
        assert isinstance(body, CompletionRequest)
        fmt = CompletionFormat(
            frontend.model_name,
            body.include_usage,
            body.continuous_usage,
            logprobs=body.logprobs,
            echo=body.echo,
            prompt_logprobs=body.prompt_logprobs is not None,
        )
        return await _generate(request, body_plan, fmt, t_arrived)

    @app.post("/v1/chat/completions", openapi_extra=operation(ChatCompletionRequest, stream=True))
    async def chat_completions(request: Request) -> Response:
        t_arrived = time.monotonic()
        # No limit asked: as much as the context has room for (the tokenizer worker cuts it).
        body_plan = await plan(request, ChatCompletionRequest, max(1, frontend.max_model_len))
        body = body_plan.body
        assert isinstance(body, ChatCompletionRequest)
        fmt = ChatFormat(
            frontend.model_name,
            body.include_usage,
            body.continuous_usage,
            logprobs=(body.top_logprobs or 0) if body.logprobs else None,
            prompt_logprobs=body.prompt_logprobs is not None,
        )
        return await _generate(request, body_plan, fmt, t_arrived)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError) -> Response:
        headers = dict(exc.headers or {})
        if exc.status in (429, 503):
            headers["Retry-After"] = "1"
        return _json(exc.body(), exc.status, headers or None)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError) -> Response:
        # FastAPI answers 422; OpenAI (and its SDK's BadRequestError) expect 400.
        return await on_api_error(request, validation_error(exc.errors()))

    @app.exception_handler(HTTPException)
    async def on_http_error(request: Request, exc: HTTPException) -> Response:
        # Keeps the exception's headers: a 405 says which methods the path takes (Allow).
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _json(error_body(str(exc.detail), kind), exc.status_code, dict(exc.headers or {}))


def _install_middleware(app: FastAPI, frontend: Frontend, api_key: str) -> None:
    expected = f"Bearer {api_key}"

    @app.middleware("http")
    async def answer_faults(request: Request, call_next: Any) -> Response:
        """A fault is answered here with a whole 500, and the connection stays usable. (An
        ``exception_handler(Exception)`` runs in Starlette's outermost middleware, which sends
        its answer and then raises again, and uvicorn then drops the keep-alive connection
        without a word: the client's next request on it fails.)"""
        try:
            response: Response = await call_next(request)
        except Exception:
            logger.exception("unexpected error answering %s", request.url.path)
            body = error_body("internal server error", "server_error", None, "internal")
            return _json(body, 500)
        return response

    @app.middleware("http")
    async def auth_and_count(request: Request, call_next: Any) -> Response:
        path = request.url.path
        given = request.headers.get("authorization") or ""
        protected = path.startswith("/v1/") or path in TOKENIZER_PATHS
        if api_key and protected and not hmac.compare_digest(given.encode(), expected.encode()):
            response: Response = _json(
                error_body(
                    "a valid API key is required (Authorization: Bearer ...)",
                    "invalid_request_error",
                    None,
                    "invalid_api_key",
                ),
                401,
            )
        else:
            response = await call_next(request)
        if protected:
            endpoint = path if path in KNOWN_ENDPOINTS else "other"  # bounded label values
            frontend.metrics.requests.labels(endpoint, str(response.status_code)).inc()
        return response
