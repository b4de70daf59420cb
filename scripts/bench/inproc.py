"""The baseline the cluster must beat: a classic single-process server.

``submit()`` tokenizes in the caller's thread (the seeds' ``add_request`` with pretok off), then
hands the ids to one engine thread through a queue. The engine thread adds requests between
steps, steps the Engine, detokenizes each new token with the ``tokenizers`` DecodeStream in the
same thread and hands one list of StreamEvents per step to ``deliver``. Everything shares one
interpreter (and its GIL), which is exactly what splitserve's separate processes avoid.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ipc.codec import pack_ids, unpack_ids
from ipc.messages import (
    FINISH_ERROR,
    RequestTimings,
    SamplingParams,
    StepOutput,
    StreamEvent,
    Usage,
)

logger = logging.getLogger("splitserve.bench.inproc")


@dataclass(slots=True)
class _Submitted:
    request_id: str
    token_ids: list[int]
    sampling: SamplingParams
    timings: RequestTimings


@dataclass(slots=True)
class _Live:
    """A request the engine thread is serving: its incremental decoder and its timings."""

    decoder: object
    timings: RequestTimings
    prompt_tokens: int
    output_tokens: int = 0
    cached_tokens: int = 0
    text: list[str] = field(default_factory=list)  # this step's pieces
    ids: list[int] = field(default_factory=list)  # this step's tokens


class InprocServer:
    def __init__(self, engine_config, deliver: Callable[[list[StreamEvent]], None],
                 name: str = "inproc") -> None:
        from tokenizers import Tokenizer

        from engine_worker.engine import Engine

        model_dir = Path(engine_config.model_path)
        self.tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        self._chat_template = None
        self._model_dir = model_dir
        self.engine = Engine(engine_config)
        self._deliver = deliver
        self._inbox: queue.SimpleQueue[_Submitted | str | None] = queue.SimpleQueue()
        self._live: dict[str, _Live] = {}
        self._thread = threading.Thread(target=self._run, name=f"{name}-engine", daemon=True)
        self._thread.start()

    # --- the caller's side ----------------------------------------------------------------------
    def encode(self, prompt: str | None, messages: list[dict] | None) -> list[int]:
        """Token ids the way a tokenizer worker makes them: raw prompts get the tokenizer's
        special tokens, rendered chats already carry theirs."""
        if messages is not None:
            return self.tokenizer.encode(self._render_chat(messages),
                                         add_special_tokens=False).ids
        return self.tokenizer.encode(prompt, add_special_tokens=True).ids

    def _render_chat(self, messages: list[dict]) -> str:
        if self._chat_template is None:
            from tokenizer_worker.chat_template import ChatTemplate

            self._chat_template = ChatTemplate.from_model_dir(self._model_dir)
            if self._chat_template is None:
                raise ValueError("this model has no chat template")
        return self._chat_template.render(messages, add_generation_prompt=True)

    def submit(self, request_id: str, sampling: SamplingParams, *, prompt: str | None = None,
               messages: list[dict] | None = None,
               prompt_token_ids: list[int] | None = None) -> float:
        """Returns at once when given ids; otherwise tokenizes first, in this thread. Returns
        t_submit (taken before tokenizing)."""
        t_submit = time.monotonic()
        if prompt_token_ids is None:
            ids = self.encode(prompt, messages)
            t_tokenized = time.monotonic()
            timings = RequestTimings(t_submit=t_submit, t_tokenize_start=t_submit,
                                     t_tokenized=t_tokenized)
        else:  # pretokenized: tokenization happened outside the timed region
            ids = prompt_token_ids
            timings = RequestTimings(t_submit=t_submit, t_tokenize_start=t_submit,
                                     t_tokenized=t_submit)
        self._inbox.put(_Submitted(request_id, ids, sampling, timings))
        return t_submit

    def abort(self, request_id: str) -> None:
        self._inbox.put(request_id)

    def close(self) -> None:
        self._inbox.put(None)
        self._thread.join(timeout=30)

    @property
    def engine_thread_id(self) -> int | None:
        return self._thread.native_id

    # --- the engine thread ----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                # Block only when idle; between steps take whatever has arrived.
                items = [] if self.engine.has_work() else [self._inbox.get()]
                while True:
                    try:
                        items.append(self._inbox.get_nowait())
                    except queue.Empty:
                        break
                for item in items:
                    if item is None:
                        return
                    if isinstance(item, str):
                        self.engine.abort(item)
                    else:
                        self._add(item)
                if self.engine.has_work():
                    events = self._events(self.engine.step())
                    if events:
                        self._deliver(events)
        except Exception:  # a dead engine thread must not hang the benchmark silently
            logger.exception("the in-process engine thread failed")
            self._deliver([self._error_event(rid, "the in-process engine thread failed")
                           for rid in list(self._live)])

    def _add(self, sub: _Submitted) -> None:
        from tokenizers.decoders import DecodeStream

        sub.timings.t_arrived = time.monotonic()
        try:
            self.engine.add(sub.request_id, sub.token_ids, sub.sampling,
                            arrival_time=sub.timings.t_arrived)
        except Exception as exc:  # overload or bad input: that request ends, the rest go on
            self._deliver([StreamEvent(request_id=sub.request_id, finished=True,
                                       finish_reason=FINISH_ERROR, error=str(exc),
                                       timings=sub.timings)])
            return
        self._live[sub.request_id] = _Live(
            decoder=DecodeStream(skip_special_tokens=sub.sampling.skip_special_tokens),
            timings=sub.timings, prompt_tokens=len(sub.token_ids))

    def _events(self, out: StepOutput) -> list[StreamEvent]:
        for start in out.started:
            live = self._live.get(start.request_id)
            if live is not None:
                live.timings.t_scheduled = start.t_scheduled
                live.cached_tokens = start.cached_tokens
        touched: dict[str, _Live] = {}
        for rid, token in zip(out.request_ids, unpack_ids(out.token_ids).tolist()):
            live = self._live.get(rid)
            if live is None:
                continue
            if live.output_tokens == 0:
                live.timings.t_first_token = out.t_step
            live.timings.t_last_token = out.t_step
            live.output_tokens += 1
            piece = live.decoder.step(self.tokenizer, token)
            if piece:
                live.text.append(piece)
            live.ids.append(token)
            touched[rid] = live
        finished = {record.request_id: (record.reason, record.error) for record in out.finished}
        events = []
        for rid, live in touched.items():
            if rid not in finished:
                events.append(StreamEvent(request_id=rid, text="".join(live.text),
                                          token_ids=pack_ids(live.ids)))
                live.text.clear()
                live.ids.clear()
        for rid, (reason, error) in finished.items():
            live = self._live.pop(rid, None)
            if live is None:
                continue
            live.timings.t_finished = time.monotonic()
            events.append(StreamEvent(
                request_id=rid, text="".join(live.text), token_ids=pack_ids(live.ids),
                finished=True, finish_reason=reason, error=error or None,
                usage=Usage(prompt_tokens=live.prompt_tokens,
                            completion_tokens=live.output_tokens,
                            cached_tokens=live.cached_tokens),
                timings=live.timings))
        return events

    def _error_event(self, request_id: str, message: str) -> StreamEvent:
        live = self._live.pop(request_id)
        return StreamEvent(request_id=request_id, finished=True, finish_reason=FINISH_ERROR,
                           error=message, timings=live.timings)
