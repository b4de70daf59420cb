"""The asyncio client (uvloop-friendly): the same API as the sync Client, awaited.

    async with AsyncClient(address) as client:
        handle = client.submit("Hello", max_tokens=16)     # not awaited: returns at once
        async for delta in handle:
            ...
        result = await handle.result()

A receiver task owns the DEALER socket and hands every frame and tick to the ClientCore, sending
what that answers; everything runs on one event loop thread, so handles need no locks.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import zmq
import zmq.asyncio

from ipc import codec
from ipc.client.base import ClientBase
from ipc.client.errors import RequestTimeoutError, UnavailableError
from ipc.client.queries import Builder
from ipc.client.records import HandleBase, RequestRecord
from ipc.client.requests import prompt_kwargs
from ipc.client.results import Delta, GenerationResult
from ipc.client.transport import (
    SubmitPipes,
    curve_keys,
    disconnect_monitor,
    make_dealer,
    make_submit_pipes,
    monitor_events,
)
from ipc.messages import ClientWelcome, SamplingParams
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


class AsyncClient(ClientBase[AsyncRequestHandle]):
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
        super().__init__(deadline_s, tokenizer_retries)
        self.address = address
        self._curve = curve_keys(server_public_key)
        self.connect_timeout_s = connect_timeout_s
        self.submit_hwm = submit_hwm
        self._ctx = zmq.asyncio.Context()
        self._dealer: zmq.asyncio.Socket | None = None
        self._pipes: SubmitPipes | None = None
        self._monitor: zmq.Socket | None = None
        self._task: asyncio.Task | None = None
        self._pending_sends: set[asyncio.Task] = set()

    @classmethod
    async def connect(cls, address: str, **kwargs: Any) -> AsyncClient:
        return await cls(address, **kwargs).start()

    async def start(self) -> AsyncClient:
        """The handshake; raises UnavailableError when nobody answers."""
        dealer: zmq.asyncio.Socket = make_dealer(
            self._ctx.socket(zmq.DEALER), self.client_id, self.address, self._curve
        )
        await dealer.send(self._core.hello_frame())
        if not await dealer.poll(int(self.connect_timeout_s * 1000)):
            dealer.close(linger=0)
            raise UnavailableError(
                f"no splitserve cluster answered at {self.address} within "
                f"{self.connect_timeout_s} s"
            )
        welcome = codec.decode_as(await dealer.recv(), ClientWelcome)
        self._dealer = dealer
        self._monitor = disconnect_monitor(dealer)
        # Plain sockets: a NOBLOCK send never waits, so submit() needs no await.
        self._pipes = make_submit_pipes(
            self._ctx, self.address, welcome, self.submit_hwm, self._curve
        )
        self._core.connected(welcome, self._pipes)
        self._task = asyncio.get_running_loop().create_task(self._receive_loop())
        return self

    def _make_handle(self, record: RequestRecord) -> AsyncRequestHandle:
        return AsyncRequestHandle(self, record)

    def _ask(
        self,
        build: Builder,
        timeout: float | None,
        read: Callable[[Any], Any],
        *,
        to_detokenizer: bool = False,
    ) -> Any:
        """Sends one query now (see QueryMethods); the awaitable it returns gives read(reply)."""
        if to_detokenizer:
            handle, frame = self._core.open_query(self._make_handle, timeout, build)
            self._send_control(frame)
        else:
            handle = self._core.send(self._make_handle, None, timeout, build)

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
        dealer, monitor = self._dealer, self._monitor
        assert dealer is not None and monitor is not None
        while True:
            out: list[bytes] = []
            if await dealer.poll(self._core.next_deadline_ms(100)):
                out += self._core.on_frame(await dealer.recv())
            if monitor_events(monitor):
                # The detokenizer is gone: route what it sent before, then end what is open.
                while await dealer.poll(0):
                    out += self._core.on_frame(await dealer.recv())
                out += self._core.on_disconnect()
            out += self._core.on_tick(time.monotonic())
            for frame in out:
                await dealer.send(frame)

    def _send_control(self, frame: bytes) -> None:
        if self._dealer is None:
            return
        # zmq.asyncio's send() returns a Future, not a coroutine: ensure_future takes both.
        task = asyncio.ensure_future(self._dealer.send(frame))
        self._pending_sends.add(task)
        task.add_done_callback(self._pending_sends.discard)

    async def close(self) -> None:
        """Aborts what is still in flight (ClientBye) and ends its handles with an error."""
        if not self._core.shut():
            return
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
        self._core.end_open()
        if self._monitor is not None:
            self._monitor.close(linger=0)
            self._monitor = None
        if self._pipes is not None:
            self._pipes.close()
            self._pipes = None
        self._ctx.term()

    async def __aenter__(self) -> AsyncClient:
        return await self.start() if self._dealer is None else self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
