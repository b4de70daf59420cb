"""POST /tokenize, POST /detokenize, GET /tokenizer_info and GET /version, in vLLM's shapes (what
lm-evaluation-harness probes to use a server's tokenizer instead of downloading one).

The frontend loads no tokenizer: each route asks the cluster through the SDK, and a tokenizer
worker answers with the tokenizer and chat template that prepare every request, so /tokenize
gives exactly the ids a completion of the same input is computed on.
"""

from __future__ import annotations

import importlib.metadata
from typing import Any

from fastapi import FastAPI, Request
from pydantic import BaseModel, Field, field_validator
from starlette.responses import Response

from http_worker.body import BodyReader
from http_worker.chat_protocol import ChatMessageIn, bound_messages
from http_worker.fields import GENERATION_POLICIES, NOT_IMPLEMENTED_FIELDS, FieldPolicy
from http_worker.frontend import Frontend
from http_worker.generation import api_error_from
from http_worker.openapi import JSON_OBJECT, operation, reading
from http_worker.protocol import STRICT, TokenId
from ipc.client import SplitserveError
from ipc.field_rules import MAX_CHAT_MESSAGES

TOKENIZER_PATHS = ("/tokenize", "/detokenize", "/tokenizer_info")


class TokenizePromptBody(BaseModel):
    model_config = STRICT
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatBody(BaseModel):
    model_config = STRICT
    model: str | None = None
    messages: list[ChatMessageIn] = Field(min_length=1, max_length=MAX_CHAT_MESSAGES)
    add_generation_prompt: bool = True
    add_special_tokens: bool = False  # the chat template writes the special tokens
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool | None = False
    _bounded = field_validator("messages", mode="before")(bound_messages)


class DetokenizeBody(BaseModel):
    model_config = STRICT
    model: str | None = None
    tokens: list[TokenId] = Field(min_length=1)


TOKENIZER_BODIES: list[type[BaseModel]] = [TokenizePromptBody, TokenizeChatBody, DetokenizeBody]
_TOKENIZE_NOT_IMPLEMENTED = {**NOT_IMPLEMENTED_FIELDS, "tools": (), "tool_choice": ("none",)}
POLICIES = {
    **GENERATION_POLICIES,
    "TokenizePromptBody": FieldPolicy(_TOKENIZE_NOT_IMPLEMENTED),
    "TokenizeChatBody": FieldPolicy(_TOKENIZE_NOT_IMPLEMENTED),
    "DetokenizeBody": FieldPolicy(),
}


def package_version() -> str:
    try:
        return importlib.metadata.version("splitserve")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout, not installed
        return "unknown"


def install_tokenize_routes(
    app: FastAPI, frontend: Frontend, bodies: BodyReader, json_response: Any
) -> None:
    """``bodies`` reads and checks every body (http_worker.body), with POLICIES for its fields."""
    version = package_version()

    async def parse(request: Request, choose: Any) -> Any:
        body: Any = await bodies.parse(request, choose)
        frontend.check_model(body.model)
        return body

    async def ask(query: Any, param: str | None = None) -> Any:
        """Runs ``query(client)`` (an SDK query); its SDK errors become HTTP errors, a bad
        request's under ``param`` when given (the SDK calls /detokenize's tokens token_ids)."""
        try:
            return await query(frontend.require_client())
        except SplitserveError as exc:
            error = api_error_from(exc)
            if param and error.status == 400:
                error.param = param
                error.message = error.message.replace("token_ids", param)
            raise error from None

    @app.post("/tokenize", openapi_extra=operation(TokenizePromptBody, TokenizeChatBody))
    async def tokenize(request: Request) -> Response:
        body = await parse(
            request, lambda data: TokenizeChatBody if "messages" in data else TokenizePromptBody
        )
        return json_response(await _tokenized(body, ask))

    @app.post("/detokenize", openapi_extra=operation(DetokenizeBody))
    async def detokenize(request: Request) -> Response:
        body = await parse(request, lambda data: DetokenizeBody)
        text = await ask(lambda client: client.detokenize(body.tokens), param="tokens")
        return json_response({"prompt": text})

    @app.get("/tokenizer_info", openapi_extra=reading(JSON_OBJECT, "401", "503", "504"))
    async def tokenizer_info() -> Response:
        return json_response(await ask(lambda client: client.tokenizer_info()))

    @app.get("/version", openapi_extra=reading(JSON_OBJECT))
    async def get_version() -> Response:
        return json_response({"version": version})


async def _tokenized(body: TokenizePromptBody | TokenizeChatBody, ask: Any) -> dict[str, Any]:
    """The /tokenize answer to one body; ``ask`` runs an SDK query (install_tokenize_routes)."""
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
    return {
        "count": result.count,
        "max_model_len": result.max_model_len,
        "tokens": result.token_ids,
        "token_strs": result.token_strs,
    }
