"""Grammar matchers for the engine, built from data and advanced off the step.

A tokenizer worker sends the vocabulary once (``GrammarVocabulary``) and, with each constrained
request, its grammar as text (llguidance's Lark dialect, already checked there under the same
limits; see runtime.grammar). Turning that text into a template (lexer and parser tables, and the
first mask) takes about a millisecond for a typical JSON schema and ~15 ms for a 120-field one.
Templates are cached by grammar text (bounded LRU); each request gets a copy (microseconds) and
the template's first mask, so a cached grammar's request is ready at once.

Threads. Everything llguidance computes runs on the builder's two threads: the build thread
makes templates, the mask thread advances each request by its sampled token and computes the
mask of its next one. Copies of a template share its lexer, and llguidance holds the GIL while a
call waits for that lexer, so a consume from the step loop while the mask thread works on a
sibling would stall the whole engine process for as long as that mask takes. The step loop only
copies templates (that does not wait) and reads what finished work left behind.

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
import time
from collections import OrderedDict
from concurrent.futures import Future

import llguidance
import numpy as np

from ipc.structured import GrammarVocabulary
from runtime.grammar import grammar_executor, new_matcher, short_error

logger = logging.getLogger("splitserve.engine")

# Templates kept: each holds its lexer's states (at most runtime.grammar's max_lexer_states,
# ~10-40 MB; typical grammars ~1-2 MB), so the worst case is this many times that.
MAX_CACHED_GRAMMARS = 32


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


class GrammarBuildError(ValueError):
    """The grammar cannot be built or cannot start; the message is short, for the client."""


class RequestGrammar:
    """One request's matcher and the mask of its next token (int32 words, bit t = token t).

    The step reads, never computes: ``ready()`` once built (or failed), ``mask_ready()`` while
    ``mask`` holds the next token's mask. ``GrammarBuilder.advance`` hands a sampled token to the
    mask thread (``pending`` until it has consumed it and computed the next mask). ``stopped``:
    the grammar is complete (nothing but eos may follow); ``error``: a short message for the
    client (the build, a consume or a mask failed; the request ends alone). ``late``: a step had
    its logits before the mask, so the row's token is drawn at a later step; the scheduler
    passes over the request until the mask is there."""

    __slots__ = (
        "grammar",
        "_build",
        "matcher",
        "mask",
        "pending",
        "late",
        "stopped",
        "error",
        "tokens",
        "cost_s",
    )

    def __init__(self, grammar: str, build: Future) -> None:
        self.grammar = grammar  # the text: its template is dropped when this request fails
        self._build: Future | None = build
        self.matcher: llguidance.LLMatcher | None = None
        self.mask: np.ndarray | None = None
        self.pending = self.late = self.stopped = False
        self.error = ""
        self.tokens = 0  # consumed so far
        self.cost_s = 0.0  # the mask thread's time on this request's last token

    def ready(self) -> bool:
        """Built, or failed (see ``error``)."""
        if self._build is not None:
            if not self._build.done():
                return False
            build, self._build = self._build, None
            try:
                self.matcher, self.mask = build.result()
            except Exception as exc:  # a build error ends the request, never the engine
                self.error = f"the grammar could not be built: {short_error(str(exc))}"
        return True

    def mask_ready(self) -> bool:
        """``mask`` is the next token's (nothing pending, nothing failed, not complete)."""
        if not self.ready() or self.pending or self.error or self.stopped:
            return False
        self.late = False
        return True

    def schedulable(self) -> bool:
        """False while building, and while a mask that was late is still being computed."""
        return self.ready() and not (self.late and self.pending)

    @property
    def settled(self) -> bool:
        """Nothing in flight, and the request is done with its grammar (complete or failed)."""
        return self._build is None and not self.pending and bool(self.stopped or self.error)


def advance_matcher(grammar: RequestGrammar, token: int) -> None:
    """Consumes ``token`` and computes the next mask into ``grammar.mask`` (or sets ``stopped``
    or ``error``). Runs on the mask thread; tests call it directly."""
    matcher = grammar.matcher
    assert matcher is not None and grammar.mask is not None
    if not matcher.consume_token(token):
        grammar.error = _late_error(grammar, matcher.get_error())
        return
    grammar.tokens += 1
    if matcher.is_stopped():
        grammar.stopped = True
        return
    matcher.unsafe_compute_mask_ptr(grammar.mask.ctypes.data, grammar.mask.nbytes)
    if matcher.is_error():
        grammar.error = _late_error(grammar, matcher.get_error())


def _late_error(grammar: RequestGrammar, message: str) -> str:
    count = f"{grammar.tokens} token" + ("" if grammar.tokens == 1 else "s")
    return f"the output could not follow the grammar after {count}: {short_error(message)}"


