"""Every message that crosses a process boundary, defined once.

Channels (who sends what to whom):

    client      -> tokenizer i : SubmitRequest
    client      -> detokenizer : ClientHello, ClientAbort, ClientBye
    detokenizer -> client      : ClientWelcome, ClientEvents (one message per step per client)
    tokenizer i -> engine      : TokenizedRequest
    tokenizer i -> detokenizer : RequestError (the request never reaches the engine)
    detokenizer -> engine      : AbortRequests (client aborts, stop strings, gone clients)
    engine      -> detokenizer : StepOutput (one message per engine step, columnar)
    any worker  -> supervisor  : WorkerReady, Heartbeat
    supervisor  -> detokenizer : ClusterNotice (a worker died / is back), forwarded to clients
    one-answer queries (tokenize, detokenize, tokenizer info, engine stats): ipc/queries.py

Timestamps are ``time.monotonic()`` seconds; on Linux that clock is system-wide, so values from
different processes on one host compare directly.
"""

from __future__ import annotations

import builtins
from dataclasses import dataclass, field
from typing import Any

from ipc.codec import message
from ipc.json_values import check_chat_template_kwargs
from ipc.sampling import SamplingParams

# Finish reasons (the field's vocabulary: OpenAI / vLLM / SGLang).
FINISH_STOP = "stop"  # eos, a stop token id or a stop string
FINISH_LENGTH = "length"  # max_tokens or the context length
FINISH_ABORT = "abort"  # the client (or a shutdown) aborted it
FINISH_ERROR = "error"  # see StreamEvent.error / error_code

# Error codes carried with FINISH_ERROR.
ERR_BAD_REQUEST = "bad_request"  # the request itself is wrong; retrying it will not help
ERR_OVERLOADED = "overloaded"  # a bounded queue is full; retry later
ERR_UNAVAILABLE = "unavailable"  # a worker died or the cluster is shutting down
ERR_INTERNAL = "internal"

@dataclass(slots=True)
class ChatMessage:
    role: str
    content: str
    name: str | None = None  # the speaker's name, which a chat template may show


# ---------------------------------------------------------------------------------------------
# client -> tokenizer


@message
@dataclass(slots=True)
class SubmitRequest:
    """A request as the client hands it over: exactly one of prompt, messages, prompt_token_ids."""

    KIND = "submit"
    request_id: str
    client_id: bytes
    sampling: SamplingParams
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    prompt_token_ids: bytes | None = None  # packed int32, see ipc.codec.pack_ids
    add_generation_prompt: bool = True  # for messages: end with the assistant turn's header
    t_submit: float = 0.0
    # For messages: extra variables of the chat template, e.g. {"enable_thinking": False}.
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    continuous_usage_stats: bool = False  # every event carries the usage so far, not the last only

    def __post_init__(self) -> None:
        if not self.request_id or len(self.request_id) > 256:
            raise ValueError("request_id must be a non-empty string of at most 256 characters")
        given = [x is not None for x in (self.prompt, self.messages, self.prompt_token_ids)]
        if sum(given) != 1:
            raise ValueError("give exactly one of prompt, messages or prompt_token_ids")
        if self.prompt is not None and not self.prompt:
            raise ValueError("prompt is empty")
        if self.messages is not None and not self.messages:
            raise ValueError("messages is empty")
        if self.prompt_token_ids is not None and not self.prompt_token_ids:
            raise ValueError("prompt_token_ids is empty")
        if self.chat_template_kwargs:
            if self.messages is None:
                raise ValueError("chat_template_kwargs applies to chat messages only")
            check_chat_template_kwargs(self.chat_template_kwargs)


# ---------------------------------------------------------------------------------------------
# tokenizer -> engine (and, through the engine, to the detokenizer)


@dataclass(slots=True)
class RequestMeta:
    """What the detokenizer needs about a request. The tokenizer writes it, the engine process
    forwards it untouched in the StepOutput that first mentions the request, so it always reaches
    the detokenizer before any of the request's tokens."""

    request_id: str
    client_id: bytes
    prompt_tokens: int
    stop: list[str] = field(default_factory=list)
    skip_special_tokens: bool = True
    tokenizer_index: int = 0
    t_submit: float = 0.0
    t_tokenize_start: float = 0.0
    t_tokenized: float = 0.0
    continuous_usage_stats: bool = False  # see SubmitRequest
    # Only when the request asked for echo or prompt_logprobs: the prompt's ids (packed int32),
    # so the detokenizer can turn them into text and token strings.
    prompt_token_ids: bytes = b""
    echo: bool = False
    prompt_logprobs: bool = False  # their values come in StepOutput.prompt_logprobs
    include_stop_str_in_output: bool = False


@message
@dataclass(slots=True)
class TokenizedRequest:
    KIND = "tokenized"
    request_id: str
    token_ids: bytes  # packed int32
    sampling: SamplingParams
    meta: RequestMeta


@message
@dataclass(slots=True)
class RequestError:
    """A request that ends before the engine: bad input, overload, shutdown."""

    KIND = "request_error"
    request_id: str
    client_id: bytes
    message: str
    code: str = ERR_BAD_REQUEST
    t_submit: float = 0.0


