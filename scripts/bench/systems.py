"""The systems the serving workload drives, behind one small interface
(scripts.bench.runner.SystemUnderTest): the in-process baseline and the cluster through the SDK."""

from __future__ import annotations

import contextlib
import functools
import os
import queue
import threading
import time
from typing import Any

from ipc.messages import SamplingParams
from scripts.bench import launcher
from scripts.bench.inproc import InprocServer
from scripts.bench.launcher import cpu_by_role, cpu_of, cpu_of_threads
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
            {r.index: self.server.pretokenize(r.prompt) for r in requests} if self.pretok else {}
        )

    def submit(self, request_id: str, request: BenchRequest, sampling: SamplingParams) -> None:
        if self.pretok:
            self.server.submit(request_id, sampling, prompt_token_ids=self._ids[request.index])
        else:
            self.server.submit(request_id, sampling, prompt=request.prompt)

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
        with contextlib.ExitStack() as stack:  # closed here if the client cannot connect
            cluster = launcher.splitserve(
                model_path, tokenizer_workers=tokenizer_workers, **cluster_knobs
            )
            self.cluster = stack.enter_context(cluster)
            self.client = stack.enter_context(Client(self.cluster.client_addr))
            self._stack = stack.pop_all()
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
        handle = self.client.submit(prompt=request.prompt, sampling=sampling, request_id=request_id)
        self._new.put((request_id, handle))

    def abort(self, request_id: str) -> None:
        self._new.put((request_id, None))

    def cpu_seconds(self) -> dict[str, float]:
        return cpu_by_role(self.cluster)

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
                fill = functools.partial(_fill, handle=live.pop(request_id))
                self._collector.complete(request_id, fill)
            time.sleep(self._poll_s)


def _fill(rec: RequestRecord, handle: Any) -> None:
    """A finished handle's deltas into its record (stream() raises the error of a failed request
    after yielding what came before it)."""
    deltas: list = []
    try:
        for delta in handle.stream(timeout=0):
            deltas.append(delta)
    except Exception as exc:  # the request ended with an error
        rec.finish_reason, rec.error, rec.t_done = "error", str(exc), time.monotonic()
    rec.delta_times = [d.t_received for d in deltas if d.token_ids]
    if rec.error is None:
        final = deltas[-1]
        rec.finish_reason, rec.error = final.finish_reason, final.error
        rec.t_done = final.t_received
        copy_server_side(rec, final.usage, final.timings)
