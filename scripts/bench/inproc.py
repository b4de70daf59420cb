"""The baseline the cluster must beat: the same cores in one process, no process boundary.

``submit()`` does in the caller's thread what a tokenizer worker does (the SDK's request, the
RequestPreparer: chat template, encoding, validation), then queues the TokenizedRequest for one
engine thread, which adds requests between steps, steps the Engine and feeds each StepOutput to
a DetokenizerCore, handing its events to ``deliver``. Everything shares one interpreter (and its
GIL), which is what splitserve's separate processes avoid; the cores are the cluster's own.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable

from detok_worker.core import DetokenizerCore
from engine_worker.engine import Engine, EngineOverloaded
from ipc.client.requests import build_submit
from ipc.codec import unpack_id_list
from ipc.messages import (
    ERR_BAD_REQUEST,
    ERR_INTERNAL,
    ERR_OVERLOADED,
    FINISH_ERROR,
    RequestError,
    RequestMeta,
    SamplingParams,
    StreamEvent,
    TokenizedRequest,
)
from runtime.model_files import load_tokenizer
from tokenizer_worker.chat_template import ChatTemplate
from tokenizer_worker.prepare import Limits, RequestPreparer

logger = logging.getLogger("splitserve.bench.inproc")

CLIENT_ID = b"inproc"


def make_preparer(model_dir: str, engine: Engine) -> RequestPreparer:
    """A tokenizer worker's request preparer for this engine's limits."""
    return RequestPreparer(
        load_tokenizer(model_dir),
        ChatTemplate.from_model_dir(model_dir),
        Limits(max_model_len=engine.max_model_len, vocab_size=engine.vocab_size),
    )


def prepare_request(
    preparer: RequestPreparer,
    request_id: str,
    sampling: SamplingParams,
    t_submit: float,
    prompt: str | None,
    messages: list[dict] | None,
    prompt_token_ids: list[int] | None = None,
) -> TokenizedRequest | RequestError:
    """The client SDK's SubmitRequest, then what a tokenizer worker makes of it."""
    request = build_submit(
        CLIENT_ID,
        request_id,
        prompt=prompt,
        messages=messages,
        prompt_token_ids=prompt_token_ids,
        sampling=sampling,
        sampling_kwargs={},
        add_generation_prompt=True,
        t_submit=t_submit,
    )
    return preparer.prepare_batch([request])[0]


