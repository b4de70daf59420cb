"""What a caller gets back: deltas as they stream, and the whole result at the end."""

from __future__ import annotations

from dataclasses import dataclass, field

from ipc.client.errors import error_for
from ipc.messages import FINISH_ERROR, LogprobEntry, RequestTimings, Usage
from ipc.structured import ToolCall, ToolCallDelta


@dataclass(slots=True)
class Delta:
    """One piece of a request's stream, as the client received it."""

    request_id: str
    text: str
    token_ids: list[int]
    t_received: float  # time.monotonic() in the client when the event arrived
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    error_code: str | None = None
    usage: Usage | None = None
    timings: RequestTimings | None = None
    # Asked for with logprobs= / prompt_logprobs= / echo=: one entry per token of token_ids;
    # the prompt's entries (the first with logprob None) and text on the first delta.
    logprobs: list[LogprobEntry] = field(default_factory=list)
    prompt_logprobs: list[LogprobEntry] = field(default_factory=list)
    echo_text: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)  # pieces of tool calls
    reasoning: str = ""  # thinking split out of the text (a reasoning parser's)
    error_param: str | None = None  # the request field a bad_request error is about
    engine_index: int = -1  # the engine replica serving it; -1: none (it ended before one)
    # The event's path from the engine (StreamEvent's fields of the same names; 0: not known).
    t_step: float = 0.0
    step_ms: float = 0.0
    step_threads: int = 0
    t_detok_woke: float = 0.0
    t_detok_sent: float = 0.0


@dataclass(slots=True)
class GenerationResult:
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None
    usage: Usage | None
    timings: RequestTimings | None
    error: str | None = None
    error_code: str | None = None
    t_submit: float = 0.0  # time.monotonic() right before the submit's send
    t_received: list[float] = field(default_factory=list)  # one per delta that carried tokens
    logprobs: list[LogprobEntry] = field(default_factory=list)  # one per token, when asked
    prompt_logprobs: list[LogprobEntry] = field(default_factory=list)
    echo_text: str = ""  # the prompt's text, with echo=True (not part of ``text``)
    tool_calls: list[ToolCall] = field(default_factory=list)  # read from the text, when tools
    reasoning: str = ""  # the thinking split out of the text (not part of ``text``)
    error_param: str | None = None  # the request field a bad_request error is about
    engine_index: int = -1  # the engine replica that served it (-1: none)

    @property
    def ok(self) -> bool:
        return self.finish_reason != FINISH_ERROR

    @property
    def ttft_s(self) -> float | None:
        return self.t_received[0] - self.t_submit if self.t_received else None

    @property
    def inter_token_s(self) -> list[float]:
        return [b - a for a, b in zip(self.t_received, self.t_received[1:])]

    def raise_for_error(self) -> GenerationResult:
        if not self.ok:
            raise error_for(
                self.error_code, self.error or "request failed", self.request_id, self.error_param
            )
        return self