# ---------------------------------------------------------------------------------------------
# detokenizer -> engine


@message
@dataclass(slots=True)
class AbortRequests:
    """Frees these requests in the engine. Ids the engine has not seen yet are remembered for a
    while, since a tokenized request may still be on its way."""

    KIND = "abort"
    request_ids: list[str]


# ---------------------------------------------------------------------------------------------
# engine -> detokenizer


@dataclass(slots=True)
class RequestStart:
    """Sent once per request, in the step that produced its first token."""

    request_id: str
    t_arrived: float  # the engine received it
    t_scheduled: float  # its first prefill chunk was scheduled
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


@dataclass(slots=True)
class EngineStats:
    running: int = 0
    waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    prefill_tokens: int = 0  # prompt tokens computed in this step
    cached_tokens: int = 0  # prompt tokens served from the prefix cache in this step
    decode_tokens: int = 0
    preempted: int = 0
    step_ms: float = 0.0
    # Since the engine started (a restarted engine counts from 0 again): prompt tokens looked up
    # in the prefix cache when a request was admitted, those found there, and preemptions.
    prefix_queried_tokens_total: int = 0
    prefix_hit_tokens_total: int = 0
    preemptions_total: int = 0


@dataclass(slots=True)
class FinishRecord:
    """A request that ended in this step (or before it reached the engine) and why."""

    request_id: str
    reason: str  # a FINISH_* value
    error: str = ""  # what went wrong, when the reason is FINISH_ERROR
    code: str = ""  # an ERR_* code, when the reason is FINISH_ERROR

    def __post_init__(self) -> None:
        # Every error reaches the client with a code; one its sender left out is ours.
        if self.reason == FINISH_ERROR and not self.code:
            self.code = ERR_INTERNAL


@dataclass(slots=True)
class TokenLogprobs:
    """The logprobs of the token at ``row`` of StepOutput.request_ids (only for requests that
    asked): its own, and the ``top`` most likely ones of the step that sampled it."""

    row: int
    logprob: float
    top_ids: bytes = b""  # packed int32, most likely first
    top_logprobs: bytes = b""  # packed float32, one per top id


@dataclass(slots=True)
class PromptLogprobs:
    """Prompt logprobs of one request for the prompt positions ``start ..`` that this step
    computed (chunked prefill sends several, always before the request's first token). Position p
    holds the logprob of prompt token p given the tokens before it; position 0 has none."""

    request_id: str
    start: int
    logprobs: bytes  # packed float32, one per position
    top_k: int = 0
    top_ids: bytes = b""  # packed int32, top_k per position, most likely first
    top_logprobs: bytes = b""  # packed float32, likewise


@message
@dataclass(slots=True)
class StepOutput:
    """Everything one engine step produced, for all requests at once (columnar)."""

    KIND = "step"
    step: int
    t_step: float  # when this step's tokens were ready
    new_requests: list[RequestMeta] = field(default_factory=list)
    request_ids: list[str] = field(default_factory=list)
    token_ids: bytes = b""  # packed int32, one new token per entry of request_ids
    started: list[RequestStart] = field(default_factory=list)
    finished: list[FinishRecord] = field(default_factory=list)
    stats: EngineStats | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # rows that asked only
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)
    # The engine process that sent it: after the supervisor reports that engine dead, the
    # detokenizer drops its late outputs (their requests already ended with an error).
    engine_pid: int = 0


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
    # Only for requests that asked: one entry per token of token_ids; the prompt's entries and
    # text (echo) on the request's first event.
    logprobs: list[LogprobEntry] = field(default_factory=list)
    prompt_logprobs: list[LogprobEntry] = field(default_factory=list)
    echo_text: str = ""


@message
@dataclass(slots=True)
class ClientEvents:
    KIND = "events"
    events: list[StreamEvent]


# ---------------------------------------------------------------------------------------------
# supervisor -> detokenizer -> every client


NOTICE_DIED = "died"  # the worker exited (or was killed for silence); the supervisor restarts it
NOTICE_READY = "ready"  # its replacement reported ready


@message
@dataclass(slots=True)
class ClusterNotice:
    """A worker died or came back. The supervisor sends it to the detokenizer, which ends what
    it can itself (the engine died: every request it holds) and forwards one to each client with
    ``alive_ids`` set to that client's requests it knows are in the engine, so the client can end
    with an error exactly the requests that died with the worker."""

    KIND = "notice"
    event: str
    role: str
    index: int
    pid: int = 0
    detail: str = ""  # e.g. "exited with code -9"
    alive_ids: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------
# workers -> supervisor


@message
@dataclass(slots=True)
class WorkerReady:
    KIND = "ready"
    role: str
    index: int
    pid: int
    addresses: list[str] = field(default_factory=list)
    # The engine reports what it resolved from the model, so the supervisor can hand it to the
    # tokenizers (context-length checks) and the detokenizer (the ClientWelcome).
    model_name: str = ""
    max_model_len: int = 0
    vocab_size: int = 0


@message
@dataclass(slots=True)
class Heartbeat:
    KIND = "heartbeat"
    role: str
    index: int
    pid: int
    t: float
    stats: dict[str, float] = field(default_factory=dict)
