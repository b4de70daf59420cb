"""The detokenizer's bookkeeping of client aborts for requests it has not seen (no sockets)."""

from __future__ import annotations

from detok_worker import worker
from detok_worker.worker import ClientInfo, Detokenizer


def bare_detokenizer() -> Detokenizer:
    detok = object.__new__(Detokenizer)
    detok.clients = {b"c": ClientInfo()}
    detok.aborts = []
    return detok


def test_aborts_for_unseen_requests_never_stop_reaching_the_engine(monkeypatch):
    """Aborts for ids that never show up (ended before the abort, lost with a worker) pile up;
    past the cap the oldest are forgotten, and later aborts still go to the engine."""
    monkeypatch.setattr(worker, "MAX_PENDING_ABORTS", 3)
    detok = bare_detokenizer()
    detok.client_abort(b"c", [f"gone-{i}" for i in range(5)])
    detok.client_abort(b"c", ["queued-in-a-tokenizer"])
    assert "queued-in-a-tokenizer" in detok.aborts
    pending = detok.clients[b"c"].pending_aborts
    assert len(pending) == 3 and "queued-in-a-tokenizer" in pending
