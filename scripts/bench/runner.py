"""Drives one system under test through one workload run: submits on the arrival schedule,
collects the stream events into RequestRecords, measures each role's CPU time over the run."""

from __future__ import annotations

import gc
import math
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from ipc.messages import RequestTimings, SamplingParams, StreamEvent, Usage
from scripts.bench.stats import RequestRecord
from scripts.bench.workloads import ArrivalSpec, BenchRequest

# The request's timings a record copies (the same names on both).
SERVER_STAMPS = (
    "t_tokenize_start t_tokenized t_arrived t_scheduled t_first_token t_last_token t_finished"
).split()


class SystemUnderTest(Protocol):
    """A system under test. Events for its requests go to the EventCollector it was given."""

    name: str

    def prepare(self, requests: list[BenchRequest]) -> None:
        """Work done before the timed region (pretokenizing, for instance)."""

    def submit(self, request_id: str, request: BenchRequest, sampling: SamplingParams) -> None: ...

    def abort(self, request_id: str) -> None: ...

    def cpu_seconds(self) -> dict[str, float]:
        """Cumulative user+system CPU seconds per role (differenced around each run)."""

    def close(self) -> None: ...


class EventCollector:
    """Fills in the run's records as requests progress and counts them down: ``deliver(events)``
    for raw StreamEvents (the in-process server; a collector thread stamps them as a client
    would receive them), ``complete(request_id, fill)`` for an outcome a client already holds
    with its own receive stamps (the cluster SDK's)."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._records: dict[str, RequestRecord] = {}
        self._lock = threading.Lock()
        self._pending = 0
        self._all_done = threading.Event()
        self._on_done = None
        self._thread = threading.Thread(target=self._run, name="bench-collector", daemon=True)
        self._thread.start()

    @property
    def thread_id(self) -> int | None:
        return self._thread.native_id

    def deliver(self, events: list[StreamEvent], t_received: float | None = None) -> None:
        """Thread-safe. ``t_received``: a receive stamp the caller already took (else now)."""
        self._queue.put((t_received, events))

    def expect(self, records: dict[str, RequestRecord], on_done) -> threading.Event:
        with self._lock:
            self._records = records
            self._pending = len(records)
            self._on_done = on_done
            self._all_done.clear()
        return self._all_done

    def _run(self) -> None:
        while True:
            t_received, events = self._queue.get()
            t = time.monotonic() if t_received is None else t_received
            for ev in events:
                self._apply(ev, t)

    def _apply(self, ev: StreamEvent, t: float) -> None:
        if not ev.finished:
            with self._lock:
                rec = self._records.get(ev.request_id)
                if rec is not None and not rec.t_done and ev.token_ids:
                    rec.delta_times.append(t)
            return
        self.complete(ev.request_id, lambda rec: _finish_from_event(rec, ev, t))

    def complete(self, request_id: str, fill: Callable[[RequestRecord], None]) -> None:
        """Ends one request: ``fill`` writes its outcome into the record (under the lock).
        Thread-safe; ignores requests already ended and those of earlier runs."""
        with self._lock:
            rec = self._records.get(request_id)
            if rec is None or rec.t_done:
                return
            fill(rec)
            rec.t_done = rec.t_done or time.monotonic()
            self._pending -= 1
            on_done, last = self._on_done, self._pending == 0
        if on_done is not None:
            on_done(rec)
        if last:
            self._all_done.set()


def _finish_from_event(rec: RequestRecord, ev: StreamEvent, t: float) -> None:
    if ev.token_ids:
        rec.delta_times.append(t)
    rec.t_done = t
    rec.finish_reason = ev.finish_reason
    rec.error = ev.error
    copy_server_side(rec, ev.usage, ev.timings)


def copy_server_side(
    rec: RequestRecord, usage: Usage | None, timings: RequestTimings | None
) -> None:
    """The usage's token counts and the server-side stamps (the client's own t_submit is kept)."""
    if usage is not None:
        rec.prompt_tokens = usage.prompt_tokens
        rec.output_tokens = usage.completion_tokens
        rec.cached_tokens = usage.cached_tokens
    if timings is not None:
        for name in SERVER_STAMPS:
            setattr(rec, name, getattr(timings, name))


def fail(error: str, reason: str = "error") -> Callable[[RequestRecord], None]:
    def fill(rec: RequestRecord) -> None:
        rec.finish_reason, rec.error = reason, error

    return fill


@dataclass(slots=True)
class RunResult:
    mode: str
    run_index: int  # counts warmups too; warmup tells them apart
    warmup: bool
    records: list[RequestRecord]
    cpu_seconds: dict[str, float] = field(default_factory=dict)
    timed_out: int = 0
    request_rate: float = math.inf  # the offered rate of the run's arrivals (inf: not Poisson)


@dataclass(frozen=True, slots=True)
class RunOptions:
    max_concurrency: int = 0  # 0: unlimited
    request_timeout_s: float = 600.0  # for the whole run after the last submit


def run_once(
    system: SystemUnderTest,
    collector: EventCollector,
    requests: list[BenchRequest],
    arrival: ArrivalSpec,
    sampling_for,
    options: RunOptions,
    *,
    mode: str,
    run_index: int,
    warmup: bool,
) -> RunResult:
    """Runs the workload once; ``sampling_for(request)`` gives each request's SamplingParams."""
    system.prepare(requests)
    ids = [f"{mode}-{run_index}-{r.index}" for r in requests]
    records = {rid: RequestRecord(index=r.index, request_id=rid) for rid, r in zip(ids, requests)}
    limiter = (
        threading.BoundedSemaphore(options.max_concurrency) if options.max_concurrency > 0 else None
    )

    def on_done(_rec: RequestRecord) -> None:
        if limiter is not None:
            limiter.release()

    all_done = collector.expect(records, on_done)
    cpu_before = system.cpu_seconds()
    # The driver's own garbage (records, handles, the workload) must not land on a submit():
    # a gen-2 collection here takes tens of ms. Paused for the submit loop, in every mode alike.
    gc.collect()
    gc.disable()
    try:
        _submit_all(system, collector, records, requests, arrival, sampling_for, limiter)
    finally:
        gc.enable()
    timed_out = 0
    if not all_done.wait(options.request_timeout_s):
        timed_out = _give_up(system, collector, records)
    cpu_after = system.cpu_seconds()
    # Clock-tick rounding can make a near-idle role's difference a hair below zero.
    cpu = {role: max(0.0, cpu_after[role] - cpu_before.get(role, 0.0)) for role in cpu_after}
    return RunResult(
        mode=mode,
        run_index=run_index,
        warmup=warmup,
        records=[records[rid] for rid in ids],
        cpu_seconds=cpu,
        timed_out=timed_out,
        request_rate=arrival.request_rate,
    )


