"""Small typed socket wrappers, so no process hand-rolls send/recv + encode/decode.

Every socket made here has a finite LINGER (closing never hangs on an absent peer) and, when it
receives, a MAXMSGSIZE (ZeroMQ drops the connection of a peer that sends a larger frame, before we
ever allocate it). Binding an ``ipc://`` address removes a stale socket file first: a crashed run
leaves one behind and a fresh bind over it would otherwise succeed while peers stay connected to a
dead inode; the bound socket file is then made owner-only (0600), on top of the run directory's
0700.

CURVE: given ``CurveKeys``, a binding socket becomes a CURVE server (it needs the secret key) and a
connecting socket a CURVE client of that server, with a fresh client key pair of its own. A peer
that does not know the server's public key never completes the handshake: ZeroMQ delivers nothing
of it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, cast

import zmq

from ipc import codec

T = TypeVar("T")
logger = logging.getLogger("splitserve.ipc")

LINGER_MS = 1000
DEFAULT_HWM = 10_000


def _as_bytes(value: bytes | str) -> bytes:
    return value.encode("ascii") if isinstance(value, str) else value


@dataclass(frozen=True, slots=True)
class CurveKeys:
    """The server key pair (Z85 text, 40 characters each); ``secret`` only where a socket binds."""

    public: bytes | str
    secret: bytes | str = b""

    def __post_init__(self) -> None:
        # Given as Z85 text or bytes; kept as bytes, which is what ZeroMQ's options take.
        for name in ("public", "secret"):
            value = getattr(self, name)
            if isinstance(value, str):
                object.__setattr__(self, name, value.encode("ascii"))
        if len(self.public) != 40 or (self.secret and len(self.secret) != 40):
            raise ValueError("CURVE keys are 40-character Z85 strings")

    def make_server(self, sock: zmq.Socket) -> zmq.Socket:
        if not self.secret:
            raise ValueError("a CURVE server socket needs the server's secret key")
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, _as_bytes(self.secret))
        return sock

    def make_client(self, sock: zmq.Socket) -> zmq.Socket:
        public, secret = zmq.curve_keypair()
        sock.setsockopt(zmq.CURVE_SERVERKEY, _as_bytes(self.public))
        sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
        return sock


def check_curve_available() -> None:
    if not zmq.has("curve"):
        raise RuntimeError(
            "this pyzmq/libzmq build has no CURVE support (libsodium); it is "
            "required to listen beyond loopback"
        )


def remove_stale_ipc(address: str) -> None:
    if address.startswith("ipc://"):
        path = address[len("ipc://") :]
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def configure(
    sock: zmq.Socket, *, receives: bool, sndhwm: int | None = None, rcvhwm: int | None = None
) -> zmq.Socket:
    sock.setsockopt(zmq.LINGER, LINGER_MS)
    if receives:
        sock.setsockopt(zmq.MAXMSGSIZE, codec.MAX_FRAME_BYTES)
    if sndhwm is not None:
        sock.setsockopt(zmq.SNDHWM, sndhwm)
    if rcvhwm is not None:
        sock.setsockopt(zmq.RCVHWM, rcvhwm)
    return sock


def bind(sock: zmq.Socket, address: str, curve: CurveKeys | None = None) -> zmq.Socket:
    if curve is not None:
        curve.make_server(sock)
    remove_stale_ipc(address)
    sock.bind(address)
    if address.startswith("ipc://"):
        os.chmod(address[len("ipc://") :], 0o600)
    return sock


def connect(sock: zmq.Socket, address: str, curve: CurveKeys | None = None) -> zmq.Socket:
    if curve is not None:
        curve.make_client(sock)
    sock.connect(address)
    return sock


def open_socket(
    ctx: zmq.Context,
    kind: int,
    address: str,
    *,
    bind_it: bool,
    sndhwm: int | None = None,
    rcvhwm: int | None = None,
    curve: CurveKeys | None = None,
) -> zmq.Socket:
    receives = kind in (zmq.PULL, zmq.ROUTER, zmq.DEALER, zmq.PAIR)
    sock = configure(ctx.socket(kind), receives=receives, sndhwm=sndhwm, rcvhwm=rcvhwm)
    if bind_it:
        bind(sock, address, curve)
    else:
        connect(sock, address, curve)
    return sock


class PushQueue:
    """The sending end of a PUSH/PULL channel: ``put(message)``."""

    def __init__(
        self,
        ctx: zmq.Context,
        address: str,
        *,
        bind: bool = False,
        hwm: int = DEFAULT_HWM,
        curve: CurveKeys | None = None,
    ) -> None:
        self.address = address
        self.socket = open_socket(ctx, zmq.PUSH, address, bind_it=bind, sndhwm=hwm, curve=curve)

    def put(self, msg: Any, *, block: bool = True, timeout_ms: int | None = None) -> None:
        """Raises zmq.Again when the pipe is full (non-blocking) or the timeout passes."""
        self.put_frame(codec.encode(msg), block=block, timeout_ms=timeout_ms)

    def put_frame(self, frame: bytes, *, block: bool = True, timeout_ms: int | None = None) -> None:
        if not block:
            self.socket.send(frame, zmq.NOBLOCK, copy=False)
            return
        if timeout_ms is not None and not self.socket.poll(timeout_ms, zmq.POLLOUT):
            raise zmq.Again()
        self.socket.send(frame, copy=False)

    def close(self) -> None:
        self.socket.close(linger=LINGER_MS)


class PullQueue(Generic[T]):
    """The receiving end: ``get()`` decodes strictly into one of the accepted message kinds.

    ``get_frame`` hands back raw bytes for callers that must answer malformed frames with an
    error (they decode with :meth:`decode` and catch ``codec.DecodeError``).
    """

    def __init__(
        self,
        ctx: zmq.Context,
        address: str,
        *kinds: type,
        bind: bool = True,
        hwm: int = DEFAULT_HWM,
        curve: CurveKeys | None = None,
    ) -> None:
        self.address = address
        self.kinds = kinds
        self.socket = open_socket(ctx, zmq.PULL, address, bind_it=bind, rcvhwm=hwm, curve=curve)

    def decode(self, frame: bytes) -> T:
        return codec.decode_as(frame, *self.kinds)

    def empty(self) -> bool:
        return not self.socket.poll(0, zmq.POLLIN)

    def wait(self, timeout_ms: int | None) -> bool:
        """True when a frame is ready; waits at most ``timeout_ms`` (None: forever)."""
        return bool(self.socket.poll(timeout_ms, zmq.POLLIN))

    def get_frame(self, *, block: bool = True) -> bytes:
        return self.socket.recv(0 if block else zmq.NOBLOCK)

    def get(self, *, block: bool = True) -> T:
        return self.decode(self.get_frame(block=block))

    def drain_frames(self, limit: int) -> list[bytes]:
        """Whatever is queued right now, at most ``limit`` frames, without waiting."""
        frames: list[bytes] = []
        # EVENTS, not recv() until zmq.Again: an exception raised per pass (per engine step,
        # where the detokenizer drains it) costs more than the check.
        while len(frames) < limit and cast(int, self.socket.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            frames.append(self.socket.recv(zmq.NOBLOCK))
        return frames

    def drain(
        self, limit: int, on_malformed: Callable[[bytes, codec.DecodeError], None]
    ) -> list[T]:
        """Whatever is queued right now (at most ``limit`` frames, without waiting), decoded; a
        malformed frame goes to ``on_malformed`` instead (to log it, or to answer it with an
        error where the sender can be told)."""
        messages: list[T] = []
        for frame in self.drain_frames(limit):
            try:
                messages.append(self.decode(frame))
            except codec.DecodeError as exc:
                on_malformed(frame, exc)
        return messages

    def close(self) -> None:
        self.socket.close(linger=0)
