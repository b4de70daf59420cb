"""KV-cache events on the wire, in vLLM's format, so that consumers built for vLLM (llm-d,
NVIDIA Dynamo, Ray's KV-aware router) read our engines unchanged, and our tokenizer workers
read them the same way.

A publisher's PUB socket sends one three-frame message per engine step that changed the cache:

    topic (bytes, default b"") | seq (8 bytes, big-endian, from 0, +1 per batch) | payload

The payload is a msgpack array ``[ts, events, data_parallel_rank]`` (``ts``: the publisher's
``time.time()``), each event a map with a ``"type"`` key (vLLM's events since it moved them from
tagged arrays to tagged maps; the batch itself is still an array):

    {"type": "BlockStored", "block_hashes": [int...], "parent_block_hash": int | None,
     "token_ids": [int...], "block_size": int, "lora_id": None, "medium": "GPU" | "CPU",
     "lora_name": None}
    {"type": "BlockRemoved", "block_hashes": [int...], "medium": "GPU" | "CPU"}
    {"type": "AllBlocksCleared"}

Block hashes are the external ids of ``ipc.block_hash``. A BlockStored names consecutive blocks
of one chain: ``parent_block_hash`` is the block before the first (None: the prompt's start) and
``token_ids`` the blocks' tokens, concatenated. ``medium`` says where the KV lives: "GPU" for an
engine on CUDA, "CPU" for one on the CPU.

Replay: a ROUTER socket answers a DEALER's ``[b"", start_seq (8 bytes BE)]`` with every batch it
still buffers whose seq >= start_seq, each as ``[b"", seq, payload]``, then the end marker
``[b"", (-1).to_bytes(8, "big", signed=True), b""]``.

The publisher lives in ``runtime.kv_publisher``, the subscriber that follows one in
``runtime.kv_subscriber``.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import msgpack

from ipc.codec import DecodeError, unpack_frame

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
SEQ_BYTES = 8
END_OF_REPLAY = (-1).to_bytes(SEQ_BYTES, "big", signed=True)
MAX_BLOCK_HASH = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    medium: str = MEDIUM_CPU


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: list[int]
    medium: str = MEDIUM_CPU


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(slots=True)
class EventBatch:
    events: list[KVCacheEvent]
    ts: float = field(default_factory=time.time)
    data_parallel_rank: int = 0


# --- codec ----------------------------------------------------------------------------------


def _event_to_wire(event: KVCacheEvent) -> dict[str, Any]:
    if isinstance(event, BlockStored):
        return {
            "type": "BlockStored",
            "block_hashes": event.block_hashes,
            "parent_block_hash": event.parent_block_hash,
            "token_ids": event.token_ids,
            "block_size": event.block_size,
            "lora_id": None,
            "medium": event.medium,
            "lora_name": None,
        }
    if isinstance(event, BlockRemoved):
        return {"type": "BlockRemoved", "block_hashes": event.block_hashes, "medium": event.medium}
    return {"type": "AllBlocksCleared"}


def encode_batch(batch: EventBatch) -> bytes:
    events = [_event_to_wire(e) for e in batch.events]
    return msgpack.packb([batch.ts, events, batch.data_parallel_rank], use_bin_type=True)


def decode_batch(payload: bytes) -> EventBatch:
    """Strict about what it uses (types, bounds), lenient about what it does not: keys a newer
    publisher adds to an event (vLLM's extra_keys, group_idx, ...) are ignored. Raises
    DecodeError saying what is wrong."""
    obj = unpack_frame(payload)
    if not isinstance(obj, list) or len(obj) not in (2, 3):
        raise DecodeError("an event batch is an array [ts, events, data_parallel_rank]")
    ts, events = obj[0], obj[1]
    rank = obj[2] if len(obj) == 3 else None
    if not isinstance(ts, (int, float)) or isinstance(ts, bool):
        raise DecodeError(f"batch ts must be a number, got {ts!r:.40}")
    if not isinstance(events, list):
        raise DecodeError("batch events must be an array")
    if rank is not None and not _is_int(rank):
        raise DecodeError(f"data_parallel_rank must be an integer, got {rank!r:.40}")
    decoded = [_event_from_wire(e, f"events[{i}]") for i, e in enumerate(events)]
    return EventBatch(decoded, float(ts), rank or 0)


def _event_from_wire(obj: Any, where: str) -> KVCacheEvent:
    if not isinstance(obj, dict):
        raise DecodeError(f"{where}: an event is a map with a 'type' key")
    kind = obj.get("type")
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    medium = obj.get("medium", MEDIUM_CPU)
    if not isinstance(medium, str):
        raise DecodeError(f"{where}.medium must be a string")
    hashes = _hash_list(obj.get("block_hashes"), f"{where}.block_hashes")
    if kind == "BlockRemoved":
        return BlockRemoved(hashes, medium)
    if kind != "BlockStored":
        raise DecodeError(f"{where}: unknown event type {kind!r:.40}")
    parent = obj.get("parent_block_hash")
    if parent is not None and not _is_block_hash(parent):
        raise DecodeError(f"{where}.parent_block_hash must be a 64-bit unsigned integer")
    token_ids, size = obj.get("token_ids"), obj.get("block_size")
    if not isinstance(token_ids, list) or not all(_is_int(t) for t in token_ids):
        raise DecodeError(f"{where}.token_ids must be an array of integers")
    if (
        not isinstance(size, int)
        or isinstance(size, bool)
        or size < 1
        or len(token_ids) != size * len(hashes)
    ):
        raise DecodeError(f"{where}: block_size times the blocks must equal the token ids")
    return BlockStored(hashes, parent, token_ids, size, medium)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_block_hash(value: Any) -> bool:
    return _is_int(value) and 0 <= value <= MAX_BLOCK_HASH


def _hash_list(value: Any, where: str) -> list[int]:
    if not isinstance(value, list) or not all(_is_block_hash(h) for h in value):
        raise DecodeError(f"{where} must be an array of 64-bit unsigned integers")
    return value


def encode_seq(seq: int) -> bytes:
    return seq.to_bytes(SEQ_BYTES, "big", signed=True)


def decode_seq(frame: bytes) -> int:
    if len(frame) != SEQ_BYTES:
        raise DecodeError(f"a sequence number is {SEQ_BYTES} bytes, got {len(frame)}")
    return int.from_bytes(frame, "big", signed=True)


# --- configuration (--kv-events-config) -------------------------------------------------------

PUBLISHERS = ("null", "zmq")
WILDCARD_HOSTS = {"*": "127.0.0.1", "0.0.0.0": "127.0.0.1", "[::]": "[::1]", "::": "[::1]"}
LOOPBACK_TCP_HOSTS = ("127.0.0.1", "localhost", "[::1]")


@dataclass(frozen=True, slots=True)
class KVEventsConfig:
    """vLLM's ``--kv-events-config`` keys, with its defaults. Events are published when
    ``enable_kv_cache_events`` is true and the publisher is "zmq" (the default then)."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        checks: dict[str, tuple[type, ...]] = {
            "enable_kv_cache_events": (bool,),
            "publisher": (str, type(None)),
            "endpoint": (str,),
            "replay_endpoint": (str, type(None)),
            "topic": (str,),
        }
        for name, kinds in checks.items():
            if not isinstance(getattr(self, name), kinds):
                raise ValueError(f"kv_events_config.{name} has the wrong type")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            if not _is_int(value) or value < (0 if name == "hwm" else 1):
                raise ValueError(f"kv_events_config.{name} must be a positive integer")
        if self.publisher is not None and self.publisher not in PUBLISHERS:
            raise ValueError(f"kv_events_config.publisher must be one of {PUBLISHERS}")
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is not None and not value.startswith(("tcp://", "ipc://", "inproc://")):
                raise ValueError(
                    f"kv_events_config.{name} must be a tcp://, ipc:// or inproc:// URL"
                )

    @property
    def publishes(self) -> bool:
        return self.enable_kv_cache_events and (self.publisher or "zmq") == "zmq"


