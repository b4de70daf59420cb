"""Prefill/decode disaggregation in the engine process (docs/disaggregation.md).

A prefill engine (``PrefillRole``) computes prompts and samples first tokens as any engine does;
the StepOutput carrying a first token goes to the detokenizer as usual (so TTFT is this
engine's). Right after that step, each request that did not finish there is handed off: its KV
blocks are copied into this engine's transfer buffer (engine_worker/kv_transfer.py), the request,
its sampler's random state and the buffer's descriptor go to the decode engine its tokenizer
worker chose (``RequestMeta.decode_index``), and the request leaves this engine. The buffer's run
is freed when that decode engine releases it, when the engine is reported dead, or when the
transfer is not taken within ``kv_transfer_timeout_s``: then the request ends 'unavailable' here
(and is counted). A request whose blocks find no room in the buffer waits, holding its blocks.

A decode engine (``DecodeRole``) takes each PrefilledRequest into its running batch when it has a
batch slot and the blocks, copies the KV in, releases the transfer, and says so in its next
StepOutput (``kv_arrivals``: the detokenizer then knows the request runs here). Requests are
taken in arrival order; the one at the head waits for room, holding the prefill's buffer.

Structured outputs (a grammar) are refused in this mode: their matcher state does not move.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

import zmq

from engine_worker.engine import Engine
from engine_worker.handoff import (
    PumpResult,
    add_prefilled,
    generator_state,
    release,
    take_first_tokens,
)
from engine_worker.kv_net import KVNetError, KVNetUnavailable
from engine_worker.kv_transfer import KVGeometry
from engine_worker.kv_transports import make_exporter, make_importer
from engine_worker.request import EngineRequest
from ipc.codec import pack_ids, unpack_id_list
from ipc.config import ClusterConfig
from ipc.messages import (
    ERR_INTERNAL,
    ERR_UNAVAILABLE,
    FINISH_ERROR,
    NOTICE_DIED,
    NOTICE_READY,
    ClusterNotice,
    FinishRecord,
    KVArrival,
    KVRelease,
    PrefilledRequest,
    RequestMeta,
    StepOutput,
    TokenizedRequest,
)
from ipc.sockets import PushQueue
from runtime.worker import StartupError

if TYPE_CHECKING:
    from engine_worker.kv_handover import HandoverRole

logger = logging.getLogger("splitserve.engine")

GRAMMAR_REFUSED = (
    "structured outputs (response_format, required tool calls) are not served with "
    "--prefill-engines/--decode-engines: a grammar's matcher cannot move to the decode engine; "
    "use the colocated mode (--engines) for them"
)


@dataclass(slots=True)
class InFlight:
    request_id: str
    decode_index: int
    t_start: float


def make_role(
    config: ClusterConfig, index: int, engine: object, ctx: zmq.Context, pid: int
) -> PrefillRole | DecodeRole | HandoverRole:
    """Engine ``index``'s role; a StartupError when it cannot take it."""
    if not isinstance(engine, Engine):
        raise StartupError("the disaggregated mode needs the real engine (no stand-in)")
    role = config.engine_role(index) or f"Ray Serve {config.kv_handover}"
    logger.info(
        "engine[%d] is a %s engine (disaggregated, KV over %s)", index, role, config.kv_transport
    )
    try:
        if config.kv_handover:
            from engine_worker.kv_handover import HandoverRole

            return HandoverRole(config, index, engine, ctx, pid)
        if role == "prefill":
            return PrefillRole(config, index, engine, ctx, pid)
        return DecodeRole(config, index, engine, ctx)
    except (ValueError, OSError, KVNetUnavailable, KVNetError) as exc:
        raise StartupError(f"disaggregation: {exc}") from exc


