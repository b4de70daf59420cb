"""The typed queue wrappers: sync and asyncio round trips, stale ipc files, frame size caps."""

from __future__ import annotations

import asyncio

import pytest
import zmq
import zmq.asyncio

from ipc import codec
from ipc.messages import AbortRequests, ClientBye
from ipc.sockets import AsyncPullQueue, AsyncPushQueue, PullQueue, PushQueue


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


def test_receivers_cap_frame_size(tmp_path):
    assert codec.MAX_FRAME_BYTES > 0
    ctx = zmq.Context()
    try:
        inbox = PullQueue(ctx, f"ipc://{tmp_path}/cap.sock")
        assert inbox.socket.getsockopt(zmq.MAXMSGSIZE) == codec.MAX_FRAME_BYTES
        assert inbox.socket.getsockopt(zmq.LINGER) >= 0
        inbox.close()
    finally:
        ctx.term()


def test_async_round_trip(tmp_path):
    async def main():
        ctx = zmq.asyncio.Context()
        inbox = AsyncPullQueue(ctx, f"ipc://{tmp_path}/a.sock", AbortRequests)
        out = AsyncPushQueue(ctx, f"ipc://{tmp_path}/a.sock")
        await out.put(AbortRequests(["x"]))
        out.put_nowait(AbortRequests(["y"]))
        got = [await asyncio.wait_for(inbox.get(), 5), await asyncio.wait_for(inbox.get(), 5)]
        out.close()
        inbox.close()
        ctx.term()
        return got
    assert asyncio.run(main()) == [AbortRequests(["x"]), AbortRequests(["y"])]