def parse_kv_events_config(text: str) -> KVEventsConfig | None:
    """The knob's JSON text ("" = off); ValueError naming the key on anything wrong."""
    if not text:
        return None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"kv_events_config is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError("kv_events_config must be a JSON object")
    unknown = set(data) - set(KVEventsConfig.__dataclass_fields__)
    if unknown:
        raise ValueError(f"kv_events_config: unknown keys {sorted(unknown)}")
    return KVEventsConfig(**data)


@dataclass(frozen=True, slots=True)
class EndpointPlan:
    address: str
    bind: bool  # vLLM's rule: bind a wildcard, an IPv6 "::" form or ipc://; else connect
    narrowed_from: str = ""  # a wildcard bind kept on loopback (no CURVE): what was asked


def plan_endpoint(
    endpoint: str, replica: int, *, curve: bool, replay: bool = False
) -> EndpointPlan:
    """Where replica ``replica`` publishes (``replay``: answers replays): the port + replica for
    tcp (an ipc:// or inproc:// path gets a ``_dp{replica}`` suffix), bound or connected by
    vLLM's rule (a replay socket is always bound). Listening beyond loopback needs the cluster's
    CURVE keys (property 7): without them a wildcard bind is kept on loopback and a bind on
    another address is refused."""
    address = _offset(endpoint, replica)
    bind = (
        replay or "*" in address or "::" in address or address.startswith(("ipc://", "inproc://"))
    )
    if not bind or not address.startswith("tcp://") or curve:
        return EndpointPlan(address, bind)
    host, _, port = address[len("tcp://") :].rpartition(":")
    if host in LOOPBACK_TCP_HOSTS:
        return EndpointPlan(address, bind)
    if host in WILDCARD_HOSTS:
        return EndpointPlan(f"tcp://{WILDCARD_HOSTS[host]}:{port}", bind, narrowed_from=address)
    raise ValueError(
        f"kv_events_config: binding {address} listens beyond loopback, which needs CURVE "
        "(--listen or --require-curve)"
    )


def _offset(endpoint: str, replica: int) -> str:
    if replica == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        if not port.isdigit() or not 0 < int(port) + replica < 65536:
            raise ValueError(f"kv_events_config: {endpoint} needs a port below 65536 - replicas")
        return f"{base}:{int(port) + replica}"
    return f"{endpoint}_dp{replica}"
