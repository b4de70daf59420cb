"""The detokenizer's logic, without sockets: what each incoming message means for the streams.

``DetokenizerCore`` takes what reaches the detokenizer (a client's hello, abort or goodbye, a
tokenizer's RequestError, the engine's StepOutput, the supervisor's ClusterNotice) and collects
what must go out, handed over by ``take_output()``:

    welcomes  clients to answer with the ClientWelcome (sent first)
    events    per client, the StreamEvents of this pass (one ClientEvents message each)
    notices   per client, ClusterNotices to send after its events
    replies   per client, answers to its queries (TokenizeResult, EngineStatsReport)
    aborts    (request id, engine replica) to abort: client aborts, matched stop strings,
              requests of clients that are gone (what vLLM's OutputProcessor returns as
              reqs_to_abort); replica EVERY_REPLICA while the request's meta, which says where
              it runs, has not arrived

Every request it learns about (a RequestMeta or a RequestError) ends in exactly one terminal
StreamEvent to its client; every query, in exactly one reply or error event. The engines' latest
stats and the routing decisions live in an EngineBook (engine_book.py), which answers
EngineStatsQuery; what a dead engine means for its requests, see on_notice. It reads no clock:
times come from the messages, or as ``now`` from its caller. The process loop (worker.py) and
the benchmark's in-process server run this same object.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

from detok_worker.engine_book import EngineBook
from detok_worker.handover import HandoverOrder
from detok_worker.output import EVERY_REPLICA, ClientInfo, DetokenizerOutput
from detok_worker.request_state import RequestState
from detok_worker.token_strings import TokenStrings
from ipc import codec
from ipc.messages import (
    ERR_DUPLICATE_REQUEST,
    ERR_UNAVAILABLE,
    FINISH_ERROR,
    FINISH_STOP,
    NOTICE_DIED,
    ClusterNotice,
    EngineStats,
    RequestError,
    RequestMeta,
    StepOutput,
    StreamEvent,
)
from ipc.messages.queries import TokenizeResult

logger = logging.getLogger("splitserve.detokenizer")

MAX_IGNORED = 100_000  # ids stopped/abandoned here whose engine finish has not arrived yet
MAX_PENDING_ABORTS = 10_000  # per client: aborts for requests not seen yet


class DetokenizerCore:
    def __init__(
        self,
        tokenizer,
        *,
        stream_interval_tokens: int = 1,
        max_pending_aborts: int = MAX_PENDING_ABORTS,
        max_ignored: int = MAX_IGNORED,
        engines: int = 1,
        routing_policy: str = "",
        roles: list[str] | None = None,
    ) -> None:
        if stream_interval_tokens < 1:
            raise ValueError(
                f"stream_interval_tokens must be at least 1, got {stream_interval_tokens}"
            )
        self.tokenizer = tokenizer
        self._strings: TokenStrings | None = None  # built on first use (logprobs, echo)
        self.stream_interval_tokens = stream_interval_tokens
        self.max_pending_aborts = max_pending_aborts
        self.max_ignored = max_ignored
        self.clients: dict[bytes, ClientInfo] = {}
        self.states: dict[str, RequestState] = {}
        # Requests ended here (stop string, gone client) whose engine finish is still to come.
        self.ignored: OrderedDict[str, None] = OrderedDict()
        self.engines = EngineBook(engines, routing_policy, roles)
        self.handovers = HandoverOrder()
        self.output = DetokenizerOutput()
        self.steps = 0
        self.notices = 0

    def take_output(self) -> DetokenizerOutput:
        output, self.output = self.output, DetokenizerOutput()
        return output

    def has_client(self, client_id: bytes) -> bool:
        return client_id in self.clients

    def stats(self) -> dict[str, float]:
        return {
            "clients": len(self.clients),
            "open_requests": len(self.states),
            "steps": self.steps,
            "notices": self.notices,
        }

    # --- clients ------------------------------------------------------------------------------
    def on_hello(self, client_id: bytes) -> None:
        self.clients.setdefault(client_id, ClientInfo())
        self.output.welcomes.append(client_id)

    def on_client_abort(self, client_id: bytes, request_ids: list[str]) -> None:
        info = self.clients.get(client_id)
        if info is None:
            return
        for rid in request_ids:
            # Known here: the engine answers with finish "abort". Not seen yet: tell the engine
            # now too (it remembers unknown ids for a while; after a detokenizer restart this
            # process never sees the metas of older requests) and abort again when it shows up.
            state = self.states.get(rid) if rid in info.request_ids else None
            self._abort(rid, state.meta if state is not None else None)
            if rid not in info.request_ids:
                info.pending_aborts[rid] = None
                info.pending_aborts.move_to_end(rid)
                if len(info.pending_aborts) > self.max_pending_aborts:
                    info.pending_aborts.popitem(last=False)

    def on_client_gone(self, client_id: bytes, reason: str) -> None:
        """The client said goodbye, or cannot be reached: abort its requests, send it nothing."""
        info = self.clients.pop(client_id, None)
        self.output.events.pop(client_id, None)
        self.output.notices.pop(client_id, None)
        self.output.replies.pop(client_id, None)
        if info is None:
            return
        logger.info(
            "client %r %s; aborting its %d requests", client_id, reason, len(info.request_ids)
        )
        for rid in info.request_ids:
            state = self.states.pop(rid, None)
            self._ignore(rid)
            self._abort(rid, state.meta if state is not None else None)

    def on_stats_query(self, client_id: bytes, request_id: str) -> None:
        if client_id in self.clients:
            self.output.replies.setdefault(client_id, []).append(self.engines.report(request_id))

    # --- engine, tokenizers, supervisor -------------------------------------------------------
    def on_tokenize_result(self, result: TokenizeResult) -> None:
        info = self.clients.get(result.client_id)
        if info is None:
            return
        if result.request_id in info.pending_aborts:  # the client gave up on it
            del info.pending_aborts[result.request_id]
            return
        self.output.replies.setdefault(result.client_id, []).append(result)

    def on_request_error(self, err: RequestError) -> None:
        """A request that ended before the engine, or a refused copy of a live one. An error for
        an id that is live here is always about a copy (the live request reached the engine, so
        no worker before it can fail it): its sender learns under ERR_DUPLICATE_REQUEST, and the
        live request's state, stream and pending aborts are left alone."""
        info = self.clients.get(err.client_id)
        if info is None:
            return
        code, message = err.code, err.message
        if code != ERR_DUPLICATE_REQUEST and err.request_id in self.states:
            code = ERR_DUPLICATE_REQUEST
            message = f"request_id {err.request_id!r} is already in flight; this copy: {message}"
        if code != ERR_DUPLICATE_REQUEST:
            info.pending_aborts.pop(err.request_id, None)
        self._queue(
            err.client_id,
            StreamEvent(
                request_id=err.request_id,
                finished=True,
                finish_reason=FINISH_ERROR,
                error=message,
                error_code=code,
                error_param=err.param or None,
            ),
        )

    def on_step_output(self, out: StepOutput) -> None:
        """One engine step, in passes whose order is the rule:

        1. the engine's stats, from any step (one with no tokens too); a dead engine's late
           output is dropped whole (its requests already ended here);
        2. the metas of requests new since the last step: every later pass names requests,
           and the engine sends a request's meta in the step output that precedes or carries
           its first token;
        3. starts and prompt logprobs, ahead of any token: a request's first delta carries its
           queue times and its prompt's entries;
        4. the tokens, decoded in order with stop strings matched and deltas queued, before the
           finishes: a request's last tokens belong in the text its terminal event carries, so
           a request that finishes in this step gets no delta of its own;
        5. the finishes: each open request's terminal event.
        Disaggregated, a decode engine's output may wait for its requests' metas first (see
        handover.py), and then reports where they run (before any of their tokens).
        """
        if not self.engines.on_step(out) or self.handovers.hold(out, self._known):
            return
        queue = [out]
        while queue:
            out = queue.pop(0)
            self.steps += 1
            for meta in out.new_requests:
                self._admit(meta)
            self.handovers.arrive(out, self.states, self._abort)
            self._apply_starts(out)
            self._apply_tokens(out)
            self._apply_finishes(out)
            queue = queue or self.handovers.release(self._known)

    def _known(self, rid: str) -> bool:
        return rid in self.states or rid in self.ignored

    def _apply_starts(self, out: StepOutput) -> None:
        for start in out.started:
            if (state := self.states.get(start.request_id)) is not None:
                state.on_start(start)
        for chunk in out.prompt_logprobs:
            if (state := self.states.get(chunk.request_id)) is not None:
                state.on_prompt_logprobs(self.strings, chunk)

    def _apply_tokens(self, out: StepOutput) -> None:
        ids = codec.unpack_id_list(out.token_ids)
        if len(ids) != len(out.request_ids):
            n, m = len(ids), len(out.request_ids)
            logger.error("step %d has %d tokens for %d requests; dropped them", out.step, n, m)
            ids = []
        logprobs = {e.row: e for e in out.logprobs if e.row < len(ids)}
        stats = out.stats or EngineStats()
        finishing = {f.request_id for f in out.finished}
        for row, (rid, token_id) in enumerate(zip(out.request_ids, ids)):
            state = self.states.get(rid)
            if state is None:
                continue  # stopped here already, or its client is gone
            values = logprobs.get(row) if logprobs else None
            state.step_ms, state.step_threads = stats.step_ms, stats.threads
            if state.on_token(
                self.tokenizer,
                token_id,
                out.t_step,
                None if values is None else (self.strings, values),
            ):
                self._finish(rid, FINISH_STOP, out.t_step, stopped_by_string=True)
                self._ignore(rid)
                self._abort(rid, state.meta)  # frees its KV blocks in the engine
            elif rid not in finishing and state.should_stream(self.stream_interval_tokens):
                self._queue(state.meta.client_id, state.delta(self._prompt_strings(state)))

    def _apply_finishes(self, out: StepOutput) -> None:
        for finish in out.finished:
            if finish.request_id in self.ignored:  # already ended here
                del self.ignored[finish.request_id]
            elif finish.request_id in self.states:
                self._finish(
                    finish.request_id,
                    finish.reason,
                    out.t_step,
                    error=finish.error,
                    code=finish.code,
                )

    def on_notice(self, notice: ClusterNotice, now: float) -> None:
        """A worker died or is back: end what died with it, tell every client. A dead
        tokenizer's requests listed alive are those already past it; a dead replica's (of
        several) that produced nothing are dropped here unended, and the notice lists as alive
        the client's requests on the other replicas: the client sends the rest again."""
        self.notices += 1
        logger.warning(
            "%s[%d] (pid %d) %s%s",
            notice.role,
            notice.index,
            notice.pid,
            notice.event,
            f": {notice.detail}" if notice.detail else "",
        )
        replica_died = notice.event == NOTICE_DIED and notice.role == "engine"
        resend = replica_died and len(self.engines.replicas) > 1
        if replica_died:
            self.engines.on_death(notice.index, notice.pid, now)
            self._end_replica(notice, now, keep_unstarted=resend)
        tokenizer_died = notice.event == NOTICE_DIED and notice.role == "tokenizer"
        for client_id, info in self.clients.items():
            alive = []
            if tokenizer_died:  # its requests already in the engine are not lost
                alive = [
                    rid
                    for rid in info.request_ids
                    if self.states[rid].meta.tokenizer_index == notice.index
                ]
            elif resend:  # what runs on the other replicas (this one's are gone by now)
                alive = list(info.request_ids)
            self.output.notices.setdefault(client_id, []).append(
                ClusterNotice(
                    event=notice.event,
                    role=notice.role,
                    index=notice.index,
                    pid=notice.pid,
                    detail=notice.detail,
                    alive_ids=alive,
                    resend_unstarted=resend,
                )
            )

    def _end_replica(self, notice: ClusterNotice, now: float, *, keep_unstarted: bool) -> None:
        """The requests of a dead replica (of the one engine: all of them) end with an
        "unavailable" error, except, with ``keep_unstarted``, those that produced nothing yet:
        they are forgotten here, and their clients send them again."""
        several = len(self.engines.replicas) > 1
        who = f"engine replica {notice.index}" if several else "the engine"
        detail = notice.detail or "exited"
        error = f"unavailable: {who} died ({detail}); the request was lost with it"
        for rid, state in list(self.states.items()):
            # Disaggregated: a request past its first token on its way to this decode engine.
            moving = state.meta.decode_index == notice.index and state.completion_tokens > 0
            if several and state.meta.engine_index != notice.index and not moving:
                continue
            if keep_unstarted and not state.completion_tokens:
                del self.states[rid]
                if (info := self.clients.get(state.meta.client_id)) is not None:
                    info.request_ids.discard(rid)
            else:
                self._finish(rid, FINISH_ERROR, now, error=error, code=ERR_UNAVAILABLE)
        if not several:
            self.ignored.clear()  # their engine finishes will never come

    def end_all(self, reason: str, now: float, *, error: str, code: str) -> None:
        """Every open request ends here, with this reason and error (shutdown, a dead engine)."""
        for rid in list(self.states):
            self._finish(rid, reason, now, error=error, code=code)

    # --- helpers ------------------------------------------------------------------------------
    def _admit(self, meta: RequestMeta) -> None:
        info = self.clients.get(meta.client_id)
        if meta.request_id in self.states:
            logger.warning("ignored a second meta for request %r", meta.request_id)
            return
        self.engines.on_admit(meta)
        if info is None:  # its client is gone (or never said hello)
            self._ignore(meta.request_id)
            self._abort(meta.request_id, meta)
        else:
            self.states[meta.request_id] = RequestState(meta)
            info.request_ids.add(meta.request_id)
            if meta.request_id in info.pending_aborts:
                del info.pending_aborts[meta.request_id]
                self._abort(meta.request_id, meta)

    def _finish(
        self,
        rid: str,
        reason: str,
        t: float,
        *,
        stopped_by_string: bool = False,
        error: str = "",
        code: str = "",
    ) -> None:
        state = self.states.pop(rid)
        if error and state.meta.decode_index >= 0:  # a decode engine may still report it
            self._ignore(rid)
        info = self.clients.get(state.meta.client_id)
        if info is not None:
            info.request_ids.discard(rid)
        self._queue(
            state.meta.client_id,
            state.final(
                reason,
                t,
                stopped_by_string=stopped_by_string,
                error=error,
                error_code=code,
                strings=self._prompt_strings(state),
            ),
        )

    @property
    def strings(self) -> TokenStrings:
        """Token strings for logprobs and echo, built the first time a request asks."""
        if self._strings is None:
            self._strings = TokenStrings(self.tokenizer)
        return self._strings

    def _prompt_strings(self, state: RequestState) -> TokenStrings | None:
        return self.strings if state.meta.prompt_token_ids and not state.sent_any else None

    def _abort(self, rid: str, meta: RequestMeta | None, replica: int | None = None) -> None:
        """To the replica the request runs on (``replica``, else its meta's; every replica
        without a meta) and, disaggregated, to the decode engine it moves to as well."""
        if replica is None:
            replica = meta.engine_index if meta is not None else EVERY_REPLICA
        self.output.aborts.append((rid, replica))
        if meta is not None and meta.decode_index >= 0 and meta.decode_index != replica:
            self.output.aborts.append((rid, meta.decode_index))

    def _ignore(self, rid: str) -> None:
        self.ignored[rid] = None
        if len(self.ignored) > self.max_ignored:
            self.ignored.popitem(last=False)

    def _queue(self, client_id: bytes, event: StreamEvent) -> None:
        self.output.events.setdefault(client_id, []).append(event)
