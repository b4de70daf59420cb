"""The OpenAI-compatible wire format of the HTTP frontend: the fields both generation endpoints
share, the completions request (chat's: chat_protocol.py), their mapping to SamplingParams, and
the error bodies (responses and stream chunks: completions_bodies.py).

Value checks live in one place, ``SamplingParams.__post_init__`` (and the rules of
ipc.field_rules it shares with the SDK); the models here check types strictly (as OpenAI: an
integer field takes an integer, never "10", true or 10.0) and the ranges the wire carries, which
the OpenAPI document then states, and turn OpenAI features we do not implement into a clear 400
instead of silently ignoring them (a client asking for logprobs must not get a response without
them). Fields the models do not declare are kept as extras and judged by ``http_worker.fields``.
The body itself (size, JSON) is read and parsed in http_worker.body.
"""

from __future__ import annotations

from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from http_worker.field_types import (
    MAX_TOKENS_RULE,
    CacheSalt,
    Count,
    LogitBias,
    Logprobs,
    MinP,
    Penalty,
    RepetitionPenalty,
    StopString,
    StopStrings,
    StopTokenIds,
    Temperature,
    TokenId,
    TopP,
    stated,
)
from ipc.field_rules import MAX_INT32, MAX_SEED, MAX_TOKEN_ID, FieldError, renamed
from ipc.messages import SamplingParams
from ipc.structured import StructuredOutputError, spec_from_request

MAX_N = 16  # choices per prompt
MAX_CHOICES = 128  # prompts x n in one request: each is one engine request

# Strict: no coercion (OpenAI's behaviour). Undeclared fields are kept for http_worker.fields.
STRICT = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)
# Validating a message costs ~10 us per content part: a body of many small parts (320,000 fit in
# the body limit) would take seconds; these bound the work before it starts.
MAX_CONTENT_PARTS = 4096  # text parts over all messages of one request

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
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status,
            message,
            type,
            param,
            code,
        )
        self.headers = headers

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
    model_config = STRICT
    include_usage: bool = False
    continuous_usage_stats: bool = False  # usage on every chunk (vLLM's extension)


class GenerationRequest(BaseModel):
    """Fields both endpoints share. Other fields are judged by http_worker.fields."""

    model_config = STRICT

    model: str | None = None
    max_tokens: Count | None = Field(None, description=MAX_TOKENS_RULE)
    # OpenAI's newer name for max_tokens
    max_completion_tokens: Count | None = Field(None, description=MAX_TOKENS_RULE)
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: Annotated[int, Field(ge=-1, le=MAX_INT32)] | None = None
    seed: Annotated[int, Field(ge=0, le=MAX_SEED)] | None = None
    stop: StopString | StopStrings | None = None
    stop_token_ids: StopTokenIds | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    user: str | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: RepetitionPenalty | None = None  # not OpenAI's; vLLM and TGI take it
    logit_bias: LogitBias | None = None  # token id (as a JSON key) -> bias
    # vLLM's extensions, with vLLM's meaning.
    min_tokens: Count = Field(0, description="at most max_tokens")
    min_p: MinP = 0.0
    include_stop_str_in_output: bool = False
    prompt_logprobs: Logprobs | None = None
    # What the output must match: OpenAI's field, or vLLM's (json, regex, choice, grammar).
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    # vLLM's: the request shares cached KV blocks only with requests of the same salt.
    cache_salt: CacheSalt | None = None
    # Ours: false keeps this request off speculative decoding (docs/speculative.md).
    speculative: bool = True

    @model_validator(mode="after")
    def _reject_unsupported(self) -> GenerationRequest:
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
            # Decimal digits only: int() would also take "1_000", " 7" and "+7".
            if not (key.isascii() and key.isdigit()) or int(key) > MAX_TOKEN_ID:
                raise bad_request(
                    f"logit_bias keys must be token ids (decimal integers in "
                    f"[0, {MAX_TOKEN_ID}]), got {key!r:.40}",
                    "logit_bias",
                )
            bias[int(key)] = value
        return bias

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)

    @property
    def max_tokens_name(self) -> str:
        """The name the request gave its limit by (the newer one wins when both are given)."""
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def named(self, exc: FieldError) -> FieldError:
        """``exc`` with its field called what this request called it (the SDK's and the
        tokenizer worker's names: max_tokens, prompt_token_ids)."""
        exc = renamed(exc, "max_tokens", self.max_tokens_name)
        return renamed(exc, "prompt_token_ids", "prompt")

    def output_options(self) -> dict[str, Any]:
        """submit() keywords beside the prompt and sampling: structured outputs (and tools, on
        the chat endpoint), the cache salt."""
        try:
            spec = spec_from_request(self.response_format, self.structured_outputs)
        except StructuredOutputError as exc:
            named = self.named(FieldError(exc.param, str(exc)))
            raise bad_request(str(named), named.param) from None
        salt = {} if self.cache_salt is None else {"cache_salt": self.cache_salt}
        return salt if spec is None else {"response_format": spec, **salt}

    def sampling(self, default_max_tokens: int, choice: int) -> SamplingParams:
        """The SamplingParams of one choice; bad values raise APIError(400) naming the field.
        Without max_tokens, ``default_max_tokens`` cut to the room the prompt leaves.

        With a seed, choice i uses seed + i: n choices with one seed must still differ (as with
        OpenAI), and the same request with the same seed must give the same n answers."""
        seed = self.seed
        if seed is not None:  # in [0, 2**63-1] (the model's bound): the sum wraps within it
            seed = (seed + choice) % (MAX_SEED + 1)
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        given = self.max_completion_tokens
        try:
            return SamplingParams(
                max_tokens=self.max_tokens if given is None else given,
                default_max_tokens=default_max_tokens,
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
                speculative=self.speculative,
                **self._logprob_fields(),
            )
        except FieldError as exc:
            exc = self.named(exc)
            raise bad_request(str(exc), exc.param) from None


