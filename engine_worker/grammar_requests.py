"""The engine's constrained requests: each one's matcher, the ones still waiting for theirs, and
the ones whose grammar has ended them.

A request's matcher is built off the step (GrammarBuilder's build thread); until it is ready the
request stays in the waiting queue, where the scheduler passes over it, and it does not count
as work, so an engine with nothing else to do sleeps (on ``wakeup_fd`` and its socket) instead of
stepping. Each sampled token goes to the builder's mask thread (``advance``), which consumes it
and computes the next mask; what that finds (the grammar is complete, or it failed) ends the
request at the next step's ``settle``. A build that fails, a grammar that fails later, or a build
that waits longer than ``wait_s`` (no vocabulary ever came) end their request with an error;
nothing else notices.
"""

from __future__ import annotations

import time

from engine_worker.grammar_builder import GrammarBuilder
from engine_worker.request import EngineRequest
from ipc.messages import ERR_BAD_REQUEST, ERR_UNAVAILABLE, FINISH_ERROR, FINISH_STOP
from ipc.structured import GrammarVocabulary

GRAMMAR_WAIT_S = 60.0


class GrammarRequests:
    def __init__(self, eos_ids: list[int], wait_s: float = GRAMMAR_WAIT_S) -> None:
        self.builder = GrammarBuilder(eos_ids=eos_ids)
        self.wait_s = wait_s
        self.building: dict[str, EngineRequest] = {}  # grammar not ready yet
        self.active: dict[str, EngineRequest] = {}  # built: waiting or running
        # Ended by their grammar: (request, finish reason, error, code).
        self.finished: list[tuple[EngineRequest, str, str, str]] = []
        self.deferred_rows = 0  # rows whose mask was late for their step (since start)

    def set_vocabulary(self, vocabulary: GrammarVocabulary) -> bool:
        return self.builder.set_vocabulary(vocabulary)

    @property
    def wakeup_fd(self) -> int:
        return self.builder.wakeup_fd

    def attach(self, request: EngineRequest, grammar: str) -> None:
        request.grammar = self.builder.request(grammar)
        if request.grammar.ready():
            self._built(request)
        else:
            self.building[request.request_id] = request

    def settle(self) -> None:
        """Moves the requests whose build ended out of ``building``, and those whose grammar
        is complete or failed (or whose build waited past ``wait_s``) to ``finished``."""
        self.builder.clear_wakeups()  # before looking: work ending later wakes us again
        now = time.monotonic()
        for request_id, request in list(self.building.items()):
            grammar = request.grammar
            assert grammar is not None
            if grammar.ready():
                del self.building[request_id]
                self._built(request)
            elif now - request.t_arrived > self.wait_s:
                del self.building[request_id]
                what = "built" if self.builder.has_vocabulary else "started (no vocabulary)"
                error = (
                    f"unavailable: the request's grammar was not {what} within {self.wait_s:g} s"
                )
                self.finished.append((request, FINISH_ERROR, error, ERR_UNAVAILABLE))
        for request_id, request in list(self.active.items()):
            grammar = request.grammar
            assert grammar is not None
            if grammar.pending or not (grammar.stopped or grammar.error):
                continue
            del self.active[request_id]
            if grammar.error:
                self.builder.evict(grammar.grammar)  # its lexer may be what failed
                self.finished.append((request, FINISH_ERROR, grammar.error, ERR_BAD_REQUEST))
            else:
                self.finished.append((request, FINISH_STOP, "", ""))

    def _built(self, request: EngineRequest) -> None:
        grammar = request.grammar
        assert grammar is not None
        if grammar.error:
            self.finished.append((request, FINISH_ERROR, grammar.error, ERR_BAD_REQUEST))
        else:
            self.active[request.request_id] = request

    def take_finished(self) -> list[tuple[EngineRequest, str, str, str]]:
        finished, self.finished = self.finished, []
        return finished

    def advance(self, sampled: list[tuple[EngineRequest, int]]) -> None:
        """Each constrained request's sampled token, to be consumed off the step."""
        self.builder.advance([(request.grammar, token) for request, token in sampled])  # type: ignore[misc]

    def defer(self, request: EngineRequest) -> None:
        """The request's step ended before its mask was computed: it sits out until it is."""
        assert request.grammar is not None
        request.grammar.late = True
        self.deferred_rows += 1

    def forget(self, request: EngineRequest) -> None:
        """The request ended (finished, aborted)."""
        self.building.pop(request.request_id, None)
        self.active.pop(request.request_id, None)
        if self.finished:
            self.finished = [f for f in self.finished if f[0] is not request]

    def close(self) -> None:
        self.builder.close()
