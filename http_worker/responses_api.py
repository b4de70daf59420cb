"""OpenAI's Responses API (POST /v1/responses): its request body, checked as strictly as chat's,
and its translation into the chat request every API is served by (http_worker.translated).

``input`` is a string (one user message) or a list of items: messages with text parts, the
``function_call`` items of an earlier answer and the ``function_call_output`` items that answer
them; ``instructions`` is the system message. ``text.format`` is chat's ``response_format``,
function ``tools`` are chat's tools. The answer's items and stream events:
responses_api_bodies.py.

This server keeps no responses: ``store`` is accepted (the answer says ``"store": false``) and
``previous_response_id`` is a 400 (docs/api.md says why).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from http_worker.field_types import (
    FORCING_CHOICE,
    Count,
    Logprobs,
    Temperature,
    TopP,
    tools_needed_by,
)
from http_worker.protocol import MAX_CONTENT_PARTS, STRICT, bad_request
from http_worker.translated import CHAT_TOOL_FIELD, TOOL_NAME, TranslatedChatRequest
from ipc.field_rules import MAX_CHAT_MESSAGES

LOGPROBS_INCLUDE = "message.output_text.logprobs"
# include values that add data about items this server never produces (reasoning, hosted tools,
# images): nothing to add, so they change nothing.
INCLUDE_VALUES = (
    LOGPROBS_INCLUDE,
    "reasoning.encrypted_content",
    "message.input_image.image_url",
    "computer_call_output.output.image_url",
    "file_search_call.results",
    "web_search_call.results",
    "web_search_call.action.sources",
    "code_interpreter_call.outputs",
)
MetadataKey = Annotated[str, Field(max_length=64)]
MetadataValue = Annotated[str, Field(max_length=512)]
Metadata = Annotated[dict[MetadataKey, MetadataValue], Field(max_length=16)]


class ResponsesTextPart(BaseModel):
    """A text part of an input message, or of an earlier answer's message or reasoning item
    (``reasoning_text``, ``summary_text``) replayed as input."""

    model_config = STRICT
    type: Literal["input_text", "output_text", "reasoning_text", "summary_text"]
    text: str


THINKING_PARTS = ("reasoning_text", "summary_text")


class ResponsesInputItem(BaseModel):
    """One input item; ``type`` says which fields it has (a message when absent)."""

    model_config = STRICT
    type: Literal["message", "function_call", "function_call_output", "reasoning"] = "message"
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: list[ResponsesTextPart] | str | None = (
        None  # the list first: its errors are the useful ones
    )
    call_id: (
        Annotated[
            str,
            Field(
                min_length=1,
                max_length=256,
                description="a function_call_output's names a function_call earlier in input",
            ),
        ]
        | None
    ) = None
    name: str | None = None
    arguments: str | None = None
    output: list[ResponsesTextPart] | str | None = None
    summary: list[ResponsesTextPart] | None = None  # a reasoning item's

    @model_validator(mode="after")
    def _fields_of_its_type(self) -> ResponsesInputItem:
        needs = {
            "message": ("role", "content"),
            "function_call": ("call_id", "name", "arguments"),
            "function_call_output": ("call_id", "output"),
            "reasoning": ("summary",),
        }[self.type]
        if missing := [f for f in needs if getattr(self, f) is None]:
            raise ValueError(f"a {self.type} item needs {' and '.join(missing)}")
        given = ("role", "content", "call_id", "name", "arguments", "output", "summary")
        may = (*needs, "content") if self.type == "reasoning" else needs
        if extra := [f for f in given if f not in may and getattr(self, f) is not None]:
            raise ValueError(f"a {self.type} item has no {' or '.join(extra)}")
        lists = [v for v in (self.summary, self.content, self.output) if isinstance(v, list)]
        thinking = [part.type in THINKING_PARTS for parts in lists for part in parts]
        if any(thinking) and self.type != "reasoning":
            raise ValueError("reasoning_text and summary_text parts belong to a reasoning item")
        if self.type == "reasoning" and (isinstance(self.content, str) or not all(thinking)):
            raise ValueError("a reasoning item holds reasoning_text and summary_text parts only")
        return self

    def thinking(self) -> str:
        """A reasoning item's text: its thinking, else its summary."""
        content = self.content if isinstance(self.content, list) else []
        return _text(content) or _text(self.summary)

    def chat_message(self) -> dict[str, Any]:
        if self.type == "message":
            return {"role": self.role, "content": _text(self.content)}
        if self.type == "function_call":
            call = {"name": self.name, "arguments": self.arguments}
            return {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": self.call_id, "type": "function", "function": call}],
            }
        return {"role": "tool", "tool_call_id": self.call_id, "content": _text(self.output)}


def _text(content: str | list[ResponsesTextPart] | None) -> str:
    if isinstance(content, list):
        return "".join(part.text for part in content)
    return content or ""


def _bounded_items(items: Any) -> Any:
    """At most MAX_CHAT_MESSAGES items and MAX_CONTENT_PARTS parts, before any is validated;
    a string is not empty (as a completion's prompt: there is nothing to answer)."""
    if items == "":
        raise ValueError("input is empty: send some text, or a list of items")
    if not isinstance(items, list):
        return items
    if len(items) > MAX_CHAT_MESSAGES:
        raise ValueError(f"at most {MAX_CHAT_MESSAGES} input items, got {len(items)}")
    parts = sum(
        len(value)
        for item in items
        if isinstance(item, dict)
        for value in (item.get("content"), item.get("output"))
        if isinstance(value, list)
    )
    if parts > MAX_CONTENT_PARTS:
        raise ValueError(f"at most {MAX_CONTENT_PARTS} content parts in all, got {parts}")
    return items


