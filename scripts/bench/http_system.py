"""The OpenAI-compatible HTTP frontend as a system under test (mode http)."""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import time

from ipc.messages import SamplingParams
from scripts.bench.metrics import RequestRecord
from scripts.bench.runner import EventCollector
from scripts.bench.systems import cluster_cpu, cpu_of
from scripts.bench.workloads import BenchRequest


class HttpSystem:
    """The OpenAI-compatible HTTP frontend, driven the way an HTTP user drives it: streamed
    ``/v1/completions`` (or ``/v1/chat/completions`` for chat prompts) from one asyncio HTTP
    client (httpx) on its own event-loop thread. ``submit`` hands the request to that loop and
    returns; a delta's receive time is stamped when its SSE chunk is parsed.

    Either launches its own cluster with a supervised frontend (mode ``http``), or drives a
    frontend that is already serving (``--endpoint URL``; its processes are not ours, so only the
    client's CPU time is known). The OpenAI API carries no server timestamps: TTFT and the
    latencies are measured, TTFT's parts are not."""

    def __init__(
        self,
        name: str,
        collector: EventCollector,
        *,
        endpoint: str | None = None,
        model_path: str | None = None,
        tokenizer_workers: int = 1,
        cluster_knobs: dict | None = None,
    ) -> None:
        import asyncio

        import httpx

        self.name = name
        self._collector = collector
        self._stack = contextlib.ExitStack()
        self.cluster = None
        if endpoint is None:
            from procs.launch_cluster import launch_cluster

            self.cluster = self._stack.enter_context(
                launch_cluster(
                    model_path,
                    tokenizer_workers=tokenizer_workers,
                    http_port=0,
                    **(cluster_knobs or {}),
                )
            )
            endpoint = self.cluster.http_url
        self.url = endpoint.rstrip("/")
        if self.url.endswith("/v1"):
            self.url = self.url[:-3]
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name=f"{name}-loop", daemon=True
        )
        self._thread.start()
        self._tasks: dict[str, object] = {}

        async def make_client():
            return httpx.AsyncClient(
                timeout=httpx.Timeout(None, connect=30.0),
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=1024),
            )

        self._http = self._call(make_client())
        try:
            models = self._call(self._http.get(f"{self.url}/v1/models"))
            models.raise_for_status()
            self.model = models.json()["data"][0]["id"]
        except BaseException:
            self.close()
            raise

    def _call(self, coro):
        import asyncio

        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def describe(self) -> dict[str, object]:
        out: dict[str, object] = {
            "endpoint": self.url,
            "client": "httpx.AsyncClient, SSE",
            "submit latency": "until the request body is written to the "
            "connection (httpcore trace)",
        }
        if self.cluster is not None:
            c = self.cluster.config
            out["tokenize"] = (
                f"{c.tokenizer_workers} tokenizer worker process(es) x "
                f"{c.tokenizer_threads} thread(s)"
            )
            out["engine_threads"] = c.engine.engine_threads
        return out

    def prepare(self, requests: list[BenchRequest]) -> None:
        pass

    def submit(self, request_id: str, request: BenchRequest, sampling: SamplingParams) -> None:
        import asyncio

        self._tasks[request_id] = asyncio.run_coroutine_threadsafe(
            self._one(request_id, request, sampling), self._loop
        )

    def abort(self, request_id: str) -> None:
        task = self._tasks.pop(request_id, None)
        if task is not None:
            task.cancel()  # closes the connection: the frontend aborts it in the engine

    def cpu_seconds(self) -> dict[str, float]:
        out = {"client": cpu_of([os.getpid()])}
        if self.cluster is not None:
            out |= cluster_cpu(self.cluster)
        return out

    def close(self) -> None:
        if getattr(self, "_http", None) is not None:
            self._call(self._http.aclose())
            self._http = None
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self._stack.close()

    async def _one(self, request_id: str, request: BenchRequest, sampling: SamplingParams) -> None:
        import json

        body: dict[str, object] = {
            "model": self.model,
            "max_tokens": sampling.max_tokens,
            "temperature": sampling.temperature,
            "ignore_eos": sampling.ignore_eos,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if sampling.seed is not None:
            body["seed"] = sampling.seed
        if sampling.stop:
            body["stop"] = sampling.stop
        if request.messages is not None:
            path, body["messages"] = "/v1/chat/completions", request.messages
        else:
            path, body["prompt"] = "/v1/completions", request.prompt
        times: list[float] = []
        outcome: dict[str, object] = {
            "finish_reason": None,
            "error": None,
            "usage": None,
            "t_sent": 0.0,
        }

        async def trace(event: str, info: dict) -> None:
            if event == "http11.send_request_body.complete":
                outcome["t_sent"] = time.monotonic()

        try:
            async with self._http.stream(
                "POST", self.url + path, json=body, extensions={"trace": trace}
            ) as reply:
                if reply.status_code != 200:
                    text = (await reply.aread()).decode(errors="replace")
                    outcome["error"] = f"HTTP {reply.status_code}: {text[:300]}"
                else:
                    async for line in reply.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        now = time.monotonic()
                        chunk = json.loads(line[len("data: ") :])
                        if chunk.get("error"):
                            outcome["error"] = str(chunk["error"].get("message", chunk["error"]))
                        for choice in chunk.get("choices") or ():
                            delta = choice.get("delta") or {}
                            if choice.get("text") or delta.get("content"):
                                times.append(now)
                            outcome["finish_reason"] = (
                                choice.get("finish_reason") or outcome["finish_reason"]
                            )
                        if chunk.get("usage"):
                            outcome["usage"] = chunk["usage"]
        except Exception as exc:  # noqa: BLE001 - any transport failure ends the request
            outcome["error"] = f"{type(exc).__name__}: {exc}"
        t_done = time.monotonic()
        self._tasks.pop(request_id, None)
        self._collector.complete(
            request_id, functools.partial(_fill_http, times=times, t_done=t_done, **outcome)
        )


def _fill_http(
    rec: RequestRecord,
    *,
    times: list[float],
    t_done: float,
    finish_reason: str | None,
    error: str | None,
    usage: dict | None,
    t_sent: float,
) -> None:
    rec.delta_times, rec.t_done = times, t_done
    if t_sent:  # an HTTP request is submitted once its body is written to the connection
        rec.t_submit_done = t_sent
    rec.finish_reason = "error" if error else finish_reason
    rec.error = error
    if usage:
        rec.prompt_tokens = int(usage.get("prompt_tokens", 0))
        rec.output_tokens = int(usage.get("completion_tokens", 0))
        details = usage.get("prompt_tokens_details") or {}
        rec.cached_tokens = int(details.get("cached_tokens") or 0)
