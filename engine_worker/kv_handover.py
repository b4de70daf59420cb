"""A prompt's KV handed between two clusters: the engines of serve-ray's prefill and decode
deployments (docs/ray.md, "Prefill/decode deployments").

Each such engine is an ordinary colocated engine (it computes and decodes whatever it is sent)
whose replica can also ask it, on its inbox:

* ``KVExportAsk`` (a prefill replica's engine, ``kv_handover="export"``): the cached full
  blocks of a prompt it has just computed are copied into its transfer buffer (the shm or net
  transport of engine_worker/kv_transports.py); the answer carries their descriptor. The run is
  held until the importer marks it taken (its stamp) or ``kv_transfer_timeout_s`` passes.
* ``KVImportAsk`` (a decode replica's engine, ``kv_handover="import"``): the described blocks
  are copied into fresh blocks of this engine and published in its prefix cache as the
  prompt's leading blocks, then released there (cached, unheld). The same prompt submitted next
  finds them as a prefix-cache hit, so this engine computes only the prompt's last block and
  samples the first token itself: its stream is the whole answer, with one terminal event.

Whatever fails (no cached blocks, no room, a run given back, a pull that failed) is answered
with an error and costs only time: the decode engine then computes the prompt itself.
"""

from __future__ import annotations

import logging
import time

import zmq

from engine_worker.engine import Engine
from engine_worker.handoff import PumpResult
from engine_worker.kv_net import KVNetError
from engine_worker.kv_transfer import KVGeometry, SharedMemoryExporter, SharedMemoryImporter
from engine_worker.kv_transports import NetImporter, make_exporter, make_importer
from engine_worker.prefix_cache import PrefixCache
from ipc.codec import unpack_id_list
from ipc.config import ClusterConfig
from ipc.messages import (
    ClusterNotice,
    KVExportAsk,
    KVHandoverReply,
    KVImportAsk,
    StepOutput,
    TokenizedRequest,
)
from ipc.sockets import PushQueue

logger = logging.getLogger("splitserve.engine")
REPLY_TIMEOUT_MS = 1000


