"""The routes of the APIs besides OpenAI's completions and chat: POST /v1/responses (OpenAI's
Responses API), POST /v1/messages and POST /v1/messages/count_tokens (Anthropic's Messages
API). Each body is read and checked by ``bodies`` (http_worker.body, with the field policy),
translated into a chat request, and answered by the path every generation takes
(http_worker.answer); only the answer's format is the API's own. Errors on /v1/messages are in
Anthropic's shape (app.py's handlers ask ``speaks_messages_api``)."""

from __future__ import annotations

import time
from typing import Any

from fastapi import FastAPI, Request
from pydantic import BaseModel
from starlette.responses import Response

from http_worker.answer import generate, json_response
from http_worker.body import BodyReader
from http_worker.fields import NO_OP_FIELDS, STREAM_OPTIONS_NO_OP_FIELDS, FieldPolicy
from http_worker.frontend import Frontend
from http_worker.generation import GenerationPlan, api_error_from, plan_generation
from http_worker.messages_api import CountTokensRequest, MessagesRequest
from http_worker.messages_api_bodies import MessagesFormat
from http_worker.openapi import ANTHROPIC_ERROR_SCHEMA, TYPED_SSE_SCHEMA, operation
from http_worker.responses_api import ResponsesRequest
from http_worker.responses_api_bodies import ResponsesFormat
from ipc.client import SplitserveError

MESSAGES_PATH = "/v1/messages"
PATHS = ("/v1/responses", MESSAGES_PATH, f"{MESSAGES_PATH}/count_tokens")
BODIES: list[type[BaseModel]] = [ResponsesRequest, MessagesRequest, CountTokensRequest]

_EARLIER_OUTPUT = "part of an earlier answer replayed as input; the model reads its text"
RESPONSES_NOT_IMPLEMENTED: dict[str, tuple[Any, ...]] = {
    "background": (False,),
    "conversation": (),
    "prompt": (),
    "reasoning": (),
    "truncation": ("disabled",),
    "max_tool_calls": (),
    "context_management": (),
    "moderation": (),
    "image": (),
    "access_programs": (),
    "background_options": (),
    "prompt_cache_options": (),
}
RESPONSES_NO_OP_FIELDS = {
    **NO_OP_FIELDS,
    "prompt_cache_retention": "how long OpenAI's prompt cache keeps a prefix; the prefix cache "
    "here keeps blocks while it has room",
}
# Anthropic's cache_control marks a prompt-cache breakpoint: the prefix cache here finds shared
# prefixes by their token ids, wherever they end.
CACHE_CONTROL = {
    "cache_control": "a prompt-cache breakpoint; the prefix cache here finds "
    "shared prefixes by their token ids"
}
MESSAGES_NOT_IMPLEMENTED: dict[str, tuple[Any, ...]] = {
    "output_config": (),
    "container": (),
    "mcp_servers": (),
    "context_management": (),
    "inference_geo": (),
    "speed": ("standard",),
    "diagnostics": (),
    "user_profile_id": (),
    "workspace_id": (),
}
MESSAGES_NO_OP_FIELDS = {
    **CACHE_CONTROL,
    "service_tier": "a processing tier for billing and latency; there is one tier here",
}
POLICIES = {
    "ResponsesRequest": FieldPolicy(RESPONSES_NOT_IMPLEMENTED, RESPONSES_NO_OP_FIELDS),
    "ResponsesStreamOptions": FieldPolicy(no_op=STREAM_OPTIONS_NO_OP_FIELDS),
    "ResponsesInputItem": FieldPolicy(
        no_op={"id": "the id an earlier answer gave the item", "status": _EARLIER_OUTPUT}
    ),
    "ResponsesTextPart": FieldPolicy(
        no_op={"annotations": _EARLIER_OUTPUT, "logprobs": _EARLIER_OUTPUT}
    ),
    "MessagesRequest": FieldPolicy(MESSAGES_NOT_IMPLEMENTED, MESSAGES_NO_OP_FIELDS),
    "CountTokensRequest": FieldPolicy(MESSAGES_NOT_IMPLEMENTED, MESSAGES_NO_OP_FIELDS),
    "MessagesBlock": FieldPolicy(no_op={**CACHE_CONTROL, "citations": _EARLIER_OUTPUT}),
    "MessagesTextBlock": FieldPolicy(no_op={**CACHE_CONTROL, "citations": _EARLIER_OUTPUT}),
    "MessagesTool": FieldPolicy(no_op=CACHE_CONTROL),
}


def speaks_messages_api(path: str) -> bool:
    return path == MESSAGES_PATH or path.startswith(f"{MESSAGES_PATH}/")


def install_other_api_routes(app: FastAPI, frontend: Frontend, bodies: BodyReader) -> None:
    def planned(body: Any) -> tuple[Any, GenerationPlan]:
        # No limit asked (Responses): as chat, the room the context has (the tokenizer cuts it).
        return body, plan_generation(body.to_chat(), max(1, frontend.max_model_len))

    @app.post("/v1/responses", openapi_extra=operation(ResponsesRequest, stream=TYPED_SSE_SCHEMA))
    async def responses(request: Request) -> Response:
        t_arrived = time.monotonic()
        body, plan = await bodies.parse(request, lambda data: ResponsesRequest, planned)
        return await generate(request, plan, ResponsesFormat(frontend.model_name, body), t_arrived)

    anthropic = {"error_schema": ANTHROPIC_ERROR_SCHEMA}

    @app.post(
        MESSAGES_PATH,
        openapi_extra=operation(MessagesRequest, stream=TYPED_SSE_SCHEMA, **anthropic),
    )
    async def messages(request: Request) -> Response:
        t_arrived = time.monotonic()
        body, plan = await bodies.parse(request, lambda data: MessagesRequest, planned)
        return await generate(request, plan, MessagesFormat(frontend.model_name, body), t_arrived)

    @app.post(
        f"{MESSAGES_PATH}/count_tokens", openapi_extra=operation(CountTokensRequest, **anthropic)
    )
    async def count_tokens(request: Request) -> Response:
        """The prompt's tokens as the engine would see them: the tokenizer worker renders the
        same chat, tools included, that a message request of it is computed on."""
        chat = await bodies.parse(
            request, lambda data: CountTokensRequest, lambda body: body.to_chat()
        )
        frontend.check_model(chat.model)
        try:
            tokenized = await frontend.require_client().tokenize(
                messages=[m.as_dict() for m in chat.messages],
                tools=chat.tools or None,
                tool_choice=chat.tool_choice,
                chat_template_kwargs=chat.chat_template_kwargs,
            )
        except SplitserveError as exc:
            raise api_error_from(exc, chat) from None
        return json_response({"input_tokens": tokenized.count})
