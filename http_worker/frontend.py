"""One frontend process's shared state: its SDK client, the served model's facts, metrics and
liveness (what /health reports)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from http_worker.engine_metrics import render_engine_metrics
from http_worker.metrics import HttpMetrics
from http_worker.protocol import APIError
from ipc.client import AsyncClient, AsyncRequestHandle, SplitserveError
from ipc.config import (
    API_KEY_HELP,
    DEFAULT_MAX_BODY_BYTES,
    HTTP_MAX_BODY_BYTES_HELP,
    LENIENT_FIELDS_HELP,
    ClusterConfig,
)
from ipc.knobs import check_knobs, knob
from ipc.messages import ERR_UNAVAILABLE, ClientWelcome

logger = logging.getLogger("splitserve.http")


@dataclass(frozen=True, slots=True)
class FrontendSettings:
    """One frontend's knobs: a standalone frontend's flags are made from these fields
    (http_worker.worker), a supervised one's come from the cluster's config (``from_cluster``)."""

    client_addr: str = knob(
        "", "the cluster's client address (the detokenizer's ROUTER)", unit="ADDR"
    )
    model_name: str = knob(
        "", "the model name clients use; empty: the name the cluster reports", unit="NAME"
    )
    api_key: str = knob("", API_KEY_HELP, unit="KEY")  # "" = no authentication (loopback only)
    connect_timeout_s: float = knob(
        30.0, "give up if the cluster does not answer the handshake", unit="SECONDS", minimum=0.1
    )
    request_deadline_s: float = knob(
        0.0,
        "end a request not finished after this long with a 504 and abort it in the cluster "
        "(0: no deadline)",
        unit="SECONDS",
        minimum=0.0,
    )
    health_fresh_s: float = knob(
        5.0,
        "/health probes the cluster only if no token arrived this recently",
        unit="SECONDS",
        minimum=0.0,
    )
    health_probe_timeout_s: float = knob(
        10.0, "how long /health waits for its probe", unit="SECONDS", minimum=0.1
    )
    index: int = knob(0, "this frontend's number (for logs and the supervisor)", minimum=0)
    url: str = knob("", "where this frontend listens (set when it binds)", cli=False)
    supervisor_addr: str = knob(
        "", "send WorkerReady and heartbeats (role 'http') to this supervisor socket", unit="ADDR"
    )
    heartbeat_interval_s: float = knob(
        0.5, "how often heartbeats go to the supervisor", unit="SECONDS", minimum=0.01
    )
    server_public_key: str = knob(
        "", "the cluster's CURVE public key, when it uses CURVE (--listen)", unit="KEY"
    )
    lenient_fields: bool = knob(False, LENIENT_FIELDS_HELP)
    engine_stats_timeout_s: float = knob(
        2.0,
        "a /metrics scrape waits this long for the engine's figures",
        unit="SECONDS",
        minimum=0.1,
    )
    max_body_bytes: int = knob(
        DEFAULT_MAX_BODY_BYTES,
        HTTP_MAX_BODY_BYTES_HELP,
        unit="BYTES",
        minimum=1024,
        flag="--http-max-body-bytes",
    )

    def __post_init__(self) -> None:
        check_knobs(self)
        if not self.client_addr:
            raise ValueError("client_addr is required (the cluster's client address)")

    @classmethod
    def from_cluster(cls, config: ClusterConfig, index: int) -> FrontendSettings:
        """Frontend ``index`` of a supervised cluster."""
        return cls(
            client_addr=config.client_addr,
            api_key=config.http_api_key,
            index=index,
            supervisor_addr=config.supervisor_addr,
            heartbeat_interval_s=config.heartbeat_interval_s,
            server_public_key=config.curve_public_key,
            lenient_fields=config.lenient_fields,
            max_body_bytes=config.http_max_body_bytes,
        )


class ClusterClient(Protocol):
    """What the routes use of the SDK's AsyncClient. A launcher may hand the frontend another
    implementation (``build_app(connect=)``): procs/serve_ray's, whose engines sit behind Ray
    Serve, hands out AsyncRequestHandles all the same."""

    @property
    def welcome(self) -> ClientWelcome | None: ...

    def submit(self, *args: Any, **kwargs: Any) -> AsyncRequestHandle: ...
    def tokenize(self, *args: Any, **kwargs: Any) -> Any: ...
    def detokenize(self, *args: Any, **kwargs: Any) -> Any: ...
    def tokenizer_info(self, *args: Any, **kwargs: Any) -> Any: ...
    def engine_stats(self, *args: Any, **kwargs: Any) -> Any: ...
    async def close(self) -> None: ...


# How a frontend gets its client once its event loop runs (Frontend.start).
Connect = Callable[["FrontendSettings"], Awaitable[ClusterClient]]


async def connect_cluster(settings: FrontendSettings) -> ClusterClient:
    """The default: the SDK's AsyncClient on the cluster's client address."""
    return await AsyncClient(
        settings.client_addr,
        connect_timeout_s=settings.connect_timeout_s,
        deadline_s=settings.request_deadline_s or None,
        server_public_key=settings.server_public_key or None,
    ).start()


class Frontend:
    """What the routes share: the SDK client, the served model's facts, metrics, liveness."""

    def __init__(self, settings: FrontendSettings, connect: Connect = connect_cluster) -> None:
        self.settings = settings
        self._connect = connect
        self.metrics = HttpMetrics()
        self.client: ClusterClient | None = None
        self.model_name = settings.model_name
        self.max_model_len = 0
        self.vocab_size = 0  # the served model's, once connected (0: not known)
        self.t_start = int(time.time())
        self.last_alive = 0.0  # time.monotonic() of the latest token any request received
        self._probe: asyncio.Task | None = None
        self._probes = 0

    async def start(self) -> None:
        self.client = await self._connect(self.settings)
        welcome = self.client.welcome
        assert welcome is not None
        self.model_name = self.model_name or welcome.model
        self.max_model_len = welcome.max_model_len
        self.vocab_size = welcome.vocab_size

    async def close(self) -> None:
        if self.client is not None:
            client, self.client = self.client, None
            await client.close()  # ClientBye: the cluster aborts whatever is still open

    def stats(self) -> dict[str, float]:
        value = self.metrics.registry.get_sample_value
        return {
            "in_flight": value("splitserve_http_requests_in_flight") or 0.0,
            "generations_in_flight": value("splitserve_generations_in_flight") or 0.0,
        }

    async def engine_metrics(self) -> bytes:
        """The engine's series (engine_metrics.py), or nothing while the cluster does not answer
        (the series are then absent from the scrape, not stale)."""
        if self.client is None:
            return b""
        try:
            report = await self.client.engine_stats(timeout=self.settings.engine_stats_timeout_s)
        except SplitserveError as exc:
            logger.warning("no engine stats for /metrics: %s", exc)
            return b""
        return render_engine_metrics(report, self.model_name)

    def check_model(self, requested: str | None) -> None:
        if requested and requested != self.model_name:
            raise APIError(
                404,
                f"the model {requested!r} does not exist; this server serves {self.model_name!r}",
                "invalid_request_error",
                "model",
                "model_not_found",
            )

    def require_client(self) -> ClusterClient:
        if self.client is None:
            raise APIError(
                503,
                "the frontend is not connected to the cluster",
                "server_error",
                None,
                ERR_UNAVAILABLE,
            )
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
                prompt_token_ids=[0],
                max_tokens=1,
                temperature=0.0,
                request_id=f"health-probe-{self._probes}",
            )
        except (SplitserveError, APIError) as exc:
            return f"probe not accepted: {exc}"
        try:
            await handle.result(timeout=self.settings.health_probe_timeout_s)
        except SplitserveError as exc:
            handle.abort()
            return f"probe failed: {exc}"
        self.last_alive = time.monotonic()
        return None
