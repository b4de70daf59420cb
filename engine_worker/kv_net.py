"""The cross-host KV transport: moves a request's KV bytes from one engine's memory into
another's, on another host, through Mooncake's transfer engine (its TCP protocol, with the
peer-to-peer handshake, so no metadata server), the transfer library SGLang and vLLM use for
the same job. Why this library, and what it does not protect: docs/kv_transport.md.

Each engine opens one ``KVNetEndpoint`` and registers its KV memory with it once (the whole
cache tensors and a staging buffer, not per request). For each request the owner of the bytes
gathers its blocks into the staging buffer (``gather_blocks``: one piece moves 25x faster over
Mooncake's TCP than the same bytes block by block) and describes them as a ``KVNetRegion``
(ipc/messages/kv_net.py: its transfer engine's ``host:port`` and the pieces, ``(address,
length)`` each), which travels to the other engine over our ZeroMQ control messages; that engine
then ``pull``s the region into its own staging buffer, ``scatter_blocks`` it into the blocks it
allocated, and answers ``KVNetDone``. (Or the other way round: ``push`` into a region the
receiver described.) The two sides may cut the same bytes into different pieces; the run of
bytes is what they share.

Mooncake is an optional extra (``pip install 'splitserve[kvnet]'``); without it, opening an
endpoint raises ``KVNetUnavailable`` saying so.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from ipc.messages.kv_net import KVNetRegion

BACKEND = "mooncake-tcp"
INSTALL_HINT = (
    "the cross-host KV transport needs Mooncake's transfer engine: "
    "pip install 'splitserve[kvnet]' (mooncake-transfer-engine-non-cuda), and the RDMA verbs "
    "library it links even for TCP (Debian/Ubuntu: apt install libibverbs1)"
)
# Mooncake waits at most this long for one transfer (MC_TRANSFER_TIMEOUT, read when an engine
# is made; it will not go below 5 s).
MIN_TIMEOUT_S = 5
# Its TCP transport queues a bounded number of slices per connection and fails a batch that
# overflows them (4,096 pieces of a 2,048-token KV did; 1,024 never did): larger transfers go
# as several batches, one after another.
MAX_BATCH_PIECES = 1024

Pieces = Sequence[tuple[int, int]]


class KVNetUnavailable(RuntimeError):
    """The kvnet extra is not installed (or its library cannot load here)."""


class KVNetError(RuntimeError):
    """A transfer failed: the peer is gone, refused it, or it did not end within the bound."""


def transfer_engine_class() -> Any:
    """Mooncake's ``TransferEngine``, or ``KVNetUnavailable`` naming the extra to install."""
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:
        raise KVNetUnavailable(f"{INSTALL_HINT} ({exc})") from None
    return TransferEngine


