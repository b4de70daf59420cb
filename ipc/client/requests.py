"""Building the SubmitRequest of one submit() call from the caller's arguments."""

from __future__ import annotations

import json
from typing import Any

from ipc import codec
from ipc.client.errors import BadRequestError
from ipc.field_rules import FieldError, check_message_shape, pack_token_ids, renamed
from ipc.messages import ChatMessage, SamplingParams, SubmitRequest
from ipc.structured import StructuredOutputSpec, ToolCall, spec_from_request

# Keywords of submit() that shape the output rather than sample it (OpenAI's names): they travel
# with the sampling keywords and are taken out here.
OUTPUT_OPTIONS = (
    "response_format",
    "structured_outputs",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
)
# Keywords of submit() about the request rather than its sampling, taken out the same way:
# cache_salt (a non-empty string of at most 256 characters) shares cached KV blocks only with
# requests of the same salt.
REQUEST_OPTIONS = ("cache_salt",)


def build_submit(
    client_id: bytes,
    wire_id: str,
    *,
    prompt: str | None,
    messages: list[Any] | None,
    prompt_token_ids: Any,
    sampling: SamplingParams | None,
    sampling_kwargs: dict[str, Any],
    add_generation_prompt: bool,
    t_submit: float,
    chat_template_kwargs: dict[str, Any] | None = None,
    continuous_usage_stats: bool = False,
) -> SubmitRequest:
    """The SubmitRequest for one submit() call; anything invalid raises BadRequestError."""
    alias = sampling_kwargs.get("max_completion_tokens") is not None
    try:
        sampling_kwargs = _max_tokens_alias(sampling_kwargs)
        options = {k: sampling_kwargs.pop(k) for k in OUTPUT_OPTIONS if k in sampling_kwargs}
        request_options = {
            k: sampling_kwargs.pop(k) for k in REQUEST_OPTIONS if k in sampling_kwargs
        }
        if sampling is None:
            sampling = SamplingParams(**sampling_kwargs)
        elif sampling_kwargs:
            raise ValueError("give either sampling= or sampling keyword arguments, not both")
        chat = None
        if messages is not None:
            chat = [chat_message(m, f"messages[{i}]") for i, m in enumerate(messages)]
        packed = None
        if prompt_token_ids is not None:
            packed = pack_token_ids(prompt_token_ids, "prompt_token_ids")
        if prompt is not None and not isinstance(prompt, str):
            raise ValueError(f"prompt must be a string, got {type(prompt).__name__}")
        return SubmitRequest(
            request_id=wire_id,
            client_id=client_id,
            sampling=sampling,
            prompt=prompt,
            messages=chat,
            prompt_token_ids=packed,
            add_generation_prompt=add_generation_prompt,
            t_submit=t_submit,
            chat_template_kwargs=dict(chat_template_kwargs or {}),
            continuous_usage_stats=continuous_usage_stats,
            **request_options,
            **_output_fields(**options),
        )
    except FieldError as exc:
        if alias:
            exc = renamed(exc, "max_tokens", "max_completion_tokens")
        raise BadRequestError(str(exc), param=exc.param) from None
    except (ValueError, TypeError, OverflowError) as exc:
        raise BadRequestError(str(exc)) from None


def _output_fields(
    response_format: Any = None,
    structured_outputs: Any = None,
    tools: Any = None,
    tool_choice: Any = None,
    parallel_tool_calls: bool = True,
) -> dict[str, Any]:
    """``response_format``: OpenAI's map or a StructuredOutputSpec; ``structured_outputs``:
    vLLM's map; ``tools`` / ``tool_choice``: OpenAI's values, sent as JSON text (the tokenizer
    worker checks them and names what is wrong)."""
    spec: StructuredOutputSpec | None = None
    if isinstance(response_format, StructuredOutputSpec):
        spec = response_format
        if structured_outputs is not None:
            raise ValueError("give response_format or structured_outputs, not both")
    else:
        spec = spec_from_request(response_format, structured_outputs)
    if not isinstance(parallel_tool_calls, bool):
        raise ValueError("parallel_tool_calls must be true or false")
    return {
        "structured": spec,
        "parallel_tool_calls": parallel_tool_calls,
        "tools": "" if tools is None else json.dumps(tools, ensure_ascii=False),
        # Kept as written (ensure_ascii off), so text that is not Unicode is refused by the codec
        # here, not passed on as an escape for a worker to decode.
        "tool_choice": "" if tool_choice is None else json.dumps(tool_choice, ensure_ascii=False),
    }


