"""The client's sockets: one DEALER to the detokenizer (handshake, events, aborts), a PUSH per
tokenizer worker (submits), and a monitor that reports the DEALER's connection dropping."""

from __future__ import annotations

import secrets
from typing import TypeVar

import zmq

from ipc.client.errors import BadRequestError
from ipc.messages import ClientWelcome
from ipc.sockets import LINGER_MS, CurveKeys, configure, connect


def curve_keys(server_public_key: str | bytes | None) -> CurveKeys | None:
    """The cluster's CURVE public key (Z85, as the supervisor prints it), or None for a cluster
    without CURVE (ipc, or tcp on loopback)."""
    if not server_public_key:
        return None
    try:
        return CurveKeys(server_public_key.strip())
    except (ValueError, UnicodeEncodeError) as exc:
        raise BadRequestError(f"server_public_key: {exc}") from None


MIN_SUBMIT_HWM = 64


def submit_hwm_for(welcome: ClientWelcome, asked: int | None) -> int:
    """Frames each tokenizer pipe holds before submit() says overloaded: as asked, or by
    default the cluster's own admission bound spread over its tokenizer workers (a burst the
    engine would queue must not be refused by a pipe that filled in microseconds)."""
    if asked is not None:
        return asked
    workers = max(1, len(welcome.tokenizer_addrs))
    return max(MIN_SUBMIT_HWM, -(-welcome.max_waiting_requests // workers))


class SubmitPipes:
    """ClientCore's Pipes: one plain (sync, also under asyncio) PUSH per tokenizer worker, whose
    NOBLOCK sends never wait (a full pipe says so instead)."""

    def __init__(self, socks: list[zmq.Socket]) -> None:
        self.socks = socks

    def __len__(self) -> int:
        return len(self.socks)

    def offer(self, index: int, frame: bytes) -> bool:
        try:
            self.socks[index].send(frame, zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return False
        return True

    def close(self) -> None:
        for sock in self.socks:
            sock.close(linger=0)


def make_submit_pipes(
    ctx: zmq.Context,
    address: str,
    welcome: ClientWelcome,
    hwm: int | None = None,
    curve: CurveKeys | None = None,
) -> SubmitPipes:
    """A PUSH per tokenizer worker the welcome names, dialled as this client must
    (``tokenizer_addrs``), each holding ``submit_hwm_for`` frames: the client knows which worker
    holds each request, so a worker's death ends exactly its requests."""
    addrs = tokenizer_addrs(address, welcome.tokenizer_addrs)
    hwm = submit_hwm_for(welcome, hwm)
    socks = []
    for addr in addrs:
        sock = configure(zmq.Socket(ctx, zmq.PUSH), receives=False, sndhwm=hwm)
        sock.setsockopt(zmq.LINGER, LINGER_MS)
        if curve is not None:
            curve.make_client(sock)
        sock.connect(addr)
        socks.append(sock)
    return SubmitPipes(socks)


def disconnect_monitor(dealer: zmq.Socket) -> zmq.Socket:
    """A plain (sync, also under asyncio) socket that reports the DEALER's connection to the
    detokenizer dropping; read it with monitor_events."""
    addr = f"inproc://splitserve-monitor-{secrets.token_hex(8)}"
    dealer.monitor(addr, zmq.EVENT_DISCONNECTED)
    monitor = zmq.Socket(dealer.context, zmq.PAIR)
    monitor.connect(addr)
    return monitor


def monitor_events(monitor: zmq.Socket) -> int:
    """How many DISCONNECTED events are queued on ``monitor`` (read without blocking)."""
    from zmq.utils.monitor import parse_monitor_message

    count = 0
    while True:
        try:
            parts = monitor.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return count
        if parse_monitor_message(parts)["event"] == zmq.EVENT_DISCONNECTED:
            count += 1


S = TypeVar("S", bound=zmq.Socket)


def make_dealer(sock: S, client_id: bytes, address: str, curve: CurveKeys | None = None) -> S:
    sock.setsockopt(zmq.IDENTITY, client_id)
    configure(sock, receives=True)
    connect(sock, address, curve)
    return sock


_WILDCARD_HOSTS = ("0.0.0.0", "*", "[::]", "::")


def tokenizer_addrs(client_addr: str, advertised: list[str]) -> list[str]:
    """The tokenizer addresses as this client must dial them: a cluster bound to a wildcard host
    (``--listen 0.0.0.0``) advertises that host, which only means "the host you reached me at"."""
    if not client_addr.startswith("tcp://"):
        return advertised
    reached = client_addr[len("tcp://") :].rsplit(":", 1)[0]
    out = []
    for addr in advertised:
        if addr.startswith("tcp://"):
            host, port = addr[len("tcp://") :].rsplit(":", 1)
            if host in _WILDCARD_HOSTS:
                addr = f"tcp://{reached}:{port}"
        out.append(addr)
    return out
