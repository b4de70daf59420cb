"""The chat completions request (POST /v1/chat/completions) and the chat messages every API
reads (the Responses and Messages APIs translate into this request, /tokenize takes its
messages): the model of one message and its text parts, and the bound on a chat's size checked
before any message is validated. What the endpoints share is in protocol.py."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from http_worker.field_types import (
    CHAT_TOOL_CHOICE,
    FORCING_CHOICE,
    Logprobs,
    chat_message_rules,
    stated,
    tools_needed_by,
)
from http_worker.protocol import MAX_CONTENT_PARTS, STRICT, GenerationRequest, bad_request
from ipc.field_rules import MAX_CHAT_MESSAGES, content_problem, tool_call_id_problem


class TextPart(BaseModel):
    # Any type and no text parse, so that the 400 can say what is supported (as_dict).
    model_config = ConfigDict(**STRICT, json_schema_extra={"required": ["type", "text"]})
    type: Annotated[str, stated("only text parts are supported", const="text")]
    text: Annotated[str | None, WithJsonSchema({"type": "string"})] = None


class ChatMessageIn(BaseModel):
    """One message; its fields' order matters to the checks below, which read the earlier
    ones (the SDK's rules, ipc.field_rules)."""

    model_config = ConfigDict(**STRICT, json_schema_extra=chat_message_rules)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    name: str | None = None  # passed to the chat template, which may show it
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's calls (OpenAI's shape)
    tool_call_id: str | None = Field(None, validate_default=True)  # a tool result's call
    # An earlier answer's thinking, replayed: for a template that shows it (Qwen3's key).
    reasoning_content: str | None = None
    content: str | list[TextPart] | None = Field(None, validate_default=True)

    @field_validator("tool_call_id")
    @classmethod
    def _tool_call_id(cls, value: Any, info: ValidationInfo) -> Any:
        if problem := tool_call_id_problem(info.data.get("role", ""), value):
            raise ValueError(problem)
        return value

    @field_validator("reasoning_content")
    @classmethod
    def _reasoning_content(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None and info.data.get("role") != "assistant":
            raise ValueError("only an assistant message has reasoning_content")
        return value

    @field_validator("content")
    @classmethod
    def _content(cls, value: Any, info: ValidationInfo) -> Any:
        if problem := content_problem(
            info.data.get("role", ""), value, info.data.get("tool_calls")
        ):
            raise ValueError(problem)
        return value

    def as_dict(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            if any(part.type != "text" or part.text is None for part in content):
                raise bad_request("only text content parts are supported", "messages")
            content = "".join(part.text for part in content)  # type: ignore[misc]
        # "developer" is OpenAI's newer name for the system role; chat templates know "system".
        role = "system" if self.role == "developer" else self.role
        out: dict[str, Any] = {"role": role, "content": content or ""}
        for key in ("name", "tool_calls", "tool_call_id", "reasoning_content"):
            if getattr(self, key):
                out[key] = getattr(self, key)
        return out


def bound_messages(messages: Any) -> Any:
    """The messages list as parsed, before any message is validated: at most MAX_CHAT_MESSAGES
    messages and MAX_CONTENT_PARTS text parts in all (a "before" validator of chat bodies)."""
    if not isinstance(messages, list):
        return messages  # the field's own checks say what is wrong
    if len(messages) > MAX_CHAT_MESSAGES:
        raise ValueError(f"at most {MAX_CHAT_MESSAGES} messages, got {len(messages)}")
    parts = sum(
        len(m["content"])
        for m in messages
        if isinstance(m, dict) and isinstance(m.get("content"), list)
    )
    if parts > MAX_CONTENT_PARTS:
        raise ValueError(f"at most {MAX_CONTENT_PARTS} content parts in all, got {parts}")
    return messages


class ChatCompletionRequest(GenerationRequest):
    model_config = ConfigDict(**STRICT, json_schema_extra=tools_needed_by(FORCING_CHOICE))
    messages: list[ChatMessageIn] = Field(min_length=1, max_length=MAX_CHAT_MESSAGES)
    _bounded = field_validator("messages", mode="before")(bound_messages)
    chat_template_kwargs: dict[str, Any] | None = None  # e.g. {"enable_thinking": false}
    logprobs: bool | None = None
    top_logprobs: Logprobs | None = None
    tools: list[Any] | None = None
    tool_choice: Annotated[Any, WithJsonSchema(CHAT_TOOL_CHOICE)] = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True

    def output_options(self) -> dict[str, Any]:
        options = super().output_options()
        for name in ("tools", "tool_choice", "parallel_tool_calls"):
            if getattr(self, name) not in (None, []):  # "tools": [] offers nothing
                options[name] = getattr(self, name)
        return options

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs is only allowed when logprobs is true")
        return self

    def _logprob_fields(self) -> dict[str, Any]:
        return {
            **super()._logprob_fields(),
            "logprobs": (self.top_logprobs or 0) if self.logprobs else None,
        }

    def prompts(self) -> list[dict[str, Any]]:
        return [
            {
                "messages": [m.as_dict() for m in self.messages],
                "add_generation_prompt": self.add_generation_prompt,
                "chat_template_kwargs": self.chat_template_kwargs,
            }
        ]