def _submit_all(
    system: SystemUnderTest,
    collector: EventCollector,
    records: dict[str, RequestRecord],
    requests: list[BenchRequest],
    arrival: ArrivalSpec,
    sampling_for,
    limiter: threading.BoundedSemaphore | None,
) -> None:
    offsets = arrival.offsets_s(len(requests))
    t0 = time.monotonic()
    for i, (rid, request) in enumerate(zip(records, requests)):
        planned = t0 + offsets[i]
        delay = planned - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        if limiter is not None:
            limiter.acquire()
        rec = records[rid]
        rec.t_planned = planned
        sampling = sampling_for(request)
        cpu = time.thread_time()
        rec.t_submit = time.monotonic()
        try:
            system.submit(rid, request, sampling)
        except Exception as exc:  # refused at once (overload, bad input): that request ends
            rec.t_submit_done = time.monotonic()
            rec.submit_cpu_s = time.thread_time() - cpu
            collector.complete(rid, fail(f"submit raised {type(exc).__name__}: {exc}"))
            continue
        rec.t_submit_done = time.monotonic()
        rec.submit_cpu_s = time.thread_time() - cpu


def _give_up(
    system: SystemUnderTest, collector: EventCollector, records: dict[str, RequestRecord]
) -> int:
    """Aborts whatever has not finished and marks it as an error, so the run still reports."""
    late = [rid for rid, rec in records.items() if not rec.t_done]
    for rid in late:
        system.abort(rid)
        collector.complete(rid, fail("timed out (--request-timeout-s)", "abort"))
    return len(late)
