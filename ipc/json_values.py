"""Checks for caller-supplied JSON objects that travel on the wire and reach a renderer (a chat
template's extra variables): plain JSON values only, bounded in size and depth, so that a request
can neither smuggle other types through msgpack nor make a worker walk an unbounded structure."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

MAX_JSON_OBJECT_KEYS = 64
MAX_JSON_NODES = 4096  # values in the whole object, nested ones included
MAX_JSON_DEPTH = 8
MAX_JSON_STRING_CHARS = 64 * 1024


def check_json_object(value: Any, name: str) -> dict[str, Any]:
    """Returns ``value`` if it is a map of string keys to JSON values within the bounds above;
    raises ValueError naming ``name`` and the offending path otherwise."""
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be an object, got {type(value).__name__}")
    if len(value) > MAX_JSON_OBJECT_KEYS:
        raise ValueError(f"{name} may have at most {MAX_JSON_OBJECT_KEYS} keys")
    budget = [MAX_JSON_NODES]
    for key, item in value.items():
        if not isinstance(key, str) or not key:
            raise ValueError(f"{name}: keys must be non-empty strings, got {key!r}")
        _check(item, f"{name}.{key}", 1, budget)
    return value


def _check(value: Any, where: str, depth: int, budget: list[int]) -> None:
    budget[0] -= 1
    if budget[0] < 0:
        raise ValueError(f"{where}: the object has more than {MAX_JSON_NODES} values")
    if depth > MAX_JSON_DEPTH:
        raise ValueError(f"{where}: nested deeper than {MAX_JSON_DEPTH} levels")
    if value is None or isinstance(value, (bool, int)):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{where}: numbers must be finite, got {value!r}")
        return
    if isinstance(value, str):
        if len(value) > MAX_JSON_STRING_CHARS:
            raise ValueError(
                f"{where}: strings may have at most {MAX_JSON_STRING_CHARS} characters"
            )
        return
    if isinstance(value, list):
        for i, item in enumerate(value):
            _check(item, f"{where}[{i}]", depth + 1, budget)
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise ValueError(f"{where}: keys must be strings, got {key!r}")
            _check(item, f"{where}.{key}", depth + 1, budget)
        return
    raise ValueError(
        f"{where}: a JSON value is a string, number, boolean, null, list or "
        f"object; got {type(value).__name__}"
    )


# Variables the tokenizer worker itself passes to a chat template: a request's own fields say them.
RESERVED_TEMPLATE_VARIABLES = {
    "messages": "the request's messages",
    "add_generation_prompt": "the request's add_generation_prompt field",
    "tools": "tools (not supported by this server)",
    "documents": "documents (not supported by this server)",
}


def check_chat_template_kwargs(value: Any) -> dict[str, Any]:
    """Extra variables for the chat template (e.g. ``{"enable_thinking": false}``)."""
    check_json_object(value, "chat_template_kwargs")
    for key in value:
        if key in RESERVED_TEMPLATE_VARIABLES:
            raise ValueError(
                f"chat_template_kwargs may not set {key!r}: it comes from "
                f"{RESERVED_TEMPLATE_VARIABLES[key]}"
            )
    # Templates test it with "is false" and the reasoning parser reads it: a string would
    # silently leave thinking on.
    if not isinstance(value.get("enable_thinking", True), bool):
        raise ValueError("chat_template_kwargs.enable_thinking must be true or false")
    return value


def json_leaves(value: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """(path, value) of every leaf of a JSON-like value and of every map key, depth first:
    ``messages[0].content``; a key's own path ends with its ascii() form (it may not be
    printable). For finding what is wrong in a value already refused: it walks everything."""
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from json_leaves(item, f"{path}[{i}]")
    elif isinstance(value, dict):
        for key, item in value.items():
            yield (f"{path}.{key!a}" if path else ascii(key)), key
            yield from json_leaves(item, f"{path}.{key}" if path else str(key))
    else:
        yield path, value


def lone_surrogate(text: str) -> str | None:
    """What is wrong with ``text`` if it holds a UTF-16 surrogate, else None. A Python str holds
    one only when it came from a lone ``\\ud800``-style escape (a valid pair decodes to one
    character), and UTF-8 has no encoding for it."""
    try:
        text.encode("utf-8")
        return None
    except UnicodeEncodeError as exc:
        code = ord(text[exc.start])
        return f"a lone UTF-16 surrogate (U+{code:04X}) at character {exc.start}: not Unicode text"
