"""Per-request detokenization state: incremental decoding, stop strings, the stream interval.

One RequestState lives from the request's RequestMeta (first StepOutput mentioning it) to its
terminal event; then it is dropped, so the detokenizer's memory is bounded by what is in flight.
"""

from __future__ import annotations

import logging

from tokenizers.decoders import DecodeStream

from detok_worker.reasoning import ReasoningSplitter
from detok_worker.stop_strings import StopStringMatcher
from detok_worker.token_strings import TokenStrings
from detok_worker.tool_parsers import TOOL_PARSERS, ParsedDelta, ToolCallParser
from ipc.codec import pack_ids, unpack_id_list
from ipc.messages import (
    FINISH_STOP,
    FINISH_TOOL_CALLS,
    LogprobEntry,
    PromptLogprobs,
    RequestMeta,
    RequestStart,
    RequestTimings,
    StreamEvent,
    TokenLogprobs,
    Usage,
)
from ipc.structured import ToolCallDelta

logger = logging.getLogger("splitserve.detokenizer")


class RequestState:
    __slots__ = (
        "meta",
        "decoder",
        "matcher",
        "completion_tokens",
        "cached_tokens",
        "timings",
        "unsent_text",
        "unsent_ids",
        "sent_any",
        "unsent_logprobs",
        "prompt_logprobs",
        "tool_parser",
        "reasoner",
        "unsent_reasoning",
        "marker_ids",
        "unsent_calls",
        "step_ms",
        "step_threads",
    )

    def __init__(self, meta: RequestMeta) -> None:
        self.meta = meta
        self.decoder = DecodeStream(skip_special_tokens=meta.skip_special_tokens)
        self.matcher = StopStringMatcher(meta.stop, meta.include_stop_str_in_output)
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.timings = RequestTimings(
            t_submit=meta.t_submit,
            t_tokenize_start=meta.t_tokenize_start,
            t_tokenized=meta.t_tokenized,
        )
        self.unsent_text = ""
        self.unsent_ids: list[int] = []
        self.sent_any = False
        # Logprob entries travel with their tokens: one per id of unsent_ids when asked.
        self.unsent_logprobs: list[LogprobEntry] = []
        self.prompt_logprobs: list[LogprobEntry] = []  # go out with the first event
        # With tools: the text the stop strings release is read for calls, which leave it.
        self.tool_parser: ToolCallParser | None = None
        if meta.tool_parser:
            self.tool_parser = TOOL_PARSERS[meta.tool_parser]()
        # A reasoning model's thinking leaves the text first: calls come after it.
        self.reasoner: ReasoningSplitter | None = None
        if meta.reasoning_parser:
            self.reasoner = ReasoningSplitter(meta.reasoning_open)
        self.unsent_reasoning = ""
        self.marker_ids: dict[int, str] | None = None  # the parser's special tokens, when skipped
        self.unsent_calls: list[ToolCallDelta] = []
        self.step_ms = 0.0  # how long the engine step of its newest token took
        self.step_threads = 0  # and the torch threads it ran on

    def on_start(self, start: RequestStart) -> None:
        self.timings.t_arrived = start.t_arrived
        self.timings.t_scheduled = start.t_scheduled
        self.cached_tokens = start.cached_tokens

    def on_prompt_logprobs(self, strings: TokenStrings, chunk: PromptLogprobs) -> None:
        prompt_ids = unpack_id_list(self.meta.prompt_token_ids)
        if chunk.start + len(chunk.logprobs) // 4 > len(prompt_ids):
            logger.error(
                "request %r: prompt logprobs past its %d prompt ids; dropped",
                self.meta.request_id,
                len(prompt_ids),
            )
            return
        self.prompt_logprobs += strings.prompt_entries(chunk, prompt_ids)

    def on_token(
        self,
        tokenizer,
        token_id: int,
        t_step: float,
        logprobs: tuple[TokenStrings, TokenLogprobs] | None = None,
    ) -> bool:
        """Decodes one new token; True when a stop string matched (the request is done)."""
        self.completion_tokens += 1
        if not self.timings.t_first_token:
            self.timings.t_first_token = t_step
        self.timings.t_last_token = t_step
        self.unsent_ids.append(token_id)
        if logprobs is not None:
            strings, values = logprobs
            self.unsent_logprobs.append(strings.sampled_entry(token_id, values))
        try:
            piece = self.decoder.step(tokenizer, token_id) or ""
        except Exception as exc:  # an id the tokenizer cannot decode: keep streaming the rest
            logger.warning(
                "request %r: token %d does not decode: %s", self.meta.request_id, token_id, exc
            )
            piece = ""
        if self.tool_parser is not None and self.tool_parser.markers:
            piece += self._marker(tokenizer, token_id)
        released, stopped = self.matcher.feed(piece)
        self._release(released)
        return stopped

    def _marker(self, tokenizer, token_id: int) -> str:
        """The text of a tool-call marker token (Mistral's [TOOL_CALLS], Llama's
        <|python_tag|>) that decoding skipped with the special tokens: the parser needs it."""
        if self.marker_ids is None:
            assert self.tool_parser is not None
            ids = {tokenizer.token_to_id(m): m for m in self.tool_parser.markers}
            self.marker_ids = {
                i: m
                for i, m in ids.items()
                if i is not None
                and self.meta.skip_special_tokens
                and not tokenizer.decode([i], skip_special_tokens=True)
            }
        return self.marker_ids.get(token_id, "")

    def _release(self, text: str, last: bool = False, cut: bool = False) -> None:
        if self.reasoner is not None:
            reasoning, text = self.reasoner.feed(text) if text else ("", "")
            if last:
                end = self.reasoner.finish()
                reasoning, text = reasoning + end[0], text + end[1]
            self.unsent_reasoning += reasoning
        if self.tool_parser is None:
            self.unsent_text += text
            return
        parsed = self.tool_parser.feed(text) if text else ParsedDelta()
        for part in (parsed, self.tool_parser.finish(cut)) if last else (parsed,):
            self.unsent_text += part.content
            for call in part.tool_calls:  # one delta per call and event
                previous = self.unsent_calls[-1] if self.unsent_calls else None
                if previous is not None and previous.index == call.index and call.id is None:
                    previous.arguments += call.arguments
                else:
                    self.unsent_calls.append(call)

    def should_stream(self, interval_tokens: int) -> bool:
        # The first token always goes out at once: time to first token is what users feel.
        return bool(self.unsent_ids) and (
            not self.sent_any or len(self.unsent_ids) >= interval_tokens
        )

    def delta(self, strings: TokenStrings | None = None) -> StreamEvent:
        """What is unsent, as one event; the first one also carries the prompt's text (echo)
        and logprobs (``strings`` is needed then)."""
        event = StreamEvent(
            request_id=self.meta.request_id,
            text=self.unsent_text,
            token_ids=pack_ids(self.unsent_ids),
            logprobs=self.unsent_logprobs,
            tool_calls=self.unsent_calls,
            reasoning=self.unsent_reasoning,
            engine_index=self.meta.engine_index,
            t_step=self.timings.t_last_token,
            step_ms=self.step_ms,
            step_threads=self.step_threads,
        )
        if not self.sent_any and self.meta.prompt_token_ids and strings is not None:
            self._add_prompt(event, strings)
        self.unsent_text, self.unsent_ids, self.sent_any = "", [], True
        self.unsent_logprobs, self.unsent_calls, self.unsent_reasoning = [], [], ""
        if self.meta.continuous_usage_stats:
            event.usage = self.usage()
        return event

    def usage(self) -> Usage:
        return Usage(
            prompt_tokens=self.meta.prompt_tokens,
            completion_tokens=self.completion_tokens,
            cached_tokens=self.cached_tokens,
        )

    def _add_prompt(self, event: StreamEvent, strings: TokenStrings) -> None:
        prompt_ids = unpack_id_list(self.meta.prompt_token_ids)
        if self.meta.echo:
            event.echo_text = strings.tokenizer.decode(
                prompt_ids, skip_special_tokens=self.meta.skip_special_tokens
            )
        if self.meta.prompt_logprobs:
            # The first prompt token has nothing before it, hence no logprob.
            event.prompt_logprobs = [strings.entry(prompt_ids[0], None), *self.prompt_logprobs]
            self.prompt_logprobs = []

    def final(
        self,
        reason: str,
        t_finished: float,
        *,
        stopped_by_string: bool = False,
        error: str | None = None,
        error_code: str | None = None,
        strings: TokenStrings | None = None,
    ) -> StreamEvent:
        # Cut (max_tokens, an abort): a call's start held back is dropped (tool_call_text).
        cut = reason != FINISH_STOP
        self._release("" if stopped_by_string else self.matcher.flush(), last=True, cut=cut)
        event = self.delta(None if error_code else strings)
        event.finished = True
        called = self.tool_parser is not None and self.tool_parser.calls > 0
        event.finish_reason = FINISH_TOOL_CALLS if reason == FINISH_STOP and called else reason
        event.error = error or None
        event.error_code = error_code or None
        event.usage = self.usage()
        self.timings.t_finished = t_finished
        event.timings = self.timings
        return event
