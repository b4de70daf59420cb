"""Building the SubmitRequest of one submit() call from the caller's arguments."""

from __future__ import annotations

from typing import Any

from ipc.client.errors import BadRequestError
from ipc.codec import pack_ids
from ipc.messages import ChatMessage, SamplingParams, SubmitRequest


def build_submit(client_id: bytes, wire_id: str, *, prompt: str | None,
                 messages: list[Any] | None, prompt_token_ids: Any, sampling: SamplingParams | None,
                 sampling_kwargs: dict[str, Any], add_generation_prompt: bool,
                 t_submit: float) -> SubmitRequest:
    """The SubmitRequest for one submit() call; anything invalid raises BadRequestError."""
    try:
        if sampling is None:
            sampling = SamplingParams(**sampling_kwargs)
        elif sampling_kwargs:
            raise ValueError("give either sampling= or sampling keyword arguments, not both")
        chat = None
        if messages is not None:
            chat = [_chat_message(m) for m in messages]
        packed = None
        if prompt_token_ids is not None:
            packed = pack_ids(prompt_token_ids)
        if prompt is not None and not isinstance(prompt, str):
            raise ValueError(f"prompt must be a string, got {type(prompt).__name__}")
        return SubmitRequest(request_id=wire_id, client_id=client_id, sampling=sampling,
                             prompt=prompt, messages=chat, prompt_token_ids=packed,
                             add_generation_prompt=add_generation_prompt, t_submit=t_submit)
    except (ValueError, TypeError, OverflowError) as exc:
        raise BadRequestError(str(exc)) from None


def _chat_message(m: Any) -> ChatMessage:
    if isinstance(m, ChatMessage):
        return m
    if isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str):
        return ChatMessage(role=m["role"], content=m["content"])
    raise ValueError(f"a chat message is a {{'role': str, 'content': str}} map, got {m!r}")




def prompt_kwargs(p: Any) -> dict[str, Any]:
    """generate()'s prompts: a string, a list of chat messages, or a list of token ids."""
    if isinstance(p, str):
        return {"prompt": p}
    if isinstance(p, (list, tuple)) and p and all(isinstance(x, int) for x in p):
        return {"prompt_token_ids": p}
    return {"messages": p}
