"""The routes of one frontend process (FastAPI), its error handlers and middleware, and its
lifespan: connect to the cluster, report to the supervisor.

Endpoints: POST /v1/completions, POST /v1/chat/completions (SSE with ``stream``),
GET /v1/models, GET /health, GET /metrics; (other_api_routes.py) POST /v1/responses,
POST /v1/messages, POST /v1/messages/count_tokens; (tokenize_routes.py) POST /tokenize,
POST /detokenize, GET /tokenizer_info, GET /version.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import zmq
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import Response

from http_worker.answer import CLIENT_CLOSED_REQUEST, generate, json_response
from http_worker.body import BodyReader, validation_error
from http_worker.chat_protocol import ChatCompletionRequest
from http_worker.completions_bodies import ChatFormat, CompletionFormat, models_body
from http_worker.frontend import Connect, Frontend, FrontendSettings, connect_cluster
from http_worker.generation import GenerationPlan, plan_generation
from http_worker.messages_api_bodies import messages_error_body
from http_worker.openapi import JSON_OBJECT, install_openapi, operation, reading
from http_worker.other_api_routes import BODIES as OTHER_API_BODIES
from http_worker.other_api_routes import PATHS as OTHER_API_PATHS
from http_worker.other_api_routes import POLICIES as OTHER_API_POLICIES
from http_worker.other_api_routes import install_other_api_routes, speaks_messages_api
from http_worker.protocol import APIError, CompletionRequest, error_body
from http_worker.tokenize_routes import (
    POLICIES,
    TOKENIZER_BODIES,
    TOKENIZER_PATHS,
    install_tokenize_routes,
    package_version,
)
from ipc.sampling import DEFAULT_MAX_TOKENS
from ipc.sockets import CurveKeys
from runtime.supervisor_link import SupervisorLink

logger = logging.getLogger("splitserve.http")
KNOWN_ENDPOINTS = (
    "/v1/completions",
    "/v1/chat/completions",
    *OTHER_API_PATHS,
    "/v1/models",
    *TOKENIZER_PATHS,
)


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
            link.maybe_heartbeat(frontend.stats)
            await asyncio.sleep(link.heartbeat_due_in_ms() / 1000)
    finally:
        link.close()
        ctx.term()


def _lifespan(
    settings: FrontendSettings, frontend: Frontend
) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """The app's start (the frontend's connections, the ready line, the supervisor reports)
    and its end."""

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

    return lifespan


def build_app(settings: FrontendSettings, connect: Connect = connect_cluster) -> FastAPI:
    """``connect``: how the frontend gets its client (the default: the cluster's address)."""
    frontend = Frontend(settings, connect)
    app = FastAPI(
        title="splitserve",
        description="An OpenAI-compatible API. Request fields are typed strictly (an integer "
        "field takes an integer, never a string or a boolean) and unknown fields are refused "
        "with a 400 naming them; docs/field-policy.md states the rules.",
        version=package_version(),
        lifespan=_lifespan(settings, frontend),
        docs_url=None,
        redoc_url=None,
        openapi_url="/openapi.json",
    )
    app.state.frontend = frontend
    policies = {**POLICIES, **OTHER_API_POLICIES}
    bodies = BodyReader(settings.max_body_bytes, settings.lenient_fields, policies)
    _install_error_handlers(app)
    _install_middleware(app, frontend, settings.api_key)
    install_openapi(
        app,
        [CompletionRequest, ChatCompletionRequest, *OTHER_API_BODIES, *TOKENIZER_BODIES],
        lambda: frontend.vocab_size,
    )

    _install_generation_routes(app, frontend, bodies)
    install_other_api_routes(app, frontend, bodies)

    @app.get("/v1/models", openapi_extra=reading(JSON_OBJECT, "401"))
    async def models() -> Response:
        return json_response(
            models_body(frontend.model_name, frontend.t_start, frontend.max_model_len)
        )

    health_answers = {"503": {"description": "a process does not answer", "content": JSON_OBJECT}}

    @app.get(
        "/health",
        openapi_extra={"responses": {**reading(JSON_OBJECT)["responses"], **health_answers}},
    )
    async def health() -> Response:
        # Unauthenticated (load balancers probe it): the status and why not, nothing about the
        # host (a pid, which frontend answered: the ready line and the logs say those).
        problem = await frontend.healthy()
        if problem is None:
            return json_response({"status": "ok"})
        return json_response({"status": "unavailable", "reason": problem}, 503)

    @app.get("/metrics", openapi_extra=reading({"text/plain": {"schema": {"type": "string"}}}))
    async def metrics() -> Response:
        text, content_type = frontend.metrics.render()
        return Response(text + await frontend.engine_metrics(), media_type=content_type)

    install_tokenize_routes(app, frontend, bodies, json_response)
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
        return await generate(request, body_plan, fmt, t_arrived)

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
        return await generate(request, body_plan, fmt, t_arrived)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError) -> Response:
        headers = dict(exc.headers or {})
        if exc.status in (429, 503):
            headers["Retry-After"] = "1"
        return _error_answer(request.url.path, exc.status, exc.body(), headers or None)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError) -> Response:
        # FastAPI answers 422; OpenAI (and its SDK's BadRequestError) expect 400.
        return await on_api_error(request, validation_error(exc.errors()))

    @app.exception_handler(HTTPException)
    async def on_http_error(request: Request, exc: HTTPException) -> Response:
        # Keeps the exception's headers: a 405 says which methods the path takes (Allow).
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        body = error_body(str(exc.detail), kind)
        return _error_answer(request.url.path, exc.status_code, body, dict(exc.headers or {}))


