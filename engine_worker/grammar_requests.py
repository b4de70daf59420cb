"""The engine's constrained requests: each one's matcher, the ones still waiting for theirs, and
what a sampled token means for them.

A request's matcher is built off the step (GrammarBuilder's thread); until it is ready the
request stays in the waiting queue, where the scheduler passes over it, and it does not count
as work, so an engine with nothing else to do sleeps (on ``wakeup_fd`` and its socket) instead of
stepping. A build that fails, or that waits longer than ``wait_s`` (no vocabulary ever came),
ends the request with an error at the next step; nothing else notices.
"""

from __future__ import annotations

import time

from engine_worker.grammar_builder import GrammarBuilder
from engine_worker.request import EngineRequest
from ipc.messages import ERR_INTERNAL, ERR_UNAVAILABLE, FINISH_ERROR
from ipc.structured import GrammarVocabulary

GRAMMAR_WAIT_S = 60.0


class GrammarRequests:
    def __init__(self, eos_ids: list[int], wait_s: float = GRAMMAR_WAIT_S) -> None:
        self.builder = GrammarBuilder(eos_ids=eos_ids)
        self.wait_s = wait_s
        self.building: dict[str, EngineRequest] = {}  # grammar not ready yet
        self.failed: list[tuple[EngineRequest, str, str]] = []  # (request, error, code)

    def set_vocabulary(self, vocabulary: GrammarVocabulary) -> bool:
        return self.builder.set_vocabulary(vocabulary)

    @property
    def wakeup_fd(self) -> int:
        return self.builder.wakeup_fd

    def attach(self, request: EngineRequest, grammar: str) -> None:
        request.grammar = self.builder.request(grammar)
        if not request.grammar.ready():
            self.building[request.request_id] = request
        elif request.grammar.error:
            self.failed.append((request, request.grammar.error, ERR_INTERNAL))

    def settle(self) -> None:
        """Moves the requests whose build ended out of ``building`` (the failed ones, and those
        past ``wait_s``, to ``failed``)."""
        self.builder.clear_wakeups()  # before looking: a build ending later wakes us again
        if not self.building:
            return
        now = time.monotonic()
        for request_id, request in list(self.building.items()):
            grammar = request.grammar
            assert grammar is not None
            if grammar.ready():
                del self.building[request_id]
                if grammar.error:
                    self.failed.append((request, grammar.error, ERR_INTERNAL))
            elif now - request.t_arrived > self.wait_s:
                del self.building[request_id]
                what = "built" if self.builder.has_vocabulary else "started (no vocabulary)"
                self.failed.append(
                    (
                        request,
                        f"unavailable: the request's grammar was not "
                        f"{what} within {self.wait_s:g} s",
                        ERR_UNAVAILABLE,
                    )
                )

    def take_failed(self) -> list[tuple[EngineRequest, str, str]]:
        failed, self.failed = self.failed, []
        return failed

    def forget(self, request: EngineRequest) -> None:
        """The request ended (finished, aborted)."""
        self.building.pop(request.request_id, None)
        if self.failed:
            self.failed = [f for f in self.failed if f[0] is not request]

    @staticmethod
    def accept(request: EngineRequest, token: int) -> tuple[str | None, str]:
        """Advances the request's matcher with its sampled token: (finish reason, error). The
        reason is FINISH_STOP when the grammar is complete, FINISH_ERROR when its mask failed
        this step (the token was drawn unmasked: it is dropped) or the matcher refused it."""
        grammar = request.grammar
        assert grammar is not None
        if grammar.error:
            return FINISH_ERROR, grammar.error
        reason = grammar.accept(token)
        return reason, grammar.error

    def close(self) -> None:
        self.builder.close()
