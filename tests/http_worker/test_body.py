"""http_worker.body without a server: the size limit, what JSON is refused and where, and which
bodies are validated off the event loop."""

from __future__ import annotations

import asyncio
import threading

import pytest
from starlette.requests import Request

from http_worker.body import INLINE_BODY_BYTES, BodyReader, field_path
from http_worker.fields import GENERATION_POLICIES
from http_worker.protocol import APIError, CompletionRequest


def request(body: bytes, headers: dict[str, str] | None = None, chunk: int = 65536) -> Request:
    """A request whose body arrives in chunks; reading past its end fails the test."""
    chunks = [body[i : i + chunk] for i in range(0, len(body), chunk)] or [b""]
    messages = [
        {"type": "http.request", "body": c, "more_body": i < len(chunks) - 1}
        for i, c in enumerate(chunks)
    ]

    async def receive() -> dict:
        assert messages, "the body was read past its end"
        return messages.pop(0)

    raw_headers = [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    return Request({"type": "http", "method": "POST", "headers": raw_headers}, receive)


def parse(body: bytes, reader: BodyReader | None = None, **kwargs) -> tuple[object, str]:
    """(the body's model, the name of the thread ``then`` ran on)."""
    reader = reader or BodyReader(8 * 1024 * 1024, False, GENERATION_POLICIES)

    async def run() -> tuple[object, str]:
        return await reader.parse(
            request(body, **kwargs),
            lambda data: CompletionRequest,
            lambda model: (model, threading.current_thread().name),
        )

    return asyncio.run(run())


def refusal(body: bytes, **kwargs) -> APIError:
    with pytest.raises(APIError) as caught:
        parse(body, **kwargs)
    return caught.value


def test_small_bodies_are_read_on_the_loop_and_large_ones_in_the_worker_thread():
    small = b'{"prompt": "hi"}'
    large = b'{"prompt": "' + b"x" * INLINE_BODY_BYTES + b'"}'
    loop_thread = threading.current_thread().name  # asyncio.run's loop runs on this thread
    assert parse(small)[1] == loop_thread
    model, thread = parse(large)
    assert thread.startswith("http-body") and len(model.prompt) == INLINE_BODY_BYTES


def test_a_body_over_the_limit_is_refused_before_it_is_read():
    reader = BodyReader(1024, False, GENERATION_POLICIES)
    body = b'{"prompt": "' + b"x" * 4096 + b'"}'
    # Declared too long: refused without a single receive() (the request would fail it).
    declared = request(b"", {"Content-Length": str(len(body))})

    async def run(req: Request) -> object:
        return await reader.parse(req, lambda data: CompletionRequest)

    for req in (declared, request(body, chunk=512)):  # chunked: stops at the limit
        with pytest.raises(APIError) as caught:
            asyncio.run(run(req))
        error = caught.value
        assert error.status == 413 and error.headers == {"Connection": "close"}
        assert error.code == "request_too_large"


@pytest.mark.parametrize(
    "body, param, words",
    [
        (
            b'{"prompt": "hi", "temperature": NaN}',
            "temperature",
            "NaN and Infinity are not JSON numbers",
        ),
        (
            b'{"prompt": "hi", "response_format": {"a": [Infinity]}}',
            "response_format.a[0]",
            "not JSON numbers",
        ),
        (b'{"prompt": "\\ud800"}', "prompt", "lone UTF-16 surrogate (U+D800)"),
        (b'{"prompt": "hi", "vendor": {"\\udfff": 1}}', "vendor.'\\udfff'", "(U+DFFF)"),
        (b'{"prompt": "\xff"}', None, "not valid UTF-8"),
        (b'{"prompt": ' + b"[" * 201 + b"]" * 201 + b"}", None, "deeper than 200 levels"),
        (b'{"prompt": "hi",}', None, "not valid JSON"),
        (b"[1, 2]", None, "must be a JSON object"),
        (b"", None, "not valid JSON"),
    ],
)
def test_what_is_not_json_is_refused_and_named(body, param, words):
    error = refusal(body)
    assert error.status == 400 and error.param == param and words in error.message, error.message


def test_field_paths_read_as_the_api_names_fields():
    assert field_path(("body", "messages", 0, "content", "str")) == "messages[0].content"
    assert field_path(("prompt", "list[int]", 3)) == "prompt[3]"
    assert field_path(()) is None


def test_a_text_prompt_is_not_walked_character_by_character():
    """Issue 38: the token-id range check enumerated a text prompt's characters in Python (a
    7 MB completions prompt spent ~8 s there before the cluster saw it)."""
    from http_worker.protocol import _check_token_ids

    class Unwalkable(str):
        def __iter__(self):
            raise AssertionError("the prompt's characters were walked")

    _check_token_ids(Unwalkable("a long text prompt"))
    _check_token_ids([1, 2, 3])
    with pytest.raises(ValueError, match="token ids are integers"):
        _check_token_ids([[1, 2], [3, -1]])
