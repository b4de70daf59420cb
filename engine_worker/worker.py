"""The engine process main loop: one per engine replica (``--engines``, index r).

Between engine steps it drains its PULL socket without blocking (tokenized requests from the
tokenizers, aborts from the detokenizer); when the engine has nothing to do it blocks in poll. Each
step becomes one StepOutput for the detokenizer, carrying the RequestMeta of every request received
since the previous one, so a request's meta always travels ahead of its tokens on one ordered
channel. The process never tokenizes: it only ever sees token ids (tests check that `tokenizers`
is never imported here, via the `imported_tokenizers` heartbeat stat).

With several replicas, each step is also followed by the replica's load on its event stream
(``ReplicaLoad``, topic ``b"load"``), which the tokenizer workers route by. A prefill or decode
engine (disaggregation) also runs its role's pass (engine_worker/disaggregation.py) between steps.
"""

from __future__ import annotations

import logging
import math
import time
from typing import TYPE_CHECKING

import zmq

from engine_worker.cache_events import event_queue_max, event_sinks
from engine_worker.interface import EngineLike, EngineOverloaded
from ipc.codec import DecodeError, unpack_id_list
from ipc.config import ClusterConfig
from ipc.messages import (
    ERR_BAD_REQUEST,
    ERR_DUPLICATE_REQUEST,
    ERR_INTERNAL,
    ERR_OVERLOADED,
    FINISH_ABORT,
    FINISH_ERROR,
    LOAD_TOPIC,
    AbortRequests,
    ClusterNotice,
    FinishRecord,
    KVExportAsk,
    KVImportAsk,
    KVRelease,
    PrefilledRequest,
    ReplicaLoad,
    RequestError,
    RequestMeta,
    StepOutput,
    TokenizedRequest,
)
from ipc.salvage import salvage_fields
from ipc.sockets import PullQueue, PushQueue
from ipc.structured import GrammarVocabulary
from runtime.factories import load_factory
from runtime.kv_publisher import KVEventPublisher
from runtime.memory import IdleTrim
from runtime.model_files import tokenizer_modules_loaded
from runtime.worker import StartupError, WorkerRuntime, run_on_context

if TYPE_CHECKING:
    from engine_worker.disaggregation import DecodeRole, PrefillRole
    from engine_worker.kv_handover import HandoverRole
PeerMessage = PrefilledRequest | KVRelease | KVExportAsk | KVImportAsk
Inbox = TokenizedRequest | AbortRequests | GrammarVocabulary | PeerMessage

logger = logging.getLogger("splitserve.engine")

INBOX_HWM = 2048
SEND_TIMEOUT_MS = 30_000
SHUTDOWN_QUIET_S = 0.3
SHUTDOWN_MAX_S = 20.0


def make_engine(config: ClusterConfig) -> EngineLike:
    """The engine; a model it cannot serve (an unknown architecture, a tensor type we do not
    serve, a file that is not a model, too little memory for it) is a StartupError naming why."""
    if config.engine_factory:  # a test seam: a stand-in engine (no model)
        engine: EngineLike = load_factory(config.engine_factory)(config)
        return engine
    from engine_worker.engine import Engine  # torch loads here, not with this module
    from engine_worker.sampler import seed_unseeded_requests

    if config.engine.seed is not None:
        seed_unseeded_requests(config.engine.seed)
    try:
        return Engine(config.engine, cache_events=True)
    except (ValueError, OSError) as exc:
        logger.debug("the engine could not load %s", config.model_path, exc_info=True)
        raise StartupError(str(exc)) from exc


