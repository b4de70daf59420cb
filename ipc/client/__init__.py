"""The client SDK: how programs use a splitserve cluster.

    from ipc.client import Client
    with Client(cluster.client_addr) as client:
        handle = client.submit(messages=[{"role": "user", "content": "Hi"}], max_tokens=32)
        for delta in handle.stream():
            print(delta.text, end="", flush=True)
        print(handle.result().finish_reason)

``submit`` encodes the request and hands it to ZeroMQ without waiting: no round trip, no
tokenization. ``tokenize``, ``detokenize``, ``tokenizer_info`` and ``engine_stats`` ask the
cluster one question each and wait for its answer. ``AsyncClient`` is the same API for asyncio.
Modules, by job: ``errors`` and ``results`` (what callers see), ``requests`` (building a
submit), ``queries`` (the one-answer queries); the I/O-free bookkeeping both clients share:
``records``, ``outbox`` (sending, resending), ``core`` (events, faults, deadlines, closing: the
frames to send), ``notices`` and ``deadlines``; ``transport`` (sockets), ``base`` (what both
clients share), ``sync_client`` and ``async_client`` (their sockets and their way of waiting).
"""

from ipc.client.async_client import AsyncClient, AsyncRequestHandle
from ipc.client.errors import (
    ERR_TIMEOUT,
    BadRequestError,
    OverloadedError,
    RequestTimeoutError,
    SplitserveError,
    UnavailableError,
)
from ipc.client.queries import Tokenized
from ipc.client.results import Delta, GenerationResult
from ipc.client.sync_client import Client, RequestHandle

__all__ = [
    "Client",
    "AsyncClient",
    "RequestHandle",
    "AsyncRequestHandle",
    "GenerationResult",
    "Delta",
    "SplitserveError",
    "BadRequestError",
    "OverloadedError",
    "UnavailableError",
    "RequestTimeoutError",
    "ERR_TIMEOUT",
    "Tokenized",
]
