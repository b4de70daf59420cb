"""The OpenAI-compatible wire format of the HTTP frontend: request models (pydantic), their
mapping to SamplingParams, and the response / stream-chunk / error bodies (plain dicts, built
by hand because they are on the per-token path and json.dumps of a dict is the cheap way).

Value checks live in one place, ``SamplingParams.__post_init__``; the models here only check
types and shapes, and turn OpenAI features we do not implement into a clear 400 instead of
silently ignoring them (a client asking for logprobs must not get a response without them).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ipc.messages import SamplingParams
from ipc.structured import StructuredOutputError, spec_from_request

MAX_N = 16  # choices per prompt
MAX_CHOICES = 128  # prompts x n in one request: each is one engine request

# --- errors -------------------------------------------------------------------------------------


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status, message, type, param, code)

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, "invalid_value")


# --- requests -----------------------------------------------------------------------------------


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _GenerationRequest(BaseModel):
    """Fields both endpoints share. Unknown fields are ignored, as OpenAI's SDKs send extras."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # not OpenAI's; vLLM and TGI take it too
    # What the output must match: OpenAI's field, or vLLM's (json, regex, choice, grammar).
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    # Accepted only at its neutral value (see _reject_unsupported).
    logit_bias: dict[str, float] | None = None

    @model_validator(mode="after")
    def _reject_unsupported(self) -> _GenerationRequest:
        for name, neutral in self._neutral_values().items():
            value = getattr(self, name)
            if value is not None and value != neutral and value not in ({}, []):
                raise ValueError(f"{name} is not supported by this server")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    def _neutral_values(self) -> dict[str, Any]:
        return {"logit_bias": {}}

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def max_tokens_or(self, default: int) -> int:
        return self.max_tokens if self.max_tokens is not None else default

    def output_options(self) -> dict[str, Any]:
        """submit() keywords for structured outputs (and tools, on the chat endpoint)."""
        try:
            spec = spec_from_request(self.response_format, self.structured_outputs)
        except StructuredOutputError as exc:
            raise bad_request(str(exc), exc.param) from None
        return {} if spec is None else {"response_format": spec}

    def sampling(self, max_tokens: int, choice: int) -> SamplingParams:
        """The SamplingParams of one choice; bad values raise APIError(400).

        With a seed, choice i uses seed + i: n choices with one seed must still differ (as with
        OpenAI), and the same request with the same seed must give the same n answers."""
        seed = self.seed
        if seed is not None and seed >= 0:  # a negative one is left for SamplingParams to refuse
            seed = (seed + choice) % (2**63)
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=0 if self.top_k is None else self.top_k,
                seed=seed, stop=stop, stop_token_ids=list(self.stop_token_ids or []),
                ignore_eos=self.ignore_eos, skip_special_tokens=self.skip_special_tokens,
                presence_penalty=self.presence_penalty or 0.0,
                frequency_penalty=self.frequency_penalty or 0.0,
                repetition_penalty=(1.0 if self.repetition_penalty is None
                                    else self.repetition_penalty))
        except ValueError as exc:
            raise bad_request(str(exc)) from None


PromptIds = list[int]


class CompletionRequest(_GenerationRequest):
    # A string, a batch of strings, token ids, or a batch of token id lists.
    prompt: str | list[str] | PromptIds | list[PromptIds]
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    logprobs: int | None = None

    def _neutral_values(self) -> dict[str, Any]:
        return {**super()._neutral_values(), "echo": False, "suffix": "", "logprobs": None,
                "best_of": self.n}

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, v: Any) -> Any:
        # One clear message instead of pydantic's four (one per member of the union).
        def ids(x: Any) -> bool:
            return isinstance(x, list) and all(type(t) is int for t in x)
        if isinstance(v, str) or (isinstance(v, list) and (
                ids(v) or all(isinstance(x, str) for x in v) or all(ids(x) for x in v))):
            return v
        raise ValueError("prompt must be a string, a list of strings, a list of token ids or a "
                         "list of token id lists")

    def prompts(self) -> list[dict[str, Any]]:
        """One submit() keyword set per prompt of the batch."""
        p = self.prompt
        if isinstance(p, str):
            batch: list[Any] = [p]
        elif p and all(isinstance(x, int) for x in p):
            batch = [p]
        else:
            batch = list(p)
        if not batch:
            raise bad_request("prompt is empty", "prompt")
        out = []
        for item in batch:
            if not item:
                raise bad_request("prompt is empty", "prompt")
            out.append({"prompt": item} if isinstance(item, str) else {"prompt_token_ids": item})
        return out


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = None


