"""The ingress replica's client: what the HTTP frontend (http_worker, unchanged) uses instead of
the SDK's AsyncClient, with the engines behind Ray Serve.

An ingress replica plays the tokenizer workers' role: ``submit`` builds the SubmitRequest as the
SDK does (same checks, same errors), then a tokenizing thread prepares it as a tokenizer worker
would (chat template, encode, validation against the engines' limits, structured outputs; the
same ``RequestPreparer``) and hashes its full blocks. The engine deployment gets the token ids
and the block ids (``calls.EngineCall``); its request router picks the replica; the replica's
events feed the request's handle, an ordinary ``AsyncRequestHandle``.

Faults: a request whose engine replica died (or whose call failed) before it produced anything
is sent again once, to whichever replica the router picks then (Serve restarts the dead one);
otherwise it ends with an ``unavailable`` error. Either way it ends with exactly one terminal
event. ``abort`` cancels the Serve call, which aborts the request in the engine replica.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ray.serve.handle import DeploymentHandle

from ipc import codec
from ipc.block_hash import BlockHasher
from ipc.client import AsyncRequestHandle, UnavailableError
from ipc.client.core import ClientCore
from ipc.client.errors import error_for
from ipc.client.queries import Builder, QueryMethods
from ipc.client.records import RequestRecord, unavailable_event
from ipc.client.requests import build_submit, encode_request
from ipc.messages import (
    FINISH_ABORT,
    FINISH_ERROR,
    ClientWelcome,
    RequestError,
    StreamEvent,
    SubmitRequest,
    TokenizedRequest,
)
from ipc.messages.queries import TokenizeResult
from procs.serve_ray.calls import EngineCall, PrefillResult, decode_events
from tokenizer_worker.prepare import RequestPreparer
from tokenizer_worker.query_answers import TokenizerQueries

logger = logging.getLogger("splitserve.serve_ray")
BATCH_MAX = 64  # requests prepared in one encode_batch, as a tokenizer worker batches
RETRIES = 1  # sends again of a request whose replica died before it produced anything

# (the request ready for an engine, or why not; its block ids; its text for a character router)
Prepared = tuple[TokenizedRequest | RequestError, list[int], str | None]


class PrepareQueue:
    """Tokenizing and hashing on one thread of its own, batched: the event loop, which streams
    every other request, never encodes a prompt. ``with_text``: each request's prompt as text
    too (its token ids decoded, the chat template applied), for a router that matches
    characters."""

    def __init__(self, preparer: RequestPreparer, block_size: int, with_text: bool = False) -> None:
        self.preparer = preparer
        self.with_text = with_text
        self.queries = TokenizerQueries(preparer.tokenizer, preparer.chat_template, preparer.limits)
        self.hasher = BlockHasher(block_size)
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="splitserve-tokenize")
        self.waiting: list[tuple[SubmitRequest, asyncio.Future[Prepared]]] = []
        self.draining = False

    async def prepare(self, request: SubmitRequest) -> Prepared:
        future: asyncio.Future[Prepared] = asyncio.get_running_loop().create_future()
        self.waiting.append((request, future))
        if not self.draining:
            self.draining = True
            asyncio.get_running_loop().create_task(self._drain())
        return await future

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while self.waiting:
                batch, self.waiting = self.waiting[:BATCH_MAX], self.waiting[BATCH_MAX:]
                try:
                    results = await loop.run_in_executor(
                        self.executor, self._prepare, [r for r, _ in batch]
                    )
                except Exception as exc:  # a bug here fails this batch, not the ingress
                    for _, future in batch:
                        if not future.done():
                            future.set_exception(exc)
                    continue
                for (_, future), result in zip(batch, results):
                    if not future.done():
                        future.set_result(result)
        finally:
            self.draining = False

    def _prepare(self, requests: list[SubmitRequest]) -> list[Prepared]:
        out: list[Prepared] = []
        for result in self.preparer.prepare_batch(requests):
            if isinstance(result, TokenizedRequest):
                hashes = self.hasher.hashes(result.token_ids, result.cache_salt)
                text = self.preparer.tokenizer.decode(result.token_ids) if self.with_text else None
                out.append((result, hashes, text))
            else:
                out.append((result, [], None))
        return out

    async def answer(self, query: Any) -> TokenizeResult | RequestError:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, self.queries.answer, query)


class ServeRequestHandle(AsyncRequestHandle):
    """An SDK handle whose events come from an engine replica through Serve."""

    task: asyncio.Task | None = None

    def __init__(self, client: ServeClient, record: RequestRecord) -> None:
        # The base keeps its client only for abort(), which this class does its own way.
        super().__init__(client, record)  # type: ignore[arg-type]

    def abort(self) -> None:
        if not self.done and self.task is not None:
            self.record.aborted = True
            self.task.cancel()


class ServeClient(QueryMethods):
    def __init__(
        self,
        engine: DeploymentHandle,
        prepare: PrepareQueue,
        welcome: ClientWelcome,
        prefill: DeploymentHandle | None = None,
    ) -> None:
        self.engine = engine.options(stream=True)
        self.prefill = prefill
        self.prefill_failed = 0  # prompts the decode side computed: no KV came for them
        self.prepare = prepare
        self.welcome: ClientWelcome | None = welcome
        self._core = ClientCore(None)
        self.client_id = self._core.client_id
        self.block_size = prepare.hasher.block_size
        self.retried = 0

    def submit(
        self,
        prompt: str | None = None,
        *,
        request_id: str | None = None,
        deadline_s: float | None = None,
        **request: Any,
    ) -> ServeRequestHandle:
        """As AsyncClient.submit; raises BadRequestError for what the SDK refuses."""
        record = self._core.new_record(request_id, None)
        msg = build_submit(
            self.client_id,
            record.wire_id,
            prompt=prompt,
            messages=request.pop("messages", None),
            prompt_token_ids=request.pop("prompt_token_ids", None),
            sampling=request.pop("sampling", None),
            add_generation_prompt=request.pop("add_generation_prompt", True),
            chat_template_kwargs=request.pop("chat_template_kwargs", None),
            continuous_usage_stats=request.pop("continuous_usage_stats", False),
            sampling_kwargs=request,
            t_submit=time.monotonic(),
        )
        encode_request(msg, record.request_id)  # what the wire cannot carry is refused here
        record.t_submit = msg.t_submit
        handle = ServeRequestHandle(self, record)
        self._core.register(record, handle)
        handle.task = asyncio.get_running_loop().create_task(self._run(handle, msg))
        return handle

    async def _run(self, handle: ServeRequestHandle, msg: SubmitRequest) -> None:
        record = handle.record
        try:
            prepared, block_ids, text = await self.prepare.prepare(msg)
            if isinstance(prepared, RequestError):
                self._end(handle, _error_event(record.wire_id, prepared))
                return
            call = self._engine_call(msg, prepared, block_ids, text)
            # A prompt of one block or less has no full block before its last token: nothing
            # to hand over, the decode replica computes it.
            if self.prefill is not None and len(prepared.token_ids) // 4 > self.block_size:
                call = await self._prefilled(call, record.request_id)
            for attempt in range(RETRIES + 1):
                try:
                    await self._stream(handle, call)
                    break
                except Exception as exc:  # the replica died, or its call failed
                    if record.seen or attempt == RETRIES:
                        raise
                    self.retried += 1
                    logger.warning("%s: sent again after %r", record.request_id, exc)
        except asyncio.CancelledError:  # abort(): the Serve call is cancelled with this task
            aborted = StreamEvent(record.wire_id, finished=True, finish_reason=FINISH_ABORT)
            self._end(handle, aborted)
        except Exception as exc:
            message = f"unavailable: the engine replica failed ({type(exc).__name__}: {exc})"
            self._end(handle, unavailable_event(record.wire_id, message[:2000]))
        else:
            if not handle.done:  # a stream that ended without its terminal event
                self._end(handle, unavailable_event(record.wire_id, "unavailable: no end"))

    async def _prefilled(self, call: EngineCall, request_id: str) -> EngineCall:
        """Prefill/decode: the prompt computed by the prefill replica the router picks (by its
        cached prefix), its KV's whereabouts added to the call. A prefill that fails costs
        only time: the call goes on without KV, and the decode replica computes the prompt
        (counted and logged, never sent twice)."""
        assert self.prefill is not None
        try:
            result: PrefillResult = await self.prefill.prefill.remote(call)
        except Exception as exc:  # the replica died, or its call failed
            result = PrefillResult(error=f"{type(exc).__name__}: {exc}")
        if result.kv is None:
            self.prefill_failed += 1
            logger.warning("%s: no KV from a prefill replica (%s)", request_id, result.error[:500])
            return call
        return dataclasses.replace(call, kv=result.kv)

    async def _stream(self, handle: ServeRequestHandle, call: EngineCall) -> None:
        events = self.engine.generate.remote(call)
        try:
            async for frame in events:
                for event in decode_events(frame):
                    self._core.apply(handle, event, time.monotonic())
        except asyncio.CancelledError:
            events.cancel()  # Serve cancels the replica's generator, which aborts the request
            raise

    def _engine_call(
        self, msg: SubmitRequest, prepared: TokenizedRequest, block_ids: list[int], text: str | None
    ) -> EngineCall:
        """Token ids in place of the text: the replica's cluster only checks them."""
        request = SubmitRequest(
            request_id=msg.request_id,
            client_id=msg.client_id,
            sampling=prepared.sampling,
            prompt_token_ids=prepared.token_ids,
            t_submit=msg.t_submit,
            structured=msg.structured,
            tools=msg.tools,
            tool_choice=msg.tool_choice,
            parallel_tool_calls=msg.parallel_tool_calls,
            continuous_usage_stats=msg.continuous_usage_stats,
            cache_salt=msg.cache_salt,
        )
        return EngineCall(
            codec.encode(request),
            tuple(block_ids),
            len(prepared.token_ids) // (4 * self.block_size),
            text,
        )

    def _end(self, handle: ServeRequestHandle, event: StreamEvent) -> None:
        if not handle.done:
            self._core.apply(handle, event, time.monotonic())

    def _ask(
        self, build: Builder, timeout: float | None, read: Any, *, to_detokenizer: bool = False
    ) -> Any:
        """The tokenizer queries are answered here, by the tokenizer that prepares requests."""

        async def answer() -> Any:
            if to_detokenizer:
                raise UnavailableError(
                    "engine figures are per replica under Ray Serve (Ray's metrics); this "
                    "ingress has none"
                )
            record = self._core.new_record(None, None)
            self._core.forget(record)
            reply = await self.prepare.answer(build(record.wire_id, time.monotonic()))
            if isinstance(reply, RequestError):
                raise error_for(reply.code, reply.message, None, reply.param or None)
            return read(reply)

        return answer()

    async def close(self) -> None:
        for handle in list(self._core.records.values()):
            if isinstance(handle, ServeRequestHandle):
                handle.abort()


def _error_event(wire_id: str, error: RequestError) -> StreamEvent:
    return StreamEvent(
        wire_id,
        finished=True,
        finish_reason=FINISH_ERROR,
        error=error.message,
        error_code=error.code,
        error_param=error.param or None,
    )
