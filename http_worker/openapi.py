"""The OpenAPI document served at /openapi.json: the request bodies as the strict models of
protocol.py validate them (types and bounds), every error as the 400-family body the server
really sends (never FastAPI's 422), so that tools can generate clients from it and fuzz it
(tests/test_http_edge.py runs schemathesis over every route).

The routes read their bodies themselves (http_worker.body), so FastAPI cannot see them: each
route states its body and answers with ``operation(...)``, and ``install_openapi`` adds the
models' schemas to the document's components.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from http_worker.field_types import TOKEN_ID_MARK

_REF = "#/components/schemas/{model}"
ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}
# Anthropic's shape, which the /v1/messages routes answer with (messages_api_bodies.py).
ANTHROPIC_ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["type", "error"],
    "properties": {
        "type": {"const": "error"},
        "error": {
            "type": "object",
            "required": ["type", "message"],
            "properties": {"type": {"type": "string"}, "message": {"type": "string"}},
        },
    },
}
_ERROR_REASONS = {
    "400": "the body or a field is invalid (param names it)",
    "401": "no valid API key (servers started with one)",
    "404": "the model is not served here",
    "413": "the body is over --http-max-body-bytes",
    "429": "the cluster's queues are full; retry later",
    "500": "a server fault",
    "503": "the cluster is unavailable",
    "504": "the request's deadline passed",
}
_OBJECT = {"type": "object"}
JSON_OBJECT = {"application/json": {"schema": _OBJECT}}
# Before OpenAPI 3.2 (itemSchema), a text/event-stream's schema describes each event.
SSE_SCHEMA = {
    "type": "object",
    "description": "one server-sent event: its data is a JSON chunk, the last one's [DONE]",
    "properties": {"data": {"type": "string"}},
    "required": ["data"],
}
TYPED_SSE_SCHEMA = {
    "type": "object",
    "description": "one server-sent event, named by its type; its data is a JSON object",
    "properties": {"event": {"type": "string"}, "data": {"type": "string"}},
    "required": ["event", "data"],
}


def _error(reason: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"description": reason, "content": {"application/json": {"schema": schema}}}


def responses(
    success: dict[str, Any], *codes: str, error_schema: dict[str, Any] = ERROR_SCHEMA
) -> dict[str, Any]:
    """The 200 answer's content types and schemas, and the error answers ``codes``."""
    out: dict[str, Any] = {"200": {"description": "success", "content": success}}
    for code in codes or _ERROR_REASONS:
        out[code] = _error(_ERROR_REASONS[code], error_schema)
    return out


def reading(success: dict[str, Any], *codes: str) -> dict[str, Any]:
    """A route without a body: its 200 content and the errors ``codes`` it may answer (a
    /health that finds the cluster down answers 503 with its own JSON object)."""
    return {"responses": responses(success, *codes) if codes else responses(success, "500")}


def operation(
    *bodies: type[BaseModel],
    success: dict[str, Any] | None = None,
    stream: bool | dict[str, Any] = False,
    error_schema: dict[str, Any] = ERROR_SCHEMA,
) -> dict[str, Any]:
    """A route's ``openapi_extra``: its JSON body (one of ``bodies``) and its answers."""
    refs = [{"$ref": _REF.format(model=model.__name__)} for model in bodies]
    content: dict[str, Any] = {"application/json": {"schema": success or _OBJECT}}
    if stream:
        content["text/event-stream"] = {"schema": SSE_SCHEMA if stream is True else stream}
    return {
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {"schema": refs[0] if len(refs) == 1 else {"anyOf": refs}}
            },
        },
        "responses": responses(content, error_schema=error_schema),
    }


def install_openapi(
    app: FastAPI, models: list[type[BaseModel]], vocab_size: Callable[[], int]
) -> None:
    """Serves the document with ``models`` (the route bodies) among its components, its token
    ids bounded by the served model's vocabulary (``vocab_size()``, 0 while not known: the
    document is then made anew on each request until it is)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        doc = get_openapi(
            title=app.title, version=app.version, description=app.description, routes=app.routes
        )
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        for model in models:
            schema = model.model_json_schema(ref_template=_REF)
            schemas.update(schema.pop("$defs", {}))
            schemas[model.__name__] = schema
        vocab = vocab_size()
        bound_token_ids(doc, vocab)
        if vocab:
            app.openapi_schema = doc
        return doc

    app.openapi = openapi  # type: ignore[method-assign]


def bound_token_ids(node: Any, vocab_size: int) -> None:
    """Every token id's schema (marked by field_types.TokenId) says the bound the tokenizer
    worker holds ids to: below the vocabulary size, which the frontend learns from its cluster.
    Unknown (0), the wire's bound stays and the description says where to find it."""
    if isinstance(node, list):
        for item in node:
            bound_token_ids(item, vocab_size)
        return
    if not isinstance(node, dict):
        return
    if node.pop(TOKEN_ID_MARK, False):
        if vocab_size:
            node["maximum"] = vocab_size - 1
            node["description"] = f"a token id of the served model (its vocabulary: {vocab_size})"
        else:
            node["description"] = (
                "a token id: below the served model's vocabulary size (GET /tokenizer_info)"
            )
    for value in node.values():
        bound_token_ids(value, vocab_size)
