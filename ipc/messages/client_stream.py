"""Between a client and the detokenizer: hello / welcome, aborts, bye, and the stream of events
that carries each request's text, usage, timings and logprobs."""

from __future__ import annotations

import builtins
from dataclasses import dataclass, field

from ipc.codec import message
from ipc.structured import ToolCallDelta

# ---------------------------------------------------------------------------------------------
# client <-> detokenizer


@message
@dataclass(slots=True)
class ClientHello:
    """The client's first message; the detokenizer learns its identity and answers ClientWelcome."""

    KIND = "hello"
    client_id: bytes


@message
@dataclass(slots=True)
class ClientWelcome:
    KIND = "welcome"
    tokenizer_addrs: list[str]
    model: str
    max_model_len: int
    vocab_size: int
    # The cluster's admission bound (the engine's waiting queue): clients size their submit
    # pipes from it, so a burst the cluster accepts is never refused by a small client pipe.
    max_waiting_requests: int = 0


@message
@dataclass(slots=True)
class ClientAbort:
    KIND = "client_abort"
    request_ids: list[str]


@message
@dataclass(slots=True)
class ClientBye:
    """The client is closing: abort whatever it still has in flight."""

    KIND = "bye"


@dataclass(slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


@dataclass(slots=True)
class RequestTimings:
    t_submit: float = 0.0
    t_tokenize_start: float = 0.0
    t_tokenized: float = 0.0
    t_arrived: float = 0.0  # at the engine
    t_scheduled: float = 0.0  # first prefill chunk scheduled
    t_first_token: float = 0.0
    t_last_token: float = 0.0
    t_finished: float = 0.0
    # Prefill/decode disaggregation: seconds from the prefill engine's export of the request's
    # KV blocks to the decode engine's import of them (0: not disaggregated).
    kv_transfer_s: float = 0.0
    kv_transfer_bytes: int = 0


@dataclass(slots=True)
class TopLogprob:
    token_id: int
    token: str  # the token's own text (its bytes decoded, invalid UTF-8 replaced)
    logprob: float
    # The token's own bytes (a piece of a UTF-8 character stays a piece). Spelled builtins.bytes:
    # the codec resolves hints in the class namespace, where ``bytes`` is this field.
    bytes: builtins.bytes


@dataclass(slots=True)
class LogprobEntry:
    """One token of the prompt or the output with its logprob and the top alternatives."""

    token_id: int
    token: str
    logprob: float | None  # None for the first prompt token (nothing before it)
    bytes: builtins.bytes
    top: list[TopLogprob] = field(default_factory=list)


@dataclass(slots=True)
class StreamEvent:
    """A text delta for one request; the last one has finished=True and a finish_reason."""

    request_id: str
    text: str = ""
    token_ids: bytes = b""  # packed int32: the tokens this delta covers
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    error_code: str | None = None
    usage: Usage | None = None
    timings: RequestTimings | None = None
    tool_calls: list[ToolCallDelta] = field(default_factory=list)  # calls read from the text
    reasoning: str = ""  # thinking split out of the text (RequestMeta.reasoning_parser)
    # Only for requests that asked: one entry per token of token_ids; the prompt's entries and
    # text (echo) on the request's first event.
    logprobs: list[LogprobEntry] = field(default_factory=list)
    prompt_logprobs: list[LogprobEntry] = field(default_factory=list)
    echo_text: str = ""
    error_param: str | None = None  # the request field a bad_request error is about
    engine_index: int = -1  # the engine replica serving it; -1: none (it ended before one)
    # Where the time between the engine and the client goes (time.monotonic(), system-wide on
    # Linux; 0: not known): the end of the engine step of the newest token this event carries,
    # when the detokenizer woke up for the pass that made it, and when it sent the pass's frame;
    # step_ms: how long that engine step took (its start is t_step - step_ms), step_threads: the
    # torch threads its forward ran on.
    t_step: float = 0.0
    step_ms: float = 0.0
    step_threads: int = 0
    t_detok_woke: float = 0.0
    t_detok_sent: float = 0.0


@message
@dataclass(slots=True)
class ClientEvents:
    KIND = "events"
    events: list[StreamEvent]
