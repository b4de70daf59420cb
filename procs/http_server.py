"""The HTTP frontend: an OpenAI-compatible server (FastAPI on uvicorn + uvloop) over the client SDK.

    python -m procs.http_server --client-addr ipc:///tmp/splitserve-x/client.sock --port 8000

Each frontend process owns one AsyncClient (its own DEALER identity at the detokenizer), so
several frontends can serve one port (``--reuse-port``, SO_REUSEPORT) or one port each. The
frontend never tokenizes: prompts, chat messages or token ids go to the cluster as they came.

Endpoints: POST /v1/completions, POST /v1/chat/completions (SSE with ``stream``),
GET /v1/models, GET /health, GET /metrics.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import logging
import os
import signal
import socket
import sys
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException
from starlette.responses import Response, StreamingResponse

import zmq

from ipc.async_client import AsyncClient, AsyncRequestHandle
from ipc.client_common import ERR_TIMEOUT, Delta, SplitserveError
from ipc.config import LOOPBACK_HOSTS, ClusterConfig
from ipc.messages import (
    ERR_BAD_REQUEST, ERR_OVERLOADED, ERR_UNAVAILABLE, Heartbeat, WorkerReady,
)
from ipc.sockets import CurveKeys, PushQueue
from procs.http_metrics import HttpMetrics
from procs.openai_protocol import (
    MAX_CHOICES, APIError, ChatCompletionRequest, ChatFormat, CompletionFormat,
    CompletionRequest, ResponseFormat, bad_request, error_body, models_body, usage_body,
)

logger = logging.getLogger("splitserve.http")
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
SSE_DONE = b"data: [DONE]\n\n"
_TYPE_NAMES = {"str", "int", "float", "bool", "list", "dict", "none"}
KNOWN_ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models")


@dataclass(frozen=True, slots=True)
class FrontendSettings:
    client_addr: str
    model_name: str = ""  # "" = the name the cluster reports
    api_key: str = ""  # "" = no authentication (loopback only)
    connect_timeout_s: float = 30.0
    request_deadline_s: float = 0.0  # 0 = none; else unfinished requests end with a 504
    health_fresh_s: float = 5.0  # a token this recent proves the cluster alive: no probe
    health_probe_timeout_s: float = 10.0
    index: int = 0
    url: str = ""  # where this frontend listens, for the start-up line and the supervisor
    supervisor_addr: str = ""  # "" = not supervised; else WorkerReady + heartbeats go there
    heartbeat_interval_s: float = 0.5
    server_public_key: str = ""  # the cluster's CURVE public key ("" = no CURVE)


class SupervisorLink:
    """Reports to the supervisor as every worker does: WorkerReady once this frontend accepts
    connections and has shaken hands with the cluster, then heartbeats carrying its stats."""

    def __init__(self, address: str, index: int, interval_s: float,
                 server_public_key: str = "") -> None:
        self.index, self.interval_s = index, interval_s
        self._ctx = zmq.Context()
        self._queue = PushQueue(self._ctx, address, hwm=100,
                                curve=CurveKeys(server_public_key) if server_public_key else None)

    def send(self, msg: Any) -> None:
        try:
            self._queue.put(msg, block=False)
        except zmq.Again:  # the supervisor is not reading; heartbeats are best-effort
            logger.warning("supervisor channel full; dropped a %s", type(msg).__name__)

    async def heartbeats(self, frontend: "Frontend") -> None:
        while True:
            self.send(Heartbeat(role="http", index=self.index, pid=os.getpid(),
                                t=time.monotonic(), stats=frontend.stats()))
            await asyncio.sleep(self.interval_s)

    def close(self) -> None:
        self._queue.close()
        self._ctx.term()


class Frontend:
    """What the routes share: the SDK client, the served model's facts, metrics, liveness."""

    def __init__(self, settings: FrontendSettings) -> None:
        self.settings = settings
        self.metrics = HttpMetrics()
        self.client: AsyncClient | None = None
        self.model_name = settings.model_name
        self.max_model_len = 0
        self.t_start = int(time.time())
        self.last_alive = 0.0  # time.monotonic() of the latest token any request received
        self._probe: asyncio.Task | None = None
        self._probes = 0

    async def start(self) -> None:
        self.client = await AsyncClient(
            self.settings.client_addr, connect_timeout_s=self.settings.connect_timeout_s,
            deadline_s=self.settings.request_deadline_s or None,
            server_public_key=self.settings.server_public_key or None).start()
        welcome = self.client.welcome
        assert welcome is not None
        self.model_name = self.model_name or welcome.model
        self.max_model_len = welcome.max_model_len

    async def close(self) -> None:
        if self.client is not None:
            client, self.client = self.client, None
            await client.close()  # ClientBye: the cluster aborts whatever is still open

    def stats(self) -> dict[str, float]:
        value = self.metrics.registry.get_sample_value
        return {"in_flight": value("splitserve_http_requests_in_flight") or 0.0,
                "generations_in_flight": value("splitserve_generations_in_flight") or 0.0}

    def check_model(self, requested: str | None) -> None:
        if requested and requested != self.model_name:
            raise APIError(404, f"the model {requested!r} does not exist; this server serves "
                           f"{self.model_name!r}", "invalid_request_error", "model",
                           "model_not_found")

    def require_client(self) -> AsyncClient:
        if self.client is None:
            raise APIError(503, "the frontend is not connected to the cluster", "server_error",
                           None, ERR_UNAVAILABLE)
        return self.client

    async def healthy(self) -> str | None:
        """None when every process answers; else why not. Real traffic counts as an answer, so
        a busy server is never probed; an idle one sends one 1-token request at most per
        ``health_fresh_s``, shared by concurrent health checks."""
        if self.client is None:
            return "not connected to the cluster"
        if time.monotonic() - self.last_alive < self.settings.health_fresh_s:
            return None
        if self._probe is None or self._probe.done():
            self._probe = asyncio.get_running_loop().create_task(self._run_probe())
        return await asyncio.shield(self._probe)

    async def _run_probe(self) -> str | None:
        self._probes += 1
        try:
            handle = self.require_client().submit(
                prompt_token_ids=[0], max_tokens=1, temperature=0.0,
                request_id=f"health-probe-{self._probes}")
        except (SplitserveError, APIError) as exc:
            return f"probe not accepted: {exc}"
        try:
            await handle.result(timeout=self.settings.health_probe_timeout_s)
        except SplitserveError as exc:
            handle.abort()
            return f"probe failed: {exc}"
        self.last_alive = time.monotonic()
        return None


