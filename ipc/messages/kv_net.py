"""The cross-host KV transport's descriptors (engine_worker/kv_net.py moves the bytes): what one
engine tells another, over a ZeroMQ control channel, so that the other can pull bytes out of its
memory (or push bytes into it) through a transfer engine, and the answer once that is done.

A region is a list of pieces, ``(address, length)`` each, in the memory its owner registered
with its transfer engine, read or written in list order as one run of bytes; ``session`` names
that transfer engine (``host:port``). The addresses are the owner's own virtual addresses: they
mean something only to the owner's transfer engine, which refuses any piece outside what it
registered.
"""

from __future__ import annotations

from dataclasses import dataclass

from ipc.codec import message

# A request's KV in the engine's layout is one piece per (layer, kv head, key/value, block)
# before adjacent pieces are merged: 23,040 for the default model's 2,048 tokens. A region
# holds at most this many pieces (a decoded list is capped at a million items anyway).
MAX_REGION_PIECES = 262_144
MAX_SESSION_CHARS = 300


@message
@dataclass(slots=True)
class KVNetRegion:
    """Bytes one engine exposes to another: pieces of the memory registered with the transfer
    engine named ``session``. ``transfer_id`` ties it to the request whose KV it holds."""

    KIND = "kv_net_region"
    transfer_id: str
    backend: str  # the transfer library and its protocol, e.g. "mooncake-tcp"
    session: str  # the owner's transfer engine, "host:port"
    addresses: list[int]
    lengths: list[int]

    def __post_init__(self) -> None:
        if not self.transfer_id or len(self.transfer_id) > 256:
            raise ValueError("transfer_id must be a non-empty string of at most 256 characters")
        if not self.session or len(self.session) > MAX_SESSION_CHARS or ":" not in self.session:
            raise ValueError("session must be the owner's transfer engine as host:port")
        if len(self.addresses) != len(self.lengths):
            raise ValueError(
                f"{len(self.addresses)} addresses for {len(self.lengths)} lengths: one each"
            )
        if not self.lengths or len(self.lengths) > MAX_REGION_PIECES:
            raise ValueError(f"a region holds 1 to {MAX_REGION_PIECES} pieces")
        if any(a <= 0 or a >= 2**64 for a in self.addresses):
            raise ValueError("piece addresses must be positive 64-bit addresses")
        if any(n <= 0 for n in self.lengths):
            raise ValueError("piece lengths must be positive")

    @property
    def pieces(self) -> list[tuple[int, int]]:
        return list(zip(self.addresses, self.lengths))

    @property
    def nbytes(self) -> int:
        return sum(self.lengths)


@message
@dataclass(slots=True)
class KVNetDone:
    """The answer to a region: the other engine has pulled it (or pushed into it), or failed
    to; either way the owner may now free or reuse the memory behind ``transfer_id``."""

    KIND = "kv_net_done"
    transfer_id: str
    ok: bool
    nbytes: int = 0
    seconds: float = 0.0
    error: str = ""  # why it failed, for the logs and the counted aborts
