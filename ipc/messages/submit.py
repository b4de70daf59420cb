"""A request on its way in: client -> tokenizer (SubmitRequest), tokenizer -> engine
(TokenizedRequest, carrying the RequestMeta the engine forwards to the detokenizer) and
tokenizer -> detokenizer (RequestError: it ends before the engine)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ipc.block_hash import check_cache_salt
from ipc.codec import message
from ipc.json_values import check_chat_template_kwargs
from ipc.messages.common import ERR_BAD_REQUEST, ChatMessage
from ipc.sampling import SamplingParams
from ipc.structured import StructuredOutputSpec

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
    # What the output must match, and OpenAI's tools (their JSON text: schemas of any shape,
    # checked by the tokenizer worker, which names what is wrong).
    structured: StructuredOutputSpec | None = None
    tools: str = ""  # a JSON list of {"type": "function", "function": {...}}
    tool_choice: str = ""  # JSON: "none", "auto", "required" or {"type": "function", ...}
    parallel_tool_calls: bool = True
    # For messages: extra variables of the chat template, e.g. {"enable_thinking": False}.
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    continuous_usage_stats: bool = False  # every event carries the usage so far, not the last only
    # Shares cached KV blocks only with requests of the same salt (tenant isolation, vLLM's
    # field): a non-empty string of at most 256 characters, or None.
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        check_cache_salt(self.cache_salt)
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
    # The engine replica the tokenizer worker chose, what decided it (an OUTCOME_* of
    # ipc.replica_router; "" with one engine: no choice was made) and how long hashing and
    # choosing took.
    engine_index: int = 0
    routing_outcome: str = ""
    routing_s: float = 0.0
    # Prefill/decode disaggregation: the decode engine the tokenizer worker chose (the request
    # moves there after its first token); -1: the engine that computes the prompt decodes too.
    decode_index: int = -1
    t_submit: float = 0.0
    t_tokenize_start: float = 0.0
    t_tokenized: float = 0.0
    tool_parser: str = ""  # reads tool calls out of the output (detok_worker.tool_parsers)
    # Splits the thinking out of the output (ipc.reasoning; "" none), and whether the output
    # starts inside it (the prompt opened <think>).
    reasoning_parser: str = ""
    reasoning_open: bool = False
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
    # The grammar the output must follow (llguidance's Lark text, checked by the tokenizer
    # worker with this vocabulary); "" for free text.
    grammar: str = ""
    cache_salt: str | None = None  # see SubmitRequest

    def __post_init__(self) -> None:
        check_cache_salt(self.cache_salt)


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
    param: str = ""  # the request field the error is about (max_tokens, ...), if one is