T = TypeVar("T")
NonEmpty = Field(min_length=1)
PromptIds = Annotated[list[TokenId], NonEmpty]
PromptText = Annotated[str, NonEmpty]
# A batch is n x its prompts requests (generation.py checks against MAX_CHOICES, naming n).
Batch = Annotated[list[T], NonEmpty, stated(maxItems=MAX_CHOICES)]


class CompletionRequest(GenerationRequest):
    # A string, a batch of strings, token ids, or a batch of token id lists; none empty.
    prompt: PromptText | Batch[PromptText] | PromptIds | Batch[PromptIds]
    echo: bool = False
    best_of: Count | None = None
    suffix: str | None = None
    logprobs: Logprobs | None = None  # an integer here; chat's logprobs is a boolean

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
            # Empty, or a batch with an empty prompt (a prompt of ids may hold token 0).
            if not v or (isinstance(v, list) and not ids(v) and not all(v)):
                raise ValueError("prompt is empty")  # before the union names four reasons
            _check_token_ids(v)
            return v
        raise ValueError(
            "prompt must be a string, a list of strings, a list of token ids or a "
            "list of token id lists"
        )

    def prompts(self) -> list[dict[str, Any]]:
        """One submit() keyword set per prompt of the batch."""
        p = self.prompt  # never empty, nor any prompt of a batch (_prompt_shape)
        batch: list[Any] = [p] if isinstance(p, str) or isinstance(p[0], int) else list(p)
        return [{"prompt": x} if isinstance(x, str) else {"prompt_token_ids": x} for x in batch]


def _check_token_ids(prompt: Any) -> None:
    """Every token id of a prompt of ids (or a batch of them) within the wire's int32. min() and
    max() look at a list in C; the ids are walked one by one only to name a bad one."""
    if isinstance(prompt, str):  # no ids (a 7 MB text was walked character by character)
        return
    batch = bool(prompt) and isinstance(prompt[0], (list, str))
    rows = [(f"[{i}]", row) for i, row in enumerate(prompt)] if batch else [("", prompt)]
    rows = [(where, row) for where, row in rows if isinstance(row, list) and row]
    if all(min(row) >= 0 and max(row) <= MAX_TOKEN_ID for _, row in rows):
        return
    for where, row in rows:
        for j, token in enumerate(row):
            if not 0 <= token <= MAX_TOKEN_ID:
                at = f"{where}[{j}]"
                raise ValueError(
                    f"token ids are integers in [0, {MAX_TOKEN_ID}], got {token} at {at}"
                )