def _error_answer(
    path: str, status: int, body: dict[str, Any], headers: dict[str, str] | None = None
) -> Response:
    """An error in the shape of the API ``path`` belongs to: OpenAI's ``body``, or Anthropic's
    on /v1/messages (the same status and message)."""
    if speaks_messages_api(path):
        body = messages_error_body(status, body["error"]["message"], body["error"]["param"])
    return json_response(body, status, headers)


def _install_middleware(app: FastAPI, frontend: Frontend, api_key: str) -> None:
    app.add_middleware(FrontendMiddleware, frontend=frontend, api_key=api_key)


class FrontendMiddleware:
    """The API key check, the request count by endpoint and status, and faults answered with a
    whole 500, as plain ASGI. (Starlette's ``@app.middleware("http")`` passes every piece of a
    response body through a memory stream to a task of its own: with two of them, two task
    switches per streamed token, on the cores the engine decodes on.)"""

    def __init__(self, app: Any, frontend: Frontend, api_key: str) -> None:
        self.app, self.frontend, self.api_key = app, frontend, api_key

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        protected = path.startswith("/v1/") or path in TOKENIZER_PATHS
        status = [0]
        try:
            if self.api_key and protected and not self._authorized(Headers(scope=scope)):
                status[0] = 401
                refusal = error_body(
                    "a valid API key is required (Authorization: Bearer ..., or x-api-key: ...)",
                    "invalid_request_error",
                    None,
                    "invalid_api_key",
                )
                await _error_answer(path, 401, refusal)(scope, receive, send)
            else:
                await self._answer_faults(scope, receive, send, status)
        finally:
            if protected and status[0]:
                endpoint = path if path in KNOWN_ENDPOINTS else "other"  # bounded label values
                self.frontend.metrics.requests.labels(endpoint, str(status[0])).inc()

    async def _answer_faults(self, scope: Any, receive: Any, send: Any, status: list[int]) -> None:
        """A fault before the answer began is answered here with a whole 500, and the connection
        stays usable. (An ``exception_handler(Exception)`` runs in Starlette's outermost
        middleware, which sends its answer and then raises again, and uvicorn then drops the
        keep-alive connection without a word: the client's next request on it fails.)"""

        async def noting_status(message: Any) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, noting_status)
        except ClientDisconnect:
            # The client left before its body was whole: nothing to answer, nobody to answer,
            # and nothing wrong here. 499 (nginx's "client closed request"), like a client that
            # leaves while its answer is computed (answer.py); docs/operations.md.
            logger.debug(
                "client closed the connection before its body was whole: %s", scope["path"]
            )
            status[0] = status[0] or CLIENT_CLOSED_REQUEST
        except Exception:
            logger.exception("unexpected error answering %s", scope["path"])
            if status[0]:
                raise  # the answer has begun: nothing whole can be sent any more
            status[0] = 500
            body = error_body("internal server error", "server_error", None, "internal")
            await _error_answer(scope["path"], body=body, status=500)(scope, receive, send)

    def _authorized(self, headers: Headers) -> bool:
        """``Authorization: Bearer KEY`` (OpenAI's clients) or ``x-api-key: KEY`` (Anthropic's)."""
        bearer = headers.get("authorization") or ""
        given = bearer.removeprefix("Bearer ") if bearer.startswith("Bearer ") else ""
        given = given or headers.get("x-api-key") or ""
        return hmac.compare_digest(given.encode(), self.api_key.encode())
