"""What goes between an ingress replica and an engine replica through Serve.

A request travels as ``EngineCall``: the request itself is ipc's codec encoding of a
SubmitRequest carrying token ids (never text), checked against its schema on arrival; beside it,
the block ids the ingress hashed, which the request router reads in the ingress's process. An
engine replica answers with a stream of ipc ``ClientEvents`` frames, the events the cluster's
detokenizer sends any client, so the ingress feeds them to ordinary SDK handles.
"""

from __future__ import annotations

from dataclasses import dataclass

from ipc import codec
from ipc.client import Delta
from ipc.codec import pack_ids
from ipc.messages import ClientEvents, KVDescriptor, StreamEvent


@dataclass(frozen=True, slots=True)
class EngineCall:
    """``payload``: a codec-encoded SubmitRequest with prompt_token_ids. ``block_ids``: the
    external ids of its prompt's full blocks (ipc.block_hash), ``prompt_blocks`` how many full
    blocks it has. ``prompt``: its text, given only to Ray's PrefixCacheAffinityRouter, which
    matches character prefixes (the benchmark's comparison); None otherwise. ``kv``: where a
    prefill replica left the prompt's KV for a decode replica (docs/ray.md)."""

    payload: bytes
    block_ids: tuple[int, ...] = ()
    prompt_blocks: int = 0
    prompt: str | None = None
    kv: KVDescriptor | None = None  # prefill/decode: the prompt's KV, from a prefill replica


@dataclass(frozen=True, slots=True)
class PrefillResult:
    """A prefill replica's answer: where the prompt's KV waits (``blocks`` full blocks), or
    why it does not (``error``: the decode replica then computes the prompt itself)."""

    kv: KVDescriptor | None = None
    blocks: int = 0
    error: str = ""
    seconds: float = 0.0


def delta_event(delta: Delta, wire_id: str, replica_rank: int) -> StreamEvent:
    """The event a replica's client received, as the ingress's client is to receive it: under
    the ingress's wire id, and naming the replica (its Serve rank) as the one serving it."""
    return StreamEvent(
        request_id=wire_id,
        text=delta.text,
        token_ids=pack_ids(delta.token_ids) if delta.token_ids else b"",
        finished=delta.finished,
        finish_reason=delta.finish_reason,
        error=delta.error,
        error_code=delta.error_code,
        usage=delta.usage,
        timings=delta.timings,
        tool_calls=delta.tool_calls,
        logprobs=delta.logprobs,
        prompt_logprobs=delta.prompt_logprobs,
        echo_text=delta.echo_text,
        error_param=delta.error_param,
        engine_index=replica_rank if delta.engine_index >= 0 else -1,
    )


def encode_events(events: list[StreamEvent]) -> bytes:
    return codec.encode(ClientEvents(events))


def decode_events(frame: bytes) -> list[StreamEvent]:
    return codec.decode_as(frame, ClientEvents).events
