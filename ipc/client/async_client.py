"""The asyncio client (uvloop-friendly): the same API as the sync Client, awaited.

    async with AsyncClient(address) as client:
        handle = client.submit("Hello", max_tokens=16)     # not awaited: returns at once
        async for delta in handle:
            ...
        result = await handle.result()

A receiver task owns the DEALER socket and routes events to handles; everything runs on one
event loop thread, so handles need no locks.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import zmq
import zmq.asyncio

from ipc import codec
from ipc.client.core import ClientCore
from ipc.client.errors import RequestTimeoutError, UnavailableError
from ipc.client.queries import Builder, QueryMethods
from ipc.client.records import HandleBase, RequestRecord, closed_event, timeout_event
from ipc.client.requests import prompt_kwargs
from ipc.client.results import Delta, GenerationResult
from ipc.client.transport import (
    curve_keys,
    disconnect_monitor,
    make_dealer,
    make_submit_sockets,
    monitor_events,
)
from ipc.messages import ClientAbort, ClientWelcome, SamplingParams, StreamEvent
from ipc.sockets import LINGER_MS


class AsyncRequestHandle(HandleBase):
    def __init__(self, client: AsyncClient, record: RequestRecord) -> None:
        super().__init__(client, record)
        self._changed = asyncio.Event()

    def deliver(self, delta: Delta) -> None:
        self._deltas.append(delta)
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()  # wakes every waiter, each re-checks its own position

    async def stream(self) -> AsyncIterator[Delta]:
        i = 0
        while True:
            while len(self._deltas) <= i:
                await self._changed.wait()
            delta = self._next_delta(i)
            i += 1
            yield delta
            if delta.finished:
                return

    def __aiter__(self) -> AsyncIterator[Delta]:
        return self.stream()

    async def result(self, timeout: float | None = None, *, check: bool = True) -> GenerationResult:
        async def finished() -> None:
            while self.record.final is None:
                await self._changed.wait()

        try:
            await asyncio.wait_for(finished(), timeout)
        except asyncio.TimeoutError:
            raise RequestTimeoutError(f"not finished within {timeout} s", self.request_id) from None
        result = self.record.result()
        return result.raise_for_error() if check else result

    def abort(self) -> None:
        if not self.done:
            self.record.aborted = True
            self._client._send_soon(codec.encode(ClientAbort([self.record.wire_id])))


class AsyncClient(QueryMethods):
    def __init__(
        self,
        address: str,
        *,
        connect_timeout_s: float = 30.0,
        deadline_s: float | None = None,
        submit_hwm: int | None = None,
        server_public_key: str | bytes | None = None,
        tokenizer_retries: int = 1,
    ) -> None:
        """See ipc.client.Client for the arguments (server_public_key: the cluster's CURVE key)."""
        self.address = address
        self._curve = curve_keys(server_public_key)
        self.connect_timeout_s = connect_timeout_s
        self.submit_hwm = submit_hwm
        self._core = ClientCore(deadline_s, tokenizer_retries)
        self.client_id = self._core.client_id
        self._ctx = zmq.asyncio.Context()
        self._dealer: zmq.asyncio.Socket | None = None
        self._submit: list[zmq.Socket] | None = None
        self._monitor: zmq.Socket | None = None
        self._task: asyncio.Task | None = None
        self._pending_sends: set[asyncio.Task] = set()
        self.welcome: ClientWelcome | None = None

    @classmethod
    async def connect(cls, address: str, **kwargs: Any) -> AsyncClient:
        return await cls(address, **kwargs).start()

    async def start(self) -> AsyncClient:
        """The handshake; raises UnavailableError when nobody answers."""
        dealer: zmq.asyncio.Socket = make_dealer(
            self._ctx.socket(zmq.DEALER), self._core.client_id, self.address, self._curve
        )
        await dealer.send(self._core.hello_frame())
        if not await dealer.poll(int(self.connect_timeout_s * 1000)):
            dealer.close(linger=0)
            raise UnavailableError(
                f"no splitserve cluster answered at {self.address} within "
                f"{self.connect_timeout_s} s"
            )
        self.welcome = codec.decode_as(await dealer.recv(), ClientWelcome)
        self._dealer = dealer
        self._monitor = disconnect_monitor(dealer)
        # Plain sockets: a NOBLOCK send never waits, so submit() needs no await.
        self._submit = make_submit_sockets(
            self._ctx, self.address, self.welcome, self.submit_hwm, self._curve
        )
        self._task = asyncio.get_running_loop().create_task(self._receive_loop())
        return self

    def submit(
        self,
        prompt: str | None = None,
        *,
        messages: list[Any] | None = None,
        prompt_token_ids: Any = None,
        sampling: SamplingParams | None = None,
        request_id: str | None = None,
        add_generation_prompt: bool = True,
        deadline_s: float | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        continuous_usage_stats: bool = False,
        **sampling_kwargs: Any,
    ) -> AsyncRequestHandle:
        """See Client.submit."""
        if self._submit is None:
            raise UnavailableError("the client is not started (await start()) or is closed")
        return self._core.submit(
            self._submit,
            lambda record: AsyncRequestHandle(self, record),
            request_id,
            deadline_s,
            prompt=prompt,
            messages=messages,
            prompt_token_ids=prompt_token_ids,
            sampling=sampling,
            sampling_kwargs=sampling_kwargs,
            add_generation_prompt=add_generation_prompt,
            chat_template_kwargs=chat_template_kwargs,
            continuous_usage_stats=continuous_usage_stats,
        )

    def _ask(
        self,
        build: Builder,
        timeout: float | None,
        read: Callable[[Any], Any],
        *,
        to_detokenizer: bool = False,
    ) -> Any:
        """Sends one query now (see QueryMethods); the awaitable it returns gives read(reply)."""
        if self._submit is None:
            raise UnavailableError("the client is not started (await start()) or is closed")

        def make(record: RequestRecord) -> AsyncRequestHandle:
            return AsyncRequestHandle(self, record)

        if to_detokenizer:
            handle, frame = self._core.open_query(make, timeout, build)
            self._send_soon(frame)
        else:
            handle = self._core.send(self._submit, make, None, timeout, build)

        async def answer() -> Any:
            await handle.result()  # raises the query's error
            return read(handle.record.reply)

        return answer()

    async def generate(
        self,
        prompts: list[Any],
        sampling: SamplingParams | None = None,
        *,
        check: bool = True,
        **sampling_kwargs: Any,
    ) -> list[GenerationResult]:
        handles = [
            self.submit(**prompt_kwargs(p), sampling=sampling, **sampling_kwargs) for p in prompts
        ]
        return [await h.result(check=check) for h in handles]

    async def _receive_loop(self) -> None:
        assert self._dealer is not None and self._monitor is not None
        while True:
            if await self._dealer.poll(self._core.next_deadline_ms(100)):
                self._route(await self._dealer.recv())
            if monitor_events(self._monitor):
                # The detokenizer is gone: route what it sent before, then end what is open.
                while await self._dealer.poll(0):
                    self._route(await self._dealer.recv())
                lost = self._core.on_disconnected()
                await self._dealer.send(self._core.hello_frame())
                await self._end_lost(lost)
            expired = self._core.expired(time.monotonic())
            if expired:
                await self._dealer.send(codec.encode(ClientAbort(expired)))
                for wire_id in expired:
                    self._core.apply(
                        self._core.records[wire_id],
                        timeout_event(wire_id, self._core.deadline_s),
                        time.monotonic(),
                    )

    def _route(self, frame: bytes) -> None:
        routed = self._core.route(frame)
        if routed.welcome is not None:
            self.welcome = routed.welcome
        if lost := routed.lost:
            self._send_soon(codec.encode(ClientAbort([wid for wid, _ in lost])))
            if routed.retry and self._submit is not None:
                lost = self._core.resubmit(self._submit, lost)
            self._core.end_lost(lost)

    async def _end_lost(self, lost: list[tuple[str, StreamEvent]]) -> None:
        if lost and self._dealer is not None:
            await self._dealer.send(codec.encode(ClientAbort([wid for wid, _ in lost])))
            self._core.end_lost(lost)

    def _send_soon(self, frame: bytes) -> None:
        if self._dealer is None:
            return
        # zmq.asyncio's send() returns a Future, not a coroutine: ensure_future takes both.
        task = asyncio.ensure_future(self._dealer.send(frame))
        self._pending_sends.add(task)
        task.add_done_callback(self._pending_sends.discard)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
            self._task = None
        if self._pending_sends:
            await asyncio.gather(*self._pending_sends, return_exceptions=True)
        if self._dealer is not None:
            await self._dealer.send(self._core.bye_frame())
            self._dealer.disable_monitor()
            self._dealer.close(linger=LINGER_MS)
            self._dealer = None
        now = time.monotonic()
        for wire_id, handle in list(self._core.records.items()):
            self._core.apply(handle, closed_event(wire_id), now)
        if self._monitor is not None:
            self._monitor.close(linger=0)
            self._monitor = None
        if self._submit is not None:
            for sock in self._submit:
                sock.close(linger=0)
            self._submit = None
        self._ctx.term()

    async def __aenter__(self) -> AsyncClient:
        return await self.start() if self._dealer is None else self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
