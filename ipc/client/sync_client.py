"""The sync client (the asyncio twin is ipc.client.async_client.AsyncClient; usage in the
package's docstring).

``submit`` encodes the request and hands it to ZeroMQ without waiting: no round trip, no
tokenization. When every tokenizer's pipe is full it raises OverloadedError at once. One
DEALER socket per client carries the handshake, aborts and all the client's events; a background
thread owns it and routes events to handles.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import zmq

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

    def abort(self) -> None:
        """Asks the cluster to stop this request; its terminal event (reason "abort") follows."""
        if not self.done:
            self._client._abort(self.record)


class Client(QueryMethods):
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
        """Connects and does the handshake (raises UnavailableError when nobody answers).

        deadline_s: a client-side limit per request; past it the request ends with a timeout
        error and is aborted in the cluster (a last resort against a hang, off by default).
        server_public_key: the cluster's CURVE public key (the supervisor prints it and writes
        it to curve_public.key in its run dir); needed when the cluster uses CURVE (--listen).
        tokenizer_retries: how many times a request still queued in a tokenizer worker that
        died is sent again to a live one before it ends with an "unavailable" error.
        submit_hwm: requests each tokenizer pipe holds before submit() raises OverloadedError;
        default: the cluster's admission bound (max_waiting_requests) over its tokenizers.
        """
        curve = curve_keys(server_public_key)
        self._core = ClientCore(deadline_s, tokenizer_retries)
        self.client_id = self._core.client_id
        self._ctx = zmq.Context()
        # _lock: the submit sockets, wire ids (a resend changes one) and _closing; the receiver
        # thread takes it too, so nobody blocks while holding it. _control_lock: the control
        # socket, whose blocking send waits for the receiver thread to drain the pipe.
        self._lock = threading.Lock()
        self._control_lock = threading.Lock()
        dealer = make_dealer(self._ctx.socket(zmq.DEALER), self._core.client_id, address, curve)
        dealer.send(self._core.hello_frame())
        if not dealer.poll(int(connect_timeout_s * 1000)):
            dealer.close(linger=0)
            self._ctx.term()
            raise UnavailableError(
                f"no splitserve cluster answered at {address} within "
                f"{connect_timeout_s} s" + _curve_hint(curve)
            )
        self.welcome: ClientWelcome = codec.decode_as(dealer.recv(), ClientWelcome)
        self._submit = make_submit_sockets(self._ctx, address, self.welcome, submit_hwm, curve)
        self._control_addr = f"inproc://control-{self._core.client_id.decode()}"
        control_in = self._ctx.socket(zmq.PULL)
        control_in.bind(self._control_addr)
        self._control = self._ctx.socket(zmq.PUSH)
        self._control.connect(self._control_addr)
        self._closing = threading.Event()
        monitor = disconnect_monitor(dealer)
        self._thread = threading.Thread(
            target=self._receive_loop,
            args=(dealer, control_in, monitor),
            name="splitserve-client",
            daemon=True,
        )
        self._thread.start()

    @property
    def model(self) -> str:
        return self.welcome.model

    @property
    def max_model_len(self) -> int:
        return self.welcome.max_model_len

    # --- submitting ---------------------------------------------------------------------------
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
    ) -> RequestHandle:
        """Sampling keywords are SamplingParams' fields (max_completion_tokens is accepted as
        max_tokens' other name). chat_template_kwargs: extra chat template variables (with
        messages), e.g. {"enable_thinking": False}. continuous_usage_stats: every delta carries
        the usage so far, not only the last."""
        with self._lock:
            if self._closing.is_set():
                raise UnavailableError("the client is closed")
            return self._core.submit(
                self._submit,
                lambda record: RequestHandle(self, record),
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

        def make(record: RequestRecord) -> RequestHandle:
            return RequestHandle(self, record)

        with self._lock:
            if self._closing.is_set():
                raise UnavailableError("the client is closed")
            if not to_detokenizer:
                handle = self._core.send(self._submit, make, None, timeout, build)
            else:
                handle, frame = self._core.open_query(make, timeout, build)
        if to_detokenizer:
            with self._control_lock:
                if not self._closing.is_set():
                    self._control.send(frame)
        handle.result()  # raises the query's error
        return read(handle.record.reply)

    # --- the receiver thread ------------------------------------------------------------------
    def _receive_loop(
        self, dealer: zmq.Socket, control_in: zmq.Socket, monitor: zmq.Socket
    ) -> None:
        poller = zmq.Poller()
        poller.register(dealer, zmq.POLLIN)
        poller.register(control_in, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        try:
            while not self._closing.is_set():
                ready = dict(poller.poll(self._core.next_deadline_ms(100)))
                if control_in in ready:
                    while (frame := _recv_nowait(control_in)) is not None:
                        dealer.send(frame)
                if dealer in ready or monitor in ready:
                    while (frame := _recv_nowait(dealer)) is not None:
                        self._route(frame, dealer)
                if monitor in ready and monitor_events(monitor):
                    # The detokenizer is gone (whatever it sent before is routed above). Its
                    # replacement binds the same address: the DEALER reconnects by itself and
                    # these wait in its pipe until then.
                    lost = self._core.on_disconnected()
                    dealer.send(self._core.hello_frame())
                    self._end_lost(lost, dealer)
                self._expire(dealer)
            while (frame := _recv_nowait(control_in)) is not None:
                dealer.send(frame)
            dealer.send(self._core.bye_frame())
        finally:
            dealer.disable_monitor()
            monitor.close(linger=0)
            dealer.close(linger=LINGER_MS)
            control_in.close(linger=0)

    def _route(self, frame: bytes, dealer: zmq.Socket) -> None:
        routed = self._core.route(frame)
        if routed.welcome is not None:
            self.welcome = routed.welcome
        self._end_lost(routed.lost, dealer, routed.retry)

    def _end_lost(
        self, lost: list[tuple[str, StreamEvent]], dealer: zmq.Socket, retry: bool = False
    ) -> None:
        """Aborts any copy still in the cluster of requests lost with a worker, sends those
        lost with a tokenizer again where it can, and ends the rest."""
        if lost:
            dealer.send(codec.encode(ClientAbort([wire_id for wire_id, _ in lost])))
            if retry:
                with self._lock:  # the submit sockets, and wire ids against _abort
                    if not self._closing.is_set():
                        lost = self._core.resubmit(self._submit, lost)
            self._core.end_lost(lost)

    def _expire(self, dealer: zmq.Socket) -> None:
        expired = self._core.expired(time.monotonic())
        if expired:
            dealer.send(codec.encode(ClientAbort(expired)))
        for wire_id in expired:
            handle = self._core.records[wire_id]
            self._core.apply(
                handle, timeout_event(wire_id, self._core.deadline_s), time.monotonic()
            )

    def _abort(self, record: RequestRecord) -> None:
        with self._lock:  # a resend either happened (new wire id) or will see the flag
            record.aborted = True
            frame = codec.encode(ClientAbort([record.wire_id]))
        with self._control_lock:
            if not self._closing.is_set():
                self._control.send(frame)

    # --- closing ------------------------------------------------------------------------------
    def close(self) -> None:
        """Aborts what is still in flight (ClientBye) and ends its handles with an error."""
        with self._lock:
            if self._closing.is_set():
                return
            self._closing.set()
        with self._control_lock:  # (not under _lock: the receiver may need it to drain for us)
            pass  # an abort in the middle of its send has finished; later ones see _closing
        self._thread.join(timeout=5)
        now = time.monotonic()
        for wire_id, handle in list(self._core.records.items()):
            self._core.apply(handle, closed_event(wire_id), now)
        for sock in self._submit:
            sock.close(linger=0)
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


def _recv_nowait(sock: zmq.Socket) -> bytes | None:
    try:
        return sock.recv(zmq.NOBLOCK)
    except zmq.Again:
        return None