class InprocServer:
    def __init__(
        self,
        engine_config,
        deliver: Callable[[list[StreamEvent]], None],
        *,
        stream_interval_tokens: int = 1,
        name: str = "inproc",
    ) -> None:
        model_dir = engine_config.model_path
        self.engine = Engine(engine_config)
        # Each role loads its own tokenizer, as the cluster's processes do.
        self.preparer = make_preparer(model_dir, self.engine)
        self.detokenizer = DetokenizerCore(
            load_tokenizer(model_dir), stream_interval_tokens=stream_interval_tokens
        )
        self.detokenizer.on_hello(CLIENT_ID)
        self.detokenizer.take_output()  # the welcome: nobody to send it to
        self._deliver = deliver
        # A request id alone is its abort; None ends the engine thread.
        self._inbox: queue.SimpleQueue[TokenizedRequest | RequestError | str | None]
        self._inbox = queue.SimpleQueue()
        self._new_metas: list[RequestMeta] = []  # added since the last step
        self._thread = threading.Thread(target=self._run, name=f"{name}-engine", daemon=True)
        self._thread.start()

    # --- the caller's side ----------------------------------------------------------------------
    def pretokenize(self, prompt: str) -> list[int]:
        """The prompt's token ids exactly as submit() would make them (for inproc-pretok)."""
        result = prepare_request(
            self.preparer, "pretokenize", SamplingParams(), time.monotonic(), prompt, None
        )
        if isinstance(result, RequestError):
            raise ValueError(result.message)
        return unpack_id_list(result.token_ids)

    def submit(
        self,
        request_id: str,
        sampling: SamplingParams,
        *,
        prompt: str | None = None,
        messages: list[dict] | None = None,
        prompt_token_ids: list[int] | None = None,
    ) -> float:
        """Tokenizes (or, given ids, validates them) in this thread, then queues the request for
        the engine thread. Returns t_submit (taken before tokenizing)."""
        t_submit = time.monotonic()
        result = prepare_request(
            self.preparer, request_id, sampling, t_submit, prompt, messages, prompt_token_ids
        )
        if prompt_token_ids is not None and isinstance(result, TokenizedRequest):
            # Pretokenized: tokenization happened outside the timed region.
            result.meta.t_tokenize_start = result.meta.t_tokenized = t_submit
        self._inbox.put(result)
        return t_submit

    def abort(self, request_id: str) -> None:
        self._inbox.put(request_id)

    def close(self) -> None:
        self._inbox.put(None)
        self._thread.join(timeout=30)

    # --- the engine thread ----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                items = self._wait_for_input()
                while True:  # between steps, take whatever has arrived
                    try:
                        items.append(self._inbox.get_nowait())
                    except queue.Empty:
                        break
                for item in items:
                    if item is None:
                        return
                    self._take(item)
                if self.engine.has_work() and not self.engine.step_delay_s():
                    out = self.engine.step()
                    # As the engine process does: metas ride ahead of their requests' tokens.
                    out.new_requests = self._new_metas + list(out.new_requests)
                    self._new_metas = []
                    self.detokenizer.on_step_output(out)
                self._flush()
        except Exception:  # a dead engine thread must not hang the benchmark silently
            logger.exception("the in-process engine thread failed")
            self.detokenizer.end_all(
                FINISH_ERROR,
                time.monotonic(),
                code=ERR_INTERNAL,
                error="the in-process engine thread failed",
            )
            self._flush()

    def _wait_for_input(self) -> list:
        """Blocks while the engine is idle, and in its idle batching window (as the engine
        process does) until the window ends or something arrives; otherwise returns at once."""
        if not self.engine.has_work():
            return [self._inbox.get()]
        delay_s = self.engine.step_delay_s()
        if delay_s > 0:
            with contextlib.suppress(queue.Empty):
                return [self._inbox.get(timeout=delay_s)]
        return []

    def _take(self, item: TokenizedRequest | RequestError | str) -> None:
        if isinstance(item, str):
            self.detokenizer.on_client_abort(CLIENT_ID, [item])
        elif isinstance(item, RequestError):
            self.detokenizer.on_request_error(item)
        else:
            self._add(item)

    def _add(self, req: TokenizedRequest) -> None:
        """What the engine process does with a TokenizedRequest; a refusal ends that request."""
        try:
            self.engine.add(
                req.request_id,
                unpack_id_list(req.token_ids),
                req.sampling,
                arrival_time=time.monotonic(),
            )
        except EngineOverloaded as exc:
            self._refuse(req, f"overloaded: {exc}", ERR_OVERLOADED)
        except ValueError as exc:
            self._refuse(req, str(exc), ERR_BAD_REQUEST)
        except Exception as exc:  # the engine must keep serving everyone else
            logger.exception("engine.add failed for %r", req.request_id)
            self._refuse(req, f"internal error: {exc}", ERR_INTERNAL)
        else:
            self._new_metas.append(req.meta)

    def _refuse(self, req: TokenizedRequest, message: str, code: str) -> None:
        self.detokenizer.on_request_error(
            RequestError(req.request_id, CLIENT_ID, message, code, req.meta.t_submit)
        )

    def _flush(self) -> None:
        out = self.detokenizer.take_output()
        for request_id, _ in out.aborts:  # stop strings matched: free their KV blocks
            self.engine.abort(request_id)
        events = out.events.get(CLIENT_ID)
        if events:
            self._deliver(events)
