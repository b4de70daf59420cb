"""Building the SubmitRequest of one submit() call from the caller's arguments."""

from __future__ import annotations

from typing import Any

from ipc.client.errors import BadRequestError
from ipc.codec import pack_ids
from ipc.messages import ChatMessage, SamplingParams, SubmitRequest


def build_submit(client_id: bytes, wire_id: str, *, prompt: str | None,
                 messages: list[Any] | None, prompt_token_ids: Any, sampling: SamplingParams | None,
                 sampling_kwargs: dict[str, Any], add_generation_prompt: bool,
                 t_submit: float, chat_template_kwargs: dict[str, Any] | None = None,
                 continuous_usage_stats: bool = False) -> SubmitRequest:
    """The SubmitRequest for one submit() call; anything invalid raises BadRequestError."""
    try:
        sampling_kwargs = _max_tokens_alias(sampling_kwargs)
        if sampling is None:
            sampling = SamplingParams(**sampling_kwargs)
        elif sampling_kwargs:
            raise ValueError("give either sampling= or sampling keyword arguments, not both")
        chat = None
        if messages is not None:
            chat = [chat_message(m) for m in messages]
        packed = None
        if prompt_token_ids is not None:
            packed = pack_ids(prompt_token_ids)
        if prompt is not None and not isinstance(prompt, str):
            raise ValueError(f"prompt must be a string, got {type(prompt).__name__}")
        return SubmitRequest(request_id=wire_id, client_id=client_id, sampling=sampling,
                             prompt=prompt, messages=chat, prompt_token_ids=packed,
                             add_generation_prompt=add_generation_prompt, t_submit=t_submit,
                             chat_template_kwargs=dict(chat_template_kwargs or {}),
                             continuous_usage_stats=continuous_usage_stats)
    except (ValueError, TypeError, OverflowError) as exc:
        raise BadRequestError(str(exc)) from None


def _max_tokens_alias(kwargs: dict[str, Any]) -> dict[str, Any]:
    """max_completion_tokens is OpenAI's newer name for max_tokens; given both, it wins (as
    the HTTP frontend decides)."""
    if kwargs.get("max_completion_tokens") is None:
        return {k: v for k, v in kwargs.items() if k != "max_completion_tokens"}
    kwargs = dict(kwargs)
    kwargs["max_tokens"] = kwargs.pop("max_completion_tokens")
    return kwargs


def chat_message(m: Any) -> ChatMessage:
    if isinstance(m, ChatMessage):
        return m
    if (isinstance(m, dict) and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str) and isinstance(m.get("name"), (str, type(None)))
            and set(m) <= {"role", "content", "name"}):
        return ChatMessage(role=m["role"], content=m["content"], name=m.get("name") or None)
    raise ValueError("a chat message is a {'role': str, 'content': str} map (and optionally "
                     f"'name': str), got {m!r}")


def prompt_kwargs(p: Any) -> dict[str, Any]:
    """generate()'s prompts: a string, a list of chat messages, or a list of token ids."""
    if isinstance(p, str):
        return {"prompt": p}
    if isinstance(p, (list, tuple)) and p and all(isinstance(x, int) for x in p):
        return {"prompt_token_ids": p}
    return {"messages": p}