class ResponsesFunctionTool(BaseModel):
    model_config = STRICT
    type: Literal["function"]
    name: Annotated[str, Field(pattern=TOOL_NAME)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # a forced call always follows the schema; auto ones are parsed

    def chat_tool(self) -> dict[str, Any]:
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        if self.parameters is not None:
            function["parameters"] = self.parameters
        return {"type": "function", "function": function}


class ResponsesNamedFunction(BaseModel):
    model_config = STRICT
    type: Literal["function"]
    name: str


class ResponsesTextFormat(BaseModel):
    model_config = STRICT
    type: Literal["text", "json_schema", "json_object"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None  # the schema is always enforced here

    def response_format(self) -> dict[str, Any]:
        if self.type != "json_schema":
            return {"type": self.type}
        body: dict[str, Any] = {"name": self.name, "schema": self.schema_}
        return {"type": "json_schema", "json_schema": {k: v for k, v in body.items() if v}}


class ResponsesText(BaseModel):
    model_config = STRICT
    format: ResponsesTextFormat | None = None
    verbosity: Literal["medium"] | None = None  # the only one a model without the knob has


class ResponsesStreamOptions(BaseModel):
    model_config = STRICT


class ResponsesRequest(BaseModel):
    """POST /v1/responses. Other fields are judged by http_worker.fields (RESPONSES_POLICIES)."""

    model_config = ConfigDict(**STRICT, json_schema_extra=tools_needed_by(FORCING_CHOICE))
    model: str | None = None
    input: (
        Annotated[list[ResponsesInputItem], Field(min_length=1)]
        | Annotated[str, Field(min_length=1)]
    )
    _bounded = field_validator("input", mode="before")(_bounded_items)
    instructions: str | None = None
    max_output_tokens: Annotated[Count, Field(ge=1)] | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    tools: list[ResponsesFunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ResponsesNamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: ResponsesText | None = None
    stream: bool = False
    stream_options: ResponsesStreamOptions | None = None
    include: list[Literal[INCLUDE_VALUES]] | None = None  # type: ignore[valid-type]
    top_logprobs: Logprobs | None = None
    metadata: Metadata | None = None
    user: str | None = None
    store: bool | None = None  # nothing is stored: the answer says "store": false
    previous_response_id: str | None = None

    @field_validator("previous_response_id")
    @classmethod
    def _nothing_stored(cls, value: str | None) -> str | None:
        if value is not None:
            raise ValueError(
                "this server keeps no responses, so it cannot continue one: send the whole "
                "conversation in input (as with store: false)"
            )
        return value

    @model_validator(mode="after")
    def _options_need_their_switch(self) -> ResponsesRequest:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError(f'top_logprobs needs "{LOGPROBS_INCLUDE}" in include')
        return self

    @property
    def logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or [])

    def chat_messages(self) -> list[dict[str, Any]]:
        """``instructions`` as the system message, then the input; consecutive function calls
        (a parallel call) join the assistant turn before them, as chat writes one turn."""
        messages: list[dict[str, Any]] = []
        if self.instructions is not None:
            messages.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            return [*messages, {"role": "user", "content": self.input}]
        calls, thinking = set(), None
        for i, item in enumerate(self.input):
            if item.type == "reasoning":  # goes with the assistant turn that follows it
                thinking = item.thinking()
                continue
            if item.type == "function_call":
                calls.add(item.call_id)
            elif item.type == "function_call_output" and item.call_id not in calls:
                raise bad_request(
                    f"input[{i}].call_id: no function_call item before it has the call_id "
                    f"{item.call_id!r:.80} (this server keeps no responses: send the call too)",
                    f"input[{i}].call_id",
                )
            message = item.chat_message()
            if thinking is not None and message["role"] == "assistant":
                message["reasoning_content"], thinking = thinking, None
            last = messages[-1] if messages else None
            if "tool_calls" in message and last is not None and last["role"] == "assistant":
                last["tool_calls"] = last.get("tool_calls", []) + message["tool_calls"]
            else:
                messages.append(message)
        if not messages:
            raise bad_request(
                "input has no message to answer (reasoning items alone are not)", "input"
            )
        return messages

    def to_chat(self) -> ResponsesChat:
        chat: dict[str, Any] = {
            "model": self.model,
            "messages": self.chat_messages(),
            "max_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "stream": self.stream,
            "user": self.user,
            "parallel_tool_calls": self.parallel_tool_calls,
        }
        if self.tools:
            chat["tools"] = [tool.chat_tool() for tool in self.tools]
        if isinstance(self.tool_choice, ResponsesNamedFunction):
            chat["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            chat["tool_choice"] = self.tool_choice
        if self.text is not None and self.text.format is not None:
            chat["response_format"] = self.text.format.response_format()
        if self.logprobs:
            chat.update(logprobs=True, top_logprobs=self.top_logprobs or 0)
        chat = {k: v for k, v in chat.items() if v is not None}
        return ResponsesChat.from_chat(chat)  # type: ignore[return-value]


class ResponsesChat(TranslatedChatRequest):
    FIELD_NAMES = (
        (re.compile(r"\bmax_tokens\b"), "max_output_tokens"),
        (re.compile(r"\bresponse_format\.json_schema\."), "text.format."),
        (re.compile(r"\bresponse_format\b"), "text.format"),
        (CHAT_TOOL_FIELD, r"tools[\1]."),
    )