class EngineProcess:
    def __init__(
        self,
        config: ClusterConfig,
        ctx: zmq.Context,
        engine: EngineLike | None = None,
        index: int = 0,
    ) -> None:
        self.config, self.index = config, index
        self.runtime = WorkerRuntime("engine", index, config, ctx)
        with self.runtime.starting():  # a first start's kernel build heartbeats meanwhile
            self.engine = engine if engine is not None else make_engine(config)
        # The prefix cache's events: off the step, on a publisher thread; the first batch
        # (AllBlocksCleared) tells followers that this replica starts empty.
        self.cache_events = KVEventPublisher(
            ctx,
            event_sinks(config, index),
            data_parallel_rank=index,
            queue_max=event_queue_max(config),
        )
        self.publish_cache_events()
        self.inbox: PullQueue[Inbox | ClusterNotice] = PullQueue(
            ctx,
            config.engine_addr(index),
            TokenizedRequest,
            AbortRequests,
            GrammarVocabulary,
            *(PrefilledRequest, KVRelease, KVExportAsk, KVImportAsk, ClusterNotice),
            hwm=INBOX_HWM,
            curve=config.curve,
        )
        # While idle the loop sleeps on the inbox and, with a real engine, on the pipe its
        # grammar builder writes to when a waiting request's grammar is ready.
        self.idle = zmq.Poller()
        self.idle.register(self.inbox.socket, zmq.POLLIN)
        if self.engine.wakeup_fd is not None:
            self.idle.register(self.engine.wakeup_fd, zmq.POLLIN)
        self.outbox = PushQueue(ctx, config.detokenizer_addr, curve=config.curve)
        self.live: set[str] = set()  # added to the engine and not finished yet
        self.pending = StepOutput(step=0, t_step=0.0)  # metas and errors awaiting the next send
        self.steps = 0
        self.received = 0
        self.trim = IdleTrim()
        # Requests received from each tokenizer worker (by meta.tokenizer_index): the load
        # report's, from which each worker knows its requests still on their way here.
        self.received_from = [0] * config.tokenizer_workers
        # When the load was last published, and self.received then: an idle replica publishes
        # it again after arrivals that ended without a step, and every heartbeat interval (a
        # load report is never replayed: a follower that joined late gets the next one).
        self.load_published_t = 0.0
        self.load_reported_at = -1
        self.pd: PrefillRole | DecodeRole | HandoverRole | None = None  # a PD engine's role
        if config.disaggregated or config.kv_handover:
            from engine_worker.disaggregation import make_role  # torch: with the engine

            self.pd = make_role(config, index, self.engine, ctx, self.runtime.pid)

    # --- main loop ----------------------------------------------------------------------------
    def run(self) -> None:
        self.runtime.announce(
            [self.inbox.address, *self.cache_events.addresses],
            model_name=str(self.engine.model_name),
            max_model_len=int(self.engine.max_model_len),
            vocab_size=int(self.engine.vocab_size),
        )
        while not self.runtime.stopping:
            self.drain_inbox()
            self.pump_role()
            if self.engine.has_work():
                delay_s = self.engine.step_delay_s()
                if delay_s > 0:  # the idle batching window: let the rest of a burst arrive
                    self.inbox.wait(math.ceil(delay_s * 1000))
                else:
                    self.step()
                    self.trim.busy()
            elif self._has_pending():
                self.send(self.take_pending())
            else:
                if self.config.routes and (
                    self.received != self.load_reported_at
                    or time.monotonic() - self.load_published_t > self.config.heartbeat_interval_s
                ):
                    self.publish_load()
                if not self.idle.poll(min(self.runtime.heartbeat_due_in_ms(), 100)):
                    self.trim.idle()  # nothing came: hand back what the last burst freed
            self.runtime.maybe_heartbeat(self.stats)
        self.shutdown()

    def drain_inbox(self) -> None:
        for msg in self.inbox.drain(INBOX_HWM, self._reject_frame):
            if isinstance(msg, AbortRequests):
                for rid in msg.request_ids:
                    self.engine.abort(rid)
            elif isinstance(msg, GrammarVocabulary):
                self.engine.set_grammar_vocabulary(msg)
            elif isinstance(msg, TokenizedRequest):
                self.add(msg)
            elif self.pd is not None:
                self.pd.on_message(msg)

    def add(self, req: TokenizedRequest) -> None:
        req.meta.engine_index = self.index  # where it is, whatever its sender wrote
        self.received += 1
        if 0 <= req.meta.tokenizer_index < len(self.received_from):
            self.received_from[req.meta.tokenizer_index] += 1
        if req.request_id in self.live or req.meta.request_id in self.live:
            self._refuse_duplicate(req)
            return
        if req.meta.request_id != req.request_id:
            # Only a raw sender can do this; the detokenizer tracks the request by meta's id.
            self._finish_early(
                req.meta,
                FINISH_ERROR,
                f"meta.request_id "
                f"{req.meta.request_id!r} differs from request_id "
                f"{req.request_id!r}",
                ERR_BAD_REQUEST,
            )
            return
        if self.runtime.stopping:
            self._finish_early(req.meta, FINISH_ABORT, "", "")
            return
        refusal = self.pd.refuse(req) if self.pd is not None else ""
        if refusal:
            self._finish_early(req.meta, FINISH_ERROR, refusal, ERR_BAD_REQUEST)
            return
        try:
            ids = unpack_id_list(req.token_ids)
            self.engine.add(
                req.request_id,
                ids,
                req.sampling,
                arrival_time=time.monotonic(),
                grammar=req.grammar,
                cache_salt=req.cache_salt,
            )
        except EngineOverloaded as exc:
            self._finish_early(req.meta, FINISH_ERROR, f"overloaded: {exc}", ERR_OVERLOADED)
        except (ValueError, DecodeError) as exc:
            self._finish_early(req.meta, FINISH_ERROR, str(exc), ERR_BAD_REQUEST)
        except Exception as exc:  # the engine must keep serving everyone else
            logger.exception("engine.add failed for %r", req.request_id)
            self._finish_early(req.meta, FINISH_ERROR, f"internal error: {exc}", ERR_INTERNAL)
        else:
            self.live.add(req.request_id)
            self.pending.new_requests.append(req.meta)
            if self.pd is not None:
                self.pd.accepted(req)

    def step(self) -> None:
        """One engine step; its tokens go to the detokenizer first, the bookkeeping (cache
        events, the load report) after, so none of it sits between a token and its client."""
        out = self.engine.step()
        self.steps += 1
        pending = self.take_pending()
        out.new_requests = pending.new_requests + list(out.new_requests)
        for record in out.finished:
            self.live.discard(record.request_id)
        out.finished += pending.finished
        out.kv_arrivals = pending.kv_arrivals + out.kv_arrivals
        self.send(out)
        if self.pd is not None:  # a prefill engine's first tokens leave right after their step
            self.pd.after_step(out)
            self.pump_role()
        self.publish_cache_events()
        self.publish_load()

    def pump_role(self) -> None:
        """A prefill or decode engine's pass: hand-offs out, arrivals in, transfers timed out."""
        if self.pd is None:
            return
        result = self.pd.pump()
        self.live.difference_update(result.left)
        self.live.update(result.joined)
        self.pending.finished += result.finished
        self.pending.kv_arrivals += result.arrivals

    def send(self, out: StepOutput) -> None:
        out.engine_pid = self.runtime.pid
        out.engine_index = self.index
        try:
            self.outbox.put(out, timeout_ms=SEND_TIMEOUT_MS)
        except zmq.Again:
            logger.error(
                "the detokenizer has not read for %d ms; dropped step %d", SEND_TIMEOUT_MS, out.step
            )

    # --- shutdown -----------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Aborts everything in flight so each request still gets its terminal event."""
        logger.info("shutting down: aborting %d in-flight requests", len(self.live))
        deadline = time.monotonic() + SHUTDOWN_MAX_S
        self.drain_inbox()
        for rid in list(self.live):
            self.engine.abort(rid)
        while self.engine.has_work() and time.monotonic() < deadline:
            self.step()
        # Requests that were already on their way from a tokenizer still get an answer.
        quiet_until = time.monotonic() + SHUTDOWN_QUIET_S
        while time.monotonic() < min(quiet_until, deadline):
            if self.inbox.wait(20):
                self.drain_inbox()
                quiet_until = time.monotonic() + SHUTDOWN_QUIET_S
        if self._has_pending():
            self.send(self.take_pending())
        self.runtime.maybe_heartbeat(self.stats)
        self.engine.close()
        if self.pd is not None:
            self.pd.close()
        self.cache_events.close()
        self.inbox.close()
        self.outbox.close()
        self.runtime.close()

    # --- helpers ------------------------------------------------------------------------------
    def _refuse_duplicate(self, req: TokenizedRequest) -> None:
        """A copy of a live request (only a raw client bypassing the SDK sends one). It gets its
        own terminal event, as every accepted message does, and the live request keeps its
        stream: a RequestError with its own code, which the detokenizer passes to the sender
        without touching the live request's state (a finish here would end that one)."""
        rid = req.meta.request_id
        logger.warning("refused a copy of live request %r", rid)
        error = RequestError(
            request_id=rid,
            client_id=req.meta.client_id,
            message=f"request_id {rid!r} is already in flight: this copy was refused and "
            "the request with that id goes on; give each request its own id",
            code=ERR_DUPLICATE_REQUEST,
            t_submit=req.meta.t_submit,
        )
        try:
            self.outbox.put(error, timeout_ms=SEND_TIMEOUT_MS)
        except zmq.Again:
            logger.error(
                "the detokenizer has not read for %d ms; dropped an error", SEND_TIMEOUT_MS
            )

    def _finish_early(self, meta: RequestMeta, reason: str, error: str, code: str) -> None:
        self.pending.new_requests.append(meta)
        self.pending.finished.append(FinishRecord(meta.request_id, reason, error, code))

    def _reject_frame(self, frame: bytes, exc: DecodeError) -> None:
        found = salvage_fields(frame, "request_id", "meta.client_id")
        rid, cid = found.get("request_id"), found.get("meta.client_id")
        logger.warning("malformed frame on the engine socket (request %r): %s", rid, exc)
        if isinstance(rid, str) and rid and isinstance(cid, bytes) and cid:
            meta = RequestMeta(request_id=rid, client_id=cid, prompt_tokens=0)
            self._finish_early(meta, FINISH_ERROR, f"malformed request: {exc}", ERR_BAD_REQUEST)

    def publish_cache_events(self) -> None:
        events = self.engine.take_cache_events()
        if events:
            self.cache_events.publish(events)

    def publish_load(self) -> None:
        """The replica's load for the tokenizer workers' routing (several engines only)."""
        if not self.config.routes:
            return
        load = self.engine.load()
        self.load_reported_at, self.load_published_t = self.received, time.monotonic()
        self.cache_events.publish_side(
            LOAD_TOPIC,
            ReplicaLoad(
                index=self.index,
                pid=self.runtime.pid,
                running=load.running,
                waiting=load.waiting + (self.pd.queued_requests if self.pd is not None else 0),
                kv_usage=load.kv_blocks_used / load.kv_blocks_total if load.kv_blocks_total else 0,
                received_from=list(self.received_from),
                kv_blocks_available=load.kv_blocks_available,
            ),
        )

    def _has_pending(self) -> bool:
        return bool(self.pending.new_requests or self.pending.finished or self.pending.kv_arrivals)

    def take_pending(self) -> StepOutput:
        pending, self.pending = self.pending, StepOutput(step=0, t_step=0.0)
        pending.step = self.steps
        pending.t_step = time.monotonic()
        return pending

    def stats(self) -> dict[str, float]:
        load = self.engine.load()
        return {
            "running": load.running,
            "waiting": load.waiting,
            "live": len(self.live),
            "steps": self.steps,
            "received": self.received,
            "imported_tokenizers": float(bool(tokenizer_modules_loaded())),
            "memory_trims": self.trim.trims,
            "grammar_rows_deferred": load.grammar_rows_deferred,
            **(
                {
                    "kv_blocks_total": load.kv_blocks_total,
                    "kv_blocks_used": load.kv_blocks_used,
                    "kv_blocks_available": load.kv_blocks_available,
                }
                if load.kv_blocks_total
                else {}
            ),
            **(self.pd.stats() if self.pd is not None else {}),
        }


def main(config: ClusterConfig, index: int = 0) -> None:
    run_on_context(lambda ctx: EngineProcess(config, ctx, index=index))
