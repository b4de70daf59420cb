"""The one-answer queries of both clients: tokenize, detokenize, tokenizer info (answered by a
tokenizer worker) and engine stats (answered by the detokenizer). Each is built here as a
function of its wire id and submit time, sent and tracked like a request (deadline, a dead
worker, a lost connection: see ClientCore), and read back here from its reply."""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ipc.client.errors import BadRequestError, SplitserveError
from ipc.client.requests import chat_message
from ipc.codec import unpack_id_list
from ipc.field_rules import pack_token_ids
from ipc.messages.queries import (
    EngineStatsQuery,
    EngineStatsReport,
    TokenizeRequest,
    TokenizeResult,
)

# (wire id, t_submit) -> the message to send under that id.
Builder = Callable[[str, float], Any]


@dataclass(slots=True)
class Tokenized:
    """What /tokenize answers: the ids the engine would see for this input."""

    token_ids: list[int]
    max_model_len: int
    token_strs: list[str] | None = None  # each token's own string, when asked

    @property
    def count(self) -> int:
        return len(self.token_ids)


def tokenize_builder(
    client_id: bytes,
    prompt: str | None,
    messages: list[Any] | None,
    add_special_tokens: bool | None,
    add_generation_prompt: bool,
    chat_template_kwargs: dict[str, Any] | None,
    return_token_strs: bool,
    tools: Any = None,
    tool_choice: Any = None,
) -> Builder:
    """``add_special_tokens`` None: as a submit of the same input gets them (a prompt gets the
    tokenizer's special tokens, a chat only what its template writes), as vLLM defaults."""
    if prompt is not None and not isinstance(prompt, str):
        raise BadRequestError(f"prompt must be a string, got {type(prompt).__name__}")
    chat = None
    if messages is not None:
        chat = _checked(lambda: [chat_message(m, f"messages[{i}]") for i, m in enumerate(messages)])
    special = (messages is None) if add_special_tokens is None else add_special_tokens
    # JSON text as a submit sends them (ensure_ascii off: text that is not Unicode is refused
    # by the codec here); the tokenizer worker checks them.
    tools_json = "" if tools is None else json.dumps(tools, ensure_ascii=False)
    choice_json = "" if tool_choice is None else json.dumps(tool_choice, ensure_ascii=False)

    def build(wire_id: str, t_submit: float) -> TokenizeRequest:
        return _checked(
            lambda: TokenizeRequest(
                wire_id,
                client_id,
                prompt=prompt,
                messages=chat,
                add_special_tokens=special,
                add_generation_prompt=add_generation_prompt,
                chat_template_kwargs=dict(chat_template_kwargs or {}),
                return_token_strs=return_token_strs,
                t_submit=t_submit,
                tools=tools_json,
                tool_choice=choice_json,
            )
        )

    return build


def detokenize_builder(client_id: bytes, token_ids: Any) -> Builder:
    if isinstance(token_ids, (str, bytes)) or not hasattr(token_ids, "__len__"):
        raise BadRequestError("token_ids must be a sequence of integers", param="token_ids")
    if len(token_ids) == 0:
        raise BadRequestError("token_ids is empty", param="token_ids")
    packed = _checked(lambda: pack_token_ids(token_ids, "token_ids"))

    def build(wire_id: str, t_submit: float) -> TokenizeRequest:
        return TokenizeRequest(wire_id, client_id, detokenize_ids=packed, t_submit=t_submit)

    return build


def info_builder(client_id: bytes) -> Builder:
    return lambda wire_id, t_submit: TokenizeRequest(
        wire_id, client_id, info=True, t_submit=t_submit
    )


def stats_builder() -> Builder:
    return lambda wire_id, t_submit: EngineStatsQuery(wire_id)


def tokenized(reply: Any, with_strs: bool) -> Tokenized:
    result = _expect(reply, TokenizeResult)
    return Tokenized(
        unpack_id_list(result.token_ids),
        result.max_model_len,
        list(result.token_strs) if with_strs else None,
    )


def detokenized(reply: Any) -> str:
    return _expect(reply, TokenizeResult).text


def info_of(reply: Any) -> dict[str, Any]:
    return dict(_expect(reply, TokenizeResult).info)


def stats_of(reply: Any) -> EngineStatsReport:
    return _expect(reply, EngineStatsReport)


def _expect(reply: Any, kind: type) -> Any:
    if not isinstance(reply, kind):  # a reply of the wrong kind under this id: a server bug
        raise SplitserveError(f"expected a {kind.__name__} reply, got {type(reply).__name__}")
    return reply


def _checked(make: Callable[[], Any]) -> Any:
    try:
        return make()
    except (ValueError, TypeError, OverflowError) as exc:
        raise BadRequestError(str(exc), param=getattr(exc, "param", None)) from None


class QueryMethods(ABC):
    """The queries of both clients. Each client's ``_ask(build, timeout, read)`` sends the query
    and returns ``read(reply)``: at once in the sync Client, as an awaitable in the AsyncClient
    (``await client.tokenize(...)``). ``timeout``: seconds before the query ends with a timeout
    error (default: the client's deadline_s). A failed query raises its SplitserveError (bad
    input: BadRequestError; a dead worker or a lost connection: UnavailableError)."""

    client_id: bytes

    @abstractmethod
    def _ask(
        self,
        build: Builder,
        timeout: float | None,
        read: Callable[[Any], Any],
        *,
        to_detokenizer: bool = False,
    ) -> Any:
        """Sends the query ``build`` makes (to the detokenizer, or else to a tokenizer worker)
        and gives ``read(reply)``, the client's way (at once, or as an awaitable)."""

    def tokenize(
        self,
        prompt: str | None = None,
        *,
        messages: list[Any] | None = None,
        add_special_tokens: bool | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        return_token_strs: bool = False,
        timeout: float | None = None,
        tools: list[Any] | None = None,
        tool_choice: Any = None,
    ) -> Any:
        """-> Tokenized: the ids the engine would see for this prompt or chat (with ``tools``
        and ``tool_choice``, OpenAI's, as a chat submit with them renders).
        ``add_special_tokens`` None: as a submit of the same input (see tokenize_builder)."""
        build = tokenize_builder(
            self.client_id,
            prompt,
            messages,
            add_special_tokens,
            add_generation_prompt,
            chat_template_kwargs,
            return_token_strs,
            tools,
            tool_choice,
        )
        return self._ask(build, timeout, lambda reply: tokenized(reply, return_token_strs))

    def detokenize(self, token_ids: Any, *, timeout: float | None = None) -> Any:
        """-> str: the text of these ids, special tokens included (as the tokenizer decodes)."""
        return self._ask(detokenize_builder(self.client_id, token_ids), timeout, detokenized)

    def tokenizer_info(self, *, timeout: float | None = None) -> Any:
        """-> dict: special tokens, chat template, model_max_length... (vLLM's
        /tokenizer_info)."""
        return self._ask(info_builder(self.client_id), timeout, info_of)

    def engine_stats(self, *, timeout: float | None = None) -> Any:
        """-> EngineStatsReport: the engine's load as of its latest step."""
        return self._ask(stats_builder(), timeout, stats_of, to_detokenizer=True)
