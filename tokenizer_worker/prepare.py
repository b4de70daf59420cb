"""Turns SubmitRequests into TokenizedRequests (or RequestErrors): chat template, batch encoding,
validation against the vocabulary and the context length.

``screen`` does everything before encoding (a prompt too long for any tokenization to fit is
refused there, unread: prompt_bound.py), ``encode`` the rest, so the worker can encode a long
prompt on its own thread (long_prompts.py); ``prepare_batch`` is the two in one.

Everything here is pure (no sockets), so it is unit-tested directly.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

from ipc.codec import DecodeError, pack_ids, unpack_ids
from ipc.field_rules import MAX_CHAT_MESSAGES
from ipc.messages import (
    ERR_BAD_REQUEST,
    ERR_INTERNAL,
    ChatMessage,
    RequestError,
    RequestMeta,
    SamplingParams,
    SubmitRequest,
    TokenizedRequest,
)
from ipc.sampling import DEFAULT_MAX_DEFAULT_TOKENS
from tokenizer_worker.chat_template import ChatTemplate, ChatTemplateError
from tokenizer_worker.grammar_compiler import GrammarSpecError
from tokenizer_worker.prompt_bound import fewest_tokens, longest_token_chars
from tokenizer_worker.reasoning import request_reasoning
from tokenizer_worker.structured import OutputPlan, StructuredOutputs, needs_plan
from tokenizer_worker.tool_calls import ToolSpecError

MAX_PROMPT_CHARS = 8 * 1024 * 1024


class RequestRejected(ValueError):
    def __init__(self, message: str, code: str = ERR_BAD_REQUEST, param: str = "") -> None:
        super().__init__(message)
        self.code, self.param = code, param


@dataclass(frozen=True, slots=True)
class Limits:
    max_model_len: int
    vocab_size: int
    # What a request without max_tokens may generate at most (0: the room its prompt leaves).
    max_default_tokens: int = DEFAULT_MAX_DEFAULT_TOKENS

    def __post_init__(self) -> None:
        if self.max_default_tokens < 0:
            raise ValueError(f"max_default_tokens must be >= 0, got {self.max_default_tokens}")
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}")
        if self.vocab_size < 1:
            raise ValueError(f"vocab_size must be at least 1, got {self.vocab_size}")


@dataclass(slots=True)
class Screened:
    """A request checked and ready to encode: its text (or ids), or the error that ends it."""

    request: SubmitRequest
    text: str | None = None
    add_special: bool = True  # raw prompts get the tokenizer's special tokens
    ids: list[int] | None = None
    plan: OutputPlan | None = None
    reasoning: tuple[str, bool] = ("", False)  # tokenizer_worker.reasoning.request_reasoning
    error: RequestError | None = None

    @property
    def chars(self) -> int:
        return len(self.text) if self.text is not None else 0


class RequestPreparer:
    def __init__(
        self,
        tokenizer,
        chat_template: ChatTemplate | None,
        limits: Limits,
        tokenizer_index: int = 0,
        structured: StructuredOutputs | None = None,
        reasoning_parser: str = "",
    ) -> None:
        self.tokenizer = tokenizer
        self.reasoning_parser = reasoning_parser  # resolved: a name, or "" for none
        self.chat_template = chat_template
        self.limits = limits
        self.tokenizer_index = tokenizer_index
        # Structured outputs and tools; the vocabulary is read on first use unless the owner
        # started it already (the worker does, at start-up).
        self.structured = structured or StructuredOutputs(
            tokenizer, limits.vocab_size, chat_template
        )
        # Characters one token stands for at most (None: no such bound for this tokenizer).
        self.longest_token = longest_token_chars(tokenizer)

    def prepare_batch(self, requests: list[SubmitRequest]) -> list[TokenizedRequest | RequestError]:
        """One result per request, in order. Text is encoded with one encode_batch per kind."""
        t_start = time.monotonic()
        return self.encode([self.screen(req) for req in requests], t_start)

    def screen(self, req: SubmitRequest) -> Screened:
        """Everything before encoding: sampling, structured outputs, the chat rendered, the text
        checked (a text too long for any tokenization to fit is refused here, unread)."""
        screened = Screened(req)
        try:
            self._check_sampling(req.sampling)
            screened.plan = self._plan(req)
            if req.prompt is not None:
                screened.text = self._check_text(req.prompt)
            elif req.messages is not None:
                # a rendered chat already carries its special tokens
                screened.text, screened.add_special = self._render_chat(req, screened.plan), False
                screened.reasoning = self._reasoning(req, screened.text, screened.plan)
            else:
                screened.ids = self._check_ids(req.prompt_token_ids or b"")
        except RequestRejected as exc:
            screened.error = _error(req, exc)
        return screened

    def encode(
        self, batch: list[Screened], t_start: float | None = None
    ) -> list[TokenizedRequest | RequestError]:
        """The screened requests' results, in order; one encode_batch per kind of text."""
        t_start = time.monotonic() if t_start is None else t_start
        for add_special in (True, False):
            group = [s for s in batch if s.text is not None and s.add_special == add_special]
            if group:
                encodings = self.tokenizer.encode_batch(
                    [s.text for s in group], add_special_tokens=add_special
                )
                for screened, encoding in zip(group, encodings):
                    screened.ids = encoding.ids
        t_done = time.monotonic()
        results: list[TokenizedRequest | RequestError] = []
        for s in batch:
            if s.error is not None:
                results.append(s.error)
                continue
            try:
                results.append(
                    self._finish(s.request, s.ids or [], t_start, t_done, s.plan, s.reasoning)
                )
            except RequestRejected as exc:
                results.append(_error(s.request, exc))
        return results

    def _finish(
        self,
        req: SubmitRequest,
        ids: list[int],
        t_start: float,
        t_done: float,
        plan: OutputPlan | None = None,
        reasoning: tuple[str, bool] = ("", False),
    ) -> TokenizedRequest:
        n = len(ids)
        if n == 0:
            raise RequestRejected("the prompt encodes to zero tokens")
        room = self.limits.max_model_len - n
        if room < 1:
            raise RequestRejected(
                f"the prompt has {n} tokens; with at least one generated token that exceeds the "
                f"context length of {self.limits.max_model_len} tokens"
            )
        sampling = _fit_to_context(req.sampling, n, self.limits)
        packed = pack_ids(ids)
        meta = RequestMeta(
            request_id=req.request_id,
            client_id=req.client_id,
            prompt_tokens=n,
            stop=list(sampling.stop),
            skip_special_tokens=sampling.skip_special_tokens,
            tokenizer_index=self.tokenizer_index,
            t_submit=req.t_submit,
            t_tokenize_start=t_start,
            t_tokenized=t_done,
            continuous_usage_stats=req.continuous_usage_stats,
            # The detokenizer turns these into the echoed text and the prompt's token strings.
            prompt_token_ids=packed if sampling.scores_prompt else b"",
            echo=sampling.echo,
            prompt_logprobs=sampling.prompt_logprobs is not None,
            include_stop_str_in_output=sampling.include_stop_str_in_output,
            tool_parser=plan.tool_parser if plan else "",
            reasoning_parser=reasoning[0],
            reasoning_open=reasoning[1],
        )
        return TokenizedRequest(
            request_id=req.request_id,
            token_ids=packed,
            sampling=sampling,
            meta=meta,
            grammar=plan.grammar if plan else "",
            cache_salt=req.cache_salt,
        )

    def _reasoning(
        self, req: SubmitRequest, text: str, plan: OutputPlan | None
    ) -> tuple[str, bool]:
        reasoning = request_reasoning(self.reasoning_parser, req, text)
        if not (reasoning[0] and plan is not None and plan.grammar):
            return reasoning
        if not reasoning[1]:
            # The grammar holds from the first token, so the model cannot open a thinking: the
            # output is all answer (and a grammar's "<think>" is its text, not a thinking).
            return "", False
        # The prompt opened the thinking, which the grammar would bind too: it is not held back
        # until </think>.
        raise RequestRejected(
            "a reasoning model's thinking, opened by the prompt, cannot be combined with "
            "response_format, structured_outputs or a forced tool_choice here: turn thinking "
            'off (chat_template_kwargs {"enable_thinking": false}; Messages: thinking '
            '{"type": "disabled"}) or serve with --reasoning-parser none',
            param="response_format" if req.structured is not None else "tool_choice",
        )

    def _plan(self, req: SubmitRequest) -> OutputPlan | None:
        if not needs_plan(req):
            return None
        try:
            return self.structured.plan(req)
        except (GrammarSpecError, ToolSpecError) as exc:
            raise RequestRejected(str(exc)) from None
        except Exception as exc:  # e.g. the vocabulary could not be read: this request fails
            raise RequestRejected(
                f"structured outputs are unavailable: {exc}", ERR_INTERNAL
            ) from None

    def _check_sampling(self, sampling: SamplingParams) -> None:
        for name, ids in (
            ("stop_token_ids", sampling.stop_token_ids),
            ("logit_bias", sampling.logit_bias),
        ):
            bad = [t for t in ids if t >= self.limits.vocab_size]
            if bad:
                raise RequestRejected(
                    f"{name} {bad[:8]} are outside the vocabulary (size {self.limits.vocab_size})",
                    param=name,
                )

    def _check_text(self, text: str) -> str:
        if not text:
            raise RequestRejected("the prompt is empty")
        if len(text) > MAX_PROMPT_CHARS:
            raise RequestRejected(f"the prompt has more than {MAX_PROMPT_CHARS} characters")
        longest, context = self.longest_token, self.limits.max_model_len
        if longest and fewest_tokens(len(text), longest) >= context:
            raise RequestRejected(
                f"the prompt has {len(text)} characters, so at least "
                f"{fewest_tokens(len(text), longest)} tokens (no token of this model stands for "
                f"more than {longest} characters); with at least one generated token that "
                f"exceeds the context length of {context} tokens"
            )
        return text

    def _check_ids(self, packed: bytes) -> list[int]:
        try:
            arr = unpack_ids(packed)
        except DecodeError as exc:
            raise RequestRejected(str(exc)) from None
        if arr.size == 0:
            raise RequestRejected("prompt_token_ids is empty")
        if int(arr.min()) < 0 or int(arr.max()) >= self.limits.vocab_size:
            raise RequestRejected(
                f"prompt_token_ids must be in [0, {self.limits.vocab_size}); got values in "
                f"[{int(arr.min())}, {int(arr.max())}]",
                param="prompt_token_ids",
            )
        return arr.tolist()

    def _render_chat(self, req: SubmitRequest, plan: OutputPlan | None = None) -> str:
        return self._check_text(
            render_chat(
                self.chat_template,
                req.messages or [],
                req.add_generation_prompt,
                req.chat_template_kwargs,
                plan.conversation if plan else None,
                plan.template_tools if plan else None,
            )
        )