def _max_tokens_alias(kwargs: dict[str, Any]) -> dict[str, Any]:
    """max_completion_tokens is OpenAI's newer name for max_tokens; given both, it wins (as
    the HTTP frontend decides). Always a copy: the caller's keywords are left as they were."""
    kwargs = dict(kwargs)
    if kwargs.get("max_completion_tokens") is None:
        kwargs.pop("max_completion_tokens", None)
        return kwargs
    kwargs["max_tokens"] = kwargs.pop("max_completion_tokens")
    return kwargs


CHAT_MESSAGE_KEYS = {"role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content"}


def chat_message(m: Any, where: str = "messages[0]") -> ChatMessage:
    """A ChatMessage, or OpenAI's message map: role, content (a string; null on an assistant
    message that only calls tools), and optionally name, tool_calls and tool_call_id (which a
    tool message needs). ``where`` names the message in errors."""
    if isinstance(m, ChatMessage):
        check_message_shape(m.role, m.content, m.tool_calls, m.tool_call_id, where)
        return m
    calls = m.get("tool_calls") if isinstance(m, dict) else None
    if not (
        isinstance(m, dict)
        and isinstance(m.get("role"), str)
        and isinstance(m.get("content"), (str, type(None)))
        and all(
            isinstance(m.get(k), (str, type(None)))
            for k in ("name", "tool_call_id", "reasoning_content")
        )
        and set(m) <= CHAT_MESSAGE_KEYS
    ):
        raise FieldError(
            where,
            f"{where}: a chat message is a {{'role': str, 'content': str}} map (and optionally "
            f"'name', 'tool_calls', 'tool_call_id', 'reasoning_content'), got {m!r:.300}",
        )
    check_message_shape(m["role"], m.get("content"), calls, m.get("tool_call_id"), where)
    return ChatMessage(
        role=m["role"],
        content=m.get("content") or "",
        name=m.get("name") or None,
        tool_calls=None if calls is None else [_tool_call(c) for c in calls],
        tool_call_id=m.get("tool_call_id"),
        reasoning_content=m.get("reasoning_content") or None,
    )


def _tool_call(call: Any) -> ToolCall:
    """OpenAI's ``{"id", "type": "function", "function": {"name", "arguments"}}``."""
    if isinstance(call, ToolCall):
        return call
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ValueError(
            f"a tool call is {{'id', 'type': 'function', 'function': {{'name', "
            f"'arguments'}}}}, got {call!r:.200}"
        )
    arguments = function.get("arguments", "{}")
    if not isinstance(arguments, str):  # OpenAI sends JSON text; an object is taken as meant
        arguments = json.dumps(arguments, ensure_ascii=False)
    call_id = call.get("id") or ""
    if not isinstance(call_id, str):
        raise ValueError("a tool call's id must be a string")
    return ToolCall(id=call_id, name=function["name"], arguments=arguments)


def prompt_kwargs(p: Any) -> dict[str, Any]:
    """generate()'s prompts: a string, a list of chat messages, or a list of token ids."""
    if isinstance(p, str):
        return {"prompt": p}
    if isinstance(p, (list, tuple)) and p and all(isinstance(x, int) for x in p):
        return {"prompt_token_ids": p}
    return {"messages": p}


def encode_request(msg: Any, request_id: str | None) -> bytes:
    """The frame of a message for a tokenizer worker; what the wire cannot carry (a lone
    surrogate in any string, an integer past 64 bits) is the caller's BadRequestError, naming
    the field as submit() takes it (sampling keywords are flat there)."""
    try:
        return codec.encode(msg)
    except codec.EncodeError as exc:
        param = exc.path.removeprefix("sampling.")
        message = str(exc).removeprefix("sampling.")
        raise BadRequestError(message, request_id, param or None) from None
