"""The sync client (the asyncio twin is ipc.client.async_client.AsyncClient; usage in the
package's docstring).

``submit`` encodes the request and hands it to ZeroMQ without waiting: no round trip, no
tokenization. When every tokenizer's pipe is full it raises OverloadedError at once. One
DEALER socket per client carries the handshake, aborts and all the client's events; a background
thread owns it and hands every frame and tick to the ClientCore, sending what that answers.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import zmq

from ipc import codec
from ipc.client.base import ClientBase
from ipc.client.errors import RequestTimeoutError, UnavailableError
from ipc.client.queries import Builder
from ipc.client.records import HandleBase, RequestRecord
from ipc.client.requests import prompt_kwargs
from ipc.client.results import Delta, GenerationResult
from ipc.client.transport import disconnect_monitor, make_dealer, make_submit_pipes, monitor_events
from ipc.messages import ClientWelcome, SamplingParams
from ipc.sockets import LINGER_MS


class RequestHandle(HandleBase):
    def __init__(self, client: Client, record: RequestRecord) -> None:
        super().__init__(client, record)
        self._cond = threading.Condition()

    def deliver(self, delta: Delta) -> None:  # receiver thread
        with self._cond:
            self._deltas.append(delta)
            self._cond.notify_all()

    def _has_delta(self, i: int) -> bool:
        return len(self._deltas) > i

    def stream(self, timeout: float | None = None) -> Iterator[Delta]:
        """Yields deltas as they arrive; an error ending raises its SplitserveError."""
        i = 0
        while True:
            with self._cond:
                if not self._cond.wait_for(functools.partial(self._has_delta, i), timeout):
                    raise RequestTimeoutError(f"no event within {timeout} s", self.request_id)
            delta = self._next_delta(i)
            i += 1
            yield delta
            if delta.finished:
                return

    __iter__ = stream

    def result(self, timeout: float | None = None, *, check: bool = True) -> GenerationResult:
        """Waits for the terminal event. ``check``: raise the error of a failed request."""
        with self._cond:
            if not self._cond.wait_for(lambda: self.record.final is not None, timeout):
                raise RequestTimeoutError(f"not finished within {timeout} s", self.request_id)
        result = self.record.result()
        return result.raise_for_error() if check else result


class Client(ClientBase[RequestHandle]):
    def _setup(self) -> None:
        """Connects and does the handshake (raises UnavailableError when nobody answers)."""
        address, curve = self.address, self._curve
        dealer = make_dealer(self._ctx.socket(zmq.DEALER), self.client_id, address, curve)
        dealer.send(self._core.hello_frame())
        if not dealer.poll(int(self.connect_timeout_s * 1000)):
            dealer.close(linger=0)
            self._ctx.term()
            raise UnavailableError(
                f"no splitserve cluster answered at {address} within "
                f"{self.connect_timeout_s} s" + _curve_hint(curve)
            )
        welcome = codec.decode_as(dealer.recv(), ClientWelcome)
        self._pipes = make_submit_pipes(self._ctx, address, welcome, self.submit_hwm, curve)
        self._core.connected(welcome, self._pipes)
        # User threads hand frames for the DEALER (aborts, queries) to the receiver thread
        # through an inproc pipe; _control_lock guards its PUSH end, whose send may wait for the
        # receiver to drain it (never taken together with the core's lock).
        control_addr = f"inproc://control-{self.client_id.decode()}"
        control_in = self._ctx.socket(zmq.PULL)
        control_in.bind(control_addr)
        self._control = self._ctx.socket(zmq.PUSH)
        self._control.connect(control_addr)
        self._control_lock = threading.Lock()
        self._thread = threading.Thread(
            target=self._receive_loop,
            args=(dealer, control_in, disconnect_monitor(dealer)),
            name="splitserve-client",
            daemon=True,
        )
        self._thread.start()

    def _make_handle(self, record: RequestRecord) -> RequestHandle:
        return RequestHandle(self, record)

    def generate(
        self,
        prompts: list[Any],
        sampling: SamplingParams | None = None,
        *,
        check: bool = True,
        timeout: float | None = None,
        **sampling_kwargs: Any,
    ) -> list[GenerationResult]:
        """Submits every prompt (a string, or a list of chat messages) and waits for all."""
        handles = [
            self.submit(**prompt_kwargs(p), sampling=sampling, **sampling_kwargs) for p in prompts
        ]
        return [h.result(timeout, check=check) for h in handles]

    def _ask(
        self,
        build: Builder,
        timeout: float | None,
        read: Callable[[Any], Any],
        *,
        to_detokenizer: bool = False,
    ) -> Any:
        """Sends one query (see QueryMethods) and returns read(its reply)."""
        handle = self._send_query(build, timeout, to_detokenizer)
        handle.result()  # raises the query's error
        return read(handle.record.reply)

    def _send_control(self, frame: bytes) -> None:
        with self._control_lock:
            if not self._core.closed:  # closing aborts everything; the pipe is going away
                self._control.send(frame)

    # --- the receiver thread ------------------------------------------------------------------
    def _receive_loop(
        self, dealer: zmq.Socket, control_in: zmq.Socket, monitor: zmq.Socket
    ) -> None:
        poller = zmq.Poller()
        for sock in (dealer, control_in, monitor):
            poller.register(sock, zmq.POLLIN)
        try:
            while not self._core.closed:
                ready = dict(poller.poll(self._core.next_deadline_ms(100)))
                out: list[bytes] = []
                if control_in in ready:
                    out += _drain(control_in)
                if dealer in ready or monitor in ready:
                    for frame in _drain(dealer):
                        out += self._core.on_frame(frame)
                if monitor in ready and monitor_events(monitor):
                    # The detokenizer is gone (whatever it sent before is routed above). Its
                    # replacement binds the same address: the DEALER reconnects by itself and
                    # what we send waits in its pipe until then.
                    out += self._core.on_disconnect()
                out += self._core.on_tick(time.monotonic())
                for frame in out:
                    dealer.send(frame)
            for frame in _drain(control_in):
                dealer.send(frame)
            dealer.send(self._core.bye_frame())
        finally:
            dealer.disable_monitor()
            monitor.close(linger=0)
            dealer.close(linger=LINGER_MS)
            control_in.close(linger=0)

    # --- closing ------------------------------------------------------------------------------
    def close(self) -> None:
        """Aborts what is still in flight (ClientBye) and ends its handles with an error."""
        if not self._core.shut():
            return
        with self._control_lock:
            pass  # an abort in the middle of its send has finished; later ones see closed
        self._thread.join(timeout=5)
        self._core.end_open()
        self._pipes.close()
        self._control.close(linger=0)
        self._ctx.term()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _curve_hint(curve: object) -> str:
    return (
        ""
        if curve is not None
        else " (a cluster that listens beyond loopback needs server_public_key=)"
    )


def _drain(sock: zmq.Socket) -> list[bytes]:
    """Every frame ``sock`` holds now, without waiting."""
    frames = []
    while True:
        try:
            frames.append(sock.recv(zmq.NOBLOCK))
        except zmq.Again:
            return frames
