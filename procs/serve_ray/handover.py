"""A prefill or decode replica's line to its own cluster's engine (engine_worker/kv_handover.py):
asks go on the engine's inbox, answers come back on a socket of the replica's own in the
cluster's run dir, both under the cluster's CURVE keys when it has them. Ray-free, so it is
tested without a Ray cluster (tests/test_kv_handover.py).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import zmq

from ipc.config import ClusterConfig
from ipc.messages import KVDescriptor, KVExportAsk, KVHandoverReply, KVImportAsk
from ipc.sockets import PullQueue, PushQueue


class HandoverChannel:
    """``ask`` blocks (call it from a thread); one ask at a time, answers matched by id."""

    def __init__(self, config: ClusterConfig, index: int = 0) -> None:
        self.ctx = zmq.Context()
        self.reply_to = f"ipc://{Path(config.run_dir) / 'kv-handover-replies'}"
        self.replies: PullQueue[KVHandoverReply] = PullQueue(
            self.ctx, self.reply_to, KVHandoverReply, curve=config.curve
        )
        self.engine = PushQueue(self.ctx, config.engine_addr(index), curve=config.curve)
        self.lock = threading.Lock()

    def export(
        self, ask_id: str, token_ids: bytes, salt: str | None, timeout_s: float
    ) -> KVHandoverReply:
        return self.ask(KVExportAsk(ask_id, token_ids, self.reply_to, salt), timeout_s)

    def import_(
        self, ask_id: str, token_ids: bytes, kv: KVDescriptor, salt: str | None, timeout_s: float
    ) -> KVHandoverReply:
        return self.ask(KVImportAsk(ask_id, token_ids, kv, self.reply_to, salt), timeout_s)

    def ask(self, msg: KVExportAsk | KVImportAsk, timeout_s: float) -> KVHandoverReply:
        deadline = time.monotonic() + timeout_s
        with self.lock:
            try:
                self.engine.put(msg, timeout_ms=int(timeout_s * 1000))
            except zmq.Again:
                return KVHandoverReply(msg.ask_id, error="the engine is not reading its inbox")
            while (left := deadline - time.monotonic()) > 0:
                if not self.replies.wait(int(left * 1000) + 1):
                    continue
                reply = self.replies.get()
                if reply.ask_id == msg.ask_id:  # else: a late answer to an ask given up on
                    return reply
        return KVHandoverReply(msg.ask_id, error=f"no answer from the engine in {timeout_s:g} s")

    def close(self) -> None:
        with self.lock:
            self.replies.close()
            self.engine.close()
            self.ctx.term()