def api_error_from(exc: SplitserveError) -> APIError:
    """The HTTP answer to an SDK error: the client's mistakes are 4xx, never 500."""
    message = str(exc)
    if exc.code == ERR_BAD_REQUEST:
        return bad_request(message)
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

    def __init__(self, frontend: Frontend, handles: list[AsyncRequestHandle], n: int,
                 t_arrived: float) -> None:
        self.frontend, self.handles, self.n, self.t_arrived = frontend, handles, n, t_arrived
        self.finals: list[Delta | None] = [None] * len(handles)
        self.errors: list[str] = [""] * len(handles)
        self._first_t: list[float] = [0.0] * len(handles)
        self._last_t: list[float] = [0.0] * len(handles)
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
        if delta.finished:
            self.finals[i] = delta
            metrics.generations_in_flight.dec()
            metrics.observe_generation(delta.finish_reason, delta.usage, delta.timings,
                                       self._first_t[i], self._last_t[i])

    def usage(self) -> dict[str, Any]:
        """OpenAI counts a prompt once however many choices it has."""
        finals = [f for f in self.finals if f is not None and f.usage is not None]
        prompt = sum(f.usage.prompt_tokens for f in self.finals[::self.n] if f and f.usage)
        cached = sum(f.usage.cached_tokens for f in self.finals[::self.n] if f and f.usage)
        return usage_body(prompt, sum(f.usage.completion_tokens for f in finals), cached)

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
        if not unfinished:  # a latency only for answers given in full: arrival to last event
            metrics.e2e.observe(max(f.t_received for f in self.finals) - self.t_arrived)

    async def aclose(self) -> None:
        # For Starlette's BackgroundTask, which would run a plain function in a thread.
        self.close()

    def fail(self, exc: SplitserveError) -> APIError:
        """A choice failed: the others are aborted, the client gets the error."""
        self.close("abort")
        return api_error_from(exc)


