"""The field policy's rules that both edges share, the HTTP frontend and the SDK
(docs/field-policy.md): integer bounds, token ids, and the error that names a field.

Types are strict at both edges: an integer field takes an integer (not a bool, a float or a
string), a boolean field a bool. What the wire cannot carry (lone UTF-16 surrogates, integers
past msgpack's 64 bits) is the codec's to refuse (``ipc.codec.EncodeError``), so that one rule
covers every string and number of every message.
"""

from __future__ import annotations

from typing import Any

from ipc.codec import pack_ids

# OpenAI's integer fields are 32-bit; token ids travel as packed int32 (ipc.codec.pack_ids).
MAX_INT32 = 2**31 - 1
MAX_TOKEN_ID = MAX_INT32  # the wire's bound; the vocabulary's is the tokenizer worker's check
MAX_SEED = 2**63 - 1
MAX_CHAT_MESSAGES = 4096  # messages of one chat request


class FieldError(ValueError):
    """A value the API refuses; ``param`` names its field as the caller wrote it (``stop[2]``,
    ``logit_bias``), so the HTTP frontend answers a 400 with that ``param``."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def is_int(value: object) -> bool:
    """An integer, and not a bool (True is not 1 here)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_int(value: Any, param: str, low: int, high: int) -> int:
    """``value`` if it is an integer in [low, high]; FieldError naming ``param`` otherwise."""
    if not is_int(value):
        raise FieldError(param, f"{param} must be an integer, got {_shown(value)}")
    if not low <= value <= high:
        raise FieldError(param, f"{param} must be an integer in [{low}, {high}], got {value}")
    return value


def pack_token_ids(ids: Any, param: str) -> bytes:
    """Token ids packed for the wire; a value past the wire's int32 (or not an integer) is a
    FieldError naming its position. Whether an id is in the vocabulary is the tokenizer
    worker's check. The common case costs one ``pack_ids``: the ids are looked at one by one
    only when packing fails."""
    try:
        return pack_ids(ids)
    except (OverflowError, TypeError, ValueError):
        pass
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
        raise FieldError(param, f"{param} must be a list of token ids, got {_shown(ids)}")
    for i, token in enumerate(ids):
        check_int(token, f"{param}[{i}]", 0, MAX_TOKEN_ID)
    raise FieldError(param, f"{param} must be a list of token ids")  # pack_ids refused it


def _shown(value: Any) -> str:
    return f"{type(value).__name__} {value!r:.40}"


def check_message_shape(
    role: str, content: Any, tool_calls: Any, tool_call_id: Any, where: str
) -> None:
    """OpenAI's rules for one chat message (``where``: ``messages[3]``)."""
    for problem, field in (
        (content_problem(role, content, tool_calls), "content"),
        (tool_call_id_problem(role, tool_call_id), "tool_call_id"),
    ):
        if problem:
            raise FieldError(f"{where}.{field}", f"{where}: {problem}")


def content_problem(role: str, content: Any, tool_calls: Any) -> str:
    """Every role needs its content (an empty string is content), except an assistant turn
    that only calls tools."""
    if content is None and not (role == "assistant" and tool_calls):
        needs = "content or tool_calls" if role == "assistant" else "content"
        return f"{role} messages need {needs}"
    return ""


def tool_call_id_problem(role: str, tool_call_id: Any) -> str:
    """A tool result names the call it answers."""
    if role == "tool" and not tool_call_id:
        return "tool messages need the tool_call_id of the call they answer"
    return ""


def renamed(exc: FieldError, old: str, new: str) -> FieldError:
    """``exc`` told under another name of its field: the caller wrote ``new`` for what the rules
    call ``old`` (max_completion_tokens, OpenAI's newer name for max_tokens)."""
    if exc.param != old:
        return exc
    return FieldError(new, str(exc).replace(old, new, 1))
