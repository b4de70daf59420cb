"""The types of request fields, each with the bounds the server holds it to, so that the OpenAPI
document (openapi.py) states what validation does: a value the document admits is one the
server takes, as far as a JSON schema can say it.

Two kinds of bound. The wire's ranges (an int32 count, a token id, 0-20 logprobs) are pydantic
constraints, checked while the body is parsed. The sampling ranges (top_p in (0, 1], penalties,
stop strings) are checked once, by ``SamplingParams`` with the SDK's messages
(ipc/sampling.py); here they are only stated (``json_schema_extra``), from the same constants.
Rules a schema cannot state (a token id below the served model's vocabulary, min_tokens at most
max_tokens) are in the descriptions; the vocabulary's bound is filled in when the frontend
knows its model (openapi.py).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field

from ipc.block_hash import MAX_CACHE_SALT_CHARS
from ipc.field_rules import MAX_INT32, MAX_TOKEN_ID
from ipc.sampling import (
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_LOGPROBS,
    MAX_REPETITION_PENALTY,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
)

# Marks a token id's schema; openapi.py replaces it with the vocabulary's bound.
TOKEN_ID_MARK = "x-token-id"


def stated(description: str = "", **bounds: Any) -> Any:
    """A Field that states ``bounds`` in the document without checking them (SamplingParams
    does, with its own messages)."""
    return Field(description=description or None, json_schema_extra=bounds)


Count = Annotated[int, Field(ge=0, le=MAX_INT32)]
TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID, json_schema_extra={TOKEN_ID_MARK: True})]
Logprobs = Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]
CacheSalt = Annotated[str, Field(min_length=1, max_length=MAX_CACHE_SALT_CHARS)]

Temperature = Annotated[float, stated("0 samples greedily", minimum=0)]
TopP = Annotated[float, stated(exclusiveMinimum=0, maximum=1)]
MinP = Annotated[float, stated(minimum=0, maximum=1)]
Penalty = Annotated[float, stated(minimum=-2, maximum=2)]
RepetitionPenalty = Annotated[
    float, stated("1 disables it", exclusiveMinimum=0, maximum=MAX_REPETITION_PENALTY)
]
StopString = Annotated[str, stated(minLength=1, maxLength=MAX_STOP_STRING_CHARS)]
StopStrings = Annotated[list[StopString], stated(maxItems=MAX_STOP_STRINGS)]
StopTokenIds = Annotated[list[TokenId], stated(maxItems=MAX_STOP_TOKEN_IDS)]
LogitBias = Annotated[
    dict[str, Annotated[float, stated(minimum=-MAX_LOGIT_BIAS, maximum=MAX_LOGIT_BIAS)]],
    stated(
        "token id (decimal digits, below the served model's vocabulary size) -> bias added to "
        "its logit",
        maxProperties=MAX_LOGIT_BIAS_ENTRIES,
        propertyNames={"pattern": "^[0-9]+$"},
    ),
]
MAX_TOKENS_RULE = (
    "at most the room the prompt leaves in the context (a larger value is a 400); 0 only to "
    "score the prompt (echo or prompt_logprobs). Not given: the endpoint's default, cut to that "
    "room and to the server's --max-default-tokens"
)


# --- rules between fields, stated for the document (json_schema_extra of a model) ---------------


def _given_content() -> dict[str, Any]:
    return {"required": ["content"], "properties": {"content": {"type": ["string", "array"]}}}


def chat_message_rules(schema: dict[str, Any]) -> None:
    """A chat message's needs by role (ipc.field_rules, checked by ChatMessageIn): content
    (an empty string counts), except an assistant turn that calls tools; a tool result also
    the tool_call_id of the call it answers."""
    some_calls = {"type": "array", "minItems": 1}
    calls = {"required": ["tool_calls"], "properties": {"tool_calls": some_calls}}
    call_id = {"type": "string", "minLength": 1}
    others = ["system", "developer", "user"]
    schema["anyOf"] = [
        {"properties": {"role": {"enum": others}}, "allOf": [_given_content()]},
        {"properties": {"role": {"const": "assistant"}}, "anyOf": [_given_content(), calls]},
        {
            "properties": {"role": {"const": "tool"}, "tool_call_id": call_id},
            "required": ["tool_call_id"],
            "allOf": [_given_content()],
        },
    ]


def tools_needed_by(forcing: dict[str, Any]) -> Any:
    """A request's rule that a tool_choice matching ``forcing`` (one that calls a tool: chat's
    "required" or a named function) needs a non-empty tools list (the tokenizer worker's
    check)."""

    def rule(schema: dict[str, Any]) -> None:
        schema.setdefault("allOf", []).append(
            {
                "if": {"required": ["tool_choice"], "properties": {"tool_choice": forcing}},
                "then": {
                    "required": ["tools"],
                    "properties": {"tools": {"type": "array", "minItems": 1}},
                },
            }
        )

    return rule


# chat's and the Responses API's tool_choice: "required", or a named function (an object)
FORCING_CHOICE = {"anyOf": [{"const": "required"}, {"type": "object"}]}
CHAT_TOOL_CHOICE = {
    "description": '"none", "auto" (the default with tools), "required" or a named function; '
    "one that calls a tool needs tools",
    "anyOf": [
        {"enum": ["none", "auto", "required"]},
        {
            "type": "object",
            "required": ["type", "function"],
            "properties": {
                "type": {"const": "function"},
                "function": {
                    "type": "object",
                    "required": ["name"],
                    "properties": {"name": {"type": "string"}},
                },
            },
        },
        {"type": "null"},
    ],
}