class PrefillRole:
    role = "prefill"

    def __init__(
        self, config: ClusterConfig, index: int, engine: Engine, ctx: zmq.Context, pid: int
    ) -> None:
        self.engine, self.index = engine, index
        self.timeout_s = config.kv_transfer_timeout_s
        cache = engine.runner.kv_cache
        self.keys, self.values = cache.keys, cache.values
        geometry = KVGeometry.of(cache.keys)
        tokens = max(config.kv_transfer_buffer_tokens, engine.max_model_len)
        blocks = -(-tokens // geometry.block_size)
        self.exporter = make_exporter(config, index, pid, geometry, blocks)
        self.to_decode = {
            d: PushQueue(ctx, config.engine_addr(d), curve=config.curve)
            for d in config.decode_indices
        }
        self.metas: dict[str, RequestMeta] = {}
        self.queued: deque[EngineRequest] = deque()
        self.in_flight: dict[int, InFlight] = {}
        self.dead: dict[int, float] = {}  # decode engines down, since when
        self.finished: list[FinishRecord] = []
        self.next_transfer = (pid << 32) + 1  # unique across restarts: a stamp never repeats
        self.transfers = self.aborted = self.bytes = 0
        self.export_s = 0.0

    # --- requests in ----------------------------------------------------------------------
    def refuse(self, req: TokenizedRequest) -> str:
        return GRAMMAR_REFUSED if req.grammar else ""

    def accepted(self, req: TokenizedRequest) -> None:
        self.metas[req.request_id] = req.meta

    def on_message(self, msg: object) -> None:
        if isinstance(msg, KVRelease):
            for transfer_id in msg.transfer_ids:
                self.exporter.release(transfer_id)
                self.in_flight.pop(transfer_id, None)
        elif (
            isinstance(msg, ClusterNotice) and msg.role == "engine" and msg.index in self.to_decode
        ):
            if msg.event == NOTICE_DIED:
                self.dead[msg.index] = time.monotonic()
                for transfer_id, flight in list(self.in_flight.items()):
                    if flight.decode_index == msg.index:
                        self._give_up(transfer_id, f"decode engine {msg.index} died")
            elif msg.event == NOTICE_READY:
                self.dead.pop(msg.index, None)
        elif isinstance(msg, PrefilledRequest):
            logger.error("a prefill engine got a prefilled request %r; dropped", msg.request_id)

    def after_step(self, out: StepOutput) -> None:
        for record in out.finished:
            self.metas.pop(record.request_id, None)
        self.queued.extend(take_first_tokens(self.engine, out.request_ids))

    # --- hand-offs --------------------------------------------------------------------------
    def pump(self) -> PumpResult:
        """Hands off what is queued, in order, until the buffer has no room; gives up on
        transfers past the bound."""
        result = PumpResult()
        while self.queued:
            request = self.queued[0]
            if self.engine.requests.get(request.request_id) is not request:
                self.queued.popleft()  # aborted meanwhile: the engine ended it
                continue
            outcome = self._hand_off(request)
            if outcome is None:
                break
            self.queued.popleft()
            self.metas.pop(request.request_id, None)
            release(self.engine, request.request_id)
            result.left.append(request.request_id)
            if outcome:
                result.finished.append(
                    FinishRecord(request.request_id, FINISH_ERROR, outcome, ERR_UNAVAILABLE)
                )
        now = time.monotonic()
        for transfer_id, flight in list(self.in_flight.items()):
            if now - flight.t_start > self.timeout_s:
                self._give_up(transfer_id, f"not taken within {self.timeout_s:g} s")
        result.finished += self.finished
        self.finished = []
        return result

    def _hand_off(self, request: EngineRequest) -> str | None:
        """ "" when the request went to a decode engine, an error when it cannot go, None when it
        must wait (no room in the buffer, its socket full, or every decode engine restarting)."""
        meta = self.metas.get(request.request_id)
        decode = meta.decode_index if meta is not None else -1
        if decode not in self.to_decode:
            decode = min(self.to_decode)  # a sender that chose none (a raw client)
        if decode in self.dead:  # another decode engine, or its restart within the bound
            alive = sorted(set(self.to_decode) - set(self.dead))
            if alive:
                decode = alive[0]
            elif time.monotonic() - self.dead[decode] < self.timeout_s:
                return None
            else:
                return f"unavailable: decode engine {decode} is down"
        t_start = time.monotonic()
        blocks = request.block_ids[: self.engine.blocks.blocks_for(request.prompt_len)]
        transfer_id = self.next_transfer
        try:
            kv = self.exporter.export(transfer_id, self.keys, self.values, blocks)
        except ValueError as exc:
            return f"unavailable: {exc}"
        if kv is None:
            return None
        message = PrefilledRequest(
            request_id=request.request_id,
            token_ids=pack_ids(request.token_ids),
            prompt_len=request.prompt_len,
            sampling=request.params,
            meta=meta if meta is not None else RequestMeta(request.request_id, b"", 0),
            kv=kv,
            prefill_index=self.index,
            generator_state=generator_state(request),
            cache_salt=request.cache_salt,
            t_arrived=request.t_arrived,
            t_scheduled=request.t_scheduled,
            cached_tokens=request.cached_tokens,
            t_export_start=t_start,
        )
        try:
            self.to_decode[decode].put(message, block=False)
        except zmq.Again:
            self.exporter.release(transfer_id)
            return None
        self.next_transfer += 1
        self.in_flight[transfer_id] = InFlight(request.request_id, decode, t_start)
        self.transfers += 1
        self.bytes += kv.nbytes
        self.export_s += time.monotonic() - t_start
        return ""

    def _give_up(self, transfer_id: int, why: str) -> None:
        flight = self.in_flight.pop(transfer_id)
        self.exporter.release(transfer_id)
        self.aborted += 1
        logger.warning(
            "KV transfer of %r to decode engine %d aborted: %s",
            flight.request_id,
            flight.decode_index,
            why,
        )
        self.finished.append(
            FinishRecord(
                flight.request_id,
                FINISH_ERROR,
                f"unavailable: the KV transfer to decode engine {flight.decode_index} was "
                f"aborted ({why})",
                ERR_UNAVAILABLE,
            )
        )

    @property
    def queued_requests(self) -> int:
        return len(self.queued)

    def stats(self) -> dict[str, float]:
        return {
            "pd_prefill": 1.0,
            "kv_transfers": self.transfers,
            "kv_transfer_bytes": self.bytes,
            "kv_export_s": self.export_s,
            "kv_transfers_aborted": self.aborted,
            "kv_transfers_in_flight": len(self.in_flight),
            "kv_transfer_blocks_held": self.exporter.held_blocks,
            "kv_handoffs_queued": len(self.queued),
        }

    def close(self) -> None:
        for queue in self.to_decode.values():
            queue.close()
        self.exporter.close()


class DecodeRole:
    role = "decode"

    def __init__(self, config: ClusterConfig, index: int, engine: Engine, ctx: zmq.Context) -> None:
        self.engine, self.index = engine, index
        cache = engine.runner.kv_cache
        self.keys, self.values = cache.keys, cache.values
        geometry = KVGeometry.of(cache.keys)
        max_blocks = -(-engine.max_model_len // geometry.block_size)
        self.importer = make_importer(config, geometry, max_blocks)
        self.to_prefill = {
            p: PushQueue(ctx, config.engine_addr(p), curve=config.curve)
            for p in config.prefill_indices
        }
        self.waiting: deque[PrefilledRequest] = deque()
        self.imported = self.refused = self.bytes = 0
        self.import_s = 0.0

    def refuse(self, req: TokenizedRequest) -> str:
        return GRAMMAR_REFUSED if req.grammar else ""

    def accepted(self, req: TokenizedRequest) -> None:
        """A prompt sent here directly (a raw sender): computed and decoded here."""

    def on_message(self, msg: object) -> None:
        if isinstance(msg, PrefilledRequest):
            self.waiting.append(msg)

    def after_step(self, out: StepOutput) -> None:
        """Nothing: a decode engine's requests stay until they finish."""

    def pump(self) -> PumpResult:
        """Takes the waiting requests in, in order, while the engine has room for them."""
        result = PumpResult()
        releases: dict[int, KVRelease] = {}
        while self.waiting:
            msg = self.waiting[0]
            outcome = self._take(msg, result)
            if outcome is None:
                break
            self.waiting.popleft()
            done = releases.setdefault(msg.prefill_index, KVRelease([], [], self.index))
            done.transfer_ids.append(msg.kv.transfer_id)
            done.imported.append(outcome)
        for prefill, message in releases.items():
            queue = self.to_prefill.get(prefill)
            if queue is None:
                continue
            try:
                queue.put(message, timeout_ms=1000)
            except zmq.Again:  # its transfers time out there instead
                logger.error("prefill engine %d is not reading; releases not sent", prefill)
        return result

    def _take(self, msg: PrefilledRequest, result: PumpResult) -> bool | None:
        """Whether the request's KV came in (None: no room yet)."""
        rid = msg.request_id
        t_start = time.monotonic()
        blocks: list[int] | None = None
        try:
            blocks = add_prefilled(
                self.engine,
                rid,
                unpack_id_list(msg.token_ids),
                msg.prompt_len,
                msg.sampling,
                msg.generator_state,
                msg.cache_salt,
            )
            if blocks is None:
                return None
            if not blocks:
                return False  # aborted on its way: the engine ends it
            imported = self.importer.import_blocks(msg.kv, self.keys, self.values, blocks)
        except (ValueError, KVNetError) as exc:  # a bad descriptor, or a pull that failed
            if blocks:
                release(self.engine, rid)
            pulled = isinstance(exc, KVNetError)
            why = f"unavailable: the KV transfer failed ({exc})" if pulled else str(exc)
            code = ERR_UNAVAILABLE if pulled else ERR_INTERNAL
            result.finished.append(FinishRecord(rid, FINISH_ERROR, why, code))
            self.refused += 1
            return False
        if not imported:  # given back by the prefill engine, which ended the request
            release(self.engine, rid)
            self.refused += 1
            logger.warning("the KV of %r was given back before it was read; dropped", rid)
            return False
        now = time.monotonic()
        self.imported += 1
        self.bytes += msg.kv.nbytes
        self.import_s += now - t_start
        result.joined.append(rid)
        result.arrivals.append(
            KVArrival(rid, msg.prefill_index, now - msg.t_export_start, msg.kv.nbytes)
        )
        return True

    @property
    def queued_requests(self) -> int:
        return len(self.waiting)

    def stats(self) -> dict[str, float]:
        return {
            "pd_decode": 1.0,
            "kv_imports": self.imported,
            "kv_imports_refused": self.refused,
            "kv_import_bytes": self.bytes,
            "kv_import_s": self.import_s,
            "kv_imports_waiting": len(self.waiting),
        }

    def close(self) -> None:
        for queue in self.to_prefill.values():
            queue.close()
        self.importer.close()
