"""The client's view of one request (RequestRecord), what sync and async handles share
(HandleBase), and the terminal events the client makes itself (timeouts, lost workers, close)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from ipc.client.errors import ERR_TIMEOUT, error_for
from ipc.client.results import Delta, GenerationResult
from ipc.codec import unpack_id_list
from ipc.messages import ERR_UNAVAILABLE, FINISH_ERROR, LogprobEntry, StreamEvent, SubmitRequest
from ipc.messages.queries import TokenizeRequest
from ipc.structured import ToolCall, add_tool_call_deltas


class RequestRecord:
    """The client's view of one request; the handle classes wrap it."""

    __slots__ = (
        "request_id",
        "wire_id",
        "t_submit",
        "deadline",
        "text",
        "token_ids",
        "t_received",
        "final",
        "tokenizer",
        "seen",
        "pending",
        "resubmits",
        "aborted",
        "query",
        "reply",
        "logprobs",
        "prompt_logprobs",
        "echo_text",
        "tool_calls",
        "reasoning",
        "engine_index",
    )

    def __init__(self, request_id: str, wire_id: str, deadline: float | None) -> None:
        self.request_id, self.wire_id, self.deadline = request_id, wire_id, deadline
        self.t_submit = 0.0  # set from the SubmitRequest, right before the send
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.t_received: list[float] = []
        self.final: Delta | None = None
        self.tokenizer = -1  # the index of the tokenizer worker it was sent to
        self.seen = False  # an event arrived: it is past its tokenizer
        # The request as sent, kept until it is past its tokenizer: if that worker dies first it
        # is sent again (to another worker, under a fresh wire id).
        self.pending: SubmitRequest | TokenizeRequest | None = None
        self.resubmits = 0
        self.aborted = False  # the caller asked to abort it
        self.query = False  # a one-answer query (ipc.messages.queries), not a generation
        self.reply: Any = None  # a query's answer (TokenizeResult, EngineStatsReport)
        self.logprobs: list[LogprobEntry] = []
        self.prompt_logprobs: list[LogprobEntry] = []
        self.echo_text = ""
        self.tool_calls: list[ToolCall] = []
        self.reasoning: list[str] = []
        self.engine_index = -1  # the replica its events came from

    def apply(self, event: StreamEvent, t: float) -> Delta:
        ids = unpack_id_list(event.token_ids) if event.token_ids else []
        delta = Delta(
            self.request_id,
            event.text,
            ids,
            t,
            event.finished,
            event.finish_reason,
            event.error,
            event.error_code,
            event.usage,
            event.timings,
            event.logprobs,
            event.prompt_logprobs,
            event.echo_text,
            event.tool_calls,
            event.reasoning,
            error_param=event.error_param,
            engine_index=event.engine_index,
            t_step=event.t_step,
            step_ms=event.step_ms,
            step_threads=event.step_threads,
            t_detok_woke=event.t_detok_woke,
            t_detok_sent=event.t_detok_sent,
        )
        self.text.append(event.text)
        if event.reasoning:
            self.reasoning.append(event.reasoning)
        add_tool_call_deltas(self.tool_calls, event.tool_calls)
        self.token_ids.extend(ids)
        self.logprobs.extend(event.logprobs)
        self.prompt_logprobs.extend(event.prompt_logprobs)
        self.echo_text += event.echo_text
        self.seen = True
        self.pending = None
        if event.engine_index >= 0:
            self.engine_index = event.engine_index
        if ids or event.text:
            self.t_received.append(t)
        if event.finished:
            self.final = delta
        return delta

    def result(self) -> GenerationResult:
        f = self.final
        assert f is not None, "result() before the terminal event"
        return GenerationResult(
            self.request_id,
            "".join(self.text),
            list(self.token_ids),
            f.finish_reason,
            f.usage,
            f.timings,
            f.error,
            f.error_code,
            self.t_submit,
            list(self.t_received),
            list(self.logprobs),
            list(self.prompt_logprobs),
            self.echo_text,
            list(self.tool_calls),
            "".join(self.reasoning),
            error_param=f.error_param,
            engine_index=self.engine_index,
        )


class HandleBase(ABC):
    """What sync and async handles share, and all ClientCore needs of a handle: its ``record``
    (the client's bookkeeping; callers read it through the properties below) and ``deliver``,
    which each handle kind implements with its own waiting (a condition or an asyncio event)."""

    def __init__(self, client: Any, record: RequestRecord) -> None:
        self._client = client
        self.record = record
        self._deltas: list[Delta] = []

    @abstractmethod
    def deliver(self, delta: Delta) -> None:
        """Hands a delta to whoever waits on this handle (from the client's receiving side)."""

    @property
    def request_id(self) -> str:
        return self.record.request_id

    @property
    def wire_id(self) -> str:
        """The id the cluster knows it by (a resend gives it a fresh one)."""
        return self.record.wire_id

    @property
    def tokenizer_index(self) -> int:
        """The tokenizer worker it was last sent to (-1 before it was sent)."""
        return self.record.tokenizer

    @property
    def resubmits(self) -> int:
        """How many times it was sent again after its tokenizer worker died."""
        return self.record.resubmits

    @property
    def t_submit(self) -> float:
        return self.record.t_submit

    @property
    def done(self) -> bool:
        return self.record.final is not None

    def abort(self) -> None:
        """Asks the cluster to stop this request; its terminal event (reason "abort") follows."""
        if not self.done:
            self._client._abort(self.record)

    def _next_delta(self, i: int) -> Delta:
        """The i-th delta, raising the request's error if that delta ends it with one."""
        delta = self._deltas[i]
        if delta.error_code:
            raise error_for(
                delta.error_code,
                delta.error or "request failed",
                self.request_id,
                delta.error_param,
            )
        return delta


def timeout_event(wire_id: str, seconds: float | None) -> StreamEvent:
    return StreamEvent(
        request_id=wire_id,
        finished=True,
        finish_reason=FINISH_ERROR,
        error=f"no terminal event within the client deadline of {seconds} s",
        error_code=ERR_TIMEOUT,
    )


def unavailable_event(wire_id: str, message: str) -> StreamEvent:
    return StreamEvent(
        request_id=wire_id,
        finished=True,
        finish_reason=FINISH_ERROR,
        error=message,
        error_code=ERR_UNAVAILABLE,
    )


def closed_event(wire_id: str) -> StreamEvent:
    return StreamEvent(
        request_id=wire_id,
        finished=True,
        finish_reason=FINISH_ERROR,
        error="the client was closed before the request finished",
        error_code=ERR_UNAVAILABLE,
    )
