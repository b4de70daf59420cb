"""The asyncio client (uvloop-friendly): the same API as the sync Client, awaited.

    async with AsyncClient(address) as client:
        handle = client.submit("Hello", max_tokens=16)     # not awaited: returns at once
        async for delta in handle:
            ...
        result = await handle.result()

A receiver task hands every frame and tick to the ClientCore, sending what that answers;
everything runs on one event loop thread, so handles need no locks. The DEALER is a plain socket
whose descriptor the loop watches (DealerWatch): a frame costs a wake-up and two non-blocking
calls, not zmq.asyncio's poller and future per await (the HTTP worker's main cost per token).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import zmq

from ipc import codec
from ipc.client.base import ClientBase
from ipc.client.dealer_watch import DealerWatch
from ipc.client.errors import RequestTimeoutError, UnavailableError
from ipc.client.queries import Builder
from ipc.client.records import HandleBase, RequestRecord
from ipc.client.requests import prompt_kwargs
from ipc.client.results import Delta, GenerationResult
from ipc.client.transport import SubmitPipes, disconnect_monitor, make_dealer, make_submit_pipes
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
    """See ClientBase for the arguments; ``await start()`` (or ``async with``) connects."""

    def _setup(self) -> None:
        self._dealer: DealerWatch | None = None
        self._pipes: SubmitPipes | None = None
        self._task: asyncio.Task | None = None

    @classmethod
    async def connect(cls, address: str, **kwargs: Any) -> AsyncClient:
        return await cls(address, **kwargs).start()

    async def start(self) -> AsyncClient:
        """The handshake; raises UnavailableError when nobody answers."""
        sock = make_dealer(
            zmq.Socket(self._ctx, zmq.DEALER), self.client_id, self.address, self._curve
        )
        dealer = DealerWatch(sock, asyncio.get_running_loop())
        dealer.send([self._core.hello_frame()])
        if not await dealer.readable(self.connect_timeout_s):
            dealer.close(linger=0)
            raise UnavailableError(
                f"no splitserve cluster answered at {self.address} within "
                f"{self.connect_timeout_s} s"
            )
        welcome = codec.decode_as(sock.recv(), ClientWelcome)
        self._dealer = dealer
        dealer.watch_disconnect(disconnect_monitor(sock))
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
        handle = self._send_query(build, timeout, to_detokenizer)

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
        dealer = self._dealer
        assert dealer is not None
        while True:
            out: list[bytes] = []
            for frame in dealer.frames():
                out += self._core.on_frame(frame)
            if dealer.disconnected():
                # The detokenizer is gone: route what it sent before, then end what is open.
                for frame in dealer.frames():
                    out += self._core.on_frame(frame)
                out += self._core.on_disconnect()
            out += self._core.on_tick(time.monotonic())
            dealer.send(out)
            await dealer.wait(self._core.next_deadline_ms(100))

    def _send_control(self, frame: bytes) -> None:
        if self._dealer is not None:
            self._dealer.send([frame])

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
        if self._dealer is not None:
            self._dealer.send([self._core.bye_frame()])
            await self._dealer.flush(LINGER_MS / 1e3)
            self._dealer.close(linger=LINGER_MS)
            self._dealer = None
        self._core.end_open()
        if self._pipes is not None:
            self._pipes.close()
            self._pipes = None
        self._ctx.term()

    async def __aenter__(self) -> AsyncClient:
        return await self.start() if self._dealer is None else self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
