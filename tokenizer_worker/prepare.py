"""Turns SubmitRequests into TokenizedRequests (or RequestErrors): chat template, batch encoding,
validation against the vocabulary and the context length.

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


class RequestPreparer:
    def __init__(
        self,
        tokenizer,
        chat_template: ChatTemplate | None,
        limits: Limits,
        tokenizer_index: int = 0,
        structured: StructuredOutputs | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.limits = limits
        self.tokenizer_index = tokenizer_index
        # Structured outputs and tools; the vocabulary is read on first use unless the owner
        # started it already (the worker does, at start-up).
        self.structured = structured or StructuredOutputs(
            tokenizer, limits.vocab_size, chat_template
        )

    def prepare_batch(self, requests: list[SubmitRequest]) -> list[TokenizedRequest | RequestError]:
        """One result per request, in order. Text is encoded with one encode_batch per kind."""
        t_start = time.monotonic()
        results: list[TokenizedRequest | RequestError | None] = [None] * len(requests)
        ids: list[list[int] | None] = [None] * len(requests)
        plans: list[OutputPlan | None] = [None] * len(requests)
        plain, chat = [], []  # (position, text): raw prompts get the tokenizer's special tokens,
        # rendered chats already carry theirs
        for i, req in enumerate(requests):
            try:
                self._check_sampling(req.sampling)
                plans[i] = self._plan(req)
                if req.prompt is not None:
                    plain.append((i, self._check_text(req.prompt)))
                elif req.messages is not None:
                    chat.append((i, self._render_chat(req, plans[i])))
                else:
                    ids[i] = self._check_ids(req.prompt_token_ids or b"")
            except RequestRejected as exc:
                results[i] = _error(req, exc)
        for group, add_special in ((plain, True), (chat, False)):
            if group:
                encodings = self.tokenizer.encode_batch(
                    [t for _, t in group], add_special_tokens=add_special
                )
                for (i, _), enc in zip(group, encodings):
                    ids[i] = enc.ids
        t_done = time.monotonic()
        for i, req in enumerate(requests):
            if results[i] is None:
                try:
                    results[i] = self._finish(req, ids[i] or [], t_start, t_done, plans[i])
                except RequestRejected as exc:
                    results[i] = _error(req, exc)
        return results  # type: ignore[return-value]

    def _finish(
        self,
        req: SubmitRequest,
        ids: list[int],
        t_start: float,
        t_done: float,
        plan: OutputPlan | None = None,
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
        )
        return TokenizedRequest(
            request_id=req.request_id,
            token_ids=packed,
            sampling=sampling,
            meta=meta,
            grammar=plan.grammar if plan else "",
            cache_salt=req.cache_salt,
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
        conversation = [
            {"role": m.role, "content": m.content, **({"name": m.name} if m.name else {})}
            for m in messages
        ]
    try:
        return template.render(
            conversation, add_generation_prompt=add_generation_prompt, extra=extra, tools=tools
        )
    except ChatTemplateError as exc:
        raise RequestRejected(str(exc)) from None


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
