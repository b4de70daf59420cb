"""Queries that get exactly one answer instead of a stream (channel table: ipc/messages).

A query travels under a request id of the client, like a submit, so the client's bookkeeping
(deadlines, a dead worker, a lost connection) ends it exactly as it ends a request: with its
reply, or with one error event.

    client -> tokenizer i  TokenizeRequest   tokenize text or chat messages, decode ids, or
                                             describe the tokenizer (one of the three)
    tokenizer i -> detokenizer -> client     TokenizeResult, or a RequestError for bad input
    client -> detokenizer  EngineStatsQuery  the engine's latest load figures
    detokenizer -> client  EngineStatsReport
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ipc.codec import message
from ipc.json_values import check_chat_template_kwargs
from ipc.messages.common import ChatMessage
from ipc.messages.engine_step import EngineStats

MAX_TOKENIZE_CHARS = 8 * 1024 * 1024


@message
@dataclass(slots=True)
class TokenizeRequest:
    """Exactly one of: ``prompt`` or ``messages`` (tokenize), ``detokenize_ids`` (decode them),
    ``info`` (the tokenizer's special tokens, chat template and limits)."""

    KIND = "tokenize"
    request_id: str
    client_id: bytes
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    detokenize_ids: bytes = b""  # packed int32
    info: bool = False
    add_special_tokens: bool = True  # for prompt and messages (the chat template adds its own)
    add_generation_prompt: bool = True  # for messages
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)  # for messages
    return_token_strs: bool = False  # also each token's own string (tokenize only)
    t_submit: float = 0.0
    # For messages: OpenAI's tools and tool_choice as JSON text (as SubmitRequest carries them),
    # which the chat template renders as a request with them would.
    tools: str = ""
    tool_choice: str = ""

    def __post_init__(self) -> None:
        if not self.request_id or len(self.request_id) > 256:
            raise ValueError("request_id must be a non-empty string of at most 256 characters")
        given = [
            self.prompt is not None,
            self.messages is not None,
            bool(self.detokenize_ids),
            self.info,
        ]
        if sum(given) != 1:
            raise ValueError(
                "give exactly one of prompt, messages, token ids to detokenize, or info"
            )
        if self.prompt is not None and not self.prompt:
            raise ValueError("prompt is empty")
        if self.prompt is not None and len(self.prompt) > MAX_TOKENIZE_CHARS:
            raise ValueError(f"prompt has more than {MAX_TOKENIZE_CHARS} characters")
        if self.messages is not None and not self.messages:
            raise ValueError("messages is empty")
        if (self.tools or self.tool_choice) and self.messages is None:
            raise ValueError("tools and tool_choice apply to chat messages only")
        if self.chat_template_kwargs:
            if self.messages is None:
                raise ValueError("chat_template_kwargs applies to chat messages only")
            check_chat_template_kwargs(self.chat_template_kwargs)

    @property
    def kind(self) -> str:
        """What is asked: "tokenize", "detokenize" or "info"."""
        return "info" if self.info else "detokenize" if self.detokenize_ids else "tokenize"


@message
@dataclass(slots=True)
class TokenizeResult:
    KIND = "tokenize_result"
    request_id: str
    client_id: bytes
    token_ids: bytes = b""  # packed int32: tokenize's answer
    text: str = ""  # detokenize's answer
    max_model_len: int = 0
    token_strs: list[str] = field(default_factory=list)  # when return_token_strs was asked
    # info's answer: the tokenizer's configuration as JSON values (special tokens, chat
    # template, model_max_length, ...), the shape of vLLM's /tokenizer_info.
    info: dict[str, Any] = field(default_factory=dict)


@message
@dataclass(slots=True)
class EngineStatsQuery:
    KIND = "engine_stats_query"
    request_id: str


@dataclass(slots=True)
class ReplicaStats:
    """One engine replica's figures as of its latest step."""

    index: int
    stats: EngineStats = field(default_factory=EngineStats)
    t_step: float = 0.0
    pid: int = 0  # 0: dead, or no step since it (re)started
    role: str = ""  # disaggregated: "prefill" or "decode"


@message
@dataclass(slots=True)
class EngineStatsReport:
    """The engines' figures as of their latest steps (all zero before the first one, and after an
    engine died until its replacement steps): ``stats`` sums the replicas (the latest step's
    step_ms is the slowest replica's), ``replicas`` has each one. ``t_step``, ``engine_pid``: the
    latest step of any replica and its sender. ``routing_decisions``: requests routed so far by
    outcome (ipc.replica_router OUTCOME_*; empty with one engine) under ``routing_policy``, and
    the time the tokenizer workers spent choosing for them."""

    KIND = "engine_stats"
    request_id: str
    stats: EngineStats = field(default_factory=EngineStats)
    t_step: float = 0.0
    engine_pid: int = 0
    replicas: list[ReplicaStats] = field(default_factory=list)
    routing_policy: str = ""
    routing_decisions: dict[str, int] = field(default_factory=dict)
    routing_seconds_total: float = 0.0