class HandoverRole:
    role = ""  # serves as a colocated engine: no role label on its series

    def __init__(
        self, config: ClusterConfig, index: int, engine: Engine, ctx: zmq.Context, pid: int
    ) -> None:
        self.engine, self.ctx, self.curve = engine, ctx, config.curve
        cache = engine.runner.kv_cache
        self.keys, self.values = cache.keys, cache.values
        geometry = KVGeometry.of(cache.keys)
        self.block_size = geometry.block_size
        prompt_blocks = -(-engine.max_model_len // geometry.block_size)
        self.exporter: SharedMemoryExporter | None = None
        self.importer: SharedMemoryImporter | NetImporter | None = None
        if config.kv_handover == "export":
            tokens = max(config.kv_transfer_buffer_tokens, engine.max_model_len)
            blocks = -(-tokens // geometry.block_size)
            self.exporter = make_exporter(config, index, pid, geometry, blocks)
        else:
            self.importer = make_importer(config, geometry, prompt_blocks)
        self.timeout_s = config.kv_transfer_timeout_s
        self.replies: dict[str, PushQueue] = {}
        self.exported_at: dict[int, float] = {}
        self.next_transfer = (pid << 32) + 1  # unique across restarts: a stamp never repeats
        self.exports = self.imports = self.imported_blocks = self.failed = self.aborted = 0
        self.queued_requests = 0

    # --- what any role does; this one serves as a colocated engine -----------------------
    def refuse(self, req: TokenizedRequest) -> str:
        return ""

    def accepted(self, req: TokenizedRequest) -> None:
        """Computed and decoded here."""

    def after_step(self, out: StepOutput) -> None:
        """Nothing leaves after a step."""

    def on_message(self, msg: object) -> None:
        if isinstance(msg, KVExportAsk):
            reply = self._export(msg)
        elif isinstance(msg, KVImportAsk):
            reply = self._import(msg)
        else:
            if not isinstance(msg, ClusterNotice):
                logger.error("a %s reached a Ray Serve hand-over engine; dropped", type(msg))
            return
        if reply.error:
            self.failed += 1
            logger.info("KV hand-over %s: %s", msg.ask_id, reply.error)
        queue = self.replies.get(msg.reply_to)
        if queue is None:
            queue = self.replies[msg.reply_to] = PushQueue(self.ctx, msg.reply_to, curve=self.curve)
        try:
            queue.put(reply, timeout_ms=REPLY_TIMEOUT_MS)
        except zmq.Again:
            logger.error("the replica at %s is not reading; reply %s dropped", msg.reply_to, reply)

    def pump(self) -> PumpResult:
        """Frees the runs their importers took, and those past the bound."""
        if self.exporter is not None:
            for transfer_id in self.exporter.reclaim_taken():
                self.exported_at.pop(transfer_id, None)
            now = time.monotonic()
            for transfer_id, t_export in list(self.exported_at.items()):
                if now - t_export > self.timeout_s:
                    self.exporter.release(transfer_id)
                    del self.exported_at[transfer_id]
                    self.aborted += 1
                    logger.warning(
                        "KV export %d not taken in %g s; freed", transfer_id, self.timeout_s
                    )
        return PumpResult()

    # --- the asks ----------------------------------------------------------------------------
    def _prefix_cache(self) -> PrefixCache:
        cache = self.engine.prefix_cache
        if cache is None:
            raise ValueError("the prefix cache is off (--no-prefix-cache): no KV to hand over")
        return cache

    def _export(self, ask: KVExportAsk) -> KVHandoverReply:
        t_start = time.monotonic()
        if self.exporter is None:
            return KVHandoverReply(ask.ask_id, error="this engine imports KV, it does not export")
        ids = unpack_id_list(ask.token_ids)
        try:
            cache = self._prefix_cache()
            blocks, _, _ = cache.match(ids, (len(ids) - 1) // self.block_size, ask.cache_salt)
            if not blocks:
                return KVHandoverReply(ask.ask_id, error="no full block of the prompt is cached")
            transfer_id = self.next_transfer
            kv = self.exporter.export(transfer_id, self.keys, self.values, blocks)
        except ValueError as exc:
            return KVHandoverReply(ask.ask_id, error=str(exc))
        if kv is None:
            return KVHandoverReply(ask.ask_id, error="the KV transfer buffer is full")
        self.next_transfer += 1
        self.exported_at[transfer_id] = t_start
        self.exports += 1
        seconds = time.monotonic() - t_start
        return KVHandoverReply(ask.ask_id, blocks=len(blocks), kv=kv, seconds=seconds)

    def _import(self, ask: KVImportAsk) -> KVHandoverReply:
        t_start = time.monotonic()
        if self.importer is None:
            return KVHandoverReply(ask.ask_id, error="this engine exports KV, it does not import")
        ids, count, salt = unpack_id_list(ask.token_ids), ask.kv.num_blocks, ask.cache_salt
        blocks = self.engine.blocks
        try:
            cache = self._prefix_cache()
            if count > (len(ids) - 1) // self.block_size:
                raise ValueError(f"{count} KV blocks for a prompt of {len(ids)} tokens")
            if len(cache.match(ids, count, salt)[0]) == count:  # nothing to import
                self.importer.mark_taken(ask.kv)
                return KVHandoverReply(ask.ask_id, seconds=time.monotonic() - t_start)
            if not blocks.can_allocate(count):
                self.importer.mark_taken(ask.kv)
                return KVHandoverReply(ask.ask_id, error="no free KV blocks to import into")
            fresh = blocks.allocate(count)
            try:
                taken = self.importer.import_blocks(ask.kv, self.keys, self.values, fresh)
                if taken:
                    self._publish(cache, ids, fresh, salt)
            finally:
                blocks.release(fresh)  # the published ones stay cached, unheld
        except (ValueError, KVNetError) as exc:
            return KVHandoverReply(ask.ask_id, error=str(exc))
        if not taken:
            return KVHandoverReply(ask.ask_id, error="the KV was given back or not pulled")
        self.importer.mark_taken(ask.kv)
        self.imports += 1
        self.imported_blocks += count
        return KVHandoverReply(ask.ask_id, blocks=count, seconds=time.monotonic() - t_start)

    def _publish(
        self, cache: PrefixCache, ids: list[int], fresh: list[int], salt: str | None
    ) -> None:
        """``fresh`` in the prefix cache as the prompt's leading full blocks, in order."""
        size = self.block_size
        parent_key: int | None = None
        parent_node = 0  # the root: the empty prefix
        for i, block in enumerate(fresh):
            tokens = tuple(ids[i * size : (i + 1) * size])
            parent_key, parent_node = cache.publish(block, tokens, parent_key, parent_node, salt)

    def stats(self) -> dict[str, float]:
        held = self.exporter.held_blocks if self.exporter is not None else 0
        return {
            "kv_handover_exports": self.exports,
            "kv_handover_imports": self.imports,
            "kv_handover_imported_blocks": self.imported_blocks,
            "kv_handover_failed": self.failed,
            "kv_transfers_aborted": self.aborted,
            "kv_transfer_blocks_held": held,
        }

    def close(self) -> None:
        for queue in self.replies.values():
            queue.close()
        if self.exporter is not None:
            self.exporter.close()
        if self.importer is not None:
            self.importer.close()
