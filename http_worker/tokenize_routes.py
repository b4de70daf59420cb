"""POST /tokenize, POST /detokenize, GET /tokenizer_info and GET /version, in vLLM's shapes (what
lm-evaluation-harness probes to use a server's tokenizer instead of downloading one).

The frontend loads no tokenizer: each route asks the cluster through the SDK, and a tokenizer
worker answers with the tokenizer and chat template that prepare every request, so /tokenize
gives exactly the ids a completion of the same input is computed on.
"""

from __future__ import annotations

import importlib.metadata
import json
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.responses import Response

from http_worker.fields import (
    GENERATION_POLICIES,
    NOT_IMPLEMENTED_FIELDS,
    FieldPolicy,
    check_fields,
)
from http_worker.frontend import Frontend
from http_worker.generation import api_error_from
from http_worker.protocol import ChatMessageIn, bad_request
from ipc.client import SplitserveError

TOKENIZER_PATHS = ("/tokenize", "/detokenize", "/tokenizer_info")


class TokenizePromptBody(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatBody(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    messages: list[ChatMessageIn] = Field(min_length=1)
    add_generation_prompt: bool = True
    add_special_tokens: bool = False  # the chat template writes the special tokens
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool | None = False


class DetokenizeBody(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    tokens: list[int]


_TOKENIZE_NOT_IMPLEMENTED = {**NOT_IMPLEMENTED_FIELDS, "tools": (), "tool_choice": ("none",)}
POLICIES = {
    **GENERATION_POLICIES,
    "TokenizePromptBody": FieldPolicy(_TOKENIZE_NOT_IMPLEMENTED),
    "TokenizeChatBody": FieldPolicy(_TOKENIZE_NOT_IMPLEMENTED),
    "DetokenizeBody": FieldPolicy(),
}


def _version() -> str:
    try:
        return importlib.metadata.version("splitserve")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout, not installed
        return "unknown"


def install_tokenize_routes(
    app: FastAPI, frontend: Frontend, lenient: bool, json_response: Any
) -> None:
    version = _version()

    async def parse(request: Request, choose: Any) -> Any:
        """The body as the model ``choose(data)`` names (a 400 if it does not fit), checked
        field by field as the generation endpoints' bodies are."""
        try:
            data = json.loads(await request.body())
        except ValueError:
            raise bad_request("the body is not valid JSON") from None
        if not isinstance(data, dict):
            raise bad_request("the body must be a JSON object")
        try:
            body = choose(data).model_validate(data)
        except ValidationError as exc:
            raise RequestValidationError(exc.errors()) from None
        check_fields(body, lenient, POLICIES)
        frontend.check_model(body.model)
        return body

    async def ask(query: Any) -> Any:
        """Runs ``query(client)`` (an SDK query); its SDK errors become HTTP errors."""
        try:
            return await query(frontend.require_client())
        except SplitserveError as exc:
            raise api_error_from(exc) from None

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        body = await parse(
            request, lambda data: TokenizeChatBody if "messages" in data else TokenizePromptBody
        )
        strs = bool(body.return_token_strs)
        if isinstance(body, TokenizeChatBody):
            messages = [m.as_dict() for m in body.messages]
            result = await ask(
                lambda client: client.tokenize(
                    messages=messages,
                    add_special_tokens=body.add_special_tokens,
                    add_generation_prompt=body.add_generation_prompt,
                    chat_template_kwargs=body.chat_template_kwargs,
                    return_token_strs=strs,
                )
            )
        else:
            result = await ask(
                lambda client: client.tokenize(
                    body.prompt, add_special_tokens=body.add_special_tokens, return_token_strs=strs
                )
            )
        return json_response(
            {
                "count": result.count,
                "max_model_len": result.max_model_len,
                "tokens": result.token_ids,
                "token_strs": result.token_strs,
            }
        )

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        body = await parse(request, lambda data: DetokenizeBody)
        text = await ask(lambda client: client.detokenize(body.tokens))
        return json_response({"prompt": text})

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> Response:
        return json_response(await ask(lambda client: client.tokenizer_info()))

    @app.get("/version")
    async def get_version() -> Response:
        return json_response({"version": version})