def render_chat(
    template: ChatTemplate | None,
    messages: list[ChatMessage],
    add_generation_prompt: bool,
    extra: dict[str, Any],
    conversation: list[dict[str, Any]] | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """The chat as the model's template writes it; RequestRejected says what is wrong.
    ``conversation`` and ``tools``: what tool calling renders instead of ``messages`` (the
    history's calls and results written in, the tools offered; tokenizer_worker.structured)."""
    if template is None:
        raise RequestRejected("this model has no chat template; send a prompt instead")
    if len(messages) > MAX_CHAT_MESSAGES:
        raise RequestRejected(f"at most {MAX_CHAT_MESSAGES} chat messages")
    for m in messages:
        if not m.role:
            raise RequestRejected("every chat message needs a non-empty role")
    if conversation is None:
        conversation = [_template_message(m) for m in messages]
    try:
        return template.render(
            conversation, add_generation_prompt=add_generation_prompt, extra=extra, tools=tools
        )
    except ChatTemplateError as exc:
        raise RequestRejected(str(exc)) from None


def _template_message(m: ChatMessage) -> dict[str, Any]:
    out: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.name:
        out["name"] = m.name
    if m.reasoning_content is not None:  # an earlier answer's thinking (Qwen3's key)
        out["reasoning_content"] = m.reasoning_content
    return out


def _fit_to_context(sampling: SamplingParams, prompt_tokens: int, limits: Limits) -> SamplingParams:
    """The sampling the engine gets: max_tokens resolved against the room the prompt leaves.
    A max_tokens the caller gave that does not fit is refused (as OpenAI and vLLM do: a limit
    the server would silently lower is not the one asked for); one not given is its default cut
    to the room and to ``max_default_tokens`` (chat's default is the whole context, completions'
    16): every API and the SDK come here, so one rule bounds them all."""
    max_model_len = limits.max_model_len
    room = max_model_len - prompt_tokens
    if sampling.max_tokens is not None:
        if sampling.max_tokens > room:
            raise RequestRejected(
                f"max_tokens is {sampling.max_tokens}, but the prompt has {prompt_tokens} "
                f"tokens and the context length is {max_model_len}: at most {room} tokens "
                "can be generated",
                param="max_tokens",
            )
        return sampling
    resolved = min(sampling.default_max_tokens, room, limits.max_default_tokens or room)
    return dataclasses.replace(
        sampling, max_tokens=resolved, min_tokens=min(sampling.min_tokens, resolved)
    )


def _error(req: SubmitRequest, exc: RequestRejected) -> RequestError:
    return RequestError(
        request_id=req.request_id,
        client_id=req.client_id,
        message=str(exc),
        code=exc.code,
        t_submit=req.t_submit,
        param=exc.param,
    )