class ChatMessageIn(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's calls (OpenAI's shape)
    tool_call_id: str | None = None  # on a "tool" message: the call it answers
    name: str | None = None

    def as_dict(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            if any(part.type != "text" or part.text is None for part in content):
                raise bad_request("only text content parts are supported", "messages")
            content = "".join(part.text for part in content)  # type: ignore[misc]
        # "developer" is OpenAI's newer name for the system role; chat templates know "system".
        role = "system" if self.role == "developer" else self.role
        out: dict[str, Any] = {"role": role, "content": content or ""}
        for key in ("tool_calls", "tool_call_id", "name"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessageIn] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True

    def _neutral_values(self) -> dict[str, Any]:
        return {**super()._neutral_values(), "logprobs": False, "top_logprobs": 0}

    def output_options(self) -> dict[str, Any]:
        options = super().output_options()
        for name in ("tools", "tool_choice", "parallel_tool_calls"):
            if getattr(self, name) is not None:
                options[name] = getattr(self, name)
        return options

    def max_tokens_or(self, default: int) -> int:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return super().max_tokens_or(default)

    def prompts(self) -> list[dict[str, Any]]:
        return [{"messages": [m.as_dict() for m in self.messages],
                 "add_generation_prompt": self.add_generation_prompt}]


# --- responses ----------------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage_body(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


class ResponseFormat:
    """Builds one endpoint's bodies; a subclass per endpoint. ``created`` and ``id`` are fixed
    per response so every chunk of a stream carries the same ones (as OpenAI's do)."""

    id_prefix = ""
    object_full = ""
    object_chunk = ""

    def __init__(self, model: str, include_usage: bool = False) -> None:
        self.id = new_id(self.id_prefix)
        self.created = int(time.time())
        self.model = model
        self.include_usage = include_usage

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices}

    def full(self, choices: list[tuple[str, str | None]], usage: dict[str, Any]) -> dict:
        """The non-streaming body; ``choices`` are (text, finish_reason) in index order."""
        body = self._envelope(self.object_full, [self._full_choice(i, text, reason)
                                                 for i, (text, reason) in enumerate(choices)])
        body["usage"] = usage
        return body

    def chunk(self, index: int, text: str, finish_reason: str | None) -> dict[str, Any]:
        body = self._envelope(self.object_chunk, [self._chunk_choice(index, text, finish_reason)])
        if self.include_usage:
            body["usage"] = None  # OpenAI: null on every chunk but the last when usage is asked
        return body

    def first_chunk(self, index: int) -> dict[str, Any] | None:
        return None

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        body = self._envelope(self.object_chunk, [])
        body["usage"] = usage
        return body

    def _full_choice(self, index: int, text: str, reason: str | None) -> dict[str, Any]:
        raise NotImplementedError

    def _chunk_choice(self, index: int, text: str, reason: str | None) -> dict[str, Any]:
        raise NotImplementedError


class CompletionFormat(ResponseFormat):
    id_prefix, object_full, object_chunk = "cmpl", "text_completion", "text_completion"

    def _full_choice(self, index: int, text: str, reason: str | None) -> dict[str, Any]:
        return {"index": index, "text": text, "logprobs": None, "finish_reason": reason}

    _chunk_choice = _full_choice


class ChatFormat(ResponseFormat):
    id_prefix, object_full, object_chunk = "chatcmpl", "chat.completion", "chat.completion.chunk"

    def _full_choice(self, index: int, text: str, reason: str | None) -> dict[str, Any]:
        return {"index": index, "message": {"role": "assistant", "content": text},
                "logprobs": None, "finish_reason": reason}

    def _chunk_choice(self, index: int, text: str, reason: str | None) -> dict[str, Any]:
        delta = {"content": text} if text or reason is None else {}
        return {"index": index, "delta": delta, "logprobs": None, "finish_reason": reason}

    def first_chunk(self, index: int) -> dict[str, Any] | None:
        # OpenAI's first chunk of each choice names the role, with empty content.
        body = self._envelope(self.object_chunk, [{"index": index, "delta": {
            "role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}])
        if self.include_usage:
            body["usage"] = None
        return body


def models_body(model: str, created: int, max_model_len: int) -> dict[str, Any]:
    return {"object": "list", "data": [{"id": model, "object": "model", "created": created,
                                        "owned_by": "splitserve",
                                        "max_model_len": max_model_len}]}
