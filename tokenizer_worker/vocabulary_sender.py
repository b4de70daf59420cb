"""Delivers the grammar vocabulary to the engine: once it has been read, and again each time the
connection to the engine is made anew (a restarted engine starts without one).

It goes on the same socket as the requests, so it reaches the engine ahead of every constrained
request sent after it. A request already queued when a restarted engine connects may still get
there first: the engine keeps such a request waiting until a vocabulary arrives.
"""

from __future__ import annotations

import logging

import zmq
from zmq.utils.monitor import recv_monitor_message

from ipc.sockets import PushQueue
from tokenizer_worker.structured import StructuredOutputs

logger = logging.getLogger("splitserve.tokenizer")


class VocabularySender:
    def __init__(self, to_engine: PushQueue, structured: StructuredOutputs) -> None:
        self.to_engine, self.structured = to_engine, structured
        self.monitor = to_engine.socket.get_monitor_socket(zmq.EVENT_CONNECTED)
        self.due = True  # not sent on the current connection yet
        self.sent = 0

    def poll(self) -> None:
        """Sends it if due and ready; never waits (the worker's loop calls this)."""
        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor, zmq.NOBLOCK)
            if isinstance(event, dict) and event.get("event") == zmq.EVENT_CONNECTED:
                self.due = True
        if self.due and self.structured.ready_vocabulary() is not None:
            self._send()

    def before_constrained_request(self) -> None:
        """Sends it now if it is due, waiting for it to be read if need be."""
        self.poll()
        if self.due:
            self._send()

    def _send(self) -> None:
        vocabulary = self.structured.vocabulary()
        self.to_engine.put(vocabulary)
        self.due = False
        self.sent += 1
        logger.info(
            "sent the grammar vocabulary (%d tokens, %s) to the engine",
            vocabulary.vocab_size,
            vocabulary.fingerprint[:12],
        )

    def close(self) -> None:
        self.to_engine.socket.disable_monitor()
        self.monitor.close(linger=0)
