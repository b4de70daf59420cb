"""Grammar matchers for the engine, built from data and off the step.

A tokenizer worker sends the vocabulary once (``GrammarVocabulary``) and, with each constrained
request, its grammar as text (llguidance's Lark dialect, already checked there; see
tokenizer_worker.grammar_compiler). Turning that text into a matcher (lexer and parser tables)
takes about a millisecond for a typical JSON schema and ~15 ms for a 120-field one, so it runs
on a background thread: llguidance releases the GIL while it builds, and the step loop never
waits. Built matchers are cached by grammar text (bounded LRU), warmed by one mask computation,
and each request gets a copy (microseconds; a cached grammar's request is ready at once).

Grammars are built with ``no_forcing``: llguidance would otherwise tokenize the text a grammar
forces (``{"name": "``) canonically, which needs a real tokenizer; without it the mask allows
every token consistent with the forced text and the model picks one. The vocabulary-only
tokenizer below raises if it is ever asked to tokenize, so this is checked, not assumed.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance

from ipc.messages import FINISH_ERROR, FINISH_STOP
from ipc.structured import GrammarVocabulary

logger = logging.getLogger("splitserve.engine")

NO_FORCING = '%llguidance {"no_forcing": true}\n'
MAX_CACHED_GRAMMARS = 128


class _VocabularyOnly(llguidance.TokenizerWrapper):
    """What llguidance.LLTokenizer reads from a tokenizer object, from data alone."""

    is_tokenizer_wrapper = True

    def __init__(self, tokens: list[bytes], special_ids: list[int], eos_id: int) -> None:
        # The base class would call a real tokenizer here; this one has only the data.
        self.tokens = tokens
        self.special_token_ids = special_ids
        self.eos_token_id = eos_id
        self.bos_token_id = None

    def __call__(self, text: str) -> list[int]:
        raise RuntimeError(f"the engine does not tokenize (the grammar asked for {text!r:.40})")


def backend_tokenizer(
    vocabulary: GrammarVocabulary, eos_ids: list[int] | None = None
) -> llguidance.LLTokenizer:
    """llguidance's tokenizer from the vocabulary's data; ``eos_ids`` (the engine's stop ids)
    override the vocabulary's. About 0.3 s for 49k tokens: call it off the step."""
    eos = sorted(set(eos_ids or vocabulary.eos_ids))
    tokens = vocabulary.token_table()
    wrapper = _VocabularyOnly(tokens, vocabulary.special_id_list(), eos[0])
    return llguidance.LLTokenizer(wrapper, eos_token=eos)


class RequestGrammar:
    """One request's matcher: not ready until the background build is done. ``matcher`` is
    touched only by the step loop once ready; ``error`` is set when the build failed or the
    matcher refused a token (the request then ends with an error)."""

    __slots__ = ("_future", "matcher", "error")

    def __init__(self, future: Future) -> None:
        self._future = future
        self.matcher: llguidance.LLMatcher | None = None
        self.error = ""

    def ready(self) -> bool:
        if self.matcher is None and not self.error:
            if not self._future.done():
                return False
            try:
                self.matcher = self._future.result()
            except Exception as exc:  # a build error ends the request, never the engine
                self.error = f"the grammar could not be built: {exc}"
        return True

    def accept(self, token: int) -> str | None:
        """Advances the matcher; FINISH_STOP when the grammar is complete (nothing but eos may
        follow), FINISH_ERROR when it refused the token (see ``error``), else None."""
        if self.matcher is None:
            raise RuntimeError("accept() before the grammar is ready")
        if not self.matcher.consume_token(token):
            self.error = f"the grammar refused token {token}: {self.matcher.get_error()}"
            return FINISH_ERROR
        return FINISH_STOP if self.matcher.is_stopped() else None


class GrammarBuilder:
    """Builds RequestGrammars on one background thread; cached ones are copied on the spot.

    A grammar asked for before any vocabulary arrived waits for one (a tokenizer worker sends it
    ahead of its constrained requests, but after an engine restart a request queued earlier can
    overtake it). Each finished build writes a byte to ``wakeup_fd``, so an engine with nothing
    else to do sleeps in poll instead of checking its waiting requests in a loop."""

    def __init__(
        self,
        vocabulary: GrammarVocabulary | None = None,
        eos_ids: list[int] | None = None,
        max_cached: int = MAX_CACHED_GRAMMARS,
    ) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-build")
        self._eos_ids = eos_ids
        self._tokenizer: Future | None = None
        self.fingerprint = ""
        self._templates: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()  # the step loop reads the cache, the build thread fills it
        self._awaiting_vocabulary: list[tuple[Future, str]] = []
        self.max_cached = max_cached
        self.built = 0  # grammars built (cache misses)
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_read, False)
        os.set_blocking(self._wake_write, False)
        if vocabulary is not None:
            self.set_vocabulary(vocabulary)

    def set_vocabulary(self, vocabulary: GrammarVocabulary) -> bool:
        """Takes the vocabulary (the first one; an identical copy from another worker is a
        no-op). False when it differs from the one in use: the sender's grammars would not fit."""
        digest = vocabulary.fingerprint or vocabulary.digest()
        if self._tokenizer is not None:
            if digest != self.fingerprint:
                logger.error(
                    "a worker sent a different vocabulary (%s, in use: %s)",
                    digest[:12],
                    self.fingerprint[:12],
                )
                return False
            return True
        self.fingerprint = digest
        self._tokenizer = self._pool.submit(backend_tokenizer, vocabulary, self._eos_ids)
        waiting, self._awaiting_vocabulary = self._awaiting_vocabulary, []
        for outer, grammar in waiting:
            self._build(grammar, outer)
        return True

    @property
    def has_vocabulary(self) -> bool:
        return self._tokenizer is not None

    def request(self, grammar: str) -> RequestGrammar:
        """A RequestGrammar for ``grammar``: ready at once when it is cached (a copy takes
        microseconds), else built in the background."""
        if self._tokenizer is None:
            waiting: Future = Future()
            self._awaiting_vocabulary.append((waiting, grammar))
            return RequestGrammar(waiting)
        with self._lock:
            template = self._templates.get(grammar)
            if template is not None:
                self._templates.move_to_end(grammar)
                done: Future = Future()
                done.set_result(template.deep_copy())
                return RequestGrammar(done)
        return RequestGrammar(self._build(grammar))

    def _build(self, grammar: str, waiting: Future | None = None) -> Future:
        """Builds on the pool; ``waiting`` (a future handed out before the vocabulary came) gets
        the result too, before the wake-up is written."""
        future = self._pool.submit(self._matcher_for, grammar)
        if waiting is not None:
            future.add_done_callback(functools.partial(_chain, waiting))
        future.add_done_callback(self._wake)
        return future

    @property
    def wakeup_fd(self) -> int:
        """Readable after a build finished (see ``clear_wakeups``)."""
        return self._wake_read

    def clear_wakeups(self) -> None:
        """Empties the wake-up pipe; call before looking at which grammars are ready."""
        try:
            while os.read(self._wake_read, 4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def _wake(self, _: Future) -> None:
        try:
            os.write(self._wake_write, b"\0")
        except (BlockingIOError, OSError):
            pass  # full (the reader wakes anyway) or closed (shutting down)

    def _matcher_for(self, grammar: str) -> llguidance.LLMatcher:
        with self._lock:  # built meanwhile by an earlier request for the same text?
            template = self._templates.get(grammar)
        if template is None:
            tokenizer = self._tokenizer.result()  # type: ignore[union-attr]
            text = llguidance.LLMatcher.grammar_from_lark(NO_FORCING + grammar)
            template = llguidance.LLMatcher(tokenizer, text, log_level=0)
            if template.is_error():
                raise ValueError(template.get_error())
            # The first mask builds the lexer's start states; copies then begin warm.
            template.compute_bitmask()
            if template.is_error():
                raise ValueError(template.get_error())
            self.built += 1
        with self._lock:
            self._templates[grammar] = template
            self._templates.move_to_end(grammar)
            while len(self._templates) > self.max_cached:
                self._templates.popitem(last=False)
            return template.deep_copy()

    def close(self) -> None:
        for waiting, _ in self._awaiting_vocabulary:
            waiting.cancel()
        self._pool.shutdown(wait=True, cancel_futures=True)  # a running build takes ms
        os.close(self._wake_read)
        os.close(self._wake_write)


def _chain(outer: Future, inner: Future) -> None:
    if outer.done():  # cancelled: the builder is closing
        return
    error = inner.exception()
    if error is not None:
        outer.set_exception(error)
    else:
        outer.set_result(inner.result())
