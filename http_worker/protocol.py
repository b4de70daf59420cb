"""The OpenAI-compatible wire format of the HTTP frontend: request models (pydantic), their
mapping to SamplingParams, and the error bodies (responses and stream chunks: responses.py).

Value checks live in one place, ``SamplingParams.__post_init__``; the models here only check
types and shapes, and turn OpenAI features we do not implement into a clear 400 instead of
silently ignoring them (a client asking for logprobs must not get a response without them).
Fields the models do not declare are kept as extras and judged by ``http_worker.fields``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ipc.messages import SamplingParams
from ipc.structured import StructuredOutputError, spec_from_request

MAX_N = 16  # choices per prompt
MAX_CHOICES = 128  # prompts x n in one request: each is one engine request

# --- errors -------------------------------------------------------------------------------------


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status,
            message,
            type,
            param,
            code,
        )

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(
    message: str, type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, "invalid_value")


# --- requests -----------------------------------------------------------------------------------


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False
    continuous_usage_stats: bool = False  # usage on every chunk (vLLM's extension)


class _GenerationRequest(BaseModel):
    """Fields both endpoints share. Other fields are judged by http_worker.fields."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens
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
    logit_bias: dict[str, float] | None = None  # token id (as a JSON key) -> bias
    # vLLM's extensions, with vLLM's meaning.
    min_tokens: int = 0
    min_p: float = 0.0
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = None
    # What the output must match: OpenAI's field, or vLLM's (json, regex, choice, grammar).
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None

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
        return {}

    def _logprob_fields(self) -> dict[str, Any]:
        """SamplingParams' logprobs / prompt_logprobs / echo for this endpoint."""
        return {"prompt_logprobs": self.prompt_logprobs}

    def _token_bias(self) -> dict[int, float]:
        bias = {}
        for key, value in (self.logit_bias or {}).items():
            try:
                bias[int(key)] = value
            except ValueError:
                raise bad_request(
                    f"logit_bias keys must be token ids, got {key!r}", "logit_bias"
                ) from None
        return bias

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)

    def max_tokens_or(self, default: int) -> int:
        for given in (self.max_completion_tokens, self.max_tokens):  # the newer name wins
            if given is not None:
                return given
        return default

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
                seed=seed,
                stop=stop,
                stop_token_ids=list(self.stop_token_ids or []),
                ignore_eos=self.ignore_eos,
                skip_special_tokens=self.skip_special_tokens,
                presence_penalty=self.presence_penalty or 0.0,
                frequency_penalty=self.frequency_penalty or 0.0,
                repetition_penalty=(
                    1.0 if self.repetition_penalty is None else self.repetition_penalty
                ),
                min_tokens=self.min_tokens,
                min_p=self.min_p,
                logit_bias=self._token_bias(),
                include_stop_str_in_output=self.include_stop_str_in_output,
                **self._logprob_fields(),
            )
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
        return {**super()._neutral_values(), "suffix": "", "best_of": self.n}

    def _logprob_fields(self) -> dict[str, Any]:
        # echo with logprobs: the prompt's entries come first, as OpenAI's legacy API had it.
        asked = [
            k for k in (self.prompt_logprobs, self.logprobs if self.echo else None) if k is not None
        ]
        return {
            "logprobs": self.logprobs,
            "echo": self.echo,
            "prompt_logprobs": max(asked) if asked else None,
        }

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, v: Any) -> Any:
        # One clear message instead of pydantic's four (one per member of the union).
        def ids(x: Any) -> bool:
            return isinstance(x, list) and all(type(t) is int for t in x)

        if isinstance(v, str) or (
            isinstance(v, list)
            and (ids(v) or all(isinstance(x, str) for x in v) or all(ids(x) for x in v))
        ):
            return v
        raise ValueError(
            "prompt must be a string, a list of strings, a list of token ids or a "
            "list of token id lists"
        )

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
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessageIn(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None  # passed to the chat template, which may show it
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's calls (OpenAI's shape)
    tool_call_id: str | None = None  # on a "tool" message: the call it answers

    def as_dict(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            if any(part.type != "text" or part.text is None for part in content):
                raise bad_request("only text content parts are supported", "messages")
            content = "".join(part.text for part in content)  # type: ignore[misc]
        # "developer" is OpenAI's newer name for the system role; chat templates know "system".
        role = "system" if self.role == "developer" else self.role
        out: dict[str, Any] = {"role": role, "content": content or ""}
        for key in ("name", "tool_calls", "tool_call_id"):
            if getattr(self, key):
                out[key] = getattr(self, key)
        return out


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessageIn] = Field(min_length=1)
    chat_template_kwargs: dict[str, Any] | None = None  # e.g. {"enable_thinking": false}
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
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
