"""SamplingParams: what a request asks of generation, validated once at construction.

It crosses every boundary inside SubmitRequest / TokenizedRequest (ipc.messages re-exports it);
the tokenizer worker checks what needs the vocabulary (token ids) or the prompt's length (the
room ``max_tokens`` needs), everything else is checked here, so the HTTP frontend, the SDK and
the engine share one set of rules and messages. Each refusal is a FieldError naming its field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ipc.field_rules import MAX_INT32, MAX_SEED, MAX_TOKEN_ID, FieldError, check_int, is_int

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
MAX_REPETITION_PENALTY = 10.0
MAX_LOGPROBS = 20  # top logprobs per token, as vLLM's default max_logprobs
MAX_LOGIT_BIAS_ENTRIES = 300  # OpenAI's limit
MAX_LOGIT_BIAS = 100.0
DEFAULT_MAX_TOKENS = 16  # vLLM's and OpenAI's completions default
# A request that gives no output limit gets its endpoint's default (chat, the Responses API: the
# whole room its prompt leaves, as vLLM and OpenAI), cut to this knob (--max-default-tokens): one
# small body must not hold a batch slot for minutes. 2048 tokens take ~20 s at the default
# model's single-stream decode on 2 CPU cores (~120 tok/s); a client that wants more asks.
DEFAULT_MAX_DEFAULT_TOKENS = 2048
MAX_DEFAULT_TOKENS_HELP = (
    "a request that gives no max_tokens (max_completion_tokens, max_output_tokens) generates at "
    "most this many tokens, besides the room its prompt leaves; 0: only the room (vLLM's "
    "default). A limit the request gives is not cut"
)


@dataclass(slots=True)
class SamplingParams:
    """What a request asks of generation. Invalid values raise ValueError at construction.

    Logprobs (``logprobs``, ``prompt_logprobs``) are the model's raw log-softmax of the logits of
    the step that produced the token: before temperature, penalties, logit_bias, min_tokens and
    top-k/top-p/min-p (vLLM's default)."""

    # The most tokens to generate; more than the context has room for after the prompt is
    # refused (by the tokenizer worker, which knows the prompt's length). 0 only with echo or
    # prompt_logprobs: score the prompt, sample nothing. None: not given, then
    # default_max_tokens applies, cut to the room the context has (never refused for it).
    max_tokens: int | None = None
    default_max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0  # 1 disables nucleus sampling
    top_k: int = 0  # 0 (or -1) disables top-k
    seed: int | None = None  # same seed, same output, whatever else shares the batch
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    # Penalties on tokens already there (OpenAI's meaning for the first two): the logit of a
    # token drops by frequency_penalty per time it was generated and by presence_penalty once
    # if it was; repetition_penalty (1 disables it) divides a positive logit of any token in
    # the prompt or the output by it and multiplies a negative one.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # top logprobs per generated token (0: only the token's own)
    prompt_logprobs: int | None = None  # the same for every prompt token but the first
    echo: bool = False  # the prompt (text and ids) comes back ahead of the output
    # eos and stop_token_ids cannot be sampled before this many tokens (stop strings, matched
    # in the detokenizer, still end the request)
    min_tokens: int = 0
    min_p: float = 0.0  # keeps tokens with probability >= min_p x the top one's (0 disables)
    # OpenAI's logit_bias: added to the raw logits of these token ids before sampling.
    logit_bias: dict[int, float] = field(default_factory=dict)
    include_stop_str_in_output: bool = False  # a matched stop string stays in the text
    # False: this request never verifies drafts, even on an engine launched with --speculative
    # (its output is the same either way; the opt-out is for latency or cost experiments).
    speculative: bool = True

    def __post_init__(self) -> None:
        self._check_lengths()
        if (
            not _is_number(self.temperature)
            or not math.isfinite(self.temperature)
            or self.temperature < 0
        ):
            raise FieldError(
                "temperature", f"temperature must be a finite number >= 0, got {self.temperature!r}"
            )
        if not _is_number(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise FieldError("top_p", f"top_p must be in (0, 1], got {self.top_p!r}")
        if not is_int(self.top_k) or not -1 <= self.top_k <= MAX_INT32:
            raise FieldError(
                "top_k",
                f"top_k must be an integer in [-1, {MAX_INT32}] (0 or -1 disable it), "
                f"got {self.top_k!r}",
            )
        if self.seed is not None:
            check_int(self.seed, "seed", 0, MAX_SEED)
        self._check_stops()
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_number(v) or not (-2.0 <= v <= 2.0):
                raise FieldError(name, f"{name} must be a number in [-2, 2], got {v!r}")
        v = self.repetition_penalty
        if not _is_number(v) or not math.isfinite(v) or not (0.0 < v <= MAX_REPETITION_PENALTY):
            raise FieldError(
                "repetition_penalty",
                f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}], got {v!r}",
            )
        self._check_logprob_fields()
        self._check_logit_bias()

    def _check_lengths(self) -> None:
        """max_tokens, default_max_tokens and min_tokens: integers the wire carries, in order."""
        if self.max_tokens is not None:
            check_int(self.max_tokens, "max_tokens", 0, MAX_INT32)
            if self.max_tokens == 0 and not self.scores_prompt:
                raise FieldError(
                    "max_tokens",
                    "max_tokens must be at least 1 (0 only with echo or prompt_logprobs, to "
                    "score the prompt), got 0",
                )
        check_int(self.default_max_tokens, "default_max_tokens", 1, MAX_INT32)
        check_int(self.min_tokens, "min_tokens", 0, MAX_INT32)
        if self.min_tokens > self.max_new_tokens:
            raise FieldError(
                "min_tokens",
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens "
                f"({self.max_new_tokens})",
            )

    def _check_stops(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, list) or len(self.stop) > MAX_STOP_STRINGS:
            raise FieldError("stop", f"at most {MAX_STOP_STRINGS} stop strings")
        for i, s in enumerate(self.stop):
            if not isinstance(s, str) or not s:
                raise FieldError(f"stop[{i}]", f"stop strings must be non-empty strings, got {s!r}")
            if len(s) > MAX_STOP_STRING_CHARS:
                raise FieldError(
                    f"stop[{i}]",
                    f"a stop string may have at most {MAX_STOP_STRING_CHARS} characters",
                )
        if not isinstance(self.stop_token_ids, list) or (
            len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS
        ):
            raise FieldError("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} stop token ids")
        for i, t in enumerate(self.stop_token_ids):
            check_int(t, f"stop_token_ids[{i}]", 0, MAX_TOKEN_ID)

    def _check_logprob_fields(self) -> None:
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not is_int(v) or not 0 <= v <= MAX_LOGPROBS):
                raise FieldError(
                    name, f"{name} must be an integer in [0, {MAX_LOGPROBS}] (or unset), got {v!r}"
                )
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise FieldError("min_p", f"min_p must be in [0, 1], got {self.min_p!r}")
        for name in (
            "echo",
            "include_stop_str_in_output",
            "ignore_eos",
            "skip_special_tokens",
            "speculative",
        ):
            if not isinstance(getattr(self, name), bool):
                raise FieldError(name, f"{name} must be a boolean, got {getattr(self, name)!r}")

    def _check_logit_bias(self) -> None:
        if not isinstance(self.logit_bias, dict):
            raise FieldError("logit_bias", "logit_bias must be a map of token id to bias")
        if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise FieldError(
                "logit_bias",
                f"logit_bias may have at most {MAX_LOGIT_BIAS_ENTRIES} entries, "
                f"got {len(self.logit_bias)}",
            )
        for token, bias in self.logit_bias.items():
            if not is_int(token) or not 0 <= token <= MAX_TOKEN_ID:
                raise FieldError(
                    "logit_bias",
                    f"logit_bias keys must be token ids (integers in [0, {MAX_TOKEN_ID}]), "
                    f"got {token!r}",
                )
            if not _is_number(bias) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise FieldError(
                    "logit_bias",
                    f"logit_bias values must be numbers in [-100, 100], got "
                    f"{bias!r} for token {token}",
                )

    @property
    def max_new_tokens(self) -> int:
        """The limit generation runs to: max_tokens, or when not given default_max_tokens (the
        tokenizer worker resolves both against the room the prompt leaves before the engine
        sees the request)."""
        return self.default_max_tokens if self.max_tokens is None else self.max_tokens

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def penalized(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    @property
    def scores_prompt(self) -> bool:
        """The prompt itself comes back (echo) or is scored (prompt_logprobs)."""
        return self.echo or self.prompt_logprobs is not None


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)