def merge_pieces(pieces: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """The same run of bytes in fewer pieces: each piece that starts where the one before it
    ends joins it (a request's blocks that lie next to each other in the cache move as one)."""
    merged: list[tuple[int, int]] = []
    for address, length in pieces:
        if length <= 0:
            raise ValueError(f"a piece of {length} bytes")
        if merged and merged[-1][0] + merged[-1][1] == address:
            merged[-1] = (merged[-1][0], merged[-1][1] + length)
        else:
            merged.append((address, length))
    return merged


def pair_pieces(local: Pieces, remote: Pieces) -> tuple[list[int], list[int], list[int]]:
    """The transfers that move the run of bytes ``remote`` into ``local`` (or back): local
    addresses, remote addresses and lengths, cut wherever either side's pieces are cut."""
    total_local, total_remote = sum(n for _, n in local), sum(n for _, n in remote)
    if total_local != total_remote:
        raise ValueError(f"{total_local} bytes here for {total_remote} bytes there")
    locals_, remotes, lengths = [], [], []
    i = j = 0
    used_local = used_remote = 0  # bytes already taken from local[i] and remote[j]
    while i < len(local) and j < len(remote):
        (la, ln), (ra, rn) = local[i], remote[j]
        n = min(ln - used_local, rn - used_remote)
        locals_.append(la + used_local)
        remotes.append(ra + used_remote)
        lengths.append(n)
        used_local += n
        used_remote += n
        if used_local == ln:
            i, used_local = i + 1, 0
        if used_remote == rn:
            j, used_remote = j + 1, 0
    return locals_, remotes, lengths


def block_pieces(caches: Sequence[Any], block_ids: Sequence[int]) -> list[tuple[int, int]]:
    """The pieces holding ``block_ids`` of contiguous cache tensors laid out as the engine's
    (``[layers, kv_heads, blocks, block_size, head_dim]``, keys then values): for each tensor,
    layer and head, the blocks in the request's order. Both sides list their own blocks the same
    way, so the same bytes meet whatever block ids each side holds them in."""
    pieces: list[tuple[int, int]] = []
    for cache in caches:
        if not cache.is_contiguous() or cache.dim() < 3:
            raise ValueError("a KV cache tensor must be contiguous with blocks in dimension 2")
        layers, heads, blocks = cache.shape[:3]
        if any(not 0 <= b < blocks for b in block_ids):
            raise ValueError(f"a block id outside the cache's {blocks} blocks")
        block_bytes = cache[0, 0, 0].numel() * cache.element_size()
        base = int(cache.data_ptr())
        for row in range(layers * heads):
            row_base = base + row * blocks * block_bytes
            pieces.extend((row_base + b * block_bytes, block_bytes) for b in block_ids)
    return merge_pieces(pieces)


def _block_rows(cache: Any) -> Any:
    """A cache tensor as ``[layers * kv_heads, blocks, words]``, in the widest integer words
    that tile a block: index copies of 8-byte words run at memcpy's speed, of single bytes at a
    quarter of it."""
    if not cache.is_contiguous() or cache.dim() < 3:
        raise ValueError("a KV cache tensor must be contiguous with blocks in dimension 2")
    layers, heads, blocks = cache.shape[:3]
    rows = cache.view(torch.uint8).view(layers * heads, blocks, -1)
    for word in (torch.int64, torch.int32, torch.int16):
        if rows.shape[2] % word.itemsize == 0:
            return rows.view(word)
    return rows


def staged_bytes(caches: Sequence[Any], block_count: int) -> int:
    """The size of ``block_count`` blocks of every cache tensor: what a staging buffer holds."""
    return sum(c[:, :, :1].numel() * c.element_size() for c in caches) * block_count


def _staged_rows(staging: Any, at: int, rows: Any, block_count: int) -> tuple[Any, int]:
    """The part of the uint8 ``staging`` from byte ``at`` that holds ``block_count`` blocks of
    ``rows`` (in its words), and the byte where the next tensor's part starts."""
    n = rows.shape[0] * block_count * rows.shape[2] * rows.element_size()
    part = staging[at : at + n].view(rows.dtype).view(rows.shape[0], block_count, -1)
    return part, at + n


def gather_blocks(caches: Sequence[Any], block_ids: Sequence[int], staging: Any) -> int:
    """Copies ``block_ids`` of every cache tensor into the uint8 tensor ``staging``, in
    ``block_pieces``' order, so that one contiguous transfer moves them (Mooncake's TCP path
    moves one large piece far faster than thousands of blocks); the bytes written."""
    index = torch.as_tensor(block_ids, dtype=torch.long)
    at = 0
    for cache in caches:
        rows = _block_rows(cache)
        part, at = _staged_rows(staging, at, rows, len(block_ids))
        torch.index_select(rows, 1, index, out=part)
    return at


def scatter_blocks(staging: Any, caches: Sequence[Any], block_ids: Sequence[int]) -> None:
    """The other end of ``gather_blocks``: the staged bytes into ``block_ids`` of the caches."""
    index = torch.as_tensor(block_ids, dtype=torch.long)
    at = 0
    for cache in caches:
        rows = _block_rows(cache)
        part, at = _staged_rows(staging, at, rows, len(block_ids))
        rows.index_copy_(1, index, part)


def buffer_piece(buffer: Any) -> tuple[int, int]:
    """``(address, length)`` of a contiguous torch tensor or numpy array."""
    if hasattr(buffer, "data_ptr"):
        if not buffer.is_contiguous():
            raise ValueError("a tensor's bytes are one piece only when it is contiguous")
        return int(buffer.data_ptr()), int(buffer.numel() * buffer.element_size())
    if not buffer.flags["C_CONTIGUOUS"]:
        raise ValueError("an array's bytes are one piece only when it is C-contiguous")
    return int(buffer.ctypes.data), int(buffer.nbytes)


class KVNetEndpoint:
    """One process's transfer engine: the memory it registered, reachable by peers at
    ``session`` (``host:port``), and the transfers it starts."""

    def __init__(self, host: str, *, trusted_network: bool = False, timeout_s: float = 30.0):
        if not trusted_network:
            raise ValueError(
                "Mooncake's TCP transport listens on every interface and lets any peer that "
                "reaches it read and write the registered memory (the KV cache) without "
                "authentication: pass trusted_network=True only where the hosts' network is "
                "private to the engines (docs/kv_transport.md)"
            )
        engine_class = transfer_engine_class()
        # Read once, when the engine is made: the bound on any one transfer.
        os.environ["MC_TRANSFER_TIMEOUT"] = str(max(MIN_TIMEOUT_S, int(timeout_s + 0.999)))
        self.engine = engine_class()
        if self.engine.initialize(host, "P2PHANDSHAKE", "tcp", "") != 0:
            raise KVNetError(f"Mooncake's transfer engine did not start on {host} (see its log)")
        self.host = host
        self.timeout_s = timeout_s
        self.session = f"{host}:{self.engine.get_rpc_port()}"
        self.registered: dict[int, int] = {}  # address -> length
        self.in_doubt: list[tuple[threading.Thread, Pieces]] = []

    def register(self, address: int, length: int) -> None:
        """Makes ``length`` bytes at ``address`` reachable by peers (once per buffer: the
        whole KV cache, not each request's blocks)."""
        if self.engine.register_memory(address, length) != 0:
            raise KVNetError(f"registering {length} bytes at {address:#x} failed")
        self.registered[address] = length

    def unregister(self, address: int) -> None:
        if self.registered.pop(address, None) is not None:
            self.engine.unregister_memory(address)

    def _check_registered(self, pieces: Pieces) -> None:
        for address, length in pieces:
            if not any(
                a <= address and address + length <= a + n for a, n in self.registered.items()
            ):
                raise ValueError(
                    f"{length} bytes at {address:#x} lie outside the memory this endpoint "
                    "registered"
                )

    def region(self, transfer_id: str, pieces: Pieces) -> KVNetRegion:
        """The descriptor a peer needs to pull these bytes (or push into them)."""
        merged = merge_pieces(pieces)
        self._check_registered(merged)
        return KVNetRegion(
            transfer_id=transfer_id,
            backend=BACKEND,
            session=self.session,
            addresses=[a for a, _ in merged],
            lengths=[n for _, n in merged],
        )

    def pull(self, region: KVNetRegion, into: Pieces) -> float:
        """Reads the peer's ``region`` into ``into`` (registered here); the seconds it took."""
        return self._move(region, into, read=True)

    def push(self, pieces: Pieces, region: KVNetRegion) -> float:
        """Writes ``pieces`` (registered here) into the peer's ``region``; the seconds."""
        return self._move(region, pieces, read=False)

    def _move(self, region: KVNetRegion, local: Pieces, *, read: bool) -> float:
        if region.backend != BACKEND:
            raise KVNetError(f"a region of the {region.backend!r} transport, not {BACKEND!r}")
        local = merge_pieces(local)
        self._check_registered(local)
        self._check_not_in_doubt(local)
        locals_, remotes, lengths = pair_pieces(local, region.pieces)
        move = (
            self.engine.batch_transfer_sync_read if read else self.engine.batch_transfer_sync_write
        )
        outcome: list[int] = []

        def transfer() -> None:
            status = 0
            for at in range(0, len(lengths), MAX_BATCH_PIECES):
                batch = slice(at, at + MAX_BATCH_PIECES)
                status = move(region.session, locals_[batch], remotes[batch], lengths[batch])
                if status != 0:
                    break
            outcome.append(status)

        # Mooncake bounds a transfer's data (MC_TRANSFER_TIMEOUT) but not its handshake: a peer
        # that is alive to the kernel and answers nothing (stopped, swapping) holds a call for
        # ever. The call runs on a thread of its own (Mooncake lets go of the GIL) and is given
        # up at the bound; its local pieces stay in doubt until it ends (see below).
        worker = threading.Thread(target=transfer, name="kv-net-transfer", daemon=True)
        t0 = time.monotonic()
        worker.start()
        worker.join(self.timeout_s)
        seconds = time.monotonic() - t0
        verb = "pulling from" if read else "pushing to"
        what = f"{region.nbytes} bytes, transfer {region.transfer_id!r}"
        if worker.is_alive():
            self.in_doubt.append((worker, local))
            raise KVNetError(
                f"{verb} {region.session} did not end within {self.timeout_s:g} s ({what})"
            )
        if outcome != [0]:
            raise KVNetError(
                f"{verb} {region.session} failed after {seconds:.2f} s ({what}, status {outcome})"
            )
        return seconds

    def _check_not_in_doubt(self, pieces: Pieces) -> None:
        """A transfer given up at the bound may still read or write its local pieces when its
        peer wakes: until it has ended, no other transfer may use them."""
        self.in_doubt = [(w, p) for w, p in self.in_doubt if w.is_alive()]
        for _, held in self.in_doubt:
            for a, n in pieces:
                if any(a < b + m and b < a + n for b, m in held):
                    raise KVNetError(
                        f"{n} bytes at {a:#x} belong to a transfer that timed out and has not "
                        "ended yet: use other memory, or wait"
                    )

    def close(self) -> None:
        for address in list(self.registered):
            self.unregister(address)
        self.engine = None
