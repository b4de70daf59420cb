"""The systems the benchmarks drive, behind one small interface
(scripts.bench.runner.SystemUnderTest): the in-process baseline and the cluster through the SDK
(the serving workload), and an OpenAI-compatible HTTP server (the peer workload)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import os
import queue
import threading
import time

from ipc.messages import SamplingParams
from scripts.bench import http_client, launcher
from scripts.bench.inproc import InprocServer
from scripts.bench.launcher import cluster_cpu, cpu_of, cpu_of_threads
from scripts.bench.runner import EventCollector, copy_server_side
from scripts.bench.stats import RequestRecord
from scripts.bench.workloads import BenchRequest


class InprocSystem:
    """One process: the main thread submits (tokenizing unless pretok), one engine thread steps
    and detokenizes; inproc and inproc-pretok share one InprocServer. CPU roles: "client" is the
    submitting and collecting threads (tokenization too unless pretok), "engine" the rest."""

    def __init__(
        self, name: str, server: InprocServer, collector: EventCollector, pretok: bool
    ) -> None:
        self.name = name
        self.pretok = pretok
        self.server = server
        self._client_threads = {threading.main_thread().native_id, collector.thread_id}
        self._ids: dict[int, list[int]] = {}

    def describe(self) -> dict[str, object]:
        return {
            "tokenize": "before the timed region"
            if self.pretok
            else "inside submit(), in the caller's thread",
            "engine_threads": self.server.engine.config.engine_threads,
            "detokenize": "in the engine thread",
            "stream_interval_tokens": self.server.detokenizer.stream_interval_tokens,
        }

    def prepare(self, requests: list[BenchRequest]) -> None:
        self._ids = (
            {r.index: self.server.pretokenize(r.prompt, r.messages) for r in requests}
            if self.pretok
            else {}
        )

    def submit(self, request_id: str, request: BenchRequest, sampling: SamplingParams) -> None:
        if self.pretok:
            self.server.submit(request_id, sampling, prompt_token_ids=self._ids[request.index])
        else:
            self.server.submit(
                request_id, sampling, prompt=request.prompt, messages=request.messages
            )

    def abort(self, request_id: str) -> None:
        self.server.abort(request_id)

    def cpu_seconds(self) -> dict[str, float]:
        total = cpu_of([os.getpid()])
        client = cpu_of_threads(self._client_threads)
        # Process and thread times tick at 10 ms each: clamp the rounding of an idle engine.
        return {"client": client, "engine": max(0.0, total - client)}

    def close(self) -> None:
        pass  # the shared server is closed by whoever made it


class ClusterSystem:
    """The cluster (the supervisor as a library) through the sync client SDK, which stamps every
    delta's receive time; a watcher thread copies finished handles' deltas into the records. CPU
    roles are processes: the tokenizer workers, the engine, the detokenizer, this one (client)."""

    def __init__(
        self,
        name: str,
        model_path: str,
        tokenizer_workers: int,
        cluster_knobs: dict,
        collector: EventCollector,
        poll_s: float,
    ) -> None:
        """poll_s: how often the watcher looks for finished handles. Only --max-concurrency
        waits on it (the timestamps are the SDK's own); each wake-up takes the
        GIL from the submitting thread, so poll slowly unless a concurrency cap needs it."""
        from ipc.client import Client

        self.name = name
        self._collector = collector
        self._poll_s = poll_s
        self._stack = contextlib.ExitStack()
        try:
            self.cluster = self._stack.enter_context(
                launcher.splitserve(
                    model_path, tokenizer_workers=tokenizer_workers, **cluster_knobs
                )
            )
            self.client = self._stack.enter_context(Client(self.cluster.client_addr))
        except BaseException:
            self._stack.close()
            raise
        self._new: queue.SimpleQueue = queue.SimpleQueue()
        self._closing = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name=f"{name}-watch", daemon=True)
        self._watcher.start()

    def describe(self) -> dict[str, object]:
        c = self.cluster.config
        return {
            "tokenize": f"{c.tokenizer_workers} tokenizer worker process(es) x "
            f"{c.tokenizer_threads} thread(s)",
            "engine_threads": c.engine.engine_threads,
            "stream_interval_tokens": c.stream_interval_tokens,
        }

    def prepare(self, requests: list[BenchRequest]) -> None:
        pass

    def submit(self, request_id: str, request: BenchRequest, sampling: SamplingParams) -> None:
        handle = self.client.submit(
            prompt=request.prompt,
            messages=request.messages,
            sampling=sampling,
            request_id=request_id,
        )
        self._new.put((request_id, handle))

    def abort(self, request_id: str) -> None:
        self._new.put((request_id, None))

    def cpu_seconds(self) -> dict[str, float]:
        return {"client": cpu_of([os.getpid()])} | cluster_cpu(self.cluster)

    def close(self) -> None:
        self._closing.set()
        self._watcher.join(timeout=5)
        self._stack.close()

    def _watch(self) -> None:
        live: dict[str, object] = {}
        while not self._closing.is_set():
            while True:
                try:
                    request_id, handle = self._new.get_nowait()
                except queue.Empty:
                    break
                if handle is None:  # abort
                    if (h := live.pop(request_id, None)) is not None:
                        h.abort()
                else:
                    live[request_id] = handle
            for request_id in [rid for rid, h in live.items() if h.done]:
                deltas = _deltas_of(live.pop(request_id))
                self._collector.complete(request_id, functools.partial(_fill, deltas=deltas))
            time.sleep(self._poll_s)


def _deltas_of(handle) -> list:
    """Every delta of a finished handle, the terminal one included (stream() raises the error of
    a failed request after yielding what came before it)."""
    out = []
    try:
        for delta in handle.stream(timeout=0):
            out.append(delta)
    except Exception as exc:  # the request ended with an error: keep it as a final "delta"
        out.append(_ErrorEnd(str(exc)))
    return out


class _ErrorEnd:
    def __init__(self, message: str) -> None:
        self.error, self.t_received = message, time.monotonic()


def _fill(rec: RequestRecord, deltas: list) -> None:
    final = deltas[-1]
    rec.delta_times = [d.t_received for d in deltas if not isinstance(d, _ErrorEnd) and d.token_ids]
    rec.t_done = final.t_received
    if isinstance(final, _ErrorEnd):
        rec.finish_reason, rec.error = "error", final.error
        return
    rec.finish_reason, rec.error = final.finish_reason, final.error
    copy_server_side(rec, final.usage, final.timings)


class HttpSystem:
    """An OpenAI-compatible HTTP server (splitserve's frontend, llama-server) driven with streamed
    chat completions from the benchmarks' one HTTP client on an event-loop thread of its own;
    a delta's receive time is stamped when its SSE chunk is parsed. The API carries no server
    timestamps (TTFT's parts are not known), and only the client's CPU time is known."""

    def __init__(
        self, name: str, collector: EventCollector, endpoint: str, keepalive: bool = True
    ) -> None:
        self.name = name
        self._collector = collector
        self.url = http_client.base_url(endpoint)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name=f"{name}-loop", daemon=True
        )
        self._thread.start()
        self._tasks: dict[str, concurrent.futures.Future] = {}

        async def make_client():
            return http_client.make_http(keepalive)

        self._http = self._call(make_client())
        try:
            self.model = self._call(http_client.model_id(self._http, self.url))
        except BaseException:
            self.close()
            raise

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def prepare(self, requests: list[BenchRequest]) -> None:
        pass

    def submit(self, request_id: str, request: BenchRequest, sampling: SamplingParams) -> None:
        body = http_client.chat_body(self.model, request.messages or [], sampling.max_tokens)
        self._tasks[request_id] = asyncio.run_coroutine_threadsafe(
            self._one(request_id, body), self._loop
        )

    async def _one(self, request_id: str, body: dict) -> None:
        outcome = await http_client.stream(self._http, self.url, body)
        self._tasks.pop(request_id, None)
        self._collector.complete(request_id, outcome.fill)

    def abort(self, request_id: str) -> None:
        task = self._tasks.pop(request_id, None)
        if task is not None:
            task.cancel()  # closes the connection: the frontend aborts it in the engine

    def cpu_seconds(self) -> dict[str, float]:
        return {"client": cpu_of([os.getpid()])}

    def close(self) -> None:
        if getattr(self, "_http", None) is not None:
            self._call(self._http.aclose())
            self._http = None
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
