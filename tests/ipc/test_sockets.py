"""The typed queue wrappers: round trips, stale ipc files, frame size caps."""

from __future__ import annotations

import pytest
import zmq

from ipc import codec
from ipc.messages import AbortRequests, ClientBye
from ipc.sockets import PullQueue, PushQueue


def test_sync_round_trip_and_kind_check(tmp_path):
    addr = f"ipc://{tmp_path}/q.sock"
    (tmp_path / "q.sock").write_text("stale file left by a crashed run")
    ctx = zmq.Context()
    try:
        inbox = PullQueue(ctx, addr, AbortRequests)
        out = PushQueue(ctx, addr)
        assert inbox.empty()
        out.put(AbortRequests(["a"]))
        out.put(ClientBye())
        assert inbox.wait(2000)
        assert inbox.get() == AbortRequests(["a"])
        with pytest.raises(codec.DecodeError, match="not accepted here"):
            inbox.get()
        assert inbox.drain_frames(10) == []
        out.close()
        inbox.close()
    finally:
        ctx.term()


def test_receivers_drop_an_oversized_frame_and_keep_serving(tmp_path, monkeypatch):
    monkeypatch.setattr(codec, "MAX_FRAME_BYTES", 4096)  # read when a receiving socket is made
    addr = f"ipc://{tmp_path}/cap.sock"
    ctx = zmq.Context()
    try:
        inbox = PullQueue(ctx, addr, AbortRequests)
        assert inbox.socket.getsockopt(zmq.MAXMSGSIZE) == 4096
        hostile = PushQueue(ctx, addr)
        hostile.socket.send(b"x" * 8192)  # ZeroMQ drops the sender's connection, unread
        hostile.close()
        out = PushQueue(ctx, addr)
        out.put(AbortRequests(["after"]))
        assert inbox.wait(2000)
        assert inbox.drain_frames(10) == [codec.encode(AbortRequests(["after"]))]
        out.close()
        inbox.close()
    finally:
        ctx.term()