async def _until_disconnect(request: Request) -> None:
    # After the body is read, uvicorn's receive() returns only when the client goes away.
    while (await request.receive())["type"] != "http.disconnect":
        pass


class ClientGone(Exception):
    pass


async def _unless_disconnected(request: Request, awaitable: Any) -> Any:
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


def _json(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(json.dumps(body, ensure_ascii=False, separators=(",", ":")), status,
                    headers, media_type="application/json")


def _sse(body: Any) -> bytes:
    return b"data: " + json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode() \
        + b"\n\n"


def _submit_all(frontend: Frontend, body: CompletionRequest | ChatCompletionRequest,
                fmt: ResponseFormat, default_max_tokens: int, t_arrived: float) -> GenerationCall:
    prompts = body.prompts()
    if len(prompts) * body.n > MAX_CHOICES:
        raise bad_request(f"at most {MAX_CHOICES} choices per request (prompts x n)", "n")
    max_tokens = body.max_tokens_or(default_max_tokens)
    samplings = [body.sampling(max_tokens, j) for j in range(body.n)]
    client = frontend.require_client()  # after validation: bad input is a 400 even when down
    handles: list[AsyncRequestHandle] = []
    try:
        for prompt in prompts:
            for sampling in samplings:
                handles.append(client.submit(**prompt, sampling=sampling,
                                             request_id=f"{fmt.id}-{len(handles)}"))
    except SplitserveError as exc:
        for h in handles:
            h.abort()
        raise api_error_from(exc) from None
    return GenerationCall(frontend, handles, body.n, t_arrived)


async def _generate(request: Request, body: CompletionRequest | ChatCompletionRequest,
                    fmt: ResponseFormat, default_max_tokens: int) -> Response:
    t_arrived = time.monotonic()
    frontend: Frontend = request.app.state.frontend
    frontend.check_model(body.model)
    call = _submit_all(frontend, body, fmt, default_max_tokens, t_arrived)
    events = call.events()
    try:
        if not body.stream:
            return _json(await _unless_disconnected(request, _collect(call, events, fmt)))
        # Wait for the first event before answering, so that errors caught before the engine
        # (bad input, overload) still get their HTTP status instead of a 200 stream.
        first = await _unless_disconnected(request, events.__anext__())
    except ClientGone:
        call.close()
        return Response(status_code=499)  # nobody reads it; the access log does
    except SplitserveError as exc:
        raise call.fail(exc) from None
    except BaseException:
        call.close("internal")
        raise
    return StreamingResponse(_stream(call, first, events, fmt), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                             background=BackgroundTask(call.aclose))


async def _collect(call: GenerationCall, events: AsyncIterator[tuple[int, Delta]],
                   fmt: ResponseFormat) -> dict[str, Any]:
    texts: list[list[str]] = [[] for _ in call.handles]
    async for i, delta in events:
        texts[i].append(delta.text)
    call.close()
    choices = [("".join(t), f.finish_reason if f else None) for t, f in zip(texts, call.finals)]
    return fmt.full(choices, call.usage())


async def _stream(call: GenerationCall, first: tuple[int, Delta],
                  events: AsyncIterator[tuple[int, Delta]], fmt: ResponseFormat
                  ) -> AsyncIterator[bytes]:
    """The SSE body. Ends with [DONE], or with an error object then [DONE] when a choice fails
    mid-stream. A client disconnect cancels this generator; ``finally`` aborts what is left."""
    try:
        for i in range(len(call.handles)):
            if (chunk := fmt.first_chunk(i)) is not None:
                yield _sse(chunk)
        i, delta = first
        while True:
            if delta.text or delta.finished:
                yield _sse(fmt.chunk(i, delta.text,
                                     delta.finish_reason if delta.finished else None))
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


# --- the app ------------------------------------------------------------------------------------


def build_app(settings: FrontendSettings) -> FastAPI:
    frontend = Frontend(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await frontend.start()
        print(f"splitserve http[{settings.index}] pid={os.getpid()} ready: {settings.url} "
              f"model {frontend.model_name!r}, cluster at {settings.client_addr}",
              file=sys.stderr, flush=True)
        link = heartbeats = None
        if settings.supervisor_addr:
            link = SupervisorLink(settings.supervisor_addr, settings.index,
                                  settings.heartbeat_interval_s, settings.server_public_key)
            link.send(WorkerReady(role="http", index=settings.index, pid=os.getpid(),
                                  addresses=[settings.url], model_name=frontend.model_name,
                                  max_model_len=frontend.max_model_len,
                                  vocab_size=frontend.client.welcome.vocab_size))
            heartbeats = asyncio.get_running_loop().create_task(link.heartbeats(frontend))
        try:
            yield
        finally:
            if heartbeats is not None:
                heartbeats.cancel()
            if link is not None:
                link.close()
            await frontend.close()

    app = FastAPI(title="splitserve", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.frontend = frontend
    _install_error_handlers(app)
    _install_middleware(app, frontend, settings.api_key)

    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionRequest) -> Response:
        fmt = CompletionFormat(frontend.model_name, body.include_usage)
        return await _generate(request, body, fmt, COMPLETIONS_DEFAULT_MAX_TOKENS)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, body: ChatCompletionRequest) -> Response:
        fmt = ChatFormat(frontend.model_name, body.include_usage)
        # No limit asked: as much as the context allows (the tokenizer clamps it to the room).
        return await _generate(request, body, fmt, max(1, frontend.max_model_len))

    @app.get("/v1/models")
    async def models() -> Response:
        return _json(models_body(frontend.model_name, frontend.t_start, frontend.max_model_len))

    @app.get("/health")
    async def health() -> Response:
        problem = await frontend.healthy()
        who = {"pid": os.getpid(), "index": settings.index}
        if problem is None:
            return _json({"status": "ok", **who})
        return _json({"status": "unavailable", "reason": problem, **who}, 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        text, content_type = frontend.metrics.render()
        return Response(text, media_type=content_type)

    return app


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError) -> Response:
        retry = {"Retry-After": "1"} if exc.status in (429, 503) else None
        return _json(exc.body(), exc.status, retry)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError) -> Response:
        # FastAPI answers 422; OpenAI (and its SDK's BadRequestError) expect 400.
        errors = exc.errors()
        first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
        # Drop "body" and the union members pydantic names in the path ("str", "list[int]").
        loc = [str(p) for p in first.get("loc", ())
               if p != "body" and not (isinstance(p, str) and (p in _TYPE_NAMES or "[" in p))]
        param = ".".join(loc) or None
        message = first.get("msg", "invalid request").removeprefix("Value error, ")
        if param:
            message = f"{param}: {message}"
        return _json(error_body(message, "invalid_request_error", param, "invalid_value"), 400)

    @app.exception_handler(HTTPException)
    async def on_http_error(request: Request, exc: HTTPException) -> Response:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _json(error_body(str(exc.detail), kind), exc.status_code)

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception) -> Response:
        logger.exception("unexpected error answering %s", request.url.path)
        return _json(error_body("internal server error", "server_error", None, "internal"), 500)


