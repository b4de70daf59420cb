"""A tokenizer worker's lane for long prompts: their encoding runs on a thread of its own, at a
lower OS priority (runtime.priority), so the worker's loop goes on answering the short requests
that arrive meanwhile (the tokenizers library releases the GIL while it encodes). A 600k-
character prompt that may still fit a long context takes about a second to encode; in the one
queue every request behind it waited that long for its first token.

The worker screens every request on its loop first (a prompt too long for any tokenization to
fit is refused there, unread: tokenizer_worker.prompt_bound), then hands what is longer than
``tokenizer_long_prompt_chars`` here. Results come back to the loop through ``take`` (the loop
routes and sends them: its sockets are its own); ``fd`` becomes readable when some are ready.
The lane holds at most ``MAX_QUEUED`` requests: past that, ``submit`` refuses (the worker answers
'overloaded', as a full queue does), so nothing waits without bound.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections import deque
from collections.abc import Callable

from ipc.messages import ERR_INTERNAL, RequestError, TokenizedRequest
from runtime.priority import lower_this_thread
from tokenizer_worker.prepare import Screened

MAX_QUEUED = 8

logger = logging.getLogger("splitserve.tokenizer")

Results = list[TokenizedRequest | RequestError]


class LongPromptLane:
    def __init__(self, encode: Callable[[list[Screened]], Results], niceness: int) -> None:
        self._encode, self._niceness = encode, niceness
        self._jobs: queue.SimpleQueue[Screened | None] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[TokenizedRequest | RequestError] = queue.SimpleQueue()
        self._ready, self._signal = os.pipe()
        os.set_blocking(self._ready, False)
        self.queued: deque[Screened] = deque()  # not yet taken back, in order (the lane's too)
        self.encoded = 0
        self.native_id = 0  # the lane thread's, once it runs
        started = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(started,), name="long-prompts", daemon=True
        )
        self._thread.start()
        started.wait(5)

    @property
    def fd(self) -> int:
        return self._ready

    def submit(self, screened: Screened) -> bool:
        """Queues one request; False when the lane is full (the caller refuses it)."""
        if len(self.queued) >= MAX_QUEUED:
            return False
        self.queued.append(screened)
        self._jobs.put(screened)
        return True

    def take(self) -> Results:
        """The results encoded since the last call (never waits)."""
        try:
            while os.read(self._ready, 4096):
                pass
        except BlockingIOError:
            pass
        results: Results = []
        while True:
            try:
                result = self._done.get_nowait()
            except queue.Empty:
                return results
            self.queued.popleft()  # the lane answers in the order it was given
            results.append(result)

    def _run(self, started: threading.Event) -> None:
        self.native_id = threading.get_native_id()
        lower_this_thread(self._niceness)
        started.set()
        while (screened := self._jobs.get()) is not None:
            try:
                (result,) = self._encode([screened])
            except Exception as exc:  # the request ends with an error; the lane goes on
                logger.exception("encoding a long prompt failed")
                req = screened.request
                result = RequestError(
                    req.request_id,
                    req.client_id,
                    f"tokenization failed: {exc}",
                    ERR_INTERNAL,
                    req.t_submit,
                )
            self.encoded += 1
            self._done.put(result)
            os.write(self._signal, b"\0")

    def close(self) -> list[Screened]:
        """Stops the thread (after the prompt it is encoding, if any; it is not waited for) and
        returns the requests it never answered, for the worker to end."""
        self._jobs.put(None)
        left = list(self.queued)
        self.queued.clear()
        self._thread.join(timeout=0.1)
        if not self._thread.is_alive():
            os.close(self._ready)
            os.close(self._signal)
        return left
