"""Anthropic's Messages API (POST /v1/messages, POST /v1/messages/count_tokens): its request
bodies, checked as strictly as chat's, and their translation into the chat request every API
is served by (http_worker.translated).

``system`` is the system message; a user turn's ``tool_result`` blocks become tool messages
(before its text, as Anthropic orders them), an assistant turn's ``tool_use`` blocks its tool
calls. ``tool_choice`` ``any`` is chat's "required" and ``tool`` a named function, both
enforced by the tool-call grammar; ``stop_sequences`` are chat's stop strings, kept in the text
so that the answer can say which one matched (messages_api_bodies.py takes it out).
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from http_worker.chat_protocol import bound_messages
from http_worker.field_types import Temperature, TopP, tools_needed_by
from http_worker.protocol import MAX_CONTENT_PARTS, STRICT, bad_request
from http_worker.translated import CHAT_TOOL_FIELD, TOOL_NAME, TranslatedChatRequest
from ipc.field_rules import MAX_CHAT_MESSAGES, MAX_INT32

CallId = Annotated[str, Field(min_length=1, max_length=256)]
Text = Annotated[str, Field(min_length=1)]  # Anthropic refuses empty text blocks
# A tool's input is an object: Anthropic refuses an input_schema of any other type.
InputSchema = Annotated[
    dict[str, Any],
    Field(json_schema_extra={"required": ["type"], "properties": {"type": {"const": "object"}}}),
]
# Anthropic's tool_choice types that call a tool: they need tools to call.
FORCING_CHOICE = {
    "type": "object",
    "required": ["type"],
    "properties": {"type": {"enum": ["any", "tool"]}},
}


class MessagesTextBlock(BaseModel):
    model_config = STRICT
    type: Literal["text"]
    text: Text


class MessagesBlock(BaseModel):
    """A content block of a message; ``type`` says which fields it has."""

    model_config = STRICT
    type: Literal["text", "tool_use", "tool_result"]
    text: Text | None = None
    id: CallId | None = None  # tool_use
    name: str | None = None  # tool_use
    input: dict[str, Any] | None = None  # tool_use
    tool_use_id: CallId | None = None  # tool_result
    content: list[MessagesTextBlock] | str | None = None  # tool_result
    is_error: bool | None = None  # tool_result

    @model_validator(mode="after")
    def _fields_of_its_type(self) -> MessagesBlock:
        needs, may = {
            "text": (("text",), ()),
            "tool_use": (("id", "name", "input"), ()),
            "tool_result": (("tool_use_id",), ("content", "is_error")),
        }[self.type]
        if missing := [f for f in needs if getattr(self, f) is None]:
            raise ValueError(f"a {self.type} block needs {' and '.join(missing)}")
        fields = ("text", "id", "name", "input", "tool_use_id", "content", "is_error")
        extra = [f for f in fields if f not in needs + may and getattr(self, f) is not None]
        if extra:
            raise ValueError(f"a {self.type} block has no {' or '.join(extra)}")
        return self

    def result_text(self) -> str:
        text = _text(self.content)
        return f"Error: {text}" if self.is_error else text  # chat's tool messages have no flag

    def chat_call(self) -> dict[str, Any]:
        arguments = json.dumps(self.input, ensure_ascii=False)
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": arguments},
        }


def _text(content: list[MessagesTextBlock] | list[MessagesBlock] | str | None) -> str:
    if isinstance(content, list):
        return "".join(block.text or "" for block in content if block.type == "text")
    return content or ""


class MessagesMessage(BaseModel):
    model_config = STRICT
    role: Literal["user", "assistant"]
    # The list first: its errors are the useful ones. Neither may be empty (Anthropic's rule).
    content: Annotated[list[MessagesBlock], Field(min_length=1)] | Text

    @field_validator("content", mode="before")
    @classmethod
    def _some_content(cls, value: Any) -> Any:
        if value in ("", []):  # one message, not one per member of the union
            raise ValueError("a message needs content: a non-empty string or at least one block")
        return value

    @model_validator(mode="after")
    def _blocks_of_its_role(self) -> MessagesMessage:
        wrong = "tool_result" if self.role == "assistant" else "tool_use"
        if isinstance(self.content, list) and any(b.type == wrong for b in self.content):
            raise ValueError(f"{self.role} messages have no {wrong} blocks")
        return self

    def chat_messages(self) -> list[dict[str, Any]]:
        if isinstance(self.content, str):
            return [{"role": self.role, "content": self.content}]
        text = _text(self.content)
        if self.role == "assistant":
            calls = [b.chat_call() for b in self.content if b.type == "tool_use"]
            message: dict[str, Any] = {"role": "assistant", "content": text or None}
            if calls:
                message["tool_calls"] = calls
            elif not text:
                message["content"] = ""
            return [message]
        results = [
            {"role": "tool", "tool_call_id": b.tool_use_id, "content": b.result_text()}
            for b in self.content
            if b.type == "tool_result"
        ]
        has_text = any(b.type == "text" for b in self.content)
        return results + ([{"role": "user", "content": text}] if has_text or not results else [])


class MessagesTool(BaseModel):
    model_config = STRICT
    type: Literal["custom"] | None = None  # first: a server tool is refused for being one
    name: Annotated[str, Field(pattern=TOOL_NAME)]
    description: str | None = None
    input_schema: InputSchema
    strict: bool | None = None  # a forced call always follows the schema; others are parsed

    @field_validator("input_schema")
    @classmethod
    def _object_schema(cls, value: dict[str, Any]) -> dict[str, Any]:
        if value.get("type") != "object":
            raise ValueError(
                'input_schema must be a JSON schema of type "object" (a tool\'s input is an '
                f"object), got type {value.get('type')!r:.40}"
            )
        return value

    def chat_tool(self) -> dict[str, Any]:
        function: dict[str, Any] = {"name": self.name, "parameters": self.input_schema}
        if self.description is not None:
            function["description"] = self.description
        return {"type": "function", "function": function}


class MessagesToolChoice(BaseModel):
    model_config = STRICT
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _name_for_tool(self) -> MessagesToolChoice:
        if (self.type == "tool") != (self.name is not None):
            raise ValueError('name is given with type "tool", and only then')
        return self

    def chat_choice(self) -> Any:
        if self.type == "tool":
            return {"type": "function", "function": {"name": self.name}}
        return {"auto": "auto", "any": "required", "none": "none"}[self.type]


class MessagesThinking(BaseModel):
    """Anthropic's extended thinking, as the chat template's ``enable_thinking``: the model's
    thinking comes back as ``thinking`` blocks when the server splits it (--reasoning-parser).
    ``budget_tokens`` is checked, not enforced apart: max_tokens bounds thinking and answer."""

    model_config = STRICT
    type: Literal["enabled", "disabled"]
    budget_tokens: Annotated[int, Field(ge=1024, le=MAX_INT32)] | None = None

    @model_validator(mode="after")
    def _budget_when_enabled(self) -> MessagesThinking:
        if (self.type == "enabled") != (self.budget_tokens is not None):
            raise ValueError('budget_tokens is given with type "enabled", and only then')
        return self


class MessagesMetadata(BaseModel):
    model_config = STRICT
    user_id: Annotated[str, Field(max_length=256)] | None = None


def _bounded_blocks(messages: Any) -> Any:
    """bound_messages, with the text blocks inside tool results counted among the parts."""
    messages = bound_messages(messages)
    if not isinstance(messages, list):
        return messages
    blocks = [
        b
        for m in messages
        if isinstance(m, dict) and isinstance(m.get("content"), list)
        for b in m["content"]
    ]
    inner = sum(
        len(b["content"])
        for b in blocks
        if isinstance(b, dict) and isinstance(b.get("content"), list)
    )
    if len(blocks) + inner > MAX_CONTENT_PARTS:
        raise ValueError(
            f"at most {MAX_CONTENT_PARTS} content blocks in all, got {len(blocks) + inner}"
        )
    return messages


class MessagesPrompt(BaseModel):
    """What a prompt is made of: what count_tokens takes, and the start of a Messages request."""

    model_config = ConfigDict(**STRICT, json_schema_extra=tools_needed_by(FORCING_CHOICE))
    model: str | None = None
    messages: list[MessagesMessage] = Field(min_length=1, max_length=MAX_CHAT_MESSAGES)
    _bounded = field_validator("messages", mode="before")(_bounded_blocks)
    system: Annotated[list[MessagesTextBlock], Field(max_length=MAX_CONTENT_PARTS)] | str | None = (
        None
    )
    tools: list[MessagesTool] | None = None
    tool_choice: MessagesToolChoice | None = None
    thinking: MessagesThinking | None = None

    def chat_body(self) -> dict[str, Any]:
        messages = [{"role": "system", "content": _text(self.system)}] if self.system else []
        for m in self.messages:
            messages += m.chat_messages()
        chat: dict[str, Any] = {"model": self.model, "messages": messages}
        if self.thinking is not None:
            enabled = self.thinking.type == "enabled"
            chat["chat_template_kwargs"] = {"enable_thinking": enabled}
        if self.tools:
            chat["tools"] = [tool.chat_tool() for tool in self.tools]
        if self.tool_choice is not None:
            chat["tool_choice"] = self.tool_choice.chat_choice()
            if self.tool_choice.disable_parallel_tool_use is not None:
                chat["parallel_tool_calls"] = not self.tool_choice.disable_parallel_tool_use
        return chat

    def to_chat(self) -> MessagesChat:
        return MessagesChat.from_chat(self.chat_body())  # type: ignore[return-value]


class CountTokensRequest(MessagesPrompt):
    """POST /v1/messages/count_tokens."""


class MessagesRequest(MessagesPrompt):
    """POST /v1/messages. Other fields are judged by http_worker.fields (MESSAGES_POLICIES)."""

    max_tokens: Annotated[int, Field(ge=1, le=MAX_INT32)]
    stop_sequences: list[str] | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: Annotated[int, Field(ge=0, le=MAX_INT32)] | None = None
    stream: bool = False
    metadata: MessagesMetadata | None = None

    def chat_body(self) -> dict[str, Any]:
        if self.messages[-1].role == "assistant":
            raise bad_request(
                "the last message is the assistant's: continuing it (a prefill) is not "
                "supported by this server; end with a user message",
                f"messages[{len(self.messages) - 1}].role",
            )
        chat = super().chat_body()
        budget = self.thinking.budget_tokens if self.thinking is not None else None
        if budget is not None and budget >= self.max_tokens:
            raise bad_request(
                f"thinking.budget_tokens ({budget}) must be less than max_tokens "
                f"({self.max_tokens})",
                "thinking.budget_tokens",
            )
        chat.update(max_tokens=self.max_tokens, stream=self.stream)
        for name in ("temperature", "top_p", "top_k"):
            if getattr(self, name) is not None:
                chat[name] = getattr(self, name)
        if self.stop_sequences:
            # Kept in the text so the answer can name the one that matched (then cut there).
            chat.update(stop=self.stop_sequences, include_stop_str_in_output=True)
        if self.stream:  # message_start states the prompt's tokens, known with the first token
            chat["stream_options"] = {"continuous_usage_stats": True}
        return chat


class MessagesChat(TranslatedChatRequest):
    FIELD_NAMES = (
        (re.compile(r"\bstop(?=\[|$)"), "stop_sequences"),
        (re.compile(r"\btools\[(\d+)\]\.function\.parameters\b"), r"tools[\1].input_schema"),
        (CHAT_TOOL_FIELD, r"tools[\1]."),
        (re.compile(r'tool_choice "required"'), 'tool_choice {"type": "any"}'),
    )
