"""What the tokenizer workers route by, besides the KV events (ipc.kv_events): each engine
replica's load, published after each of its steps on its event stream under the topic ``b"load"``
(sequence numbers of its own, so the KV topic's stay gap-free)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ipc.codec import message

LOAD_TOPIC = b"load"


@message
@dataclass(slots=True)
class ReplicaLoad:
    """One replica's gauges after a step. ``received_from[i]``: requests it has received from
    tokenizer worker i since it started, so worker i's requests still on their way to it are
    exactly what it sent minus that (no guessing at what finished). ``pid`` tells a restarted
    replica (its counts start again from 0) from the one before."""

    KIND = "replica_load"
    index: int
    pid: int
    running: int
    waiting: int
    kv_usage: float = 0.0  # share of KV blocks held by requests (0 to 1)
    received_from: list[int] = field(default_factory=list)
    kv_blocks_available: int = 0  # free or only caching a prefix (decode engines route by it)