def _install_middleware(app: FastAPI, frontend: Frontend, api_key: str) -> None:
    expected = f"Bearer {api_key}"

    @app.middleware("http")
    async def auth_and_count(request: Request, call_next: Any) -> Response:
        path = request.url.path
        given = request.headers.get("authorization") or ""
        if api_key and path.startswith("/v1/") and not hmac.compare_digest(
                given.encode(), expected.encode()):
            response: Response = _json(error_body(
                "a valid API key is required (Authorization: Bearer ...)",
                "invalid_request_error", None, "invalid_api_key"), 401)
        else:
            response = await call_next(request)
        if path.startswith("/v1/"):
            endpoint = path if path in KNOWN_ENDPOINTS else "other"  # bounded label values
            frontend.metrics.requests.labels(endpoint, str(response.status_code)).inc()
        return response


# --- the process --------------------------------------------------------------------------------


class _Server:
    """uvicorn's Server, except that under the supervisor SIGINT is ignored (as every worker
    does): a terminal's Ctrl-C reaches the supervisor, which stops us in order with SIGTERM."""

    @staticmethod
    def make(config: Any, under_supervisor: bool) -> Any:
        import uvicorn

        class Server(uvicorn.Server):
            def handle_exit(self, sig: int, frame: Any) -> None:
                if under_supervisor and sig == signal.SIGINT:
                    return
                super().handle_exit(sig, frame)

        return Server(config)


