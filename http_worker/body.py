"""The one place a request body is read, parsed and validated (docs/field-policy.md).

Every route with a body goes through ``BodyReader.parse``:

1. size: a body over ``max_body_bytes`` is a 413 before it is read (Content-Length) or as soon
   as it passes the limit (chunked), and nothing of it is forwarded;
2. JSON: parsed by pydantic-core's parser, which refuses what is not JSON (NaN, Infinity,
   invalid UTF-8, lone UTF-16 surrogates) and nesting deeper than ``MAX_JSON_DEPTH``; a
   refusal says where (a lone surrogate names its field, found by a second, lenient parse
   that only refused bodies pay);
3. the route's model, in strict mode (an integer field takes an integer, not "10" or true),
   then the field policy for undeclared fields (http_worker.fields), then whatever the route
   derives from the body before the cluster sees it (``then``).

Steps 2-3 take time in proportion to the body (about 10 ms per MB here). A body up to
``INLINE_BODY_BYTES`` (every ordinary request) is handled on the event loop; a larger one in a
thread, so that the streams this process serves keep flowing meanwhile: the loop then waits at
most one parser call, not the whole body's validation.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import pydantic_core
from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from http_worker.fields import FieldPolicy, check_fields
from http_worker.protocol import APIError, bad_request
from ipc.json_values import json_leaves, lone_surrogate
from runtime.priority import lower_this_thread

INLINE_BODY_BYTES = 64 * 1024
MAX_JSON_DEPTH = 200  # pydantic-core's parser refuses deeper nesting ("recursion limit")
_TYPE_NAMES = {"str", "int", "float", "bool", "list", "dict", "none"}
_JSON_TYPES = {str: "a string", bool: "a boolean", int: "an integer", float: "a number"}
_T = TypeVar("_T")

_executor: ThreadPoolExecutor | None = None


def _worker() -> ThreadPoolExecutor:
    # One thread: large bodies wait for each other instead of multiplying threads (and memory).
    global _executor
    if _executor is None:
        # At the background niceness (runtime.priority): parsing a huge body is not the step.
        _executor = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="http-body", initializer=lower_this_thread
        )
    return _executor


class BodyReader:
    def __init__(
        self, max_body_bytes: int, lenient: bool, policies: dict[str, FieldPolicy]
    ) -> None:
        self.max_body_bytes = max_body_bytes
        self.lenient = lenient
        self.policies = policies

    async def parse(
        self,
        request: Request,
        choose: Callable[[dict[str, Any]], type[BaseModel]],
        then: Callable[[Any], _T] = lambda body: body,
    ) -> _T:
        """``then(body)`` for the body as the model ``choose(data)`` names; APIError (400 naming
        the field, or 413) for a body the API refuses."""
        raw = await self.read(request)

        def work() -> _T:
            data = parse_json_object(raw)
            body = validated(choose(data), data)
            check_fields(body, self.lenient, self.policies)
            return then(body)

        if len(raw) <= INLINE_BODY_BYTES:
            return work()
        return await asyncio.get_running_loop().run_in_executor(_worker(), work)

    async def read(self, request: Request) -> bytes:
        limit = self.max_body_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise _too_large(f"it has {declared}", limit)
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _too_large(f"it has more than {limit}", limit)
            chunks.append(chunk)
        return b"".join(chunks)


def _too_large(size: str, limit: int) -> APIError:
    return APIError(
        413,
        f"the request body is over this server's limit of {limit} bytes ({size}; see "
        "--http-max-body-bytes)",
        "invalid_request_error",
        None,
        "request_too_large",
        headers={"Connection": "close"},  # the rest of the body is not read
    )


def parse_json_object(raw: bytes) -> dict[str, Any]:
    try:
        # Keys repeat and are cached; values mostly do not (caching them took 2-3x longer).
        data = pydantic_core.from_json(raw, allow_inf_nan=False, cache_strings="keys")
    except ValueError as exc:
        raise _not_json(raw, str(exc)) from None
    if not isinstance(data, dict):
        raise bad_request("the body must be a JSON object")
    return data


def _not_json(raw: bytes, reason: str) -> APIError:
    """Why pydantic-core's parser refused the body, in the API's words. Python's own parser,
    which takes lone surrogates and NaN, finds where they are."""
    if "recursion limit" in reason:
        return bad_request(f"the body is nested deeper than {MAX_JSON_DEPTH} levels")
    try:
        data = json.loads(raw)
    except UnicodeDecodeError:
        return bad_request("the body is not valid UTF-8")
    except (ValueError, RecursionError) as exc:
        return bad_request(f"the body is not valid JSON: {exc}")
    found = _not_json_value(data)
    if found is None:
        return bad_request(f"the body is not valid JSON: {reason}")
    where, what = found
    return bad_request(f"{where}: {what}" if where else what, where or None)


def _not_json_value(data: Any) -> tuple[str, str] | None:
    """(path, problem) of the first string that is not Unicode or number that is not JSON."""
    for path, value in json_leaves(data):
        if isinstance(value, str) and (problem := lone_surrogate(value)) is not None:
            return path, problem
        if isinstance(value, float) and not math.isfinite(value):
            return path, "NaN and Infinity are not JSON numbers"
    return None


def validated(model: type[BaseModel], data: dict[str, Any]) -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc.errors()) from None


def validation_error(errors: Any) -> APIError:
    """The first of pydantic's errors as a 400 naming its field (``messages[0].content``)."""
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    param = field_path(first.get("loc", ()))
    message = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
    if str(first.get("type", "")).endswith("_type") and "input" in first:
        message += f", got {_json_type(first['input'])}"
    return bad_request(f"{param}: {message}" if param else message, param)


def field_path(loc: Any) -> str | None:
    """pydantic's location as the API names a field: ``messages[0].content``. The "body" and the
    union members pydantic names on the way ("str", "list[int]") are not part of it."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part != "body" and part not in _TYPE_NAMES and "[" not in part:
            path += f".{part}" if path else part
    return path or None


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    for kind, name in _JSON_TYPES.items():
        if type(value) is kind:
            return name
    return "an array" if isinstance(value, list) else "an object"
