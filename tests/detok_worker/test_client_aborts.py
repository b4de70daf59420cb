"""The detokenizer's bookkeeping of client aborts for requests it has not seen (no sockets)."""

from __future__ import annotations

from detok_worker.core import EVERY_REPLICA, DetokenizerCore


def test_aborts_for_unseen_requests_never_stop_reaching_the_engine():
    """Aborts for ids that never show up (ended before the abort, lost with a worker) pile up;
    past the cap the oldest are forgotten, and later aborts still go to the engine."""
    core = DetokenizerCore(tokenizer=None, max_pending_aborts=3)
    core.on_hello(b"c")
    core.on_client_abort(b"c", [f"gone-{i}" for i in range(5)])
    core.on_client_abort(b"c", ["queued-in-a-tokenizer"])
    assert ("queued-in-a-tokenizer", EVERY_REPLICA) in core.take_output().aborts
    pending = core.clients[b"c"].pending_aborts
    assert len(pending) == 3 and "queued-in-a-tokenizer" in pending