class GrammarBuilder:
    """Builds templates on one thread and advances requests on another; cached templates are
    copied on the spot.

    A grammar asked for before any vocabulary arrived waits for one (a tokenizer worker sends it
    ahead of its constrained requests, but after an engine restart a request queued earlier can
    overtake it). Finished work writes a byte to ``wakeup_fd``, so an engine with nothing else to
    do sleeps in poll instead of checking its requests in a loop."""

    def __init__(
        self,
        vocabulary: GrammarVocabulary | None = None,
        eos_ids: list[int] | None = None,
        max_cached: int = MAX_CACHED_GRAMMARS,
    ) -> None:
        self._build_thread = grammar_executor("grammar-build")
        self._mask_thread = grammar_executor("grammar-mask")
        self._eos_ids = eos_ids
        self._tokenizer: Future | None = None
        self.fingerprint = ""
        self.mask_words = 0
        self._templates: OrderedDict[str, tuple[llguidance.LLMatcher, np.ndarray]] = OrderedDict()
        self._lock = threading.Lock()  # the step loop reads the cache, the build thread fills it
        self._awaiting_vocabulary: list[tuple[Future, str]] = []
        self.max_cached = max_cached
        self.built = 0  # templates built (cache misses)
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
        self.mask_words = (vocabulary.vocab_size + 31) // 32
        self._tokenizer = self._build_thread.submit(backend_tokenizer, vocabulary, self._eos_ids)
        waiting, self._awaiting_vocabulary = self._awaiting_vocabulary, []
        for outer, grammar in waiting:
            self._build(grammar, outer)
        return True

    @property
    def has_vocabulary(self) -> bool:
        return self._tokenizer is not None

    def request(self, grammar: str) -> RequestGrammar:
        """A RequestGrammar for ``grammar``: ready at once when it is cached, else built in the
        background."""
        if self._tokenizer is None:
            waiting: Future = Future()
            self._awaiting_vocabulary.append((waiting, grammar))
            return RequestGrammar(grammar, waiting)
        with self._lock:
            cached = self._templates.get(grammar)
            if cached is not None:
                self._templates.move_to_end(grammar)
        if cached is not None:
            done: Future = Future()
            done.set_result((cached[0].deep_copy(), cached[1].copy()))
            return RequestGrammar(grammar, done)
        return RequestGrammar(grammar, self._build(grammar))

    def advance(self, tokens: list[tuple[RequestGrammar, int]]) -> None:
        """Hands each request's sampled token to the mask thread, cheapest grammars first: a
        costly one delays only itself, not the others behind it."""
        if not tokens:
            return
        for grammar, _ in tokens:
            grammar.pending = True
        tokens.sort(key=lambda item: item[0].cost_s)
        self._mask_thread.submit(self._advance, tokens)

    def _advance(self, tokens: list[tuple[RequestGrammar, int]]) -> None:
        for grammar, token in tokens:
            t_start = time.perf_counter()
            try:
                advance_matcher(grammar, token)
            except Exception as exc:  # an API misuse in llguidance: this request fails alone
                grammar.error = _late_error(grammar, str(exc))
            grammar.cost_s = time.perf_counter() - t_start
            grammar.pending = False  # last: the step reads the fields above once this is False
            if grammar.late:
                self._wake()
        self._wake()

    def evict(self, grammar: str) -> None:
        """Drops a template, e.g. once a request following it failed: its copies share its
        lexer, and a lexer that hit a limit fails every copy; the next request builds anew."""
        with self._lock:
            self._templates.pop(grammar, None)

    def _build(self, grammar: str, waiting: Future | None = None) -> Future:
        """Builds on the build thread; ``waiting`` (a future handed out before the vocabulary
        came) gets the result too, before the wake-up is written."""
        future = self._build_thread.submit(self._template_for, grammar)
        if waiting is not None:
            future.add_done_callback(functools.partial(_chain, waiting))
        future.add_done_callback(lambda _: self._wake())
        return future

    def _template_for(self, grammar: str) -> tuple[llguidance.LLMatcher, np.ndarray]:
        """(a copy of the template, its first mask), building the template if needed."""
        with self._lock:  # built meanwhile by an earlier request for the same text?
            cached = self._templates.get(grammar)
        if cached is None:
            template = new_matcher(self._tokenizer.result(), grammar)  # type: ignore[union-attr]
            mask: np.ndarray = np.zeros(self.mask_words, dtype=np.int32)
            if not template.is_error():
                template.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
            if template.is_error():
                raise GrammarBuildError(short_error(template.get_error(), at_start=True))
            self.built += 1
            cached = (template, mask)
        with self._lock:
            self._templates[grammar] = cached
            self._templates.move_to_end(grammar)
            while len(self._templates) > self.max_cached:
                self._templates.popitem(last=False)
        return cached[0].deep_copy(), cached[1].copy()

    @property
    def wakeup_fd(self) -> int:
        """Readable after grammar work finished (see ``clear_wakeups``)."""
        return self._wake_read

    def clear_wakeups(self) -> None:
        """Empties the wake-up pipe; call before looking at which grammars are ready."""
        try:
            while os.read(self._wake_read, 4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def _wake(self) -> None:
        try:
            os.write(self._wake_write, b"\0")
        except (BlockingIOError, OSError):
            pass  # full (the reader wakes anyway) or closed (shutting down)

    def close(self) -> None:
        for waiting, _ in self._awaiting_vocabulary:
            waiting.cancel()
        # A running build or mask is bounded by the parser limits (milliseconds).
        self._build_thread.shutdown(wait=True, cancel_futures=True)
        self._mask_thread.shutdown(wait=True, cancel_futures=True)
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