def listening_socket(host: str, port: int, reuse_port: bool) -> socket.socket:
    """Bound and listening before the app starts, so the port (even 0) is known up front and
    connections made once the supervisor hears WorkerReady wait in the backlog, never refused.
    With ``reuse_port`` several frontends bind the same port; the kernel spreads connections."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(2048)
    return sock


def frontend_command(client_addr: str, *, port: int, host: str = "127.0.0.1", index: int = 0,
                     reuse_port: bool = False, model_name: str = "",
                     extra_args: tuple[str, ...] = ()) -> list[str]:
    """The command line that starts one frontend (for the supervisor, tests and benchmarks).
    Run it with the repository root as cwd or on PYTHONPATH."""
    cmd = [sys.executable, "-m", "procs.http_server", "--client-addr", client_addr,
           "--host", host, "--port", str(port), "--index", str(index)]
    if reuse_port:
        cmd.append("--reuse-port")
    if model_name:
        cmd += ["--model-name", model_name]
    return cmd + list(extra_args)


def wait_until_serving(base_url: str, popen: Any = None, timeout_s: float = 60.0) -> None:
    """Blocks until GET {base_url}/health answers 200; raises if ``popen`` exits or time runs
    out. /health succeeding means the handshake and one round trip through every process."""
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        if popen is not None and popen.poll() is not None:
            raise RuntimeError(f"the frontend exited with code {popen.returncode} during start-up")
        try:
            with urllib.request.urlopen(f"{base_url}/health", timeout=5) as reply:
                if reply.status == 200:
                    return
        except urllib.error.HTTPError as exc:
            last = f"HTTP {exc.code}"
        except OSError as exc:
            last = str(exc)
        time.sleep(0.1)
    raise TimeoutError(f"{base_url} not serving after {timeout_s:.0f} s ({last})")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m procs.http_server",
                                description="OpenAI-compatible HTTP frontend of a splitserve "
                                "cluster (one process; start several for more).")
    p.add_argument("--client-addr", required=True, metavar="ADDR",
                   help="the cluster's client address (the detokenizer's ROUTER)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on; anything but loopback needs --api-key")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    p.add_argument("--reuse-port", action="store_true",
                   help="bind with SO_REUSEPORT so several frontends share --port")
    p.add_argument("--model-name", default="", metavar="NAME",
                   help="the model name clients use (default: the name the cluster reports)")
    p.add_argument("--api-key", default=os.environ.get("SPLITSERVE_API_KEY", ""),
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: "
                   "$SPLITSERVE_API_KEY, or none)")
    p.add_argument("--index", type=int, default=0, help="this frontend's number (for logs)")
    p.add_argument("--server-public-key", default=os.environ.get("SPLITSERVE_SERVER_PUBLIC_KEY",
                                                                 ""), metavar="KEY",
                   help="the cluster's CURVE public key, when it uses CURVE (--listen); "
                        "default: $SPLITSERVE_SERVER_PUBLIC_KEY")
    p.add_argument("--supervisor-addr", default="", metavar="ADDR",
                   help="send WorkerReady and heartbeats (role 'http') to this supervisor socket")
    p.add_argument("--heartbeat-interval-s", type=float, default=0.5, metavar="SECONDS")
    p.add_argument("--connect-timeout-s", type=float, default=30.0, metavar="SECONDS",
                   help="give up if the cluster does not answer the handshake (default 30)")
    p.add_argument("--request-deadline-s", type=float, default=0.0, metavar="SECONDS",
                   help="end a request not finished after this long with a 504 and abort it in "
                   "the cluster (default 0: no deadline)")
    p.add_argument("--health-fresh-s", type=float, default=5.0, metavar="SECONDS",
                   help="/health probes the cluster only if no token arrived this recently")
    p.add_argument("--health-probe-timeout-s", type=float, default=10.0, metavar="SECONDS")
    p.add_argument("--graceful-shutdown-s", type=int, default=10, metavar="SECONDS",
                   help="on SIGTERM, wait this long for open responses before closing them")
    p.add_argument("--log-level", default=os.environ.get("SPLITSERVE_LOG_LEVEL", "INFO"))
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.host not in LOOPBACK_HOSTS and not args.api_key:
        sys.exit(f"listening on {args.host} (not loopback) requires --api-key")
    under_supervisor = bool(os.environ.get("SPLITSERVE_SUPERVISOR_PID"))
    if under_supervisor:
        from procs.run_worker import die_with_parent
        die_with_parent()
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr, format=(
        f"%(asctime)s http-{args.index} pid=%(process)d %(levelname)s %(name)s: %(message)s"))
    sock = listening_socket(args.host, args.port, args.reuse_port)
    host = f"[{args.host}]" if ":" in args.host else args.host
    settings = FrontendSettings(
        client_addr=args.client_addr, model_name=args.model_name, api_key=args.api_key,
        connect_timeout_s=args.connect_timeout_s, request_deadline_s=args.request_deadline_s,
        health_fresh_s=args.health_fresh_s,
        health_probe_timeout_s=args.health_probe_timeout_s, index=args.index,
        url=f"http://{host}:{sock.getsockname()[1]}", supervisor_addr=args.supervisor_addr,
        heartbeat_interval_s=args.heartbeat_interval_s,
        server_public_key=args.server_public_key)
    import uvicorn

    config = uvicorn.Config(build_app(settings), host=args.host, port=args.port, loop="uvloop",
                            http="auto", lifespan="on", access_log=False, log_config=None,
                            log_level=args.log_level.lower(),
                            timeout_graceful_shutdown=args.graceful_shutdown_s)
    server = _Server.make(config, under_supervisor)
    server.run(sockets=[sock])
    if not server.started:
        sys.exit(3)  # start-up failed (no cluster answered): the log above says why


def main_from_config(config: ClusterConfig, index: int) -> None:
    """The supervisor's way in (``python -m procs.run_worker http INDEX CONFIG``): one frontend
    of the cluster, reporting to the supervisor like every other worker."""
    argv = ["--client-addr", config.client_addr, "--host", config.http_host,
            "--port", str(config.http_port or 0), "--index", str(index),
            "--supervisor-addr", config.supervisor_addr,
            "--heartbeat-interval-s", str(config.heartbeat_interval_s)]
    if config.http_workers > 1:
        argv.append("--reuse-port")
    if config.http_api_key:
        argv += ["--api-key", config.http_api_key]
    if config.curve_public_key:
        argv += ["--server-public-key", config.curve_public_key]
    main(argv)


if __name__ == "__main__":
    main()
