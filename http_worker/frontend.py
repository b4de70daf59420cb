"""One frontend process's shared state: its SDK client, the served model's facts, metrics and
liveness (what /health reports)."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from http_worker.engine_metrics import render_engine_metrics
from http_worker.metrics import HttpMetrics
from http_worker.protocol import APIError
from ipc.client import AsyncClient, SplitserveError
from ipc.config import DEFAULT_MAX_BODY_BYTES
from ipc.messages import ERR_UNAVAILABLE

logger = logging.getLogger("splitserve.http")


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
    lenient_fields: bool = False  # unknown request fields: logged and ignored instead of a 400
    engine_stats_timeout_s: float = 2.0  # a scrape waits this long for the engine's figures
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # a larger request body is refused (413)


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
            self.settings.client_addr,
            connect_timeout_s=self.settings.connect_timeout_s,
            deadline_s=self.settings.request_deadline_s or None,
            server_public_key=self.settings.server_public_key or None,
        ).start()
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
        return render_engine_metrics(report.stats, self.model_name)

    def check_model(self, requested: str | None) -> None:
        if requested and requested != self.model_name:
            raise APIError(
                404,
                f"the model {requested!r} does not exist; this server serves {self.model_name!r}",
                "invalid_request_error",
                "model",
                "model_not_found",
            )

    def require_client(self) -> AsyncClient:
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
